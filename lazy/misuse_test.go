package lazy_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

const f32, i64 = graph.Float32, graph.Int64

// x is a batched [4, 3] input in a fresh graph.
func x() *lazy.Tensor { return lazy.Placeholder([]int{4, 3}, f32, 0) }

// img is a batched NCHW [4, 3, 5, 5] input in a fresh graph.
func img() *lazy.Tensor { return lazy.Placeholder([]int{4, 3, 5, 5}, f32, 0) }

func p(shape ...int) *lazy.Tensor { return lazy.ParamSpec(shape, f32, "p") }

func pi(shape ...int) *lazy.Tensor { return lazy.ParamSpec(shape, i64, "p") }

func sh(s ...[]int) [][]int { return s }

func d(s ...int) []int {
	if s == nil {
		return []int{}
	}
	return s
}

func dense(shape ...int) *tensor.Dense {
	return tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(shape...))
}

type misuse struct {
	name   string
	build  func() *lazy.Tensor
	op     string  // OpError.Op
	shapes [][]int // OpError.Shapes
	want   error   // sentinel
}

func misuses() []misuse {
	conv := func(w []int, o lazy.ConvOptions) func() *lazy.Tensor {
		return func() *lazy.Tensor { return img().Conv2d(p(w...), nil, o) }
	}
	return []misuse{
		{"matmul inner dims", func() *lazy.Tensor { return x().MatMul(p(4, 5)) }, "matmul", sh(d(4, 3), d(4, 5)), graph.ErrShape},
		{"matmul with TransB, inner dims", func() *lazy.Tensor { return x().MatMulT(p(3, 5), false, true) }, "matmul", sh(d(4, 3), d(3, 5)), graph.ErrShape},
		{"causal_mask of a vector", func() *lazy.Tensor { return lazy.Placeholder([]int{4}, f32, 0).CausalMask() }, "causal_mask", sh(d(4)), graph.ErrShape},
		{"matmul of int64", func() *lazy.Tensor { return pi(2, 3).MatMul(pi(3, 2)) }, "matmul", sh(d(2, 3), d(3, 2)), graph.ErrDType},
		{"rms_norm weight shape", func() *lazy.Tensor { return x().RMSNorm(p(4), 1e-6) }, "rms_norm", sh(d(4, 3), d(4)), graph.ErrShape},
		{"rms_norm eps 0", func() *lazy.Tensor { return x().RMSNorm(nil, 0) }, "rms_norm", sh(d(4, 3)), graph.ErrAttr},
		{"rotary of a rank-3 tensor", func() *lazy.Tensor { return lazy.Placeholder([]int{4, 5, 8}, f32, 0).Rotary(p(5, 8)) }, "rotary", sh(d(4, 5, 8), d(5, 8)), graph.ErrShape},
		{"rotary table length", func() *lazy.Tensor { return lazy.Placeholder([]int{4, 5, 2, 8}, f32, 0).Rotary(p(6, 8)) }, "rotary", sh(d(4, 5, 2, 8), d(6, 8)), graph.ErrShape},
		{"rotary of no heads", func() *lazy.Tensor { return lazy.Placeholder([]int{4, 5, 2, 8}, f32, 0).RotaryHeads(p(5, 8), 0) }, "rotary", sh(d(4, 5, 2, 8)), graph.ErrAttr},
		{"swiglu broadcast", func() *lazy.Tensor { return x().SwiGLU(p(3)) }, "swiglu", sh(d(4, 3), d(3)), graph.ErrShape},
		{"attention_qkv kv heads", func() *lazy.Tensor {
			return lazy.Placeholder([]int{4, 5, 48}, f32, 0).AttentionQKV(8, lazy.AttentionOptions{KVHeads: 3})
		}, "attention_qkv", sh(d(4, 5, 48)), graph.ErrAttr},
		{"failed broadcast", func() *lazy.Tensor { return x().Add(p(2, 3)) }, "add", sh(d(4, 3), d(2, 3)), graph.ErrShape},
		{"failed broadcast with size 0", func() *lazy.Tensor { return p(0, 3).Mul(p(2, 3)) }, "mul", sh(d(0, 3), d(2, 3)), graph.ErrShape},
		{"batchDim out of range", func() *lazy.Tensor { return lazy.Placeholder([]int{4, 3}, f32, 2) }, "input", sh(d(4, 3)), graph.ErrAttr},
		{"batchDim negative", func() *lazy.Tensor { return lazy.Placeholder([]int{4, 3}, f32, -1) }, "input", sh(d(4, 3)), graph.ErrAttr},
		{"batchDim of a scalar", func() *lazy.Tensor { return lazy.Wrap(tensor.New(tensor.FromScalar(float32(1))), 0) }, "input", sh(d()), graph.ErrAttr},
		{"Wrap batchDim out of range", func() *lazy.Tensor { return lazy.Wrap(dense(2, 3), 5) }, "input", sh(d(2, 3)), graph.ErrAttr},
		{"empty batch axis", func() *lazy.Tensor { return lazy.Placeholder([]int{0, 3}, f32, 0) }, "input", sh(d(0, 3)), graph.ErrShape},
		{"reshape size mismatch", func() *lazy.Tensor { return x().Reshape(5, 3) }, "reshape", sh(d(4, 3)), graph.ErrShape},
		{"reshape of an empty tensor to an overflowing shape", func() *lazy.Tensor {
			return lazy.Placeholder([]int{4, 0}, f32, 0).Reshape(1<<40, 0, 1<<40)
		}, "reshape", sh(d(4, 0)), graph.ErrShape},
		{"placeholder too large", func() *lazy.Tensor { return lazy.Placeholder([]int{4, 1 << 40, 1 << 40}, f32, 0) }, "input", sh(d(4, 1<<40, 1<<40)), graph.ErrShape},
		{"reshape with two -1", func() *lazy.Tensor { return x().Reshape(-1, -1) }, "reshape", sh(d(4, 3)), graph.ErrAttr},
		{"float indices to embedding", func() *lazy.Tensor { return x().Embedding(p(10, 8)) }, "embedding", sh(d(4, 3), d(10, 8)), graph.ErrDType},
		{"int64 input to exp", func() *lazy.Tensor { return lazy.Placeholder([]int{4}, i64, 0).Exp() }, "exp", sh(d(4)), graph.ErrDType},
		{"conv kernel larger than the padded input", conv([]int{8, 3, 8, 8}, lazy.ConvOptions{Padding: [2]int{1, 1}}), "conv2d", sh(d(4, 3, 5, 5), d(8, 3, 8, 8)), graph.ErrShape},
		{"conv kernel larger than the input at stride 2", conv([]int{8, 3, 6, 6}, lazy.ConvOptions{Stride: [2]int{2, 2}}), "conv2d", sh(d(4, 3, 5, 5), d(8, 3, 6, 6)), graph.ErrShape},
		{"conv groups not dividing channels", conv([]int{8, 1, 3, 3}, lazy.ConvOptions{Groups: 2}), "conv2d", sh(d(4, 3, 5, 5), d(8, 1, 3, 3)), graph.ErrAttr},
		{"conv weight channel mismatch", conv([]int{8, 4, 3, 3}, lazy.ConvOptions{}), "conv2d", sh(d(4, 3, 5, 5), d(8, 4, 3, 3)), graph.ErrShape},
		{"mixing graphs", func() *lazy.Tensor { return x().Add(x()) }, "add", sh(d(4, 3), d(4, 3)), graph.ErrMixedGraphs},
		{"nil tensor input", func() *lazy.Tensor { return lazy.Wrap(nil, 0) }, "wrap", nil, graph.ErrNilTensor},
		{"typed nil *tensor.Dense", func() *lazy.Tensor { return lazy.Wrap((*tensor.Dense)(nil), 0) }, "wrap", nil, graph.ErrNilTensor},
		{"nil Param data", func() *lazy.Tensor { return lazy.Param((*tensor.Dense)(nil), "w") }, "param", nil, graph.ErrNilTensor},
		{"float64 data", func() *lazy.Tensor { return lazy.Const(tensor.New(tensor.WithBacking([]float64{1, 2}))) }, "const", sh(d(2)), graph.ErrDType},
		// Zero-size data is refused where it enters: executed, it panicked.
		{"zero-size Wrap", func() *lazy.Tensor { return lazy.Wrap(dense(4, 0), 0) }, "wrap", sh(d(4, 0)), graph.ErrShape},
		{"zero-size batch in Wrap", func() *lazy.Tensor { return lazy.Wrap(dense(0, 3), 0) }, "wrap", sh(d(0, 3)), graph.ErrShape},
		{"zero-size Param", func() *lazy.Tensor { return lazy.Param(dense(3, 0), "w") }, "param", sh(d(3, 0)), graph.ErrShape},
		{"zero-size Const", func() *lazy.Tensor { return lazy.Const(dense(0, 3)) }, "const", sh(d(0, 3)), graph.ErrShape},
		{"nil *lazy.Tensor argument", func() *lazy.Tensor { return x().Add(nil) }, "add", sh(d(4, 3)), graph.ErrNilTensor},
		{"nil *lazy.Tensor receiver", func() *lazy.Tensor { var t *lazy.Tensor; return t.Relu() }, "relu", nil, graph.ErrNilTensor},
		{"zero lazy.Tensor argument", func() *lazy.Tensor { return x().Mul(&lazy.Tensor{}) }, "mul", sh(d(4, 3)), graph.ErrNilTensor},
		{"nil weight for linear", func() *lazy.Tensor { return x().Linear(nil, nil) }, "linear", sh(d(4, 3)), graph.ErrNilTensor},
		{"param with a negative dim", func() *lazy.Tensor { return x().Add(p(-1, 3)) }, "add", sh(d(4, 3), d(-1, 3)), graph.ErrShape},
		{"softmax axis out of range", func() *lazy.Tensor { return x().Softmax(2) }, "softmax", sh(d(4, 3)), graph.ErrAttr},
		{"log_softmax axis out of range", func() *lazy.Tensor { return x().LogSoftmax(-3) }, "log_softmax", sh(d(4, 3)), graph.ErrAttr},
		{"permute with repeated axis", func() *lazy.Tensor { return x().Permute(1, 1) }, "permute", sh(d(4, 3)), graph.ErrAttr},
		{"permute of the wrong length", func() *lazy.Tensor { return x().Permute(1, 0, 2) }, "permute", sh(d(4, 3)), graph.ErrAttr},
		{"transpose axis out of range", func() *lazy.Tensor { return x().Transpose(0, 2) }, "transpose", sh(d(4, 3)), graph.ErrAttr},
		{"transpose negative axis out of range", func() *lazy.Tensor { return x().Transpose(-3, 1) }, "transpose", sh(d(4, 3)), graph.ErrAttr},
		{"slice out of range", func() *lazy.Tensor { return x().Slice(1, 0, 4) }, "slice", sh(d(4, 3)), graph.ErrAttr},
		{"slice start after end", func() *lazy.Tensor { return x().Slice(1, 2, 1) }, "slice", sh(d(4, 3)), graph.ErrAttr},
		{"slice step 0", func() *lazy.Tensor { return x().SliceStep(1, 0, 3, 0) }, "slice", sh(d(4, 3)), graph.ErrAttr},
		{"concat rank mismatch", func() *lazy.Tensor { t := x(); return lazy.Concat(1, t, p(4)) }, "concat", sh(d(4, 3), d(4)), graph.ErrShape},
		{"concat size mismatch", func() *lazy.Tensor { t := x(); return lazy.Concat(1, t, p(5, 2)) }, "concat", sh(d(4, 3), d(5, 2)), graph.ErrShape},
		{"concat of nothing", func() *lazy.Tensor { return lazy.Concat(0) }, "concat", nil, graph.ErrArity},
		{"linear bias wrong shape", func() *lazy.Tensor { return x().Linear(p(5, 3), p(3)) }, "linear", sh(d(4, 3), d(5, 3), d(3)), graph.ErrShape},
		{"linear weight wrong shape", func() *lazy.Tensor { return x().Linear(p(3, 5), nil) }, "linear", sh(d(4, 3), d(3, 5)), graph.ErrShape},
		{"layer_norm weight wrong shape", func() *lazy.Tensor { return x().LayerNorm(p(4), nil, 1, 1e-5) }, "layer_norm", sh(d(4, 3), d(4)), graph.ErrShape},
		{"layer_norm eps 0", func() *lazy.Tensor { return x().LayerNorm(nil, nil, 1, 0) }, "layer_norm", sh(d(4, 3)), graph.ErrAttr},
		{"layer_norm eps negative", func() *lazy.Tensor { return x().LayerNorm(p(3), p(3), 1, -1e-5) }, "layer_norm", sh(d(4, 3), d(3), d(3)), graph.ErrAttr},
		{"layer_norm bias without weight", func() *lazy.Tensor { return x().LayerNorm(nil, p(3), 1, 1e-5) }, "layer_norm", sh(d(4, 3)), graph.ErrArity},
		{"batch_norm weight wrong shape", func() *lazy.Tensor { return img().BatchNorm2d(p(4), nil, nil, nil, true, 1e-5) }, "batch_norm", sh(d(4, 3, 5, 5), d(4)), graph.ErrShape},
		{"batch_norm running_var wrong shape", func() *lazy.Tensor { return img().BatchNorm2d(nil, nil, p(3), p(5), false, 1e-5) }, "batch_norm", sh(d(4, 3, 5, 5), d(3), d(5)), graph.ErrShape},
		{"batch_norm running_mean wrong shape in training mode", func() *lazy.Tensor { return img().BatchNorm2d(p(3), p(3), p(1, 3), nil, true, 1e-5) }, "batch_norm", sh(d(4, 3, 5, 5)), graph.ErrShape},
		{"batch_norm eval without running statistics", func() *lazy.Tensor { return img().BatchNorm2d(p(3), p(3), p(3), nil, false, 1e-5) }, "batch_norm", sh(d(4, 3, 5, 5)), graph.ErrArity},
		{"batch_norm bias without weight", func() *lazy.Tensor { return img().BatchNorm2d(nil, p(3), nil, nil, true, 1e-5) }, "batch_norm", sh(d(4, 3, 5, 5)), graph.ErrArity},
		{"batch_norm2d of a rank-2 input", func() *lazy.Tensor { return x().BatchNorm2d(nil, nil, nil, nil, true, 1e-5) }, "batch_norm", sh(d(4, 3)), graph.ErrShape},
		{"batch_norm eps 0", func() *lazy.Tensor { return x().BatchNorm(nil, nil, nil, nil, true, 0) }, "batch_norm", sh(d(4, 3)), graph.ErrAttr},
		{"batch_norm int64 running_mean", func() *lazy.Tensor { return x().BatchNorm(nil, nil, pi(3), p(3), false, 1e-5) }, "batch_norm", sh(d(4, 3), d(3), d(3)), graph.ErrDType},
		{"batch_norm in training mode with one value per channel", func() *lazy.Tensor {
			return lazy.Placeholder([]int{1, 3}, f32, 0).BatchNorm(nil, nil, nil, nil, true, 1e-5)
		}, "batch_norm", sh(d(1, 3)), graph.ErrShape},
		{"cross_entropy float labels", func() *lazy.Tensor {
			g := lazy.NewGraph()
			return g.Placeholder([]int{4, 10}, f32, 0).CrossEntropy(g.Placeholder([]int{4}, f32, 0), graph.ReduceMean)
		}, "cross_entropy", sh(d(4, 10), d(4)), graph.ErrDType},
		{"cross_entropy N mismatch", func() *lazy.Tensor {
			return lazy.Placeholder([]int{4, 10}, f32, 0).CrossEntropy(pi(3), graph.ReduceMean)
		}, "cross_entropy", sh(d(4, 10), d(3)), graph.ErrShape},
		{"mse shape mismatch", func() *lazy.Tensor { return x().MSE(p(4, 2), graph.ReduceMean) }, "mse", sh(d(4, 3), d(4, 2)), graph.ErrShape},
		{"two inputs with different batch sizes", func() *lazy.Tensor {
			g := lazy.NewGraph()
			g.Placeholder([]int{4, 3}, f32, 0)
			return g.Placeholder([]int{5, 3}, f32, 0)
		}, "input", sh(d(5, 3)), graph.ErrShape},
		{"two Wraps with different batch sizes", func() *lazy.Tensor {
			g := lazy.NewGraph()
			g.Wrap(dense(4, 3), 0)
			return g.Wrap(dense(3, 5), 1)
		}, "input", sh(d(3, 5)), graph.ErrShape},
		{"max_pool kernel 0", func() *lazy.Tensor { return img().MaxPool2d(lazy.PoolOptions{}) }, "max_pool2d", sh(d(4, 3, 5, 5)), graph.ErrAttr},
		{"avg_pool kernel 0 on one axis", func() *lazy.Tensor { return img().AvgPool2d(lazy.PoolOptions{Kernel: [2]int{2, 0}}) }, "avg_pool2d", sh(d(4, 3, 5, 5)), graph.ErrAttr},
		{"pool kernel larger than the input", func() *lazy.Tensor { return img().MaxPool2d(lazy.PoolOptions{Kernel: [2]int{6, 6}}) }, "max_pool2d", sh(d(4, 3, 5, 5)), graph.ErrShape},
		{"reduce with repeated axis", func() *lazy.Tensor { return x().Sum(1, 1) }, "sum", sh(d(4, 3)), graph.ErrAttr},
		{"reduce with an axis repeated after normalising", func() *lazy.Tensor { return x().MeanKeepDim(1, -1) }, "mean", sh(d(4, 3)), graph.ErrAttr},
		{"reduce axis out of range", func() *lazy.Tensor { return x().Max(2) }, "max", sh(d(4, 3)), graph.ErrAttr},
		{"grad of a free parameter", func() *lazy.Tensor { return lazy.Grad(p(), p(3))[0] }, "grad", nil, graph.ErrArity},
		{"grad with a zero lazy.Tensor parameter", func() *lazy.Tensor { return lazy.Grad(x().Sum(), &lazy.Tensor{})[0] }, "grad", sh(d()), graph.ErrNilTensor},
		{"grad of a non-scalar loss", func() *lazy.Tensor { return lazy.Grad(x().Relu(), p(3))[0] }, "backward", sh(d(4, 3)), graph.ErrShape},
		{"sticky: reshape error survives later ops", func() *lazy.Tensor {
			t := x()
			return t.Reshape(7).Relu().Add(t).Sum(0).Transpose(0, 5)
		}, "reshape", sh(d(4, 3)), graph.ErrShape},
	}
}

// followUps are later ops applied to an errored tensor; each must return the
// same error.
var followUps = []struct {
	name string
	f    func(t *lazy.Tensor) *lazy.Tensor
}{
	{"relu", func(t *lazy.Tensor) *lazy.Tensor { return t.Relu() }},
	{"add to itself", func(t *lazy.Tensor) *lazy.Tensor { return t.Add(t) }},
	{"as second operand", func(t *lazy.Tensor) *lazy.Tensor { return p(3).Mul(t) }},
	{"reshape", func(t *lazy.Tensor) *lazy.Tensor { return t.Reshape(-1) }},
	{"transpose", func(t *lazy.Tensor) *lazy.Tensor { return t.Transpose(0, 1) }},
	{"slice step 0", func(t *lazy.Tensor) *lazy.Tensor { return t.SliceStep(0, 0, 1, 0) }},
	{"layer_norm bias without weight", func(t *lazy.Tensor) *lazy.Tensor { return t.LayerNorm(nil, p(3), 1, 1e-5) }},
	{"batch_norm eval without running statistics", func(t *lazy.Tensor) *lazy.Tensor { return t.BatchNorm2d(nil, nil, nil, nil, false, 1e-5) }},
	{"batch_norm with an errored running mean", func(t *lazy.Tensor) *lazy.Tensor { return x().BatchNorm(nil, nil, t, p(3), false, 1e-5) }},
	{"concat", func(t *lazy.Tensor) *lazy.Tensor { return lazy.Concat(0, t, t) }},
	{"linear", func(t *lazy.Tensor) *lazy.Tensor { return t.Linear(p(2, 3), nil) }},
	{"cross_entropy", func(t *lazy.Tensor) *lazy.Tensor { return t.CrossEntropy(pi(4), graph.ReduceMean) }},
}

func TestMisuse(t *testing.T) {
	cases := misuses()
	require.GreaterOrEqual(t, len(cases), 25)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out *lazy.Tensor
			noPanic(t, func() { out = c.build() })
			require.NotNil(t, out)
			err := out.Err()
			require.Error(t, err)

			var oe *graph.OpError
			require.True(t, errors.As(err, &oe), "error %T is not a *graph.OpError", err)
			assert.ErrorIs(t, err, c.want)
			assert.Equal(t, c.op, oe.Op, "OpError.Op")
			assert.Equal(t, norm(c.shapes), norm(oe.Shapes), "OpError.Shapes")
			assert.True(t, strings.HasPrefix(oe.Site, "lazy/misuse_test.go:"), "OpError.Site = %q", oe.Site)

			// An errored tensor has no type and no node.
			assert.Nil(t, out.Shape())
			assert.Equal(t, -1, out.ID())

			for _, fu := range followUps {
				var later *lazy.Tensor
				noPanic(t, func() { later = fu.f(out) })
				assert.Same(t, oe, later.Err(), "after %s", fu.name)
			}
		})
	}
}

// Every error from the public API is an *OpError, so errors.Is works through
// Unwrap for each sentinel and only that sentinel.
func TestMisuseSentinelsAreDistinct(t *testing.T) {
	sentinels := []error{graph.ErrShape, graph.ErrDType, graph.ErrAttr, graph.ErrArity,
		graph.ErrMixedGraphs, graph.ErrNilTensor}
	for _, c := range misuses() {
		err := c.build().Err()
		for _, s := range sentinels {
			assert.Equal(t, s == c.want, errors.Is(err, s), "%s: errors.Is(err, %v)", c.name, s)
		}
	}
}

// The graph is unchanged by a rejected op: no half-built node is left behind.
func TestMisuseLeavesGraphIntact(t *testing.T) {
	t0 := x()
	g := t0.Graph()
	before := g.IR().Len()
	for _, bad := range []*lazy.Tensor{t0.Reshape(5), t0.Softmax(3), t0.Linear(p(2, 2), nil), t0.Sum(0, 0)} {
		require.Error(t, bad.Err())
	}
	assert.Equal(t, before, g.IR().Len())
	ok := t0.Relu()
	require.NoError(t, ok.Err())
	assert.Equal(t, before+1, g.IR().Len())
}

func noPanic(t *testing.T, f func()) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("panic: %v", r)
		}
	}()
	f()
}

// norm maps an empty shape list to nil so nil and [][]int{} compare equal.
func norm(s [][]int) [][]int {
	if len(s) == 0 {
		return nil
	}
	return s
}

// A parameter the loss does not use gets a zero gradient, even when the
// graph first meets it in Grad (after the loss node).
func TestGradOfUnusedParam(t *testing.T) {
	w := p(5, 3)
	loss := x().Linear(p(2, 3), nil).Sum()
	grads := lazy.Grad(loss, w)
	require.Len(t, grads, 1)
	require.NoError(t, grads[0].Err())
	assert.Equal(t, []int{5, 3}, grads[0].Shape())
	nd := loss.Graph().IR().Node(grads[0].ID())
	assert.Equal(t, graph.OpFill, nd.Op)
	assert.Zero(t, nd.Attrs.Scalar)
}

// AttentionQKV refuses a mask and heads that do not split qkv into whole
// heads, with typed errors; a good call gives [B, T, C].
func TestAttentionQKVMisuse(t *testing.T) {
	qkv := lazy.Placeholder([]int{4, 5, 24}, f32, 0)
	m := lazy.Placeholder([]int{5, 5}, f32, -1)
	assert.ErrorIs(t, qkv.AttentionQKV(2, lazy.AttentionOptions{Mask: m}).Err(), graph.ErrAttr)
	assert.ErrorIs(t, qkv.AttentionQKV(3, lazy.AttentionOptions{}).Err(), graph.ErrAttr)
	assert.ErrorIs(t, qkv.AttentionQKV(0, lazy.AttentionOptions{}).Err(), graph.ErrAttr)
	y := qkv.AttentionQKV(2, lazy.AttentionOptions{Causal: true})
	require.NoError(t, y.Err())
	assert.Equal(t, []int{4, 5, 8}, y.Shape())

	// Grouped-query heads: qkv [4, 5, (4 + 2·2)·6] holds 4 query heads
	// and 2 key/value heads of 6; 3 key/value heads do not divide 4, and
	// 1 (multi-query) does not split 40 into whole heads ((4 + 2)·d).
	gqa := lazy.Placeholder([]int{4, 5, 48}, f32, 0)
	y = gqa.AttentionQKV(4, lazy.AttentionOptions{KVHeads: 2})
	require.NoError(t, y.Err())
	assert.Equal(t, []int{4, 5, 24}, y.Shape())
	assert.ErrorIs(t, gqa.AttentionQKV(4, lazy.AttentionOptions{KVHeads: 3}).Err(), graph.ErrAttr)
	assert.ErrorIs(t, gqa.AttentionQKV(4, lazy.AttentionOptions{KVHeads: -1}).Err(), graph.ErrAttr)
	assert.ErrorIs(t, lazy.Placeholder([]int{4, 5, 40}, f32, 0).AttentionQKV(4, lazy.AttentionOptions{KVHeads: 1}).Err(), graph.ErrAttr)
	mqa := lazy.Placeholder([]int{4, 5, 36}, f32, 0).AttentionQKV(4, lazy.AttentionOptions{KVHeads: 1})
	require.NoError(t, mqa.Err())
	assert.Equal(t, []int{4, 5, 24}, mqa.Shape())

	// Attention reads the key/value heads off k: a KVHeads that disagrees
	// is refused, one that agrees changes nothing.
	g := lazy.NewGraph()
	q := g.Placeholder([]int{4, 4, 5, 6}, f32, 0)
	k := g.Placeholder([]int{4, 2, 5, 6}, f32, 0)
	assert.ErrorIs(t, q.Attention(k, k, lazy.AttentionOptions{KVHeads: 4}).Err(), graph.ErrAttr)
	require.NoError(t, q.Attention(k, k, lazy.AttentionOptions{KVHeads: 2}).Err())
}

// ParamIDs and Grad name their caller's line in their errors (ParamIDs
// finds it only when it fails: a training step calls it every step).
func TestParamIDsErrorSite(t *testing.T) {
	loss := x().Sum(0, 1)
	other := x().Sum(0, 1)
	_, err := lazy.ParamIDs(loss, other)
	var oe *graph.OpError
	require.True(t, errors.As(err, &oe), "%v", err)
	assert.ErrorIs(t, err, graph.ErrMixedGraphs)
	assert.True(t, strings.HasPrefix(oe.Site, "lazy/misuse_test.go:"), "OpError.Site = %q", oe.Site)
	gerr := lazy.Grad(loss, other)[0].Err()
	require.True(t, errors.As(gerr, &oe), "%v", gerr)
	assert.True(t, strings.HasPrefix(oe.Site, "lazy/misuse_test.go:"), "OpError.Site = %q", oe.Site)
}
