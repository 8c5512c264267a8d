package models

import (
	"math"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

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
	// WrittenOut builds the model as a user writes it with plain lazy
	// ops, not batchfit's fused ones: RMSNorm as x·(mean(x²) + ε)^−½·w,
	// rotary embedding as q·cos + rotate_half(q)·sin with slices, neg,
	// concat and mul, SwiGLU as silu(gate)·up, and q, k and v from three
	// projections through the attention op. Its parameters and numbers
	// are the same; graph.FusePointwise fuses its elementwise chains.
	WrittenOut bool
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

// Llama32_1B is Llama 3.2 1B: 16 layers of width 2048, 32 query and 8
// key/value heads of 64, SwiGLU width 8192, vocabulary 128,256, tied
// embeddings, rope_theta 500,000 with llama3 scaling (factor 32, low 1,
// high 4, original 8192 positions).
func Llama32_1B() LlamaConfig {
	return LlamaConfig{Vocab: 128256, Hidden: 2048, Intermediate: 8192, Layers: 16, Heads: 32, KVHeads: 8, HeadDim: 64,
		MaxPositions: 131072, RMSNormEps: 1e-5, TieEmbeddings: true,
		Rope: RopeConfig{Theta: 500000, Type: "llama3", Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}}
}

// Llama32_3B is Llama 3.2 3B: 28 layers of width 3072, 24 query and 8
// key/value heads of 128, SwiGLU width 8192, vocabulary 128,256, tied
// embeddings, rope_theta 500,000 with llama3 scaling (factor 32, low 1,
// high 4, original 8192 positions): 3,212,749,824 parameters.
func Llama32_3B() LlamaConfig {
	return LlamaConfig{Vocab: 128256, Hidden: 3072, Intermediate: 8192, Layers: 28, Heads: 24, KVHeads: 8, HeadDim: 128,
		MaxPositions: 131072, RMSNormEps: 1e-5, TieEmbeddings: true,
		Rope: RopeConfig{Theta: 500000, Type: "llama3", Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}}
}

// Llama3_8B is Llama 3 8B: 32 layers of width 4096, 32 query and 8
// key/value heads of 128, SwiGLU width 14336, vocabulary 128,256, an
// untied head, rope_theta 500,000 (8,030,261,248 parameters).
func Llama3_8B() LlamaConfig {
	return LlamaConfig{Vocab: 128256, Hidden: 4096, Intermediate: 14336, Layers: 32, Heads: 32, KVHeads: 8, HeadDim: 128,
		MaxPositions: 8192, RMSNormEps: 1e-5, Rope: RopeConfig{Theta: 500000}}
}

// LlamaTiny is a Llama small enough for the CPU: 2 layers of width 32, 4
// query heads over 2 key/value heads of 8, SwiGLU width 64, vocabulary 64,
// 64 positions, tied embeddings, llama3 rope scaling over 16 original
// positions (so every band of the scaling is in use).
func LlamaTiny() LlamaConfig {
	return LlamaConfig{Vocab: 64, Hidden: 32, Intermediate: 64, Layers: 2, Heads: 4, KVHeads: 2, MaxPositions: 64,
		RMSNormEps: 1e-5, TieEmbeddings: true,
		Rope: RopeConfig{Theta: 10000, Type: "llama3", Factor: 4, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 16}}
}

// HeadDimOrDefault is head_dim, Hidden / Heads when HeadDim is 0.
func (c LlamaConfig) HeadDimOrDefault() int {
	if c.HeadDim > 0 || c.Heads < 1 {
		return c.HeadDim
	}
	return c.Hidden / c.Heads
}

// KVHeadsOrDefault is num_key_value_heads, Heads when KVHeads is 0.
func (c LlamaConfig) KVHeadsOrDefault() int {
	if c.KVHeads > 0 {
		return c.KVHeads
	}
	return c.Heads
}

// Check reports the first size or setting of c that no Llama has, as a
// graph.ErrAttr error naming it.
func (c LlamaConfig) Check() error {
	bad := func(format string, args ...any) error {
		return graph.Errorf(graph.ErrAttr, "Llama config: "+format, args...)
	}
	kv, d := c.KVHeadsOrDefault(), c.HeadDimOrDefault()
	switch {
	case c.Vocab < 1 || c.Hidden < 1 || c.Intermediate < 1 || c.Layers < 1 || c.Heads < 1:
		return bad("vocab_size %d, hidden_size %d, intermediate_size %d, num_hidden_layers %d and num_attention_heads %d must be positive",
			c.Vocab, c.Hidden, c.Intermediate, c.Layers, c.Heads)
	case c.KVHeads < 0 || c.Heads%kv != 0:
		return bad("num_key_value_heads %d must divide num_attention_heads %d", c.KVHeads, c.Heads)
	case c.HeadDim < 0 || d < 1 || c.HeadDim == 0 && c.Hidden%c.Heads != 0:
		return bad("head_dim %d: without one, num_attention_heads %d must divide hidden_size %d", c.HeadDim, c.Heads, c.Hidden)
	case d%2 != 0:
		return bad("head_dim %d is odd: rotary embedding pairs i with i + head_dim/2", d)
	case !(c.RMSNormEps > 0) || math.IsInf(c.RMSNormEps, 1):
		return bad("rms_norm_eps must be positive and finite, got %g", c.RMSNormEps)
	case c.MaxPositions < 0:
		return bad("max_position_embeddings %d is negative", c.MaxPositions)
	}
	return c.Rope.Check()
}

// Check reports a rotary setting no rope type takes, as a graph.ErrAttr
// error: a theta that is not positive and finite, an unknown type, or a
// scaling type without the factors it needs.
func (r RopeConfig) Check() error {
	bad := func(format string, args ...any) error {
		return graph.Errorf(graph.ErrAttr, "rope: "+format, args...)
	}
	if !(r.Theta > 0) || math.IsInf(r.Theta, 1) {
		return bad("rope_theta must be positive and finite, got %g", r.Theta)
	}
	switch r.Type {
	case "", "default":
	case "linear":
		if !(r.Factor > 0) || math.IsInf(r.Factor, 1) {
			return bad("linear scaling needs a positive, finite factor, got %g", r.Factor)
		}
	case "llama3":
		switch {
		case !(r.Factor > 0) || math.IsInf(r.Factor, 1):
			return bad("llama3 scaling needs a positive, finite factor, got %g", r.Factor)
		case !(r.LowFreqFactor > 0) || !(r.HighFreqFactor > r.LowFreqFactor) || math.IsInf(r.HighFreqFactor, 1):
			return bad("llama3 scaling needs 0 < low_freq_factor < high_freq_factor, got %g and %g", r.LowFreqFactor, r.HighFreqFactor)
		case r.OriginalMaxPositions < 1:
			return bad("llama3 scaling needs original_max_position_embeddings, got %d", r.OriginalMaxPositions)
		}
	default:
		return bad("rope_type %q (batchfit takes default, linear and llama3)", r.Type)
	}
	return nil
}

// InvFreq is the rotary embedding's inverse frequencies for heads of dim
// values (dim/2 of them, in float64): base^(−2i/dim) for i < dim/2, then
// the scaling of r.Type as transformers computes it (modeling_rope_utils:
// _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
// _compute_llama3_parameters). linear divides every frequency by Factor;
// llama3 keeps the frequencies whose wavelength 2π/f is below
// OriginalMaxPositions/HighFreqFactor, divides those above
// OriginalMaxPositions/LowFreqFactor by Factor, and between the two
// interpolates with s = (OriginalMaxPositions/wavelength − LowFreqFactor)
// / (HighFreqFactor − LowFreqFactor): (1 − s)·f/Factor + s·f.
func (r RopeConfig) InvFreq(dim int) ([]float64, error) {
	if err := r.Check(); err != nil {
		return nil, err
	}
	if dim < 2 || dim%2 != 0 {
		return nil, graph.Errorf(graph.ErrAttr, "rope: head dim %d must be even and positive", dim)
	}
	f := make([]float64, dim/2)
	for i := range f {
		f[i] = 1 / math.Pow(r.Theta, float64(2*i)/float64(dim))
	}
	switch r.Type {
	case "linear":
		for i := range f {
			f[i] /= r.Factor
		}
	case "llama3":
		old := float64(r.OriginalMaxPositions)
		lowWave, highWave := old/r.LowFreqFactor, old/r.HighFreqFactor
		for i, v := range f {
			wave := 2 * math.Pi / v
			switch {
			case wave < highWave: // high frequency: kept
			case wave > lowWave: // low frequency: scaled
				f[i] = v / r.Factor
			default:
				s := (old/wave - r.LowFreqFactor) / (r.HighFreqFactor - r.LowFreqFactor)
				f[i] = (1-s)*v/r.Factor + s*v
			}
		}
	}
	return f, nil
}

// Table is the cos/sin table lazy.Tensor.Rotary takes for positions 0 to
// positions − 1 and heads of dim values: [positions, dim] float32, row t
// holding cos(t·f_i) in column i and sin(t·f_i) in column dim/2 + i for
// the inverse frequencies f of InvFreq, computed in float64 and rounded
// once.
func (r RopeConfig) Table(dim, positions int) (*tensor.Dense, error) {
	f, err := r.InvFreq(dim)
	if err != nil {
		return nil, err
	}
	if positions < 1 {
		return nil, graph.Errorf(graph.ErrAttr, "rope: a table of %d positions", positions)
	}
	h := dim / 2
	data := make([]float32, positions*dim)
	for t := range positions {
		row := data[t*dim : (t+1)*dim]
		for i, v := range f {
			s, c := math.Sincos(float64(t) * v)
			row[i], row[h+i] = float32(c), float32(s)
		}
	}
	return tensor.New(tensor.WithShape(positions, dim), tensor.WithBacking(data)), nil
}
