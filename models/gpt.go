package models

import (
	"math"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// GPTConfig sizes a GPT.
type GPTConfig struct {
	Vocab   int // tokens
	Context int // maximum sequence length (rows of the position embedding)
	Layers  int
	Heads   int
	Dim     int // model width; a multiple of Heads
	// WrittenOutAttention builds each block's attention as PyTorch's eager
	// code writes it (q·kᵀ, scale, causal_mask, softmax, ·v, each a
	// [B, H, T, T] value kept for backward), for comparison. By default
	// attention is fused (lazy.Tensor.AttentionQKV, see UnpackedAttention),
	// which keeps nothing [T, T]-sized: GPT-2 small's batch-8 step at seq
	// 1024 plans 9.4 GiB instead of 13.8 GiB in fp32 (measured with the
	// unpacked fused op). In 16 bits at head dims 64 and 128 (bf16-mixed,
	// fp16-mixed) it runs on cuDNN's fused attention or tensor cores; in
	// fp32 on cuBLAS over blocks of queries (bench/RESULTS.md).
	WrittenOutAttention bool
	// UnpackedAttention builds the fused attention from q, k and v sliced
	// out of the projection and permuted to [B, H, T, d] (and the output
	// permuted back), as PyTorch code writes it. By default attention
	// reads them in place from the projection (lazy.Tensor.AttentionQKV),
	// which saves those copies and their gradients' slices and concat:
	// 2.4 ms of GPT-2 small's 27.9 ms bf16-mixed step at batch 8, seq 1024
	// on an H100 (25.6 ms without them). WrittenOutAttention takes
	// precedence.
	UnpackedAttention bool
}

// GPT2Small is GPT-2 small: 12 layers, width 768, 12 heads, 1024 positions,
// 50257 tokens (124M parameters with the tied head).
func GPT2Small() GPTConfig {
	return GPTConfig{Vocab: 50257, Context: 1024, Layers: 12, Heads: 12, Dim: 768}
}

// GPT is a decoder-only transformer; Forward maps int64 tokens [B, T] to
// logits [B, T, Vocab].
type GPT struct {
	nn.Children
	cfg GPTConfig
	wte *nn.Embedding
	wpe *nn.Param
	err error
}

// NewGPT builds a GPT with GPT-2's initialisation: N(0, 0.02²) weights,
// zero biases, unit layer-norm scales.
func NewGPT(opt nn.Options, cfg GPTConfig) *GPT {
	m := &GPT{cfg: cfg}
	if cfg.Vocab < 1 || cfg.Context < 1 || cfg.Layers < 1 || cfg.Heads < 1 || cfg.Dim < 1 || cfg.Dim%cfg.Heads != 0 {
		m.err = graph.Errorf(graph.ErrAttr, "GPT config %+v: sizes must be positive and Dim a multiple of Heads", cfg)
		return m
	}
	m.wte = &nn.Embedding{Weight: opt.Normal("weight", []int{cfg.Vocab, cfg.Dim}, 0, 0.02)}
	m.wpe = opt.Normal("wpe.weight", []int{cfg.Context, cfg.Dim}, 0, 0.02)
	blocks := make([]nn.Module, cfg.Layers)
	for i := range blocks {
		blocks[i] = newBlock(opt, cfg)
	}
	m.Children = nn.NewChildren(
		nn.Child{Name: "wte", Module: m.wte},
		nn.Child{Name: "h", Module: nn.NewSequential(blocks...)},
		nn.Child{Name: "ln_f", Module: nn.NewLayerNorm(opt, []int{cfg.Dim}, 1e-5)},
	)
	return m
}

// Config is the model's configuration.
func (m *GPT) Config() GPTConfig { return m.cfg }

// Params lists the position embedding, then the children's parameters.
func (m *GPT) Params() []*nn.Param {
	if m.wpe == nil {
		return nil
	}
	return append([]*nn.Param{m.wpe}, m.Children.Params()...)
}

// Err reports a construction error.
func (m *GPT) Err() error {
	if m.err != nil {
		return m.err
	}
	return m.Children.Err()
}

// Forward maps tokens [B, T] (int64, T ≤ Context) to logits [B, T, Vocab].
// The output head reuses the token embedding (weight tying), so its
// gradient accumulates from both uses.
func (m *GPT) Forward(tokens *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(tokens); err != nil { // the input's error first, as in nn
		return lazy.ErrorTensor("models.GPT", err)
	}
	if err := m.Err(); err != nil {
		return lazy.ErrorTensor("models.GPT", err, tokens.Shape())
	}
	if g := tokens.Graph(); g != nil { // the caller's site, found once for every op
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	s := tokens.Shape()
	if len(s) != 2 || s[1] > m.cfg.Context {
		return lazy.ErrorTensor("models.GPT", graph.Errorf(graph.ErrShape,
			"GPT needs tokens [B, T] with T ≤ %d, got %v", m.cfg.Context, s), s)
	}
	pos := m.wpe.Tensor().Slice(0, 0, s[1])
	x := m.Call("wte", tokens).Add(pos)
	x = m.Call("ln_f", m.Call("h", x))
	return x.Linear(m.wte.Weight.As(x), nil)
}

// Loss is the mean next-token cross-entropy of logits [B, T, V] against
// targets [B, T]. An error either input already holds is returned as it
// is, logits' first: the shape check does not mask it.
func Loss(logits, targets *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(logits, targets); err != nil {
		return lazy.ErrorTensor("models.Loss", err)
	}
	s := logits.Shape()
	if len(s) != 3 {
		return lazy.ErrorTensor("models.Loss", graph.Errorf(graph.ErrShape, "logits must be [B, T, V], got %v", s), s)
	}
	if g := logits.Graph(); g != nil { // the caller's site, found once for both ops
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	return logits.Reshape(-1, s[2]).CrossEntropy(targets.Reshape(-1), graph.ReduceMean)
}

// block is a pre-norm transformer block: x + attn(ln_1(x)), then
// x + mlp(ln_2(x)).
type block struct{ nn.Children }

func newBlock(opt nn.Options, cfg GPTConfig) *block {
	d := cfg.Dim
	attn := &attention{heads: cfg.Heads, writtenOut: cfg.WrittenOutAttention, unpacked: cfg.UnpackedAttention, Children: nn.NewChildren(
		nn.Child{Name: "c_attn", Module: linear(opt, d, 3*d)},
		nn.Child{Name: "c_proj", Module: linear(opt, d, d)},
	)}
	mlp := nn.NewSequentialNamed(
		nn.Child{Name: "c_fc", Module: linear(opt, d, 4*d)},
		nn.Child{Name: "gelu", Module: nn.GELU{Approx: true}},
		nn.Child{Name: "c_proj", Module: linear(opt, 4*d, d)},
	)
	return &block{nn.NewChildren(
		nn.Child{Name: "ln_1", Module: nn.NewLayerNorm(opt, []int{d}, 1e-5)},
		nn.Child{Name: "attn", Module: attn},
		nn.Child{Name: "ln_2", Module: nn.NewLayerNorm(opt, []int{d}, 1e-5)},
		nn.Child{Name: "mlp", Module: mlp},
	)}
}

func (b *block) Forward(x *lazy.Tensor) *lazy.Tensor {
	x = x.Add(b.Call("attn", b.Call("ln_1", x)))
	return x.Add(b.Call("mlp", b.Call("ln_2", x)))
}

// linear is a Linear layer with GPT-2's N(0, 0.02²) weights and zero bias.
func linear(opt nn.Options, in, out int) *nn.Linear {
	return &nn.Linear{Weight: opt.Normal("weight", []int{out, in}, 0, 0.02), Bias: opt.Full("bias", []int{out}, 0)}
}

// attention is causal multi-head self-attention.
type attention struct {
	nn.Children
	heads      int
	writtenOut bool // GPTConfig.WrittenOutAttention
	unpacked   bool // GPTConfig.UnpackedAttention
}

// Forward: q, k, v from one projection, softmax(q·kᵀ/√d + causal mask)·v per
// head (the packed fused op, the fused op on q, k, v sliced out, or
// written out), heads concatenated and projected.
func (a *attention) Forward(x *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(x); err != nil {
		return lazy.ErrorTensor("attention", err)
	}
	s := x.Shape()
	if len(s) != 3 {
		return lazy.ErrorTensor("attention", graph.Errorf(graph.ErrShape, "attention needs [B, T, C], got %v", s), s)
	}
	t, c := s[1], s[2]
	d := c / a.heads
	qkv := a.Call("c_attn", x)
	opts := lazy.AttentionOptions{Causal: true, Scale: 1 / math.Sqrt(float64(d))}
	if !a.writtenOut && !a.unpacked {
		return a.Call("c_proj", qkv.AttentionQKV(a.heads, opts))
	}
	head := func(i int) *lazy.Tensor { // [B, H, T, d]
		return qkv.Slice(2, i*c, (i+1)*c).Reshape(-1, t, a.heads, d).Permute(0, 2, 1, 3)
	}
	q, k, v := head(0), head(1), head(2)
	var y *lazy.Tensor
	if a.writtenOut {
		att := q.MatMulT(k, false, true).MulScalar(1 / math.Sqrt(float64(d))).CausalMask().Softmax(-1)
		y = att.MatMul(v)
	} else {
		y = q.Attention(k, v, opts)
	}
	y = y.Permute(0, 2, 1, 3).Reshape(-1, t, c)
	return a.Call("c_proj", y)
}

// firstErr is the first error that one of ts holds: ts were built before
// the op at hand, so their errors come before its own checks. A nil
// tensor holds none; the op's checks report it.
func firstErr(ts ...*lazy.Tensor) error {
	for _, t := range ts {
		if t != nil && t.Err() != nil {
			return t.Err()
		}
	}
	return nil
}
