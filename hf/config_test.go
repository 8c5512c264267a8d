package hf_test

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// The testdata configs were written by transformers 5 (config.json,
// rope_parameters) and in the older spelling (config.legacy.json,
// rope_theta + rope_scaling, torch_dtype); see testdata/README.md.
func TestReadConfigTinyCheckpoints(t *testing.T) {
	cases := []struct {
		dir   string
		arch  hf.Architecture
		llama models.LlamaConfig
		dtype string
	}{
		{"llama-gqa-tied-llama3", hf.Llama, models.LlamaConfig{Vocab: 256, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
			MaxPositions: 128, RMSNormEps: 1e-5, TieEmbeddings: true,
			Rope: models.RopeConfig{Theta: 10000, Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 32}}, "float32"},
		{"llama-gqa-untied", hf.Llama, models.LlamaConfig{Vocab: 256, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
			MaxPositions: 128, RMSNormEps: 1e-5, Rope: models.RopeConfig{Theta: 10000, Type: "default"}}, "float32"},
		{"llama-mqa-linear-bf16", hf.Llama, models.LlamaConfig{Vocab: 256, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 1, HeadDim: 32,
			MaxPositions: 128, RMSNormEps: 1e-5, Rope: models.RopeConfig{Theta: 10000, Type: "linear", Factor: 2}}, "bfloat16"},
		{"qwen2-tiny", hf.Qwen2, models.LlamaConfig{Vocab: 256, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
			MaxPositions: 128, RMSNormEps: 1e-5, TieEmbeddings: true, QKVBias: true, Rope: models.RopeConfig{Theta: 1e6, Type: "default"}}, "float32"},
		{"mistral-tiny", hf.Mistral, models.LlamaConfig{Vocab: 256, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
			MaxPositions: 128, RMSNormEps: 1e-5, Rope: models.RopeConfig{Theta: 1e6, Type: "default"}}, "float32"},
	}
	for _, c := range cases {
		for _, file := range []string{"config.json", "config.legacy.json"} {
			t.Run(c.dir+"/"+file, func(t *testing.T) {
				cfg, err := hf.ReadConfig(filepath.Join("testdata", c.dir, file))
				require.NoError(t, err)
				assert.Equal(t, c.arch, cfg.Architecture)
				require.NotNil(t, cfg.Llama)
				assert.Nil(t, cfg.GPT)
				assert.Equal(t, c.llama, *cfg.Llama)
				assert.Equal(t, c.dtype, cfg.DType)
				assert.Zero(t, cfg.SlidingWindow)
			})
		}
	}
	// A directory reads its config.json.
	cfg, err := hf.ReadConfig(filepath.Join("testdata", "gpt2-tiny"))
	require.NoError(t, err)
	assert.Equal(t, hf.GPT2, cfg.Architecture)
	assert.Equal(t, models.GPTConfig{Vocab: 320, Context: 64, Layers: 2, Heads: 4, Dim: 64}, *cfg.GPT)
	assert.Equal(t, 50256, cfg.BOS)
	assert.Equal(t, []int{50256}, cfg.EOS)
	legacy, err := hf.ReadConfig(filepath.Join("testdata", "gpt2-tiny", "config.legacy.json"))
	require.NoError(t, err)
	assert.Equal(t, *cfg.GPT, *legacy.GPT)
	assert.Equal(t, "float32", legacy.DType)
}

// params.json holds transformers' parameter counts for real-shaped
// configs (on the meta device); the parameters these configs imply must
// add up to them, name for name.
func TestReadConfigRealShapes(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("testdata", "configs", "params.json"))
	require.NoError(t, err)
	var want map[string]struct {
		Parameters int64    `json:"parameters"`
		Names      int      `json:"names"`
		Keys       []string `json:"state_dict_keys"`
	}
	require.NoError(t, json.Unmarshal(b, &want))
	require.Len(t, want, 7)
	for name, w := range want {
		for _, file := range []string{name + ".json", name + ".legacy.json"} {
			t.Run(file, func(t *testing.T) {
				cfg, err := hf.ReadConfig(filepath.Join("testdata", "configs", file))
				require.NoError(t, err)
				var names []string
				var n int64
				if cfg.Architecture == hf.GPT2 {
					m := models.NewGPT(nn.Options{ShapeOnly: true}, *cfg.GPT)
					require.NoError(t, nn.Check(m))
					for _, p := range m.Params() {
						names = append(names, "transformer."+p.Name())
					}
					n = int64(nn.NumParams(m))
				} else {
					for _, s := range llamaSpecs(*cfg.Llama) {
						names = append(names, s.name)
						n += numel(s.shape)
					}
				}
				assert.Equal(t, w.Parameters, n)
				assert.Len(t, names, w.Names)
				for _, k := range w.Keys {
					if k != "lm_head.weight" || !cfg.Tied() {
						assert.Contains(t, names, k)
					}
				}
			})
		}
	}
	m, err := hf.ReadConfig(filepath.Join("testdata", "configs", "mistral-7b.json"))
	require.NoError(t, err)
	assert.Equal(t, 4096, m.SlidingWindow)
	l, err := hf.ReadConfig(filepath.Join("testdata", "configs", "llama3.2-1b.legacy.json"))
	require.NoError(t, err)
	assert.Equal(t, models.RopeConfig{Theta: 500000, Type: "llama3", Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}, l.Llama.Rope)
	assert.True(t, l.Llama.TieEmbeddings)
	assert.Equal(t, 128000, l.BOS)
	q, err := hf.ReadConfig(filepath.Join("testdata", "configs", "qwen2-0.5b.json"))
	require.NoError(t, err)
	assert.True(t, q.Llama.QKVBias)
	assert.False(t, q.Llama.OutBias)
	assert.Equal(t, 1e-6, q.Llama.RMSNormEps)
	assert.Equal(t, 2, q.Llama.KVHeads)
	assert.Equal(t, 64, q.Llama.HeadDim, "896 / 14")
}

func TestParseConfigDefaultsAndSpellings(t *testing.T) {
	// Absent keys take transformers' defaults.
	cfg, err := hf.ParseConfig([]byte(`{"model_type": "llama"}`))
	require.NoError(t, err)
	assert.Equal(t, hf.Llama, cfg.Architecture)
	assert.Equal(t, models.LlamaConfig{Vocab: 32000, Hidden: 4096, Intermediate: 11008, Layers: 32, Heads: 32, KVHeads: 32, HeadDim: 128,
		MaxPositions: 2048, RMSNormEps: 1e-6, Rope: models.RopeConfig{Theta: 10000, Type: "default"}}, *cfg.Llama)
	assert.Equal(t, -1, cfg.BOS)

	// The oldest spelling: "type" in rope_scaling; integers written as floats.
	cfg, err = hf.ParseConfig([]byte(`{"architectures": ["LlamaForCausalLM"], "hidden_size": 64.0, "num_attention_heads": 4,
		"rope_scaling": {"type": "linear", "factor": 4}, "attention_bias": true, "mlp_bias": true, "eos_token_id": [1, 2, 3]}`))
	require.NoError(t, err)
	assert.Equal(t, models.RopeConfig{Theta: 10000, Type: "linear", Factor: 4}, cfg.Llama.Rope)
	assert.Equal(t, 64, cfg.Llama.Hidden)
	assert.Equal(t, 16, cfg.Llama.HeadDim)
	assert.True(t, cfg.Llama.QKVBias && cfg.Llama.OutBias && cfg.Llama.MLPBias)
	assert.Equal(t, []int{1, 2, 3}, cfg.EOS)

	// Qwen2 with its sliding window switched on.
	cfg, err = hf.ParseConfig([]byte(`{"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true, "sliding_window": 1024}`))
	require.NoError(t, err)
	assert.Equal(t, 1024, cfg.SlidingWindow)
	assert.True(t, cfg.Llama.QKVBias)
}

func TestParseConfigRejects(t *testing.T) {
	cases := []struct {
		name, json string
		want       error
	}{
		{"not JSON", `{"model_type": `, hf.ErrConfig},
		{"not an object", `[1]`, hf.ErrConfig},
		{"trailing data", `{"model_type": "llama"} {}`, hf.ErrConfig},
		{"no architecture", `{}`, hf.ErrUnsupported},
		{"two architectures", `{"architectures": ["LlamaForCausalLM", "GPT2LMHeadModel"]}`, hf.ErrUnsupported},
		{"model_type disagrees", `{"architectures": ["LlamaForCausalLM"], "model_type": "gpt2"}`, hf.ErrConfig},
		{"string size", `{"model_type": "llama", "hidden_size": "4096"}`, hf.ErrConfig},
		{"fractional size", `{"model_type": "llama", "hidden_size": 40.5}`, hf.ErrConfig},
		{"negative size", `{"model_type": "llama", "num_hidden_layers": -2}`, hf.ErrConfig},
		{"zero size", `{"model_type": "llama", "vocab_size": 0}`, hf.ErrConfig},
		{"huge size", `{"model_type": "llama", "vocab_size": 1e300}`, hf.ErrConfig},
		{"kv heads do not divide", `{"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 5}`, hf.ErrConfig},
		{"hidden not divisible", `{"model_type": "llama", "hidden_size": 100, "num_attention_heads": 32}`, hf.ErrConfig},
		{"eps zero", `{"model_type": "llama", "rms_norm_eps": 0}`, hf.ErrConfig},
		{"bool as string", `{"model_type": "llama", "tie_word_embeddings": "yes"}`, hf.ErrConfig},
		{"yarn", `{"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}}`, hf.ErrUnsupported},
		{"dynamic v5", `{"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2}}`, hf.ErrUnsupported},
		{"llama3 incomplete", `{"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8}}`, hf.ErrConfig},
		{"llama3 band reversed", `{"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1, "original_max_position_embeddings": 8192}}`, hf.ErrConfig},
		{"linear without factor", `{"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}`, hf.ErrConfig},
		{"rope theta conflict", `{"model_type": "llama", "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}`, hf.ErrConfig},
		{"per-layer rope", `{"model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"}}}`, hf.ErrUnsupported},
		{"gelu llama", `{"model_type": "llama", "hidden_act": "gelu"}`, hf.ErrUnsupported},
		{"partial rotary", `{"model_type": "llama", "partial_rotary_factor": 0.5}`, hf.ErrUnsupported},
		{"exact gelu gpt2", `{"model_type": "gpt2", "activation_function": "gelu"}`, hf.ErrUnsupported},
		{"gpt2 inner", `{"model_type": "gpt2", "n_inner": 1000}`, hf.ErrUnsupported},
		{"gpt2 eps", `{"model_type": "gpt2", "layer_norm_epsilon": 1e-6}`, hf.ErrUnsupported},
		{"gpt2 untied", `{"model_type": "gpt2", "tie_word_embeddings": false}`, hf.ErrUnsupported},
		{"gpt2 layer-scaled attention", `{"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": true}`, hf.ErrUnsupported},
		{"gpt2 heads", `{"model_type": "gpt2", "n_embd": 100, "n_head": 12}`, hf.ErrConfig},
		{"bad token id", `{"model_type": "gpt2", "eos_token_id": [-1]}`, hf.ErrConfig},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := hf.ParseConfig([]byte(c.json))
			assert.ErrorIs(t, err, c.want)
		})
	}
	_, err := hf.ParseConfig([]byte(`{"architectures": ["BertForMaskedLM"], "model_type": "bert"}`))
	var ua *hf.UnsupportedArchitectureError
	require.True(t, errors.As(err, &ua), "%v", err)
	assert.Equal(t, "BertForMaskedLM", ua.Architecture)
	assert.Equal(t, hf.Architectures(), ua.Supported)
	for _, a := range hf.Architectures() {
		assert.Contains(t, err.Error(), string(a), "the error lists the supported architectures")
	}
}

func TestReadConfigHostileFiles(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big.json")
	require.NoError(t, os.WriteFile(big, []byte(`{"model_type": "llama", "x": "`+strings.Repeat("a", 1<<20)+`"}`), 0o644))
	_, err := hf.ReadConfig(big)
	assert.ErrorIs(t, err, hf.ErrTooLarge)
	_, err = hf.ParseConfig(make([]byte, 1<<20+1))
	assert.ErrorIs(t, err, hf.ErrTooLarge)

	fifoDir := filepath.Join(dir, "fifo")
	require.NoError(t, os.Mkdir(fifoDir, 0o755))
	require.NoError(t, syscall.Mkfifo(filepath.Join(fifoDir, "config.json"), 0o644))
	_, err = hf.ReadConfig(fifoDir)
	assert.ErrorIs(t, err, hf.ErrNotRegular)
	require.NoError(t, os.Symlink("/dev/zero", filepath.Join(dir, "zero.json")))
	_, err = hf.ReadConfig(filepath.Join(dir, "zero.json"))
	assert.ErrorIs(t, err, hf.ErrNotRegular)
	_, err = hf.ReadConfig(filepath.Join(dir, "absent"))
	assert.ErrorIs(t, err, os.ErrNotExist)
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.Mkdir(empty, 0o755))
	_, err = hf.ReadConfig(empty)
	assert.ErrorIs(t, err, os.ErrNotExist)
}

// models.Llama32_3B is the Llama 3.2 3B config.json, field by field, and
// its parameter count is the published 3.21 B.
func TestLlama32_3BConfig(t *testing.T) {
	c, err := hf.ReadConfig(filepath.Join("testdata", "configs", "llama3.2-3b.json"))
	require.NoError(t, err)
	assert.Equal(t, models.Llama32_3B(), *c.Llama)
	assert.Equal(t, 3_212_749_824, nn.NumParams(models.NewLlama(nn.Options{ShapeOnly: true}, models.Llama32_3B())))
}
