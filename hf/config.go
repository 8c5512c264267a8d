package hf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/batchfit/batchfit/internal/safefile"
	"github.com/batchfit/batchfit/models"
)

// Architecture is a config.json "architectures" entry batchfit has a
// model for.
type Architecture string

// The supported architectures: the Llama family maps to models.Llama
// (LlamaConfig), GPT-2 to models.GPT.
const (
	Llama   Architecture = "LlamaForCausalLM"
	Mistral Architecture = "MistralForCausalLM"
	Qwen2   Architecture = "Qwen2ForCausalLM"
	GPT2    Architecture = "GPT2LMHeadModel"
)

// Architectures lists the supported architectures.
func Architectures() []Architecture { return []Architecture{Llama, Mistral, Qwen2, GPT2} }

// LlamaFamily reports whether a maps to models.LlamaConfig.
func (a Architecture) LlamaFamily() bool { return a == Llama || a == Mistral || a == Qwen2 }

// modelTypes maps config.json's "model_type" to its architecture, for
// configs without "architectures".
var modelTypes = map[string]Architecture{"llama": Llama, "mistral": Mistral, "qwen2": Qwen2, "gpt2": GPT2}

func (a Architecture) modelType() string {
	for t, b := range modelTypes {
		if a == b {
			return t
		}
	}
	return ""
}

// Config is a checkpoint's config.json: its architecture and the model
// configuration batchfit builds from it.
type Config struct {
	Architecture Architecture
	// Llama is set for the Llama family (Llama, Mistral, Qwen2).
	Llama *models.LlamaConfig
	// GPT is set for GPT-2.
	GPT *models.GPTConfig
	// DType is the declared dtype of the weights ("dtype", or the older
	// "torch_dtype"): "float32", "bfloat16", "float16", or "" when the
	// file has none. Save stores tensors in it (float32 when "").
	DType string
	// SlidingWindow is the attention window of Mistral's sliding_window
	// (and Qwen2's when use_sliding_window is set), 0 for none.
	// models.Llama attends over the whole causal context, which is the
	// same attention only for sequences of at most SlidingWindow tokens.
	SlidingWindow int
	// BOS and EOS are bos_token_id and eos_token_id (a list for some
	// Llama 3 files); BOS is -1 and EOS empty when unset.
	BOS int
	EOS []int

	// raw is the file's keys, so that Save writes back what it does not
	// own (generation settings, token ids, dropouts) unchanged.
	raw map[string]json.RawMessage
}

// maxConfigBytes bounds config.json: real ones are a few KiB (Qwen2's
// per-layer lists included).
const maxConfigBytes = 1 << 20

// Bounds on sizes, far beyond any real model, so that products of them
// (parameter counts) cannot overflow an int64.
const (
	maxDim       = 1 << 24
	maxLayers    = 1 << 14
	maxPositions = 1 << 30
)

// ReadConfig reads path's config.json when path is a directory, or path
// itself. The file must be a regular file of at most 1 MiB.
func ReadConfig(path string) (Config, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, "config.json")
	}
	b, err := readBounded(path, maxConfigBytes)
	if err != nil {
		return Config{}, err
	}
	cfg, err := ParseConfig(b)
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// readBounded reads a regular file of at most limit bytes; a longer one
// is ErrTooLarge.
func readBounded(path string, limit int64) ([]byte, error) {
	b, err := safefile.ReadAll(path, limit)
	if errors.Is(err, safefile.ErrTooLarge) {
		err = fmt.Errorf("%w: %w", ErrTooLarge, err)
	}
	return b, err
}

// ParseConfig parses a config.json's bytes. Keys that are absent or null
// take transformers' defaults for the architecture.
func ParseConfig(b []byte) (Config, error) {
	if len(b) > maxConfigBytes {
		return Config{}, fmt.Errorf("%w: config of %d bytes, at most %d", ErrTooLarge, len(b), maxConfigBytes)
	}
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&raw); err != nil || raw == nil {
		return Config{}, fmt.Errorf("%w: not a JSON object: %v", ErrConfig, err)
	}
	if dec.More() {
		return Config{}, fmt.Errorf("%w: data after the JSON object", ErrConfig)
	}
	r := &reader{m: raw}
	arch := r.architecture()
	cfg := Config{Architecture: arch, raw: raw, BOS: -1}
	if r.err != nil {
		return Config{}, r.err
	}
	cfg.DType = r.str("torch_dtype", "")
	cfg.DType = r.str("dtype", cfg.DType)
	cfg.BOS = r.integer("bos_token_id", -1, 0, math.MaxInt32)
	cfg.EOS = r.intList("eos_token_id")
	switch {
	case arch == GPT2:
		g := r.gpt2()
		cfg.GPT = &g
	default:
		l, window := r.llama(arch)
		cfg.Llama, cfg.SlidingWindow = &l, window
	}
	if r.err != nil {
		return Config{}, r.err
	}
	return cfg, nil
}

// reader reads typed values from a config's keys; the first error sticks.
type reader struct {
	m   map[string]json.RawMessage
	in  string // "" at the top level, "rope_parameters." inside it
	err error
}

func (r *reader) fail(sentinel error, key, format string, a ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s%s: %s", sentinel, r.in, key, fmt.Sprintf(format, a...))
	}
}

// value is key's raw value, nil when absent or null.
func (r *reader) value(key string) json.RawMessage {
	v := r.m[key]
	if v == nil || string(v) == "null" {
		return nil
	}
	return v
}

func (r *reader) has(key string) bool { return r.value(key) != nil }

// integer reads an integer in [lo, hi].
func (r *reader) integer(key string, def, lo, hi int) int {
	v := r.value(key)
	if v == nil {
		return def
	}
	n, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil {
		// 4096.0 is an integer too, as Python's json would read it.
		f, ferr := strconv.ParseFloat(string(v), 64)
		if ferr != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
			r.fail(ErrConfig, key, "%s is not an integer", v)
			return def
		}
		n = int64(f)
	}
	if n < int64(lo) || n > int64(hi) {
		r.fail(ErrConfig, key, "%d is outside [%d, %d]", n, lo, hi)
		return def
	}
	return int(n)
}

// positive reads an integer in [1, hi].
func (r *reader) positive(key string, def, hi int) int { return r.integer(key, def, 1, hi) }

// float reads a finite number; positive ones only when pos is set.
func (r *reader) float(key string, def float64, pos bool) float64 {
	v := r.value(key)
	if v == nil {
		return def
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		r.fail(ErrConfig, key, "%s is not a finite number", v)
		return def
	}
	if pos && f <= 0 {
		r.fail(ErrConfig, key, "%g must be positive", f)
		return def
	}
	return f
}

func (r *reader) boolean(key string, def bool) bool {
	v := r.value(key)
	if v == nil {
		return def
	}
	var b bool
	if err := json.Unmarshal(v, &b); err != nil {
		r.fail(ErrConfig, key, "%s is not true or false", v)
		return def
	}
	return b
}

func (r *reader) str(key, def string) string {
	v := r.value(key)
	if v == nil {
		return def
	}
	var s string
	if err := json.Unmarshal(v, &s); err != nil {
		r.fail(ErrConfig, key, "%s is not a string", v)
		return def
	}
	return s
}

func (r *reader) object(key string) map[string]json.RawMessage {
	v := r.value(key)
	if v == nil {
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(v, &m); err != nil {
		r.fail(ErrConfig, key, "not an object")
		return nil
	}
	return m
}

// intList reads a token id or a list of them.
func (r *reader) intList(key string) []int {
	v := r.value(key)
	if v == nil {
		return nil
	}
	if v[0] != '[' {
		return []int{r.integer(key, 0, 0, math.MaxInt32)}
	}
	var ns []int64
	if err := json.Unmarshal(v, &ns); err != nil {
		r.fail(ErrConfig, key, "%s is not a list of token ids", v)
		return nil
	}
	out := make([]int, len(ns))
	for i, n := range ns {
		if n < 0 || n > math.MaxInt32 {
			r.fail(ErrConfig, key, "token id %d is out of range", n)
			return nil
		}
		out[i] = int(n)
	}
	return out
}

// architecture reads "architectures" (or, without it, "model_type").
func (r *reader) architecture() Architecture {
	var archs []string
	if v := r.value("architectures"); v != nil {
		if err := json.Unmarshal(v, &archs); err != nil {
			r.fail(ErrConfig, "architectures", "not a list of strings")
			return ""
		}
	}
	mt := r.str("model_type", "")
	if r.err != nil {
		return ""
	}
	var name string
	switch {
	case len(archs) == 1:
		name = archs[0]
	case len(archs) > 1:
		r.err = fmt.Errorf("%w: architectures %v: a checkpoint of several architectures", ErrUnsupported, archs)
		return ""
	case modelTypes[mt] != "":
		return modelTypes[mt]
	default:
		name = mt
		if name == "" {
			name = "(none: no architectures or model_type)"
		}
	}
	a := Architecture(name)
	if !slices.Contains(Architectures(), a) {
		r.err = &UnsupportedArchitectureError{Architecture: name, Supported: Architectures()}
		return ""
	}
	if t, ok := modelTypes[mt]; mt != "" && (!ok || t != a) {
		r.fail(ErrConfig, "model_type", "%q does not match architecture %s", mt, a)
		return ""
	}
	return a
}

// llamaDefaults are transformers' defaults for keys a config leaves out.
type llamaDefaults struct {
	vocab, hidden, intermediate, layers, heads, kvHeads, positions int
	eps, theta                                                     float64
	window                                                         int // sliding_window's default
}

var familyDefaults = map[Architecture]llamaDefaults{
	Llama:   {vocab: 32000, hidden: 4096, intermediate: 11008, layers: 32, heads: 32, kvHeads: 0, positions: 2048, eps: 1e-6, theta: 10000},
	Mistral: {vocab: 32000, hidden: 4096, intermediate: 14336, layers: 32, heads: 32, kvHeads: 8, positions: 4096 * 32, eps: 1e-6, theta: 10000, window: 4096},
	Qwen2:   {vocab: 151936, hidden: 4096, intermediate: 22016, layers: 32, heads: 32, kvHeads: 32, positions: 32768, eps: 1e-6, theta: 10000, window: 4096},
}

// llama reads a Llama-family config and its sliding window.
func (r *reader) llama(arch Architecture) (models.LlamaConfig, int) {
	d := familyDefaults[arch]
	c := models.LlamaConfig{
		Vocab:        r.positive("vocab_size", d.vocab, maxDim),
		Hidden:       r.positive("hidden_size", d.hidden, maxDim),
		Intermediate: r.positive("intermediate_size", d.intermediate, maxDim),
		Layers:       r.positive("num_hidden_layers", d.layers, maxLayers),
		Heads:        r.positive("num_attention_heads", d.heads, maxDim),
		MaxPositions: r.positive("max_position_embeddings", d.positions, maxPositions),
		RMSNormEps:   r.float("rms_norm_eps", d.eps, true),
	}
	kvDef := d.kvHeads
	if kvDef == 0 {
		kvDef = c.Heads
	}
	c.KVHeads = r.positive("num_key_value_heads", kvDef, maxDim)
	if r.err == nil && c.Heads%c.KVHeads != 0 {
		r.fail(ErrConfig, "num_key_value_heads", "%d does not divide num_attention_heads %d", c.KVHeads, c.Heads)
	}
	if !r.has("head_dim") && r.err == nil && c.Hidden%c.Heads != 0 {
		r.fail(ErrConfig, "hidden_size", "%d is not a multiple of num_attention_heads %d (and head_dim is unset)", c.Hidden, c.Heads)
	}
	c.HeadDim = r.positive("head_dim", c.Hidden/max(c.Heads, 1), maxDim)
	c.TieEmbeddings = r.boolean("tie_word_embeddings", false)
	switch arch {
	case Llama:
		c.QKVBias = r.boolean("attention_bias", false)
		c.OutBias = c.QKVBias
		c.MLPBias = r.boolean("mlp_bias", false)
	case Qwen2: // Qwen2's q, k and v projections always have biases, its output projection none
		c.QKVBias = true
	}
	if act := r.str("hidden_act", "silu"); act != "silu" && r.err == nil {
		r.fail(ErrUnsupported, "hidden_act", "%q: models.Llama's feed-forward block is SwiGLU (silu)", act)
	}
	if f := r.float("partial_rotary_factor", 1, true); f != 1 && r.err == nil {
		r.fail(ErrUnsupported, "partial_rotary_factor", "%g: models.Llama rotates whole heads", f)
	}
	c.Rope = r.rope(d.theta)
	// sliding_window: null switches the window off; absent, it takes
	// the default.
	window := 0
	if _, present := r.m["sliding_window"]; !present {
		window = d.window
	}
	window = r.integer("sliding_window", window, 0, maxPositions)
	if arch == Llama || arch == Qwen2 && !r.boolean("use_sliding_window", false) {
		window = 0
	}
	return c, window
}

// rope reads the rotary embedding's settings from rope_parameters
// (transformers 5) or rope_theta + rope_scaling (older files).
func (r *reader) rope(defTheta float64) models.RopeConfig {
	theta := r.float("rope_theta", defTheta, true)
	var p *reader
	switch {
	case r.has("rope_parameters"):
		m := r.object("rope_parameters")
		if m == nil {
			return models.RopeConfig{}
		}
		p = &reader{m: m, in: "rope_parameters."}
		if !p.has("rope_type") && !p.has("type") && !p.has("rope_theta") {
			r.fail(ErrUnsupported, "rope_parameters", "per-layer-type rope settings")
			return models.RopeConfig{}
		}
		t := p.float("rope_theta", theta, true)
		if r.has("rope_theta") && t != theta {
			r.fail(ErrConfig, "rope_theta", "%g disagrees with rope_parameters.rope_theta %g", theta, t)
		}
		theta = t
	case r.has("rope_scaling"):
		m := r.object("rope_scaling")
		if m == nil {
			return models.RopeConfig{}
		}
		p = &reader{m: m, in: "rope_scaling."}
	}
	rc := models.RopeConfig{Theta: theta, Type: "default"}
	if p == nil {
		return rc
	}
	typ := p.str("rope_type", p.str("type", "default"))
	switch typ {
	case "default", "":
	case "linear":
		rc.Type = typ
		rc.Factor = p.float("factor", 0, true)
		if !p.has("factor") {
			p.fail(ErrConfig, "factor", "linear scaling needs a factor")
		}
	case "llama3":
		rc.Type = typ
		for _, k := range []string{"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} {
			if !p.has(k) {
				p.fail(ErrConfig, k, "llama3 scaling needs it")
			}
		}
		rc.Factor = p.float("factor", 0, true)
		rc.LowFreqFactor = p.float("low_freq_factor", 0, true)
		rc.HighFreqFactor = p.float("high_freq_factor", 0, true)
		rc.OriginalMaxPositions = p.positive("original_max_position_embeddings", 0, maxPositions)
		if p.err == nil && rc.HighFreqFactor <= rc.LowFreqFactor {
			p.fail(ErrConfig, "high_freq_factor", "%g must exceed low_freq_factor %g", rc.HighFreqFactor, rc.LowFreqFactor)
		}
	default:
		p.fail(ErrUnsupported, "rope_type", "%q: models.Llama implements default, linear and llama3 rope", typ)
	}
	if r.err == nil {
		r.err = p.err
	}
	return rc
}

// gpt2 reads a GPT-2 config; settings models.GPT does not implement are
// refused rather than approximated.
func (r *reader) gpt2() models.GPTConfig {
	c := models.GPTConfig{
		Vocab:   r.positive("vocab_size", 50257, maxDim),
		Context: r.positive("n_positions", r.positive("n_ctx", 1024, maxPositions), maxPositions),
		Dim:     r.positive("n_embd", 768, maxDim),
		Layers:  r.positive("n_layer", 12, maxLayers),
		Heads:   r.positive("n_head", 12, maxDim),
	}
	if r.err == nil && c.Dim%c.Heads != 0 {
		r.fail(ErrConfig, "n_embd", "%d is not a multiple of n_head %d", c.Dim, c.Heads)
	}
	if inner := r.positive("n_inner", 4*c.Dim, 4*maxDim); inner != 4*c.Dim && r.err == nil {
		r.fail(ErrUnsupported, "n_inner", "%d: models.GPT's MLP is 4 × n_embd = %d wide", inner, 4*c.Dim)
	}
	// models.GPT's GELU is the tanh approximation, which gelu_new and
	// gelu_pytorch_tanh name.
	if act := r.str("activation_function", "gelu_new"); act != "gelu_new" && act != "gelu_pytorch_tanh" && r.err == nil {
		r.fail(ErrUnsupported, "activation_function", "%q: models.GPT uses the tanh GELU (gelu_new)", act)
	}
	if eps := r.float("layer_norm_epsilon", 1e-5, true); eps != 1e-5 && r.err == nil {
		r.fail(ErrUnsupported, "layer_norm_epsilon", "%g: models.GPT's layer norms use 1e-5", eps)
	}
	for _, s := range []struct {
		key  string
		want bool
	}{{"scale_attn_weights", true}, {"scale_attn_by_inverse_layer_idx", false}, {"add_cross_attention", false}, {"tie_word_embeddings", true}} {
		if got := r.boolean(s.key, s.want); got != s.want && r.err == nil {
			r.fail(ErrUnsupported, s.key, "%v: models.GPT implements %v", got, s.want)
		}
	}
	return c
}

// Tied reports whether the output head reuses the token embedding (so the
// checkpoint has no lm_head.weight): always for GPT-2, tie_word_embeddings
// for the Llama family.
func (c Config) Tied() bool {
	if c.Llama != nil {
		return c.Llama.TieEmbeddings
	}
	return c.Architecture == GPT2
}
