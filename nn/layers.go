package nn

import (
	"math"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// Linear is x·Wᵀ + b with W of shape [out, in] and b of shape [out].
type Linear struct {
	Weight *Param
	Bias   *Param // nil without bias
}

// NewLinear initialises W and b uniformly in ±1/√in, PyTorch's default
// (kaiming_uniform with a = √5 works out to that bound).
func NewLinear(opt Options, in, out int, bias bool) *Linear {
	bound := 1 / math.Sqrt(float64(max(in, 1)))
	l := &Linear{Weight: opt.Uniform("weight", []int{out, in}, bound)}
	if bias {
		l.Bias = opt.Uniform("bias", []int{out}, bound)
	}
	return l
}

// Forward applies the layer to x [..., in].
func (l *Linear) Forward(x *lazy.Tensor) *lazy.Tensor {
	return x.Linear(l.Weight.as(x), optionalAs(l.Bias, x))
}

// Params returns weight, then bias.
func (l *Linear) Params() []*Param { return params(l.Weight, l.Bias) }

// Conv2d convolves NCHW input with a weight [out, in/groups, kh, kw] and an
// optional bias [out].
type Conv2d struct {
	Weight  *Param
	Bias    *Param // nil without bias
	Options lazy.ConvOptions
	err     error
}

// NewConv2d initialises weight and bias uniformly in ±1/√fan_in with
// fan_in = in/groups·kh·kw, PyTorch's default. Zero stride, dilation and
// groups in co mean 1.
func NewConv2d(opt Options, in, out int, kernel [2]int, bias bool, co lazy.ConvOptions) *Conv2d {
	g := co.Groups
	if g == 0 {
		g = 1
	}
	c := &Conv2d{Options: co}
	if g < 0 || in%g != 0 || out%g != 0 {
		c.err = graph.Errorf(graph.ErrAttr, "Conv2d groups %d must divide in %d and out %d", co.Groups, in, out)
		g = 1
	}
	fanIn := max(in/g*kernel[0]*kernel[1], 1)
	bound := 1 / math.Sqrt(float64(fanIn))
	c.Weight = opt.Uniform("weight", []int{out, in / g, kernel[0], kernel[1]}, bound)
	if bias {
		c.Bias = opt.Uniform("bias", []int{out}, bound)
	}
	return c
}

// Forward convolves x [N, in, H, W].
func (c *Conv2d) Forward(x *lazy.Tensor) *lazy.Tensor {
	if c.err != nil {
		return fail("nn.Conv2d", c.err, x)
	}
	return x.Conv2d(c.Weight.as(x), optionalAs(c.Bias, x), c.Options)
}

// Params returns weight, then bias.
func (c *Conv2d) Params() []*Param { return params(c.Weight, c.Bias) }

// Err is the construction error, if any.
func (c *Conv2d) Err() error { return c.err }

// LayerNorm normalises over trailing axes of the given shape, then scales
// and shifts elementwise.
type LayerNorm struct {
	Weight *Param // ones
	Bias   *Param // zeros
	Eps    float64
	dims   int
	err    error
}

// NewLayerNorm normalises over trailing axes equal to shape (PyTorch's
// normalized_shape); eps is typically 1e-5.
func NewLayerNorm(opt Options, shape []int, eps float64) *LayerNorm {
	ln := &LayerNorm{Eps: eps, dims: len(shape),
		Weight: opt.Full("weight", shape, 1), Bias: opt.Full("bias", shape, 0)}
	switch {
	case len(shape) == 0:
		ln.err = graph.Errorf(graph.ErrShape, "LayerNorm needs a non-empty normalized shape")
	case !(eps > 0):
		ln.err = graph.Errorf(graph.ErrAttr, "LayerNorm eps must be positive, got %g", eps)
	}
	return ln
}

// Forward normalises x [..., shape...].
func (ln *LayerNorm) Forward(x *lazy.Tensor) *lazy.Tensor {
	if ln.err != nil {
		return fail("nn.LayerNorm", ln.err, x)
	}
	return x.LayerNorm(ln.Weight.as(x), ln.Bias.as(x), ln.dims, ln.Eps)
}

// Params returns weight, then bias.
func (ln *LayerNorm) Params() []*Param { return params(ln.Weight, ln.Bias) }

// Err is the construction error, if any.
func (ln *LayerNorm) Err() error { return ln.err }

// RMSNorm divides by the root mean square of the last axis and scales
// elementwise: Hugging Face's LlamaRMSNorm (lazy.Tensor.RMSNorm).
type RMSNorm struct {
	Weight *Param // ones
	Eps    float64
	err    error
}

// NewRMSNorm normalises over a last axis of dim values; eps is the
// model's rms_norm_eps (1e-5 or 1e-6 in Llama's configs).
func NewRMSNorm(opt Options, dim int, eps float64) *RMSNorm {
	n := &RMSNorm{Eps: eps, Weight: opt.Full("weight", []int{dim}, 1)}
	if !(eps > 0) || math.IsInf(eps, 1) {
		n.err = graph.Errorf(graph.ErrAttr, "RMSNorm eps must be positive and finite, got %g", eps)
	}
	return n
}

// Forward normalises x [..., dim].
func (n *RMSNorm) Forward(x *lazy.Tensor) *lazy.Tensor {
	if n.err != nil {
		return fail("nn.RMSNorm", n.err, x)
	}
	return x.RMSNorm(n.Weight.Tensor(), n.Eps)
}

// Params returns the weight.
func (n *RMSNorm) Params() []*Param { return params(n.Weight) }

// Err is the construction error, if any.
func (n *RMSNorm) Err() error { return n.err }

// Embedding maps int64 indices to rows of a [num, dim] table.
type Embedding struct {
	Weight *Param
}

// NewEmbedding draws the table from N(0, 1), PyTorch's default.
func NewEmbedding(opt Options, num, dim int) *Embedding {
	return &Embedding{Weight: opt.Normal("weight", []int{num, dim}, 0, 1)}
}

// Forward looks up int64 indices x, appending an axis of size dim.
func (e *Embedding) Forward(x *lazy.Tensor) *lazy.Tensor {
	y := x.Embedding(e.Weight.Tensor())
	if e.Weight.Frozen() && e.Weight.Tensor().DType().IsHalf() { // a 16-bit frozen table: its rows widened (FreezeAs)
		y = y.Cast(graph.Float32)
	}
	return y
}

// Params returns the table.
func (e *Embedding) Params() []*Param { return params(e.Weight) }

// ReLU is max(x, 0).
type ReLU struct{}

func (ReLU) Forward(x *lazy.Tensor) *lazy.Tensor { return x.Relu() }
func (ReLU) Params() []*Param                    { return nil }

// GELU is x·Φ(x), or its tanh approximation when Approx is set.
type GELU struct{ Approx bool }

func (g GELU) Forward(x *lazy.Tensor) *lazy.Tensor {
	if g.Approx {
		return x.GeluTanh()
	}
	return x.Gelu()
}
func (GELU) Params() []*Param { return nil }

// Dropout zeroes elements with probability P in training mode and scales
// the rest by 1/(1−P), as PyTorch's does; in evaluation mode (the default)
// it is the identity. Training (or SetTraining on a model) switches it.
type Dropout struct {
	P float64
	// Training turns dropout on; off (the default) it is the identity, as
	// in evaluation mode.
	Training bool
	// Seed keys the masks. Each Forward in training mode uses the next
	// step of the module's counter, so every training step draws a fresh
	// mask while the chunks of one step share it.
	Seed uint64
	step uint64
	err  error
}

// NewDropout checks 0 ≤ p < 1; the module starts in evaluation mode.
func NewDropout(p float64) *Dropout {
	d := &Dropout{P: p}
	if !(p >= 0 && p < 1) {
		d.err = graph.Errorf(graph.ErrAttr, "Dropout probability %g is outside [0, 1)", p)
	}
	return d
}

// Forward zeroes elements with probability P in training mode and returns
// x unchanged otherwise.
func (d *Dropout) Forward(x *lazy.Tensor) *lazy.Tensor {
	if d.err != nil {
		return fail("nn.Dropout", d.err, x)
	}
	if !d.Training || d.P == 0 {
		return x
	}
	d.step++
	return x.Dropout(d.P, d.Seed, d.step)
}

func (d *Dropout) Params() []*Param { return nil }

// Step is the module's counter: how many training-mode Forwards it has
// run, the last of which drew its mask for step Step (0 before the first).
// A checkpoint saves it (with Seed); SetStep restores it, so the next
// Forward draws the mask the uninterrupted run's next Forward draws.
func (d *Dropout) Step() uint64 { return d.step }

// SetStep sets the counter Step reports.
func (d *Dropout) SetStep(n uint64) { d.step = n }

// Err is the construction error, if any.
func (d *Dropout) Err() error { return d.err }

// MaxPool2d takes the max over windows of NCHW input; a zero Stride means
// the kernel size.
type MaxPool2d lazy.PoolOptions

func (p MaxPool2d) Forward(x *lazy.Tensor) *lazy.Tensor { return x.MaxPool2d(lazy.PoolOptions(p)) }
func (MaxPool2d) Params() []*Param                      { return nil }

// AvgPool2d averages windows of NCHW input; a zero Stride means the kernel
// size.
type AvgPool2d lazy.PoolOptions

func (p AvgPool2d) Forward(x *lazy.Tensor) *lazy.Tensor { return x.AvgPool2d(lazy.PoolOptions(p)) }
func (AvgPool2d) Params() []*Param                      { return nil }

// Flatten reshapes [N, d1, d2, …] to [N, d1·d2·…], like PyTorch's
// nn.Flatten() with its default start_dim 1.
type Flatten struct{}

func (Flatten) Forward(x *lazy.Tensor) *lazy.Tensor {
	s := x.Shape()
	if x.Err() != nil || len(s) == 0 {
		return fail("nn.Flatten", graph.Errorf(graph.ErrShape, "Flatten needs a leading batch axis, got shape %v", s), x)
	}
	return x.Reshape(s[0], -1)
}
func (Flatten) Params() []*Param { return nil }

// optionalAs is p as a layer applied to x reads it (Param.as), nil for no
// parameter.
func optionalAs(p *Param, x *lazy.Tensor) *lazy.Tensor {
	if p == nil {
		return nil
	}
	return p.as(x)
}

func params(ps ...*Param) []*Param {
	out := make([]*Param, 0, len(ps))
	for _, p := range ps {
		if p != nil {
			out = append(out, p)
		}
	}
	return out
}
