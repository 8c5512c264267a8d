package lazy

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// Unary elementwise ops.

func (t *Tensor) Neg() *Tensor     { return apply(graph.OpNeg, graph.Attrs{}, t) }
func (t *Tensor) Exp() *Tensor     { return apply(graph.OpExp, graph.Attrs{}, t) }
func (t *Tensor) Log() *Tensor     { return apply(graph.OpLog, graph.Attrs{}, t) }
func (t *Tensor) Sqrt() *Tensor    { return apply(graph.OpSqrt, graph.Attrs{}, t) }
func (t *Tensor) Abs() *Tensor     { return apply(graph.OpAbs, graph.Attrs{}, t) }
func (t *Tensor) Tanh() *Tensor    { return apply(graph.OpTanh, graph.Attrs{}, t) }
func (t *Tensor) Sigmoid() *Tensor { return apply(graph.OpSigmoid, graph.Attrs{}, t) }
func (t *Tensor) Relu() *Tensor    { return apply(graph.OpRelu, graph.Attrs{}, t) }

// Gelu is x·Φ(x) with the exact normal CDF.
func (t *Tensor) Gelu() *Tensor { return apply(graph.OpGelu, graph.Attrs{}, t) }

// CausalMask sets t[..., i, j] to −inf where j > i + (S − T), for attention
// scores t [..., T, S]: position i sees only keys up to its own.
func (t *Tensor) CausalMask() *Tensor {
	return apply(graph.OpCausalMask, graph.Attrs{Scalar: math.Inf(-1)}, t)
}

// Dropout zeroes each element with probability p and scales the others by
// 1/(1−p). The mask is a pure function of (seed, step, sample, element), so
// chunked runs and gradients see the same mask; pass a new step each
// training step.
func (t *Tensor) Dropout(p float64, seed, step uint64) *Tensor {
	return apply(graph.OpDropout, graph.Attrs{Scalar: p, Seed: seed, Counter: step}, t)
}

// Silu is x·sigmoid(x) (SiLU or swish, the activation of Llama's MLP).
func (t *Tensor) Silu() *Tensor { return apply(graph.OpSilu, graph.Attrs{}, t) }

// GeluTanh is GELU's tanh approximation (GPT-2's "gelu_new").
func (t *Tensor) GeluTanh() *Tensor { return apply(graph.OpGelu, graph.Attrs{Approx: true}, t) }

// Cast converts t to the floating-point dtype dt (t itself when it
// already has it), rounding to nearest even when dt is narrower. Precision
// policies insert casts themselves (package precision); Cast is for graphs
// that choose their dtypes by hand.
func (t *Tensor) Cast(dt graph.DType) *Tensor {
	if t.Err() == nil && !t.zero() && t.DType() == dt && dt.IsFloat() {
		return t
	}
	return apply(graph.OpCast, graph.Attrs{Target: graph.Type{DType: dt}}, t)
}

// Binary elementwise ops with NumPy broadcasting; operands of two float
// dtypes promote as PyTorch's do (graph.Promote: bfloat16 with float32 is
// float32).

func (t *Tensor) Add(u *Tensor) *Tensor     { return apply(graph.OpAdd, graph.Attrs{}, t, u) }
func (t *Tensor) Sub(u *Tensor) *Tensor     { return apply(graph.OpSub, graph.Attrs{}, t, u) }
func (t *Tensor) Mul(u *Tensor) *Tensor     { return apply(graph.OpMul, graph.Attrs{}, t, u) }
func (t *Tensor) Div(u *Tensor) *Tensor     { return apply(graph.OpDiv, graph.Attrs{}, t, u) }
func (t *Tensor) Pow(u *Tensor) *Tensor     { return apply(graph.OpPow, graph.Attrs{}, t, u) }
func (t *Tensor) Maximum(u *Tensor) *Tensor { return apply(graph.OpMaximum, graph.Attrs{}, t, u) }

// Scalar forms.

func (t *Tensor) AddScalar(s float64) *Tensor  { return scalar(graph.OpAddScalar, t, s) }
func (t *Tensor) SubScalar(s float64) *Tensor  { return scalar(graph.OpSubScalar, t, s) }
func (t *Tensor) RSubScalar(s float64) *Tensor { return scalar(graph.OpRSubScalar, t, s) } // s − t
func (t *Tensor) MulScalar(s float64) *Tensor  { return scalar(graph.OpMulScalar, t, s) }
func (t *Tensor) DivScalar(s float64) *Tensor  { return scalar(graph.OpDivScalar, t, s) }
func (t *Tensor) RDivScalar(s float64) *Tensor { return scalar(graph.OpRDivScalar, t, s) } // s / t
func (t *Tensor) PowScalar(s float64) *Tensor  { return scalar(graph.OpPowScalar, t, s) }
func (t *Tensor) MaximumScalar(s float64) *Tensor {
	return scalar(graph.OpMaximumScalar, t, s)
}

func scalar(op graph.Op, t *Tensor, s float64) *Tensor {
	return apply(op, graph.Attrs{Scalar: s}, t)
}

// MatMul is the matrix product over the last two axes, broadcasting leading axes.
func (t *Tensor) MatMul(u *Tensor) *Tensor { return apply(graph.OpMatMul, graph.Attrs{}, t, u) }

// Linear is t·wᵀ + b with w of shape [out, in]; b may be nil.
func (t *Tensor) Linear(w, b *Tensor) *Tensor {
	if b == nil {
		return apply(graph.OpLinear, graph.Attrs{}, t, w)
	}
	return apply(graph.OpLinear, graph.Attrs{}, t, w, b)
}

// Reductions. With no axes they reduce every axis.

func (t *Tensor) Sum(axes ...int) *Tensor  { return reduce(graph.OpSum, t, axes, false) }
func (t *Tensor) Mean(axes ...int) *Tensor { return reduce(graph.OpMean, t, axes, false) }
func (t *Tensor) Max(axes ...int) *Tensor  { return reduce(graph.OpMax, t, axes, false) }

// SumKeepDim, MeanKeepDim and MaxKeepDim keep reduced axes with size 1.
func (t *Tensor) SumKeepDim(axes ...int) *Tensor  { return reduce(graph.OpSum, t, axes, true) }
func (t *Tensor) MeanKeepDim(axes ...int) *Tensor { return reduce(graph.OpMean, t, axes, true) }
func (t *Tensor) MaxKeepDim(axes ...int) *Tensor  { return reduce(graph.OpMax, t, axes, true) }

func reduce(op graph.Op, t *Tensor, axes []int, keep bool) *Tensor {
	return apply(op, graph.Attrs{Axes: append([]int(nil), axes...), KeepDim: keep}, t)
}

// Softmax and LogSoftmax along axis.

func (t *Tensor) Softmax(axis int) *Tensor { return apply(graph.OpSoftmax, graph.Attrs{Axis: axis}, t) }
func (t *Tensor) LogSoftmax(axis int) *Tensor {
	return apply(graph.OpLogSoftmax, graph.Attrs{Axis: axis}, t)
}

// LayerNorm normalises over the trailing normDims axes, then scales by
// weight and shifts by bias (each optional: pass nil).
func (t *Tensor) LayerNorm(weight, bias *Tensor, normDims int, eps float64) *Tensor {
	attrs := graph.Attrs{NormDims: normDims, Eps: eps}
	switch {
	case weight == nil && bias == nil:
		return apply(graph.OpLayerNorm, attrs, t)
	case bias == nil:
		return apply(graph.OpLayerNorm, attrs, t, weight)
	case weight == nil && t.Err() == nil:
		return errTensor("layer_norm", site(), graph.Errorf(graph.ErrArity, "bias without weight"), t.Shape())
	case weight == nil:
		return apply(graph.OpLayerNorm, attrs, t) // returns t's sticky error
	}
	return apply(graph.OpLayerNorm, attrs, t, weight, bias)
}

// RMSNorm divides t by the root mean square of its last axis and scales
// by weight ([last], or nil for none): y = t·rsqrt(mean(t²) + eps)·weight,
// Hugging Face's LlamaRMSNorm (no mean subtracted, no bias). The
// arithmetic is float32 at least and the result has t's dtype; under a
// mixed precision policy t and weight are float32 and a result only
// 16-bit GEMMs read is written in 16 bits. Fused with a residual add
// before it where the executor can (graph.AddRMSNormProducer).
func (t *Tensor) RMSNorm(weight *Tensor, eps float64) *Tensor {
	attrs := graph.Attrs{NormDims: 1, Eps: eps}
	if weight == nil {
		return apply(graph.OpRMSNorm, attrs, t)
	}
	return apply(graph.OpRMSNorm, attrs, t, weight)
}

// Rotary is the rotary position embedding of t [B, T, H, d] (H heads of d
// at each of T positions, as a q or k projection reshaped gives them) by
// the angle table cs [T, d]: float32, cos θ_t,i in columns i < d/2 and sin
// θ_t,i in columns d/2 + i, row t for position t (models.RopeConfig.Table
// makes one). Each pair (i, i + d/2) of each head rotates by θ_t,i, Hugging
// Face's rotate_half convention. The result has t's type.
func (t *Tensor) Rotary(cs *Tensor) *Tensor { return apply(graph.OpRotary, graph.Attrs{}, t, cs) }

// RotaryHeads is Rotary of the first heads heads of t [B, T, N, d] only,
// the rest copied: a packed projection [B, T, (H + 2·Hkv)·d] viewed as
// [B, T, H + 2·Hkv, d] rotates its H + Hkv heads of q and k and keeps v's,
// for AttentionQKV. heads must be 1 to N.
func (t *Tensor) RotaryHeads(cs *Tensor, heads int) *Tensor {
	if heads < 1 && t.Err() == nil { // an earlier error sticks: apply returns it
		return errTensor("rotary", site(), graph.Errorf(graph.ErrAttr, "rotary of %d heads of %v: want at least 1", heads, t.Shape()), t.Shape())
	}
	return apply(graph.OpRotary, graph.Attrs{End: heads}, t, cs)
}

// SwiGLU is silu(t)·up, t the gate: Llama's feed-forward activation
// act_fn(gate_proj(x))·up_proj(x), in one pass (and one backward pass).
// t and up have one shape and dtype.
func (t *Tensor) SwiGLU(up *Tensor) *Tensor { return apply(graph.OpSwiGLU, graph.Attrs{}, t, up) }

// BatchNorm normalises t [N, C, ...] per channel (axis 1), as PyTorch's
// F.batch_norm, then scales by weight and shifts by bias ([C] each,
// optional: pass nil; bias needs weight). In training mode it uses the
// batch's mean and biased variance over every axis but the channels, so a
// graph using it cannot run in batch chunks (BatchNormPerChunk opts in to
// per-chunk statistics); runMean and runVar are not
// read and may be nil (graphs have no side effects: nn.BatchNorm2d
// updates its running statistics explicitly). In evaluation mode it uses
// runMean and runVar ([C], required) and stays per-sample.
func (t *Tensor) BatchNorm(weight, bias, runMean, runVar *Tensor, training bool, eps float64) *Tensor {
	return t.batchNorm(false, false, weight, bias, runMean, runVar, training, eps)
}

// BatchNorm2d is BatchNorm for NCHW input: t must have rank 4.
func (t *Tensor) BatchNorm2d(weight, bias, runMean, runVar *Tensor, training bool, eps float64) *Tensor {
	return t.batchNorm(true, false, weight, bias, runMean, runVar, training, eps)
}

// BatchNormPerChunk is training-mode BatchNorm with per-chunk statistics
// (graph.Attrs.PerChunk), the explicit opt-in to chunking through batch
// norm: it normalises with the mean and biased variance of the samples it
// runs on, so when the planner splits the batch each chunk is normalised
// with its own, as each micro-batch is under PyTorch's gradient
// accumulation, and the graph stays chunkable. In one chunk it is
// BatchNorm in training mode. Every chunk holds more than one value per
// channel (for [N, C] input, at least two samples). weight and bias are
// as for BatchNorm.
func (t *Tensor) BatchNormPerChunk(weight, bias *Tensor, eps float64) *Tensor {
	return t.batchNorm(false, true, weight, bias, nil, nil, true, eps)
}

// BatchNorm2dPerChunk is BatchNormPerChunk for NCHW input: t must have
// rank 4.
func (t *Tensor) BatchNorm2dPerChunk(weight, bias *Tensor, eps float64) *Tensor {
	return t.batchNorm(true, true, weight, bias, nil, nil, true, eps)
}

// BatchStats is t [N, C, ...]'s per-channel mean and unbiased variance
// over every axis but 1, as one [2, C] value: row 0 the mean, row 1 the
// variance, what running statistics are updated with. Run in batch chunks
// it is still the statistics of all N samples: the chunks' partials merge
// exactly (graph.CombineMoments). Evaluate it as it is; slices of it are
// not chunkable.
func (t *Tensor) BatchStats() *Tensor { return apply(graph.OpBatchNormStats, graph.Attrs{}, t) }

func (t *Tensor) batchNorm(nchw, perChunk bool, weight, bias, runMean, runVar *Tensor, training bool, eps float64) *Tensor {
	attrs := graph.Attrs{Training: training, PerChunk: perChunk, Eps: eps}
	if t.Err() != nil || t.zero() {
		return apply(graph.OpBatchNorm, attrs, t) // t's sticky error, or a typed one for t
	}
	shape := t.Shape()
	fail := func(sentinel error, format string, args ...any) *Tensor {
		return errTensor("batch_norm", site(), graph.Errorf(sentinel, format, args...), shape)
	}
	if nchw && len(shape) != 4 {
		return fail(graph.ErrShape, "BatchNorm2d expects NCHW input of rank 4, got %v", shape)
	}
	in := []*Tensor{t}
	switch {
	case training:
		// Not read in training mode, but checked, so a wrong shape shows
		// whichever mode runs first.
		for i, s := range []*Tensor{runMean, runVar} {
			switch {
			case s == nil || len(shape) < 2:
			case s.Err() != nil:
				return ErrorTensor("batch_norm", s.Err())
			case !slices.Equal(s.Shape(), []int{shape[1]}):
				return fail(graph.ErrShape, "%s shape %v, want [%d]", []string{"running_mean", "running_var"}[i], s.Shape(), shape[1])
			}
		}
	case runMean == nil || runVar == nil:
		return fail(graph.ErrArity, "evaluation mode needs the running mean and variance")
	default:
		in = append(in, runMean, runVar)
	}
	switch {
	case weight != nil && bias != nil:
		in = append(in, weight, bias)
	case weight != nil:
		in = append(in, weight)
	case bias != nil:
		return fail(graph.ErrArity, "bias without weight")
	}
	return apply(graph.OpBatchNorm, attrs, in...)
}

// Movement ops.

// Reshape to shape; one entry may be −1.
func (t *Tensor) Reshape(shape ...int) *Tensor {
	return apply(graph.OpReshape, graph.Attrs{Shape: append([]int(nil), shape...)}, t)
}

// Permute reorders axes: output axis i is input axis perm[i].
func (t *Tensor) Permute(perm ...int) *Tensor {
	return apply(graph.OpPermute, graph.Attrs{Perm: append([]int(nil), perm...)}, t)
}

// Transpose swaps axes a and b (negative values count from the end).
func (t *Tensor) Transpose(a, b int) *Tensor {
	r := len(t.Shape())
	if t.Err() != nil {
		return apply(graph.OpPermute, graph.Attrs{}, t)
	}
	perm := make([]int, r)
	for i := range perm {
		perm[i] = i
	}
	na, nb := a, b
	if na < 0 {
		na += r
	}
	if nb < 0 {
		nb += r
	}
	if na < 0 || na >= r || nb < 0 || nb >= r {
		return errTensor("transpose", site(), graph.Errorf(graph.ErrAttr, "axes %d, %d out of range for rank %d", a, b, r), t.Shape())
	}
	perm[na], perm[nb] = perm[nb], perm[na]
	return apply(graph.OpPermute, graph.Attrs{Perm: perm}, t)
}

// Slice keeps indices [start, end) of axis.
func (t *Tensor) Slice(axis, start, end int) *Tensor { return t.SliceStep(axis, start, end, 1) }

// SliceStep keeps indices start, start+step, … below end of axis.
func (t *Tensor) SliceStep(axis, start, end, step int) *Tensor {
	if step < 1 && t.Err() == nil { // an earlier error sticks: apply returns it
		return errTensor("slice", site(), graph.Errorf(graph.ErrAttr, "step %d must be ≥ 1", step), t.Shape())
	}
	return apply(graph.OpSlice, graph.Attrs{Axis: axis, Start: start, End: end, Step: step}, t)
}

// Concat joins ts along axis.
func Concat(axis int, ts ...*Tensor) *Tensor {
	if len(ts) == 0 {
		return errTensor("concat", site(), graph.Errorf(graph.ErrArity, "concat of no tensors"))
	}
	return apply(graph.OpConcat, graph.Attrs{Axis: axis}, ts...)
}

// Embedding looks up rows of weight [num, dim] at int64 indices t.
func (t *Tensor) Embedding(weight *Tensor) *Tensor {
	return apply(graph.OpEmbedding, graph.Attrs{}, t, weight)
}

// ConvOptions configures Conv2d. Zero Stride/Dilation/Groups mean 1.
type ConvOptions struct {
	Stride, Padding, Dilation [2]int
	Groups                    int
}

// Conv2d convolves NCHW t with weight [out, in/groups, kh, kw]; bias may be nil.
func (t *Tensor) Conv2d(weight, bias *Tensor, o ConvOptions) *Tensor {
	attrs := graph.Attrs{Stride: o.Stride, Padding: o.Padding, Dilation: o.Dilation, Groups: o.Groups}
	if bias == nil {
		return apply(graph.OpConv2d, attrs, t, weight)
	}
	return apply(graph.OpConv2d, attrs, t, weight, bias)
}

// PoolOptions configures pooling. A zero Stride means the kernel size.
type PoolOptions struct {
	Kernel, Stride, Padding, Dilation [2]int
}

// MaxPool2d takes the max over windows of an NCHW tensor.
func (t *Tensor) MaxPool2d(o PoolOptions) *Tensor {
	return apply(graph.OpMaxPool2d, graph.Attrs{Kernel: o.Kernel, Stride: o.Stride, Padding: o.Padding, Dilation: o.Dilation}, t)
}

// AvgPool2d averages windows of an NCHW tensor (zero padding counts).
func (t *Tensor) AvgPool2d(o PoolOptions) *Tensor {
	return apply(graph.OpAvgPool2d, graph.Attrs{Kernel: o.Kernel, Stride: o.Stride, Padding: o.Padding, Dilation: o.Dilation}, t)
}

// How a loss (CrossEntropy, MSE) combines its per-sample values: the
// reductions of package graph, here so that a training loop needs only
// this package. Mean divides by the whole batch's count, so chunked runs
// add up to the whole batch's loss.
const (
	Mean = graph.ReduceMean
	Sum  = graph.ReduceSum
)

// CrossEntropy of logits t [N, C] against int64 class labels [N], reduced
// by r (Mean or Sum). A row labelled graph.IgnoreLabel (−100, PyTorch's
// ignore_index) takes no part: its loss and gradient are 0, and a mean
// still divides by N.
func (t *Tensor) CrossEntropy(labels *Tensor, r graph.Reduction) *Tensor {
	return apply(graph.OpCrossEntropy, graph.Attrs{Reduction: r}, t, labels)
}

// CrossEntropyClasses is CrossEntropy over the first classes columns of
// logits t [N, C] (0 < classes ≤ C): the columns past them, such as a
// linear layer's padding outputs, are ignored by the loss and get exactly
// zero gradient. Labels must be below classes. It is what
// t.Slice(1, 0, classes).CrossEntropy(labels, r) computes, without the
// slice's copy of the logits and its gradient's scatter.
func (t *Tensor) CrossEntropyClasses(labels *Tensor, classes int, r graph.Reduction) *Tensor {
	if classes <= 0 && t.Err() == nil { // an earlier error sticks: apply returns it
		return errTensor("cross_entropy", site(), graph.Errorf(graph.ErrShape, "cross_entropy of %d classes out of logits %v: want at least 1", classes, t.Shape()), t.Shape())
	}
	return apply(graph.OpCrossEntropy, graph.Attrs{Reduction: r, End: classes}, t, labels)
}

// LinearCrossEntropy is t.Linear(w, nil) then CrossEntropy against labels
// (reduced by r) in one op, graph.OpLinearCrossEntropy: hidden states t
// [N, C], a classifier weight w [V, C] (a linear's layout: Hugging Face's
// lm_head, or a tied embedding), int64 labels [N] (graph.IgnoreLabel
// rows take no part). The [N, V] logits are never stored: the op runs
// over chunks of tokens. graph.FuseLinearCrossEntropy makes it from the
// two ops at a training step's loss, which a Session runs by default.
func (t *Tensor) LinearCrossEntropy(w, labels *Tensor, r graph.Reduction) *Tensor {
	return apply(graph.OpLinearCrossEntropy, graph.Attrs{Reduction: r}, t, w, labels)
}

// LinearCrossEntropyOptions are LinearCrossEntropyWith's options.
type LinearCrossEntropyOptions struct {
	// Classes scores only w's first Classes rows (0: all of them), as
	// CrossEntropyClasses does for a padded head.
	Classes int
	// Chunk is the tokens per logits chunk (0: graph.DefaultLossChunk;
	// a Session sets the planner's choice).
	Chunk int
	// Scale, when set, is a float scalar the loss is multiplied by
	// (models.CausalLMLoss's 1/count).
	Scale *Tensor
}

// LinearCrossEntropyWith is LinearCrossEntropy with options o.
func (t *Tensor) LinearCrossEntropyWith(w, labels *Tensor, r graph.Reduction, o LinearCrossEntropyOptions) *Tensor {
	a := graph.Attrs{Reduction: r, End: o.Classes, LossChunk: o.Chunk}
	if o.Scale != nil {
		return apply(graph.OpLinearCrossEntropy, a, t, w, labels, o.Scale)
	}
	return apply(graph.OpLinearCrossEntropy, a, t, w, labels)
}

// MSE is the mean (or sum) of squared differences between t and target.
func (t *Tensor) MSE(target *Tensor, r graph.Reduction) *Tensor {
	return apply(graph.OpMSE, graph.Attrs{Reduction: r}, t, target)
}

// MatMulT is MatMul with the last two axes of t (transA) and/or u (transB)
// transposed, without making transposed copies: attention's q·kᵀ is
// q.MatMulT(k, false, true).
func (t *Tensor) MatMulT(u *Tensor, transA, transB bool) *Tensor {
	return apply(graph.OpMatMul, graph.Attrs{TransA: transA, TransB: transB}, t, u)
}

// AttentionOptions configures Attention. A zero Scale means 1/√d. Causal
// hides key j from query i when j > i (PyTorch's is_causal, top-left
// aligned when T ≠ S). Mask, when set, is added to the scaled scores and
// broadcasts to [B, H, T, S] (−Inf hides a key); it may be any float type
// and takes no gradient. KVHeads is AttentionQKV's count of key/value
// heads (0: as many as the query heads); Attention reads it off k, and a
// nonzero KVHeads other than k's is an error.
type AttentionOptions struct {
	Causal  bool
	Scale   float64
	Mask    *Tensor
	KVHeads int
}

// Attention is fused scaled dot-product attention, softmax(scale·q·kᵀ +
// mask)·v, of q [B, H, T, d] with k, v [B, Hkv, S, d] (Hkv dividing H:
// grouped-query attention). It keeps no [T, S] value: backward recomputes
// the scores block by block. A query whose every key is masked gets 0
// output and 0 gradient.
func (t *Tensor) Attention(k, v *Tensor, o AttentionOptions) *Tensor {
	if o.KVHeads != 0 && t.Err() == nil && k.Err() == nil {
		if ks := k.Shape(); len(ks) != 4 || ks[1] != o.KVHeads {
			return errTensor("attention", site(), graph.Errorf(graph.ErrAttr, "attention: KVHeads %d, but k %v has other heads (q %v); Attention reads them off k",
				o.KVHeads, ks, t.Shape()), t.Shape(), ks)
		}
	}
	attrs := graph.Attrs{Scalar: o.Scale, Causal: o.Causal}
	if o.Mask == nil {
		return apply(graph.OpAttention, attrs, t, k, v)
	}
	return apply(graph.OpAttention, attrs, t, k, v, o.Mask)
}

// AttentionQKV is Attention over q, k and v packed in one projection, as a
// transformer block's qkv = x·W_qkv gives them: t is [B, T, (H + 2·Hkv)·d]
// with H = heads query heads and Hkv = o.KVHeads key/value heads (heads
// when 0; Hkv divides H: grouped-query attention, Hkv = 1 multi-query),
// its columns q [H, d], then k [Hkv, d], then v [Hkv, d] (with Hkv = H,
// [B, T, 3, H, d]); the result is [B, T, H·d], the heads side by side. It
// equals slicing t in three, reshaping each part to [B, T, heads, d],
// permuting to [B, heads, T, d], Attention, and permuting back to [B, T,
// H·d], without those copies (or their gradients' copies): cuDNN reads q,
// k, v and writes o and d qkv through strides. A mask is not taken
// (o.Mask must be nil).
func (t *Tensor) AttentionQKV(heads int, o AttentionOptions) *Tensor {
	if o.Mask != nil && t.Err() == nil {
		return errTensor("attention_qkv", site(), graph.Errorf(graph.ErrAttr, "attention_qkv takes no mask (qkv %v); use Attention", t.Shape()), t.Shape())
	}
	return apply(graph.OpAttentionQKV, graph.Attrs{Groups: heads, KVHeads: o.KVHeads, Scalar: o.Scale, Causal: o.Causal}, t)
}
