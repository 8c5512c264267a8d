package hf_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// loadTestdata reads a testdata checkpoint into fresh parameters.
func loadTestdata(t *testing.T, dir string) (hf.Config, []*nn.Param) {
	path := filepath.Join("testdata", dir)
	cfg, err := hf.ReadConfig(path)
	require.NoError(t, err)
	var ps []*nn.Param
	if cfg.GPT != nil {
		ps = models.NewGPT(nn.Seed(4), *cfg.GPT).Params()
	} else {
		ps = newParams(llamaSpecs(*cfg.Llama), 8)
	}
	require.NoError(t, hf.LoadInto(path, ps))
	return cfg, ps
}

// Loaded and saved again, each transformers checkpoint comes out as the
// very file transformers wrote (same names, order, dtype, header and
// bytes: the tied head omitted, GPT-2's Conv1D weights transposed back,
// bfloat16 stored as bfloat16), with a config.json that reads back to the
// same configuration; loading the saved copy gives the parameters bit for
// bit.
func TestSaveReproducesTransformersFiles(t *testing.T) {
	for _, dir := range []string{"gpt2-tiny", "llama-gqa-tied-llama3", "llama-mqa-linear-bf16", "qwen2-tiny"} {
		t.Run(dir, func(t *testing.T) {
			cfg, ps := loadTestdata(t, dir)
			out := t.TempDir()
			require.NoError(t, hf.Save(out, cfg, ps))
			want, err := os.ReadFile(filepath.Join("testdata", dir, hf.WeightsFile))
			require.NoError(t, err)
			got, err := os.ReadFile(filepath.Join(out, hf.WeightsFile))
			require.NoError(t, err)
			require.Equal(t, want, got, "model.safetensors differs from transformers'")

			back, err := hf.ReadConfig(out)
			require.NoError(t, err)
			assert.Equal(t, cfg.Architecture, back.Architecture)
			assert.Equal(t, cfg.Llama, back.Llama)
			assert.Equal(t, cfg.GPT, back.GPT)
			assert.Equal(t, cfg.DType, back.DType)
			assert.Equal(t, cfg.BOS, back.BOS)
			assert.Equal(t, cfg.EOS, back.EOS)

			var ps2 []*nn.Param
			if cfg.GPT != nil {
				ps2 = models.NewGPT(nn.Seed(5), *cfg.GPT).Params()
			} else {
				ps2 = newParams(llamaSpecs(*cfg.Llama), 9)
			}
			require.NoError(t, hf.LoadInto(out, ps2))
			for i := range ps {
				require.Equal(t, ps[i].Value().Data(), ps2[i].Value().Data(), ps[i].Name())
			}
		})
	}
}

// The config Save writes keeps the file's other keys and spells the rope
// settings both ways, consistently.
func TestSaveConfigJSON(t *testing.T) {
	cfg, ps := loadTestdata(t, "llama-gqa-tied-llama3")
	legacy, err := hf.ReadConfig(filepath.Join("testdata", "llama-gqa-tied-llama3", "config.legacy.json"))
	require.NoError(t, err)
	for _, c := range []hf.Config{cfg, legacy} {
		out := t.TempDir()
		require.NoError(t, hf.Save(out, c, ps))
		b, err := os.ReadFile(filepath.Join(out, hf.ConfigFile))
		require.NoError(t, err)
		var m map[string]any
		require.NoError(t, json.Unmarshal(b, &m))
		assert.Equal(t, []any{"LlamaForCausalLM"}, m["architectures"])
		assert.Equal(t, "llama", m["model_type"])
		assert.Equal(t, 0.02, m["initializer_range"], "a key Save does not own is kept")
		assert.Equal(t, map[string]any{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
			"original_max_position_embeddings": 32.0}, m["rope_scaling"])
		assert.Equal(t, map[string]any{"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
			"original_max_position_embeddings": 32.0}, m["rope_parameters"])
		assert.Contains(t, string(b), `"rope_theta": 10000.0`, "floats are written as Python writes them")
		assert.Contains(t, string(b), `"rms_norm_eps": 1e-05`)
		assert.Equal(t, "float32", m["torch_dtype"])
		assert.Equal(t, "float32", m["dtype"])
	}

	// A configuration built in Go, with no file behind it.
	fresh := hf.Config{Architecture: hf.Mistral, BOS: -1, Llama: &models.LlamaConfig{Vocab: 256, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 2,
		HeadDim: 16, MaxPositions: 128, RMSNormEps: 1e-5, Rope: models.RopeConfig{Theta: 1e6, Type: "default"}}, SlidingWindow: 64, DType: "bfloat16"}
	out := t.TempDir()
	require.NoError(t, hf.Save(out, fresh, newParams(llamaSpecs(*fresh.Llama), 10)))
	back, err := hf.ReadConfig(out)
	require.NoError(t, err)
	assert.Equal(t, *fresh.Llama, *back.Llama)
	assert.Equal(t, 64, back.SlidingWindow)
	assert.Equal(t, "bfloat16", back.DType)
	assert.Equal(t, -1, back.BOS)
}

func TestSaveRejects(t *testing.T) {
	cfg, ps := loadTestdata(t, "llama-gqa-tied-llama3")
	untied := *cfg.Llama
	untied.TieEmbeddings = false
	head := newParams([]spec{{"lm_head.weight", []int{256, 64}}}, 1)
	bad := cfg
	bad.DType = "int8"
	cases := []struct {
		name string
		cfg  hf.Config
		ps   []*nn.Param
		want error
	}{
		{"tied config, head parameter", cfg, append(ps, head...), hf.ErrConfig},
		{"untied config, no head", hf.Config{Architecture: hf.Llama, Llama: &untied, BOS: -1}, ps, hf.ErrMissingTensor},
		{"dtype", bad, ps, hf.ErrUnsupported},
		{"no embedding", cfg, ps[1:], hf.ErrMissingTensor},
		{"unknown name", cfg, append(ps, newParams([]spec{{"adapter.weight", []int{2}}}, 1)...), hf.ErrUnsupported},
		{"no model config", hf.Config{Architecture: hf.Qwen2}, ps, hf.ErrConfig},
		{"embedding of another vocabulary", hf.Config{Architecture: hf.Llama, BOS: -1, Llama: func() *models.LlamaConfig { c := *cfg.Llama; c.Vocab = 300; return &c }()}, ps, hf.ErrShape},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := t.TempDir()
			assert.ErrorIs(t, hf.Save(out, c.cfg, c.ps), c.want)
			entries, err := os.ReadDir(out)
			require.NoError(t, err)
			assert.Empty(t, entries, "nothing is written")
		})
	}
	t.Run("sharded directory", func(t *testing.T) {
		out := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(out, hf.IndexFile), []byte("{}"), 0o644))
		assert.ErrorIs(t, hf.Save(out, cfg, ps), hf.ErrCheckpoint)
	})
}
