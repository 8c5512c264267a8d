package models

// LlamaConfig sizes a Llama-family decoder (Llama 2 and 3, Mistral, Qwen2):
// RMSNorm, rotary position embeddings, SwiGLU feed-forward blocks and
// grouped-query attention. Its fields mirror Hugging Face's LlamaConfig;
// each field's comment names the config.json key it is read from.
//
// A Llama's parameters carry Hugging Face's names exactly
// ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
// "model.norm.weight", "lm_head.weight"), so a checkpoint maps onto a
// model without a table; a tied model has no "lm_head.weight".
type LlamaConfig struct {
	Vocab        int // vocab_size
	Hidden       int // hidden_size
	Intermediate int // intermediate_size: the SwiGLU block's inner width
	Layers       int // num_hidden_layers
	Heads        int // num_attention_heads
	// KVHeads is num_key_value_heads: Heads for multi-head attention, 1
	// for multi-query, any divisor of Heads for grouped-query; 0 means
	// Heads.
	KVHeads int
	// HeadDim is head_dim; 0 means Hidden / Heads.
	HeadDim      int
	MaxPositions int     // max_position_embeddings
	RMSNormEps   float64 // rms_norm_eps
	// TieEmbeddings is tie_word_embeddings: the output head reuses the
	// token embedding.
	TieEmbeddings bool
	// QKVBias gives the q, k and v projections biases (Llama's
	// attention_bias; Qwen2 always has them).
	QKVBias bool
	// OutBias gives the attention's output projection a bias (Llama's
	// attention_bias; Qwen2 has none).
	OutBias bool
	// MLPBias is mlp_bias: biases on gate, up and down projections.
	MLPBias bool
	Rope    RopeConfig
}

// RopeConfig is a rotary embedding's settings: Hugging Face's rope_theta
// and rope_scaling (older config.json files) or rope_parameters
// (transformers 5).
type RopeConfig struct {
	Theta float64 // rope_theta: the frequencies' base
	// Type is rope_type: "default" (or empty), "linear" or "llama3".
	Type string
	// Factor divides the positions ("linear") or the low frequencies
	// ("llama3").
	Factor float64
	// LowFreqFactor, HighFreqFactor and OriginalMaxPositions
	// (original_max_position_embeddings) shape "llama3" scaling's band
	// between the unscaled high and the scaled low frequencies.
	LowFreqFactor        float64
	HighFreqFactor       float64
	OriginalMaxPositions int
}
