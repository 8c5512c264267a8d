// Package hf reads and writes Hugging Face checkpoints: config.json for
// LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (to
// models.LlamaConfig) and GPT2LMHeadModel (to models.GPTConfig), and
// safetensors weights, in one model.safetensors or in the shards
// model.safetensors.index.json lists.
//
// ReadConfig parses a config in either spelling of the rotary settings:
// rope_parameters (transformers 5) or rope_theta + rope_scaling (older
// files, with "type" or "rope_type"); default, linear and llama3 rope are
// supported, other types and settings batchfit's models cannot reproduce
// (yarn rope, a non-SwiGLU activation, exact-GELU GPT-2, …) are refused
// with ErrUnsupported, and an unknown architecture with an
// *UnsupportedArchitectureError listing the supported ones. Absent keys
// take transformers' defaults. Files are bounded (config.json ≤ 1 MiB,
// index ≤ 16 MiB) and must be regular files.
//
// LoadInto fills a model's nn.Params from a checkpoint directory. Each
// architecture has one name table (names.go): the Llama family's is the
// identity, since models.Llama names parameters as Hugging Face does;
// GPT-2's adds the "transformer." prefix (or accepts its absence, as in
// the original hub files) and transposes the Conv1D weights, which
// Hugging Face stores [in, out]. Everything is checked before any
// parameter changes: every parameter's tensor present, of its shape (a
// *ShapeError names the tensor and both shapes) and dtype F32, BF16 or
// F16; no checkpoint tensor left over (old mask buffers aside); a head
// tied to the embedding either absent or equal to it. Tensors stream from
// the files straight into the parameters' float32 data.
//
// Save writes config.json and model.safetensors that transformers'
// from_pretrained loads: for a checkpoint loaded and saved unchanged, the
// weights file is the one transformers wrote, byte for byte (tests hold
// it), with the tied head omitted and {"format": "pt"} metadata. The
// config keeps the keys it was read with and writes the rope settings in
// both spellings.
//
// SaveAdapter and LoadAdapter write and read PEFT LoRA adapters
// (adapter_config.json and adapter_model.safetensors, names under
// "base_model.model."), for models adapted with nn.LoRA; LoadAdapter
// checks every tensor's name, shape (a *ShapeError) and rank (a
// *RankError) and refuses settings batchfit does not compute as PEFT
// does (DoRA, rsLoRA, rank patterns, …) with ErrUnsupported, before the
// model changes. scripts/check-peft-adapters.py checks them against peft.
//
// The testdata checkpoints were made by transformers from fixed seeds
// with the repository's scripts/make-reference-data.py (testdata/README.md).
package hf
