package ref

import (
	"fmt"
	"math"
	"math/rand/v2"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Case is one small graph over every op family, used twice: by this
// package's finite-difference checks of autodiff, and by the executor
// conformance suite (internal/conformance), which runs each case forward and
// backward on an executor and compares with Eval.
//
// out = Fn(p) where p[0] is a data-less batched input (axis 0) and p[1:] are
// shape-only parameters; the loss is Σ out·r with r a fixed random weight,
// so every output element counts with its own coefficient. Chains start from
// p[0] so that every node lands in p[0]'s graph.
type Case struct {
	Name     string
	Shapes   [][]int
	Positive bool // draw inputs from [0.5, 2) instead of [−1, 1)
	// Ties draws inputs from {−1, −½, 0, ½, 1} so maxima tie and relu
	// meets 0; such cases are not differentiable there, so only the
	// conformance suite runs them.
	Ties bool
	// Rounds marks a case that casts to a 16-bit float: rounding is a
	// step function, so finite differences do not apply and only the
	// conformance suite runs it.
	Rounds bool
	// FuseGeluGrad runs graph.FuseGeluGrad on the graph after autodiff,
	// as a mixed-precision training step does, so its backward pass holds
	// matmul_gelu_grad.
	FuseGeluGrad bool
	// FuseLayerNormGrad runs graph.FuseLayerNormGradAdd on the graph after
	// autodiff, as every training step does, so its backward pass holds
	// layer_norm_grad_x_add.
	FuseLayerNormGrad bool
	// FusePointwise runs graph.FusePointwise on the graph after autodiff,
	// so its forward and backward chains of pointwise ops are
	// fused_pointwise nodes.
	FusePointwise bool
	// FuseEmbeddingGrad runs graph.FuseEmbeddingGradAdd on the graph after
	// autodiff, as every training step does, so a tied embedding's
	// gradient is an embedding_grad onto the other one.
	FuseEmbeddingGrad bool
	Fn                func(p []*lazy.Tensor) *lazy.Tensor
}

// Built is a case's graph with its loss and backward pass appended.
type Built struct {
	Graph  *graph.Graph
	Out    int           // Fn's result
	Loss   int           // Σ out·r
	Params []int         // p's node ids, in p's order
	Grads  []int         // d loss / d p, in p's order
	Vals   map[int]Value // data for every data-less source (p and r)
}

func f32(shape []int, data ...float32) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(data))
}

func i64(shape []int, data ...int64) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(data))
}

func c3(x float32) *lazy.Tensor { return lazy.Const(f32([]int{3}, x, 2*x, -x)) }

// Cases cover every forward op; their backward passes cover every gradient op.
var Cases = []Case{
	{Name: "neg", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Neg() }},
	{Name: "exp", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Exp() }},
	{Name: "log", Shapes: [][]int{{2, 3}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Log() }},
	{Name: "sqrt", Shapes: [][]int{{2, 3}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Sqrt() }},
	{Name: "abs", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Abs() }},
	{Name: "tanh", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Tanh() }},
	{Name: "sigmoid", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Sigmoid() }},
	{Name: "relu", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Relu() }},
	{Name: "gelu", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MulScalar(3).Gelu() }},
	{Name: "silu", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MulScalar(3).Silu() }},
	{Name: "gelu_tanh", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MulScalar(3).GeluTanh() }},
	{Name: "scalar_ops", Shapes: [][]int{{2, 3}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		x := p[0]
		return x.AddScalar(1).SubScalar(0.5).RSubScalar(3).MulScalar(1.5).DivScalar(2).RDivScalar(2).Add(x.PowScalar(2.5))
	}},
	{Name: "maximum_scalar", Shapes: [][]int{{3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MaximumScalar(0.1) }},
	{Name: "add_sub_broadcast", Shapes: [][]int{{2, 3}, {3}, {2, 1}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Add(p[1]).Sub(p[2])
	}},
	{Name: "mul_div_broadcast", Shapes: [][]int{{2, 3}, {3}, {2, 1}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Mul(p[1]).Div(p[2])
	}},
	{Name: "pow", Shapes: [][]int{{2, 3}, {1, 3}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Pow(p[1]) }},
	{Name: "maximum", Shapes: [][]int{{2, 3}, {3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Maximum(p[1]) }},
	{Name: "matmul_batched", Shapes: [][]int{{2, 3, 4}, {4, 2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MatMul(p[1]) }},
	{Name: "matmul_broadcast", Shapes: [][]int{{2, 1, 3, 4}, {3, 4, 2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MatMul(p[1]) }},
	{Name: "linear_rank3", Shapes: [][]int{{2, 3, 4}, {5, 4}, {5}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Linear(p[1], p[2]) }},
	// 16 outputs: CUDA's bias_fill writes whole 16-byte packs of biases.
	{Name: "linear_wide", Shapes: [][]int{{3, 4}, {16, 4}, {16}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Linear(p[1], p[2]) }},
	// The backward pass's product with w2 and GELU′ fuse into
	// matmul_gelu_grad; widths of 8 and 16 meet cuBLASLt's epilogue
	// strides, so CUDA runs the GELU and DGELU epilogues.
	{Name: "mlp_gelu_fused", Shapes: [][]int{{2, 3, 16}, {8, 16}, {8}, {16, 8}, {16}}, FuseGeluGrad: true,
		Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Linear(p[1], p[2]).GeluTanh().Linear(p[3], p[4]) }},
	{Name: "linear_rank1", Shapes: [][]int{{4}, {3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Linear(p[1], nil) }},
	{Name: "sum_mean", Shapes: [][]int{{2, 3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Sum(1).Add(p[0].Mean(1)).Add(p[0].MeanKeepDim(0, 1).Reshape(4)).Add(p[0].SumKeepDim(1).Reshape(2, 4))
	}},
	{Name: "max", Shapes: [][]int{{3, 4, 2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Max(1).Add(p[0].MaxKeepDim(0, 1).Reshape(2)) }},
	{Name: "softmax", Shapes: [][]int{{2, 4, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Softmax(1) }},
	{Name: "log_softmax", Shapes: [][]int{{3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].LogSoftmax(0) }},
	{Name: "layer_norm", Shapes: [][]int{{2, 3, 4}, {3, 4}, {3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].LayerNorm(p[1], p[2], 2, 1e-5)
	}},
	{Name: "layer_norm_plain", Shapes: [][]int{{3, 5}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].LayerNorm(nil, nil, 1, 1e-5) }},
	// A residual block: x's gradient through the layer norm meets the
	// stream's, and the two fuse into layer_norm_grad_x_add (CUDA's fused
	// backward pass adds it, with the weight's and bias's gradients).
	{Name: "residual_layer_norm_fused", Shapes: [][]int{{2, 3, 8}, {8}, {8}}, FuseLayerNormGrad: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Add(p[0].LayerNorm(p[1], p[2], 1, 1e-5).Tanh())
	}},
	{Name: "rms_norm", Shapes: [][]int{{2, 3, 8}, {8}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].RMSNorm(p[1], 1e-5) }},
	{Name: "rms_norm_plain", Shapes: [][]int{{3, 5}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].RMSNorm(nil, 1e-6) }},
	// Llama's residual stream: x's gradient through the RMS norm meets the
	// stream's and they fuse into rms_norm_grad_x_add (CUDA's fused
	// backward pass adds it, with the weight's gradient); the sum before
	// the norm is the add it pairs with forward (graph.AddRMSNormProducer).
	{Name: "residual_rms_norm_fused", Shapes: [][]int{{2, 3, 8}, {8}}, FuseLayerNormGrad: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		h := p[0].Add(p[0].Tanh())
		return h.Add(h.RMSNorm(p[1], 1e-5).Tanh())
	}},
	// Written-out Llama pieces, fused by FusePointwise forward and
	// backward: RMSNorm as x·(mean(x²)+ε)^−½·w, SwiGLU as silu(a)·b, a
	// softmax of rows with its max subtracted, and rotary embedding with
	// slices, neg, concat and mul.
	{Name: "rms_norm_written", Shapes: [][]int{{2, 3, 8}, {8}}, FusePointwise: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		x := p[0]
		return x.Mul(x.Mul(x).MeanKeepDim(-1).AddScalar(1e-5).PowScalar(-0.5)).Mul(p[1])
	}},
	{Name: "swiglu_written", Shapes: [][]int{{2, 3, 8}, {8}}, FusePointwise: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		a, b := p[0].Mul(p[1]), p[0].Tanh()
		return a.Silu().Mul(b)
	}},
	{Name: "softmax_written", Shapes: [][]int{{2, 3, 8}}, FusePointwise: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		x := p[0].MulScalar(2)
		e := x.Sub(x.MaxKeepDim(-1)).Exp()
		return e.Div(e.SumKeepDim(-1))
	}},
	{Name: "rotary_written", Shapes: [][]int{{2, 3, 4, 8}}, FusePointwise: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		x := p[0].MulScalar(1.5)
		cos, sin := lazy.Const(ropeTable(4, 8)), lazy.Const(ropeTable(4, 8)).MulScalar(-0.5)
		rot := lazy.Concat(-1, x.Slice(-1, 4, 8).Neg(), x.Slice(-1, 0, 4))
		return x.Mul(cos).Add(rot.Mul(sin)).Gelu()
	}},
	// Rotary embedding of every head, and of the first 4 of 6 (a packed
	// projection's q and k heads; the rest are copied), by a table of
	// angles of no particular pattern.
	{Name: "rotary", Shapes: [][]int{{2, 3, 4, 8}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Rotary(lazy.Const(ropeTable(3, 8)))
	}},
	{Name: "rotary_heads", Shapes: [][]int{{2, 5, 6, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].RotaryHeads(lazy.Const(ropeTable(5, 4)), 4).Tanh()
	}},
	// The full form, a table [T, 2d] of a cos and a sin per element whose
	// halves differ (FuseAttentionQKV's rewrite of rotary written out),
	// at head dim 4 and at 16 (the device's vector path).
	{Name: "rotary_full", Shapes: [][]int{{2, 5, 6, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].RotaryHeads(lazy.Const(ropeTableFull(5, 4)), 4).Tanh()
	}},
	{Name: "rotary_full_d16", Shapes: [][]int{{2, 3, 2, 16}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Rotary(lazy.Const(ropeTableFull(3, 16))).Tanh()
	}},
	// SwiGLU of two halves of a projection, times a parameter so that a
	// parameter's gradient flows through it.
	{Name: "swiglu", Shapes: [][]int{{2, 3, 10}, {3, 5}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MulScalar(3).Slice(2, 0, 5).SwiGLU(p[0].Slice(2, 5, 10)).Mul(p[1])
	}},
	// Training mode: every x moves the batch statistics; M = 3·2·3 values
	// per channel.
	{Name: "batch_norm_train", Shapes: [][]int{{3, 2, 2, 3}, {2}, {2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].BatchNorm2d(p[1], p[2], nil, nil, true, 1e-5)
	}},
	{Name: "batch_norm_train_weight_rank3", Shapes: [][]int{{4, 3, 2}, {3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].BatchNorm(p[1], nil, nil, nil, true, 1e-3).Tanh()
	}},
	{Name: "batch_norm_train_plain_rank2", Shapes: [][]int{{5, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].BatchNorm(nil, nil, nil, nil, true, 1e-5)
	}},
	// Per-chunk statistics: in one piece, training mode's numbers (the
	// chunked runs are the session tests').
	{Name: "batch_norm_train_per_chunk", Shapes: [][]int{{3, 2, 2, 3}, {2}, {2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].BatchNorm2dPerChunk(p[1], p[2], 1e-5)
	}},
	// The mean and unbiased variance running statistics follow, [2, C],
	// differentiated through both rows.
	{Name: "batch_norm_stats", Shapes: [][]int{{3, 2, 2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].BatchStats() }},
	{Name: "batch_norm_stats_rank2", Shapes: [][]int{{5, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Tanh().BatchStats() }},
	// Evaluation mode: running mean and variance are inputs too, so their
	// gradients are checked as well (Positive keeps the variance positive).
	{Name: "batch_norm_eval", Shapes: [][]int{{3, 2, 2, 3}, {2}, {2}, {2}, {2}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].BatchNorm2d(p[1], p[2], p[3], p[4], false, 1e-5)
	}},
	{Name: "batch_norm_eval_plain", Shapes: [][]int{{2, 3, 2, 2}, {3}, {3}}, Positive: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].BatchNorm2d(nil, nil, p[1], p[2], false, 1e-3)
	}},
	{Name: "reshape_permute", Shapes: [][]int{{2, 3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Reshape(6, 4).Permute(1, 0).Reshape(2, 2, 6).Permute(2, 0, 1)
	}},
	// The executors' four-wide paths: a permute keeping the last axis (as
	// attention's heads), a step-1 slice and concat of runs of 4, and the
	// gradient of a sum over leading axes (an expand of a trailing row),
	// with element counts that leave tails.
	{Name: "permute_heads", Shapes: [][]int{{2, 3, 5, 8}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Permute(0, 2, 1, 3).Tanh().Permute(0, 2, 1, 3).Mul(p[0])
	}},
	{Name: "slice_concat_runs", Shapes: [][]int{{3, 12}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		q, k, v := p[0].Slice(1, 0, 4), p[0].Slice(1, 4, 8), p[0].Slice(1, 8, 12)
		return lazy.Concat(1, v.Mul(q), k.Tanh(), q)
	}},
	{Name: "sum_leading_axes", Shapes: [][]int{{3, 5, 8}, {8}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Tanh().Sum(0, 1).Mul(p[1])
	}},
	{Name: "elementwise_tail", Shapes: [][]int{{5, 7}, {5, 7}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Relu().Add(p[1].Gelu()).MulScalar(1.5).Sub(p[1])
	}},
	{Name: "slice_concat", Shapes: [][]int{{4, 5}, {4, 2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return lazy.Concat(1, p[0].SliceStep(1, 1, 5, 2), p[1], p[0].Slice(1, 0, 1)).Slice(0, 1, 3)
	}},
	{Name: "embedding", Shapes: [][]int{{5, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return lazy.Const(i64([]int{2, 3}, 4, 0, 4, 1, 1, 3)).Embedding(p[0])
	}},
	// A tied embedding: W [6, 3] embeds indices and is the head's weight;
	// its gradient is embedding_grad onto the heads' (FuseEmbeddingGrad).
	{Name: "embedding_tied", Shapes: [][]int{{4, 3}, {6, 3}}, FuseEmbeddingGrad: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		e := lazy.Const(i64([]int{4}, 5, 0, 5, 2)).Embedding(p[1])
		return p[0].Linear(p[1], nil).Add(e.Tanh().Linear(p[1], nil))
	}},
	{Name: "conv2d", Shapes: [][]int{{2, 4, 6, 5}, {6, 2, 3, 2}, {6}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Conv2d(p[1], p[2], lazy.ConvOptions{Stride: [2]int{2, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 2}, Groups: 2})
	}},
	// 4×4 = 16 output pixels per channel: bias_fill's per-channel packs.
	{Name: "conv2d_bias_packs", Shapes: [][]int{{2, 2, 4, 4}, {3, 2, 3, 3}, {3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Conv2d(p[1], p[2], lazy.ConvOptions{Padding: [2]int{1, 1}})
	}},
	// A 1×1 kernel with unit stride and no padding in two groups: the
	// convolutions multiply the input itself (CUDA's direct path; its
	// weight gradient regroups the input's 16 positions in 16-byte packs).
	{Name: "conv2d_1x1", Shapes: [][]int{{3, 4, 4, 4}, {6, 2, 1, 1}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Conv2d(p[1], nil, lazy.ConvOptions{Groups: 2})
	}},
	// Depthwise: a group per channel, strided and padded.
	{Name: "conv2d_depthwise", Shapes: [][]int{{2, 4, 7, 7}, {4, 1, 3, 3}, {4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Conv2d(p[1], p[2], lazy.ConvOptions{Stride: [2]int{2, 2}, Padding: [2]int{1, 1}, Groups: 4})
	}},
	{Name: "max_pool2d", Shapes: [][]int{{2, 2, 5, 5}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MaxPool2d(lazy.PoolOptions{Kernel: [2]int{3, 2}, Stride: [2]int{2, 1}, Padding: [2]int{1, 1}})
	}},
	{Name: "avg_pool2d", Shapes: [][]int{{2, 2, 5, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].AvgPool2d(lazy.PoolOptions{Kernel: [2]int{2, 3}, Stride: [2]int{1, 2}, Padding: [2]int{1, 1}})
	}},
	{Name: "cross_entropy", Shapes: [][]int{{4, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		y := lazy.Const(i64([]int{4}, 2, 0, 1, 2))
		return p[0].CrossEntropy(y, graph.ReduceMean).Add(p[0].MulScalar(2).CrossEntropy(y, graph.ReduceSum))
	}},
	// Rows labelled −100 (graph.IgnoreLabel) take no part: no loss, zero
	// gradient.
	{Name: "cross_entropy_ignore", Shapes: [][]int{{5, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		y := lazy.Const(i64([]int{5}, 2, graph.IgnoreLabel, 1, graph.IgnoreLabel, 0))
		return p[0].CrossEntropy(y, graph.ReduceSum).Add(p[0].MulScalar(2).CrossEntropy(y, graph.ReduceMean))
	}},
	// Classes 0..4 of 7 columns (Attrs.End): the last two, a padded
	// linear's extra outputs, take no part and get zero gradient.
	{Name: "cross_entropy_classes", Shapes: [][]int{{4, 7}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		y := lazy.Const(i64([]int{4}, 4, 0, 1, 2))
		return p[0].CrossEntropyClasses(y, 5, graph.ReduceMean).Add(p[0].MulScalar(2).CrossEntropyClasses(y, 5, graph.ReduceSum))
	}},
	// linear_cross_entropy: h [5, 3] and W [7, 3], in chunks of 2 tokens
	// (the last one partial) with a row ignored; then over W's first 5
	// rows (a padded head: the last two get zero gradient), summed, times
	// a scale, in chunks of 3.
	{Name: "linear_cross_entropy", Shapes: [][]int{{5, 3}, {7, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		y := lazy.Const(i64([]int{5}, 2, graph.IgnoreLabel, 6, 0, 3))
		y5 := lazy.Const(i64([]int{5}, 4, 0, graph.IgnoreLabel, 1, 2))
		scale := lazy.Const(tensor.New(tensor.FromScalar(float32(0.25))))
		a := p[0].LinearCrossEntropyWith(p[1], y, graph.ReduceMean, lazy.LinearCrossEntropyOptions{Chunk: 2})
		b := p[0].MulScalar(2).LinearCrossEntropyWith(p[1], y5, graph.ReduceSum,
			lazy.LinearCrossEntropyOptions{Classes: 5, Chunk: 3, Scale: scale})
		return a.Add(b)
	}},
	// Every row ignored: loss 0 and zero gradients, no NaN.
	{Name: "linear_cross_entropy_ignored", Shapes: [][]int{{3, 4}, {6, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		y := lazy.Const(i64([]int{3}, graph.IgnoreLabel, graph.IgnoreLabel, graph.IgnoreLabel))
		return p[0].LinearCrossEntropy(p[1], y, graph.ReduceMean).Add(p[0].Tanh().Sum())
	}},
	{Name: "mse", Shapes: [][]int{{3, 2}, {3, 2}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MSE(p[1], graph.ReduceMean).Add(p[0].Tanh().MSE(p[1], graph.ReduceSum))
	}},
	{Name: "mixed_const", Shapes: [][]int{{2, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Mul(c3(0.5)).Add(c3(1)) }},
	{Name: "causal_attention", Shapes: [][]int{{2, 2, 3, 4}, {2, 2, 5, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		// scores [2, 2, 3, 5]: 3 queries over 5 keys, the last query sees all.
		return p[0].MatMulT(p[1], false, true).MulScalar(0.5).CausalMask().Softmax(-1)
	}},
	{Name: "causal_attention_wide", Shapes: [][]int{{2, 2, 8, 4}, {2, 2, 16, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		// scores [2, 2, 8, 16]: rows a whole number of 16-byte packs, so
		// CUDA's causal_mask takes its vector path, with packs wholly
		// masked, wholly kept and cut by the diagonal.
		return p[0].MatMulT(p[1], false, true).CausalMask().Softmax(-1)
	}},
	// Fused attention: q, k and v are slices of the batched input so all
	// three carry the batch. Grouped-query (4 query heads over 2 key/value
	// heads), causal with 3 queries over 5 keys (top-left aligned).
	{Name: "attention_gqa_causal", Shapes: [][]int{{2, 8, 5, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		q := p[0].Slice(1, 0, 4).Slice(2, 0, 3)
		return q.Attention(p[0].Slice(1, 4, 6), p[0].Slice(1, 6, 8), lazy.AttentionOptions{Causal: true})
	}},
	// An additive mask with a row hidden entirely (its output and gradients
	// are 0) and a given scale; the output is scaled by a parameter so a
	// parameter's gradient flows through attention too.
	{Name: "attention_mask", Shapes: [][]int{{2, 6, 4, 3}, {4, 3}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		inf := float32(math.Inf(-1))
		m := lazy.Const(f32([]int{1, 1, 4, 4}, 0, 0.5, -1, inf, inf, inf, inf, inf, 0.25, inf, 0, 2, -0.5, 0, 0, 0))
		q := p[0].Slice(1, 0, 2)
		return q.Attention(p[0].Slice(1, 2, 4), p[0].Slice(1, 4, 6), lazy.AttentionOptions{Scale: 0.7, Mask: m}).Mul(p[1])
	}},
	// Packed attention: qkv [2, 5, 3·2·4] (2 heads of 4), causal and
	// not, default scale and a given one.
	{Name: "attention_qkv_causal", Shapes: [][]int{{2, 5, 24}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].AttentionQKV(2, lazy.AttentionOptions{Causal: true})
	}},
	{Name: "attention_qkv", Shapes: [][]int{{2, 3, 12}, {3, 4}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].AttentionQKV(1, lazy.AttentionOptions{Scale: 0.7}).Mul(p[1])
	}},
	// Grouped-query and multi-query packed attention: qkv [2, 5, (4 +
	// 2·2)·4] (4 query heads, 2 key/value heads of 4), causal; qkv [2, 4,
	// (3 + 2·1)·4] (3 query heads sharing 1 key/value head), a given scale.
	{Name: "attention_qkv_gqa_causal", Shapes: [][]int{{2, 5, 32}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].AttentionQKV(4, lazy.AttentionOptions{Causal: true, KVHeads: 2})
	}},
	{Name: "attention_qkv_mqa", Shapes: [][]int{{2, 4, 20}, {4, 12}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].AttentionQKV(3, lazy.AttentionOptions{Scale: 0.6, KVHeads: 1}).Mul(p[1])
	}},
	// A Llama block's attention: q and k rotated in place in the packed
	// projection first (the first 4 of 6 heads of 4), then 2 query heads
	// over 1 key/value head.
	{Name: "attention_qkv_rotary_gqa", Shapes: [][]int{{2, 5, 24}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		qkv := p[0].Reshape(-1, 5, 6, 4).RotaryHeads(lazy.Const(ropeTable(5, 4)), 4).Reshape(-1, 5, 24)
		return qkv.AttentionQKV(2, lazy.AttentionOptions{Causal: true, KVHeads: 1})
	}},
	{Name: "dropout", Shapes: [][]int{{4, 3, 5}}, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Dropout(0.4, 7, 3).Tanh().Dropout(0.25, 7, 4)
	}},
	// Casts both ways, and elementwise ops of mixed float dtypes, which
	// promote as PyTorch's do (bfloat16 + float16 → float32).
	{Name: "cast", Shapes: [][]int{{2, 3}, {3}}, Rounds: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Cast(graph.BFloat16).Tanh().Add(p[1].Cast(graph.Float16)).Mul(p[0].Cast(graph.Float16)).Cast(graph.Float32)
	}},
	{Name: "ties_max_pool", Shapes: [][]int{{2, 2, 4, 4}}, Ties: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MaxPool2d(lazy.PoolOptions{Kernel: [2]int{2, 2}, Stride: [2]int{1, 1}})
	}},
	{Name: "ties_max_maximum_relu", Shapes: [][]int{{4, 6}, {6}}, Ties: true, Fn: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MaxKeepDim(1).Add(p[0].Maximum(p[1])).Add(p[0].Relu()).Add(p[0].MaximumScalar(0.5))
	}},
}

// ropeTable is a rotary embedding's table [t, d]: cos θ then sin θ of
// angles θ_p,i = (p + 1)·(0.7 + 0.45·i), p a position and i < d/2.
func ropeTable(t, d int) *tensor.Dense {
	data := make([]float32, t*d)
	for p := range t {
		for i := range d / 2 {
			th := float64(p+1) * (0.7 + 0.45*float64(i))
			data[p*d+i], data[p*d+d/2+i] = float32(math.Cos(th)), float32(math.Sin(th))
		}
	}
	return f32([]int{t, d}, data...)
}

// ropeTableFull is rotary's full table [t, 2d]: cos θ of each of d
// elements, then sin θ, of angles θ_p,i = (p + 1)·(0.7 + 0.45·i) for
// every i < d, so a row's two halves differ.
func ropeTableFull(t, d int) *tensor.Dense {
	data := make([]float32, t*2*d)
	for p := range t {
		for i := range d {
			th := float64(p+1) * (0.7 + 0.45*float64(i))
			data[p*2*d+i], data[p*2*d+d+i] = float32(math.Cos(th)), float32(math.Sin(th))
		}
	}
	return f32([]int{t, 2 * d}, data...)
}

// uniform draws a value with entries uniform in [lo, hi).
func uniform(rng *rand.Rand, lo, hi float64, shape ...int) Value {
	v := Zeros(shape...)
	for i := range v.Data {
		v.Data[i] = lo + (hi-lo)*rng.Float64()
	}
	return v
}

// Build makes the case's graph, appends loss = Σ out·r and its backward
// pass, and draws values for the data-less sources from rng.
func (c Case) Build(rng *rand.Rand) (*Built, error) { return c.BuildAs(rng, graph.Float32) }

// BuildAs is Build with the case's input and parameters of dtype dt, so
// every op of the case runs in dt (float16, bfloat16): what the
// conformance suite checks the rounding of each op with. The weight r
// stays float32, so the loss promotes to float32.
func (c Case) BuildAs(rng *rand.Rand, dt graph.DType) (*Built, error) {
	ps := make([]*lazy.Tensor, len(c.Shapes))
	ps[0] = lazy.Placeholder(c.Shapes[0], dt, 0)
	for i, s := range c.Shapes[1:] {
		ps[i+1] = lazy.ParamSpec(s, dt, fmt.Sprintf("p%d", i+1))
	}
	out := c.Fn(ps)
	if err := out.Err(); err != nil {
		return nil, err
	}
	b := &Built{Graph: out.Graph().IR(), Out: out.ID(), Vals: map[int]Value{}}
	g := b.Graph
	lo, hi := -1.0, 1.0
	if c.Positive {
		lo, hi = 0.5, 2
	}
	b.Params = make([]int, len(ps))
	draw := func(s []int) Value { return uniform(rng, lo, hi, s...) }
	if c.Ties {
		draw = func(s []int) Value {
			v := Zeros(s...)
			for i := range v.Data {
				v.Data[i] = float64(rng.IntN(5)-2) / 2
			}
			return v
		}
	}
	for i, s := range c.Shapes {
		id := ps[0].ID()
		if i > 0 {
			id = g.NodeNamed(fmt.Sprintf("p%d", i))
		}
		if id < 0 {
			return nil, graph.Errorf(graph.ErrArity, "case %s: parameter p%d is not in the graph", c.Name, i)
		}
		b.Params[i] = id
		b.Vals[id] = draw(s)
	}
	r, err := shapeinfer.AppendSource(g, graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: out.Shape(), DType: graph.Float32}})
	if err != nil {
		return nil, err
	}
	b.Vals[r] = uniform(rng, -1, 1, out.Shape()...)
	prod, err := shapeinfer.Append(g, graph.Node{Op: graph.OpMul, Inputs: []int{out.ID(), r}})
	if err != nil {
		return nil, err
	}
	if b.Loss, err = shapeinfer.Append(g, graph.Node{Op: graph.OpSum, Inputs: []int{prod}}); err != nil {
		return nil, err
	}
	if b.Grads, err = autodiff.Backward(g, b.Loss, b.Params); err != nil {
		return b, err
	}
	if c.FuseGeluGrad {
		if err := b.rewrite(graph.FuseGeluGrad); err != nil {
			return nil, err
		}
	}
	if c.FuseLayerNormGrad {
		if err := b.rewrite(graph.FuseLayerNormGradAdd); err != nil {
			return nil, err
		}
	}
	if c.FuseEmbeddingGrad {
		if err := b.rewrite(graph.FuseEmbeddingGradAdd); err != nil {
			return nil, err
		}
	}
	if c.FusePointwise {
		if err := b.rewrite(graph.FusePointwise); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// rewrite runs a backward-pass fusion on b's graph, its output, loss and
// gradients kept.
func (b *Built) rewrite(pass func(*graph.Graph, []int) (*graph.Graph, []int, error)) error {
	ng, ids, err := pass(b.Graph, append([]int{b.Out, b.Loss}, b.Grads...))
	if err != nil {
		return err
	}
	vals := make(map[int]Value, len(b.Vals))
	for id, v := range b.Vals {
		vals[ids[id]] = v
	}
	for _, v := range [][]int{b.Params, b.Grads} {
		for i, id := range v {
			v[i] = ids[id]
		}
	}
	b.Graph, b.Out, b.Loss, b.Vals = ng, ids[b.Out], ids[b.Loss], vals
	return nil
}
