package hf_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/hf"
)

// TestExportForFromPretrained writes checkpoints saved by Save into
// $BATCHFIT_HF_EXPORT for scripts/check-hf-saves.py, which loads each with
// transformers' from_pretrained and compares it with the testdata
// checkpoint it came from (logits, weights, rope frequencies). Configs
// come from the transformers 5 file, the older spelling, or no file at all
// (built in Go); weights in float32 or bfloat16.
func TestExportForFromPretrained(t *testing.T) {
	out := os.Getenv("BATCHFIT_HF_EXPORT")
	if out == "" {
		t.Skip("set BATCHFIT_HF_EXPORT=DIR to write checkpoints for the from_pretrained check (scripts/check-hf-saves.py)")
	}
	for _, e := range []struct {
		name, src, config string // config: "" (the source's), "legacy" or "go"
		dtype             string
	}{
		{"gpt2-tiny-f32", "gpt2-tiny", "", "float32"},
		{"gpt2-tiny-go-bf16", "gpt2-tiny", "go", "bfloat16"},
		{"llama-gqa-tied-llama3-legacy", "llama-gqa-tied-llama3", "legacy", "float32"},
		{"llama-gqa-tied-llama3-go", "llama-gqa-tied-llama3", "go", "float32"},
		{"llama-mqa-linear-bf16", "llama-mqa-linear-bf16", "", "bfloat16"},
		{"llama-mqa-linear-go-f32", "llama-mqa-linear-bf16", "go", "float32"},
		{"qwen2-tiny-go", "qwen2-tiny", "go", "float32"},
		{"llama-gqa-untied-from-shards", "llama-gqa-untied-sharded", "", "float32"},
	} {
		cfg, ps := loadTestdata(t, e.src)
		switch e.config {
		case "legacy":
			var err error
			cfg, err = hf.ReadConfig(filepath.Join("testdata", e.src, "config.legacy.json"))
			require.NoError(t, err)
		case "go":
			cfg = hf.Config{Architecture: cfg.Architecture, Llama: cfg.Llama, GPT: cfg.GPT, SlidingWindow: cfg.SlidingWindow, BOS: -1}
		}
		cfg.DType = e.dtype
		require.NoError(t, hf.Save(filepath.Join(out, e.name), cfg, ps), e.name)
	}
}
