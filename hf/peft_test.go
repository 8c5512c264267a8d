package hf_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// peftConfig is the Llama the adapter tests adapt: llama-tiny with an
// untied head.
func peftConfig() models.LlamaConfig {
	cfg := models.LlamaTiny()
	cfg.TieEmbeddings = false
	return cfg
}

// adaptedLlama is a Llama of peftConfig with seed's weights and LoRA
// adapters (r 4, alpha 8) on targets whose B are random (a trained
// adapter's: fresh ones are zero).
func adaptedLlama(t *testing.T, seed uint64, targets []string) *models.Llama {
	t.Helper()
	m := models.NewLlama(nn.Seed(seed), peftConfig())
	ls, err := nn.LoRA{Rank: 4, Alpha: 8, Targets: targets, Base: graph.Float32}.Apply(nn.Seed(seed+1), m)
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(seed, 3))
	for _, l := range ls {
		d := l.Layer.B.Value().Data().([]float32)
		for i := range d {
			d[i] = float32(0.05 * rng.NormFloat64())
		}
	}
	return m
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

// SaveAdapter writes PEFT's files: tensors named base_model.model.<param>
// in float32, a config with PEFT's keys; LoadAdapter reads them onto a
// fresh base, and saving that again gives both files byte for byte.
func TestAdapterRoundTripByteForByte(t *testing.T) {
	targets := []string{"q_proj", "v_proj", "o_proj", "down_proj"}
	m := adaptedLlama(t, 1, targets)
	dir := filepath.Join(t.TempDir(), "adapter")
	require.NoError(t, hf.SaveAdapter(dir, m, "base"))

	f, err := safetensors.Open(filepath.Join(dir, hf.AdapterWeightsFile))
	require.NoError(t, err)
	names := []string{}
	for _, ti := range f.Tensors() {
		names = append(names, ti.Name)
		assert.Equal(t, safetensors.F32, ti.DType)
	}
	require.NoError(t, f.Close())
	assert.Contains(t, names, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
	assert.Contains(t, names, "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
	assert.Len(t, names, 2*len(targets)*peftConfig().Layers)

	var conf map[string]any
	require.NoError(t, json.Unmarshal(readFile(t, filepath.Join(dir, hf.AdapterConfigFile)), &conf))
	assert.Equal(t, "LORA", conf["peft_type"])
	assert.Equal(t, "CAUSAL_LM", conf["task_type"])
	assert.Equal(t, 4.0, conf["r"])
	assert.Equal(t, 8.0, conf["lora_alpha"])
	assert.Equal(t, 0.0, conf["lora_dropout"])
	assert.Equal(t, "none", conf["bias"])
	assert.Equal(t, false, conf["fan_in_fan_out"])
	assert.Equal(t, "base", conf["base_model_name_or_path"])
	assert.Equal(t, []any{"down_proj", "o_proj", "q_proj", "v_proj"}, conf["target_modules"])

	fresh := models.NewLlama(nn.Seed(1), peftConfig())
	c, err := hf.LoadAdapter(dir, fresh, graph.Float32)
	require.NoError(t, err)
	assert.Equal(t, 4, c.LoRA.Rank)
	assert.Equal(t, "base", c.BaseModel)
	want := nn.LoRAParams(m)
	got := nn.LoRAParams(fresh)
	require.Len(t, got, len(want))
	for i := range want {
		require.Equal(t, want[i].Name(), got[i].Name())
		require.Equal(t, want[i].Value().Data(), got[i].Value().Data(), want[i].Name())
	}
	again := filepath.Join(t.TempDir(), "again")
	require.NoError(t, hf.SaveAdapter(again, fresh, "base"))
	for _, name := range []string{hf.AdapterWeightsFile, hf.AdapterConfigFile} {
		require.Equal(t, readFile(t, filepath.Join(dir, name)), readFile(t, filepath.Join(again, name)), name)
	}
}

// writeAdapter writes an adapter directory of conf (JSON) and tensors.
func writeAdapter(t *testing.T, conf map[string]any, tensors []safetensors.Tensor) string {
	t.Helper()
	dir := t.TempDir()
	b, err := json.Marshal(conf)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, hf.AdapterConfigFile), b, 0o644))
	require.NoError(t, safetensors.WriteFile(filepath.Join(dir, hf.AdapterWeightsFile), tensors, nil))
	return dir
}

// Hostile adapter files are refused with typed errors, before the model
// is changed: bad or unsupported config values, a config too large, a
// FIFO or a directory for a file, a tensor of the wrong shape, rank or
// dtype, a tensor of no targeted layer, a missing one, a truncated
// weights file.
func TestAdapterHostileFiles(t *testing.T) {
	cfg := peftConfig()
	good := func() map[string]any {
		return map[string]any{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.0,
			"target_modules": []string{"q_proj"}, "bias": "none", "task_type": "CAUSAL_LM"}
	}
	q := func(layer int, ab string) string {
		return "base_model.model.model.layers." + string(rune('0'+layer)) + ".self_attn.q_proj.lora_" + ab + ".weight"
	}
	qOut := cfg.Heads * cfg.HeadDimOrDefault()
	tensors := func(r int) []safetensors.Tensor {
		var ts []safetensors.Tensor
		for l := range cfg.Layers {
			ts = append(ts,
				safetensors.Tensor{Name: q(l, "A"), DType: safetensors.F32, Shape: []int{r, cfg.Hidden}, Float32: make([]float32, r*cfg.Hidden)},
				safetensors.Tensor{Name: q(l, "B"), DType: safetensors.F32, Shape: []int{qOut, r}, Float32: make([]float32, r*qOut)})
		}
		return ts
	}
	with := func(k string, v any) map[string]any {
		c := good()
		if v == nil {
			delete(c, k)
		} else {
			c[k] = v
		}
		return c
	}
	cases := []struct {
		name    string
		conf    map[string]any
		tensors []safetensors.Tensor
		want    error
	}{
		{"prefix tuning", with("peft_type", "PREFIX_TUNING"), tensors(2), hf.ErrUnsupported},
		{"rank 0", with("r", 0), tensors(2), hf.ErrConfig},
		{"rank huge", with("r", 1<<30), tensors(2), hf.ErrConfig},
		{"rank text", with("r", "two"), tensors(2), hf.ErrConfig},
		{"alpha negative", with("lora_alpha", -1), tensors(2), hf.ErrConfig},
		{"dropout 1", with("lora_dropout", 1.0), tensors(2), hf.ErrConfig},
		{"bias", with("bias", "all"), tensors(2), hf.ErrUnsupported},
		{"dora", with("use_dora", true), tensors(2), hf.ErrUnsupported},
		{"rslora", with("use_rslora", true), tensors(2), hf.ErrUnsupported},
		{"lora bias", with("lora_bias", true), tensors(2), hf.ErrUnsupported},
		{"exclude modules", with("exclude_modules", []string{"layers.0.self_attn.q_proj"}), tensors(2), hf.ErrUnsupported},
		{"not json", map[string]any{"peft_type": []int{1}}, tensors(2), hf.ErrConfig},
		{"fan in fan out", with("fan_in_fan_out", true), tensors(2), hf.ErrUnsupported},
		{"rank pattern", with("rank_pattern", map[string]int{"q_proj": 8}), tensors(2), hf.ErrUnsupported},
		{"regex targets", with("target_modules", ".*q_proj"), tensors(2), hf.ErrUnsupported},
		{"no targets", with("target_modules", nil), tensors(2), hf.ErrConfig},
		{"empty targets", with("target_modules", []string{}), tensors(2), hf.ErrConfig},
		{"targets of numbers", with("target_modules", []int{1}), tensors(2), hf.ErrConfig},
		{"target not in the model", with("target_modules", []string{"c_attn"}), tensors(2), graph.ErrAttr},
		{"task", with("task_type", "SEQ_CLS"), tensors(2), hf.ErrUnsupported},
		{"rank mismatch", good(), tensors(3), hf.ErrAdapterRank},
		{"unexpected tensor", good(), append(tensors(2), safetensors.Tensor{Name: "base_model.model.lm_head.lora_A.weight",
			DType: safetensors.F32, Shape: []int{2, cfg.Hidden}, Float32: make([]float32, 2*cfg.Hidden)}), hf.ErrUnexpectedTensor},
		{"missing tensor", good(), tensors(2)[1:], hf.ErrMissingTensor},
		{"wrong shape", good(), func() []safetensors.Tensor {
			ts := tensors(2)
			ts[0].Shape, ts[0].Float32 = []int{2, cfg.Hidden + 1}, make([]float32, 2*(cfg.Hidden+1))
			return ts
		}(), hf.ErrShape},
		{"integer tensor", good(), func() []safetensors.Tensor {
			ts := tensors(2)
			ts[0].DType, ts[0].Float32, ts[0].Raw = safetensors.I32, nil, make([]byte, 4*2*cfg.Hidden)
			return ts
		}(), safetensors.ErrDType},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := writeAdapter(t, c.conf, c.tensors)
			m := models.NewLlama(nn.Seed(1), cfg)
			_, err := hf.LoadAdapter(dir, m, graph.Float32)
			require.ErrorIs(t, err, c.want)
			assert.Empty(t, nn.LoRAAdapters(m), "the model is unchanged")
			for _, p := range m.Params() {
				require.False(t, p.Frozen(), p.Name())
			}
		})
	}
	var rank *hf.RankError
	_, err := hf.LoadAdapter(writeAdapter(t, good(), tensors(3)), models.NewLlama(nn.Seed(1), cfg), 0)
	require.True(t, errors.As(err, &rank))
	assert.Equal(t, 2, rank.Rank)
	assert.Equal(t, 3, rank.Got)

	// A config too large, a FIFO, a directory, a truncated weights file.
	big := writeAdapter(t, good(), tensors(2))
	require.NoError(t, os.WriteFile(filepath.Join(big, hf.AdapterConfigFile), []byte(`{"r": 2, "pad": "`+strings.Repeat("x", 2<<20)+`"}`), 0o644))
	_, err = hf.LoadAdapter(big, models.NewLlama(nn.Seed(1), cfg), 0)
	require.ErrorIs(t, err, hf.ErrTooLarge)

	dirAsFile := writeAdapter(t, good(), tensors(2))
	require.NoError(t, os.Remove(filepath.Join(dirAsFile, hf.AdapterConfigFile)))
	require.NoError(t, os.Mkdir(filepath.Join(dirAsFile, hf.AdapterConfigFile), 0o755))
	_, err = hf.LoadAdapter(dirAsFile, models.NewLlama(nn.Seed(1), cfg), 0)
	require.ErrorIs(t, err, hf.ErrNotRegular)

	fifo := writeAdapter(t, good(), tensors(2))
	require.NoError(t, os.Remove(filepath.Join(fifo, hf.AdapterWeightsFile)))
	if syscall.Mkfifo(filepath.Join(fifo, hf.AdapterWeightsFile), 0o644) == nil {
		_, err = hf.LoadAdapter(fifo, models.NewLlama(nn.Seed(1), cfg), 0)
		require.ErrorIs(t, err, hf.ErrNotRegular)
	}

	short := writeAdapter(t, good(), tensors(2))
	w := filepath.Join(short, hf.AdapterWeightsFile)
	b := readFile(t, w)
	require.NoError(t, os.WriteFile(w, b[:len(b)-9], 0o644))
	m := models.NewLlama(nn.Seed(1), cfg)
	_, err = hf.LoadAdapter(short, m, 0)
	require.ErrorIs(t, err, safetensors.ErrFormat)
	assert.Empty(t, nn.LoRAAdapters(m))

	huge := writeAdapter(t, good(), tensors(2))
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], math.MaxUint64)
	require.NoError(t, os.WriteFile(filepath.Join(huge, hf.AdapterWeightsFile), lenBuf[:], 0o644))
	_, err = hf.LoadAdapter(huge, models.NewLlama(nn.Seed(1), cfg), 0)
	require.ErrorIs(t, err, safetensors.ErrTooLarge)
}

// checkTokens are the inputs the PEFT check runs: [2, 12] tokens, labels
// equal to them but for two positions of −100.
func checkTokens(vocab int) (tokens, labels *tensor.Dense) {
	rng := rand.New(rand.NewPCG(11, 12))
	tok := make([]int64, 24)
	for i := range tok {
		tok[i] = int64(rng.IntN(vocab))
	}
	lab := slices.Clone(tok)
	lab[3], lab[19] = graph.IgnoreLabel, graph.IgnoreLabel
	return tensor.New(tensor.WithShape(2, 12), tensor.WithBacking(tok)), tensor.New(tensor.WithShape(2, 12), tensor.WithBacking(lab))
}

// evalLlama runs m's logits and causal LM loss on the CPU in float32.
func evalLlama(t *testing.T, m *models.Llama, tokens, labels *tensor.Dense) (logits []float32, loss float32) {
	t.Helper()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	defer sess.Close()
	x := lazy.Wrap(tokens.Clone().(*tensor.Dense), 0)
	out := m.Forward(x)
	l := models.CausalLMLoss(out, x.Graph().Wrap(labels.Clone().(*tensor.Dense), 0))
	vs, err := sess.Eval(context.Background(), out, l)
	require.NoError(t, err)
	return slices.Clone(vs[0].Float32s()), vs[1].Float32s()[0]
}

func int64Bytes(d []int64) []byte {
	b := make([]byte, 8*len(d))
	for i, v := range d {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(v))
	}
	return b
}

// TestWritePeftCheck writes into $BATCHFIT_PEFT_CHECK what
// scripts/check-peft-adapters.py compares against peft: base/ (hf.Save of
// a Llama, float32), adapter/ (SaveAdapter: LoRA r 4, alpha 8 on every
// linear layer but the head, random B), merged/ (hf.Save of MergeLoRA),
// and reference.safetensors: input_ids and labels [2, 12] (I64, two
// labels −100), logits (F32 [2, 12, vocab]) and loss (F32 scalar) of the
// adapted model as batchfit's CPU executor computes them in float32.
func TestWritePeftCheck(t *testing.T) {
	out := os.Getenv("BATCHFIT_PEFT_CHECK")
	if out == "" {
		t.Skip("set BATCHFIT_PEFT_CHECK=DIR to write an adapter for the peft check (scripts/check-peft-adapters.py)")
	}
	cfg := peftConfig()
	hcfg := hf.Config{Architecture: hf.Llama, Llama: &cfg, DType: "float32", BOS: -1}
	base := models.NewLlama(nn.Seed(21), cfg)
	require.NoError(t, hf.Save(filepath.Join(out, "base"), hcfg, base.Params()))
	m := adaptedLlama(t, 21, nn.DefaultLoRATargets)
	require.NoError(t, hf.SaveAdapter(filepath.Join(out, "adapter"), m, "base"))
	merged, err := nn.MergeLoRA(m)
	require.NoError(t, err)
	require.NoError(t, hf.Save(filepath.Join(out, "merged"), hcfg, merged))
	tokens, labels := checkTokens(cfg.Vocab)
	logits, loss := evalLlama(t, m, tokens, labels)
	require.NoError(t, safetensors.WriteFile(filepath.Join(out, "reference.safetensors"), []safetensors.Tensor{
		{Name: "input_ids", DType: safetensors.I64, Shape: []int{2, 12}, Raw: int64Bytes(tokens.Data().([]int64))},
		{Name: "labels", DType: safetensors.I64, Shape: []int{2, 12}, Raw: int64Bytes(labels.Data().([]int64))},
		{Name: "logits", DType: safetensors.F32, Shape: []int{2, 12, cfg.Vocab}, Float32: logits},
		{Name: "loss", DType: safetensors.F32, Shape: []int{}, Float32: []float32{loss}},
	}, map[string]string{"format": "pt"}))
}

// An adapter PEFT made (scripts/make-reference-data.py's make_peft: r 4,
// alpha 8 on q_proj and v_proj of hf/testdata/llama-gqa-untied, random A
// and B) loads onto that checkpoint, and the adapted model's logits are
// peft's in float64. $BATCHFIT_PEFT_REFERENCE names another such
// directory (scripts/check-peft-adapters.py --make OUT writes OUT/peft-lora).
//
// Tolerance: 1e-5 of the logits' magnitude (float32 against float64).
func TestLoadPeftReference(t *testing.T) {
	dir := filepath.Join("testdata", "peft-lora-llama")
	if d := os.Getenv("BATCHFIT_PEFT_REFERENCE"); d != "" {
		dir = d
	}
	if _, err := os.Stat(filepath.Join(dir, hf.AdapterConfigFile)); err != nil {
		t.Skip("no testdata/peft-lora-llama: make it with scripts/make-reference-data.py where peft is installed (or set BATCHFIT_PEFT_REFERENCE)")
	}
	src := filepath.Join("testdata", "llama-gqa-untied-sharded") // the weights of llama-gqa-untied, in shards
	cfg, err := hf.ReadConfig(src)
	require.NoError(t, err)
	m := models.NewLlama(nn.Seed(1), *cfg.Llama)
	require.NoError(t, hf.LoadInto(src, m.Params()))
	c, err := hf.LoadAdapter(dir, m, graph.Float32)
	require.NoError(t, err)
	assert.Equal(t, 4, c.LoRA.Rank)
	f, err := safetensors.Open(filepath.Join(dir, "reference.safetensors"))
	require.NoError(t, err)
	defer f.Close()
	ids := make([]int64, 24)
	require.NoError(t, f.ReadInt64("input_ids", ids))
	want := make([]float64, 24*cfg.Llama.Vocab)
	require.NoError(t, f.ReadFloat64("logits_f64", want))
	tokens := tensor.New(tensor.WithShape(2, 12), tensor.WithBacking(ids))
	got, _ := evalLlama(t, m, tokens, tokens.Clone().(*tensor.Dense))
	scale := 0.0
	for _, v := range want {
		scale = max(scale, math.Abs(v))
	}
	for i := range want {
		require.InDelta(t, want[i], float64(got[i]), 1e-5*scale, "logit %d", i)
	}
}

// A config as a recent PEFT release writes it, with the keys newer
// releases add, parses to its LoRA; an older one without them too.
func TestParseAdapterConfigFromPEFT(t *testing.T) {
	recent := `{
  "alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": null, "bias": "none",
  "corda_config": null, "eva_config": null, "exclude_modules": null, "fan_in_fan_out": false,
  "inference_mode": true, "init_lora_weights": true, "layer_replication": null, "layers_pattern": null,
  "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 8, "lora_bias": false, "lora_dropout": 0.05,
  "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null, "peft_type": "LORA",
  "qalora_group_size": 16, "r": 4, "rank_pattern": {}, "revision": null, "target_modules": ["v_proj", "q_proj"],
  "target_parameters": null, "task_type": "CAUSAL_LM", "trainable_token_indices": null, "use_dora": false,
  "use_qalora": false, "use_rslora": false}`
	old := `{"base_model_name_or_path": "meta-llama/Llama-2-7b-hf", "bias": "none", "enable_lora": null,
  "fan_in_fan_out": false, "inference_mode": true, "lora_alpha": 16.0, "lora_dropout": 0.1, "merge_weights": false,
  "modules_to_save": null, "peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}`
	c, err := hf.ParseAdapterConfig([]byte(recent))
	require.NoError(t, err)
	assert.Equal(t, nn.LoRA{Rank: 4, Alpha: 8, Dropout: 0.05, Targets: []string{"q_proj", "v_proj"}}, c.LoRA)
	assert.Empty(t, c.BaseModel)
	c, err = hf.ParseAdapterConfig([]byte(old))
	require.NoError(t, err)
	assert.Equal(t, nn.LoRA{Rank: 8, Alpha: 16, Dropout: 0.1, Targets: []string{"q_proj", "v_proj"}}, c.LoRA)
	assert.Equal(t, "meta-llama/Llama-2-7b-hf", c.BaseModel)
	_, err = hf.ParseAdapterConfig([]byte(`[1, 2]`))
	require.ErrorIs(t, err, hf.ErrConfig)
}

// Adapters on some of the layers a name reaches are saved under their
// paths, so that a load adapts those layers only.
func TestSaveAdapterNamesPathsWhenNeeded(t *testing.T) {
	m := adaptedLlama(t, 2, []string{"layers.0.mlp.up_proj", "q_proj"})
	dir := t.TempDir()
	require.NoError(t, hf.SaveAdapter(dir, m, ""))
	c, err := hf.ReadAdapterConfig(dir)
	require.NoError(t, err)
	assert.Equal(t, []string{"model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}, c.LoRA.Targets)
	assert.Empty(t, c.BaseModel)
	fresh := models.NewLlama(nn.Seed(2), peftConfig())
	_, err = hf.LoadAdapter(dir, fresh, graph.Float32)
	require.NoError(t, err)
	assert.Len(t, nn.LoRAAdapters(fresh), 3)
}
