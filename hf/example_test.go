package hf_test

import (
	"fmt"
	"path/filepath"

	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// Read a GPT-2 checkpoint's config, build models.GPT from it and load the
// weights into its parameters.
func ExampleLoadInto() {
	dir := filepath.Join("testdata", "gpt2-tiny")
	cfg, err := hf.ReadConfig(dir)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(cfg.Architecture, *cfg.GPT)
	m := models.NewGPT(nn.Seed(1), *cfg.GPT)
	if err := hf.LoadInto(dir, m.Params()); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(nn.NumParams(m), "parameters loaded")
	// Output:
	// GPT2LMHeadModel {320 64 2 4 64 false false}
	// 124672 parameters loaded
}

// A Llama-family config gives a models.LlamaConfig; an architecture
// without a batchfit model is a typed error naming the supported ones.
func ExampleParseConfig() {
	cfg, err := hf.ParseConfig([]byte(`{"architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
		"num_attention_heads": 32, "num_key_value_heads": 8, "rope_scaling": {"rope_type": "llama3",
		"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(cfg.Llama.Heads, cfg.Llama.KVHeads, cfg.Llama.HeadDim, cfg.Llama.Rope.Type, cfg.Llama.Rope.Factor)
	_, err = hf.ParseConfig([]byte(`{"architectures": ["T5ForConditionalGeneration"]}`))
	fmt.Println(err)
	// Output:
	// 32 8 64 llama3 32
	// hf: unsupported: architecture "T5ForConditionalGeneration"; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel
}
