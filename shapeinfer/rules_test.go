package shapeinfer_test

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/shapeinfer"
)

// N is the full batch size the rule tables use unless a case says otherwise.
const N = 4

// A tiny DSL for types: f/i are unbatched float32/int64 values, fb/ib are
// batched on axis ax with PerSample = dims[ax]/N, fp sets PerSample by hand.

func dims(d []int) []int {
	if d == nil {
		return []int{}
	}
	return d
}

func f(d ...int) graph.Type {
	return graph.Type{Shape: dims(d), DType: graph.Float32, BatchAxis: -1, PerSample: 1}
}

func i(d ...int) graph.Type {
	return graph.Type{Shape: dims(d), DType: graph.Int64, BatchAxis: -1, PerSample: 1}
}

func fb(ax int, d ...int) graph.Type { return batched(f(d...), ax) }
func ib(ax int, d ...int) graph.Type { return batched(i(d...), ax) }

func batched(t graph.Type, ax int) graph.Type {
	t.BatchAxis, t.PerSample = ax, t.Shape[ax]/N
	return t
}

// fp is a float32 value batched on ax with an explicit PerSample (reshape folds).
func fp(ax, per int, d ...int) graph.Type {
	t := f(d...)
	t.BatchAxis, t.PerSample = ax, per
	return t
}

func ts(t ...graph.Type) []graph.Type { return t }

// withDType is t in dtype dt.
func withDType(t graph.Type, dt graph.DType) graph.Type {
	t.DType = dt
	return t
}

type ruleCase struct {
	name  string
	op    graph.Op
	attrs graph.Attrs
	in    []graph.Type
	batch int // 0 means N
	want  graph.Type
	// check inspects the normalised attributes, when the case cares.
	check func(t *testing.T, a graph.Attrs)
}

func scalarIs(want float64) func(*testing.T, graph.Attrs) {
	return func(t *testing.T, a graph.Attrs) {
		t.Helper()
		assert.InDelta(t, want, a.Scalar, 1e-15, "Attrs.Scalar (tolerance 1e-15)")
	}
}

func axesAre(want ...int) func(*testing.T, graph.Attrs) {
	return func(t *testing.T, a graph.Attrs) { t.Helper(); assert.Equal(t, dims(want), dims(a.Axes)) }
}

func shapeAttrIs(want ...int) func(*testing.T, graph.Attrs) {
	return func(t *testing.T, a graph.Attrs) { t.Helper(); assert.Equal(t, dims(want), dims(a.Shape)) }
}

func validCases() []ruleCase {
	var cs []ruleCase
	add := func(c ...ruleCase) { cs = append(cs, c...) }

	// Unary and scalar ops keep the input type exactly.
	for _, op := range []graph.Op{graph.OpNeg, graph.OpExp, graph.OpLog, graph.OpSqrt, graph.OpAbs,
		graph.OpTanh, graph.OpSigmoid, graph.OpRelu, graph.OpGelu, graph.OpSign, graph.OpSilu} {
		add(ruleCase{name: "batched", op: op, in: ts(fb(0, 4, 3)), want: fb(0, 4, 3)},
			ruleCase{name: "scalar", op: op, in: ts(f()), want: f()},
			ruleCase{name: "folded batch", op: op, in: ts(fp(1, 2, 3, 8)), want: fp(1, 2, 3, 8)})
	}
	add(ruleCase{name: "attention scores", op: graph.OpCausalMask, attrs: graph.Attrs{Scalar: math.Inf(-1)}, in: ts(fb(0, 4, 2, 3, 3)), want: fb(0, 4, 2, 3, 3)},
		ruleCase{name: "rectangular", op: graph.OpCausalMask, in: ts(f(3, 5)), want: f(3, 5)})
	add(ruleCase{name: "batched", op: graph.OpDropout, attrs: graph.Attrs{Scalar: 0.1, Seed: 3, Counter: 9}, in: ts(fb(0, 4, 7)), want: fb(0, 4, 7)},
		ruleCase{name: "p = 0", op: graph.OpDropout, in: ts(f(2)), want: f(2)})
	for _, op := range []graph.Op{graph.OpAddScalar, graph.OpSubScalar, graph.OpRSubScalar, graph.OpMulScalar,
		graph.OpDivScalar, graph.OpRDivScalar, graph.OpPowScalar, graph.OpMaximumScalar} {
		add(ruleCase{name: "batched", op: op, attrs: graph.Attrs{Scalar: 2.5}, in: ts(fb(1, 2, 4)), want: fb(1, 2, 4)},
			ruleCase{name: "empty", op: op, attrs: graph.Attrs{Scalar: -1}, in: ts(f(0, 3)), want: f(0, 3)})
	}

	// Binary broadcasting, for every binary op.
	for _, op := range []graph.Op{graph.OpAdd, graph.OpSub, graph.OpMul, graph.OpDiv, graph.OpPow, graph.OpMaximum} {
		add(ruleCase{name: "scalar with [2,3]", op: op, in: ts(f(), f(2, 3)), want: f(2, 3)},
			ruleCase{name: "[2,3] with scalar", op: op, in: ts(f(2, 3), f()), want: f(2, 3)},
			ruleCase{name: "[3,1]+[1,4]", op: op, in: ts(f(3, 1), f(1, 4)), want: f(3, 4)},
			ruleCase{name: "[5]+[2,3,5]", op: op, in: ts(f(5), f(2, 3, 5)), want: f(2, 3, 5)},
			ruleCase{name: "size-0 [0,3]+[1,3]", op: op, in: ts(f(0, 3), f(1, 3)), want: f(0, 3)},
			ruleCase{name: "both batched on axis 0", op: op, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},
			ruleCase{name: "batched with bias", op: op, in: ts(fb(0, 4, 3), f(3)), want: fb(0, 4, 3)})
	}
	// Casts keep shape and batch axis; binary ops of two float dtypes
	// promote as PyTorch's do.
	as := func(t graph.Type, dt graph.DType) graph.Type { t.DType = dt; return t }
	to := func(dt graph.DType) graph.Attrs { return graph.Attrs{Target: graph.Type{DType: dt}} }
	add(ruleCase{name: "float32 to bfloat16", op: graph.OpCast, attrs: to(graph.BFloat16), in: ts(fb(0, 4, 3)), want: as(fb(0, 4, 3), graph.BFloat16)},
		ruleCase{name: "float16 to float32", op: graph.OpCast, attrs: to(graph.Float32), in: ts(as(f(3), graph.Float16)), want: f(3)},
		ruleCase{name: "bfloat16 + float32 promotes", op: graph.OpAdd, in: ts(as(fb(0, 4, 3), graph.BFloat16), f(3)), want: fb(0, 4, 3)},
		ruleCase{name: "bfloat16 · float16 promotes", op: graph.OpMul, in: ts(withDType(f(3), graph.BFloat16), as(f(3), graph.Float16)), want: f(3)},
		ruleCase{name: "bfloat16 stays", op: graph.OpSub, in: ts(withDType(f(3), graph.BFloat16), withDType(f(3), graph.BFloat16)), want: withDType(f(3), graph.BFloat16)})
	add(
		// The lower-rank operand's batch axis moves right by the rank difference.
		ruleCase{name: "batch axis shifts under broadcasting", op: graph.OpAdd, in: ts(f(2, 1, 1), fb(0, 4, 3)), want: fb(1, 2, 4, 3)},
		ruleCase{name: "both batched, axes line up after broadcasting", op: graph.OpMul, in: ts(fb(0, 4, 3), fb(1, 2, 4, 3)), want: fb(1, 2, 4, 3)},
		ruleCase{name: "batched folded PerSample kept", op: graph.OpAdd, in: ts(fp(0, 2, 8, 3), f(8, 1)), want: fp(0, 2, 8, 3)},
		// With N = 1 a batch axis of size 1 may broadcast against a larger
		// unbatched axis; the result then has no batch axis (its size is not N).
		ruleCase{name: "N=1 batch axis broadcast away", op: graph.OpAdd, batch: 1, in: ts(fp(0, 1, 1, 3), f(5, 3)), want: f(5, 3)},
	)

	// Contraction.
	add(
		ruleCase{name: "2-D", op: graph.OpMatMul, in: ts(f(2, 3), f(3, 5)), want: f(2, 5)},
		ruleCase{name: "batched rows", op: graph.OpMatMul, in: ts(fb(0, 4, 3), f(3, 5)), want: fb(0, 4, 5)},
		ruleCase{name: "batched leading axis", op: graph.OpMatMul, in: ts(fb(0, 4, 2, 3), f(3, 5)), want: fb(0, 4, 2, 5)},
		ruleCase{name: "both batched leading axis", op: graph.OpMatMul, in: ts(fb(0, 4, 2, 3), fb(0, 4, 3, 5)), want: fb(0, 4, 2, 5)},
		ruleCase{name: "batched columns of the right operand", op: graph.OpMatMul, in: ts(f(2, 3), fb(1, 3, 4)), want: fb(1, 2, 4)},
		ruleCase{name: "broadcast leading axes", op: graph.OpMatMul, in: ts(f(2, 1, 2, 3), f(5, 3, 4)), want: f(2, 5, 2, 4)},
		ruleCase{name: "contracts the batch of both (xᵀ·y)", op: graph.OpMatMul, in: ts(fb(1, 3, 4), fb(0, 4, 5)), want: f(3, 5)},
		ruleCase{name: "TransA", op: graph.OpMatMul, attrs: graph.Attrs{TransA: true}, in: ts(f(3, 2), f(3, 5)), want: f(2, 5)},
		ruleCase{name: "TransB (q·kᵀ)", op: graph.OpMatMul, attrs: graph.Attrs{TransB: true}, in: ts(fb(0, 4, 2, 3), fb(0, 4, 5, 3)), want: fb(0, 4, 2, 5)},
		ruleCase{name: "TransA contracts the batch of both", op: graph.OpMatMul, attrs: graph.Attrs{TransA: true}, in: ts(fb(0, 4, 3), fb(0, 4, 5)), want: f(3, 5)},
		ruleCase{name: "TransA moves the batch to the columns", op: graph.OpMatMul, attrs: graph.Attrs{TransA: true, TransB: true}, in: ts(f(3, 2), fb(0, 4, 3)), want: fb(1, 2, 4)},
		ruleCase{name: "N=1 batched leading axis broadcast away", op: graph.OpMatMul, batch: 1, in: ts(fp(0, 1, 1, 2, 3), f(5, 3, 4)), want: f(5, 2, 4)},

		ruleCase{name: "no bias", op: graph.OpLinear, in: ts(fb(0, 4, 3), f(5, 3)), want: fb(0, 4, 5)},
		ruleCase{name: "bias", op: graph.OpLinear, in: ts(fb(0, 4, 3), f(5, 3), f(5)), want: fb(0, 4, 5)},
		ruleCase{name: "rank 3, batch on axis 1", op: graph.OpLinear, in: ts(fb(1, 2, 4, 3), f(5, 3)), want: fb(1, 2, 4, 5)},
		ruleCase{name: "rank 1", op: graph.OpLinear, in: ts(f(3), f(5, 3)), want: f(5)},
		ruleCase{name: "batch on the feature axis is contracted", op: graph.OpLinear, in: ts(fb(1, 3, 4), f(5, 4)), want: f(3, 5)},
	)

	// Reductions. Mean's Scalar is 1/count with the full batch N.
	add(
		ruleCase{name: "sum last axis", op: graph.OpSum, attrs: graph.Attrs{Axes: []int{1}}, in: ts(fb(0, 4, 3)), want: fb(0, 4), check: axesAre(1)},
		ruleCase{name: "sum -1 keepdim", op: graph.OpSum, attrs: graph.Attrs{Axes: []int{-1}, KeepDim: true}, in: ts(fb(0, 4, 3)), want: fb(0, 4, 1), check: axesAre(1)},
		ruleCase{name: "sum over the batch", op: graph.OpSum, attrs: graph.Attrs{Axes: []int{0}}, in: ts(fb(0, 4, 3)), want: f(3)},
		ruleCase{name: "sum of an empty axis is fine", op: graph.OpSum, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f(0, 3)), want: f(3)},
		ruleCase{name: "sum of a scalar", op: graph.OpSum, in: ts(f()), want: f(), check: axesAre()},
		ruleCase{name: "sum axes sorted", op: graph.OpSum, attrs: graph.Attrs{Axes: []int{2, -3}}, in: ts(fb(1, 2, 4, 3)), want: fb(0, 4), check: axesAre(0, 2)},
		ruleCase{name: "mean of everything", op: graph.OpMean, in: ts(fb(0, 4, 3)), want: f(), check: func(t *testing.T, a graph.Attrs) {
			scalarIs(1.0/12)(t, a) // 4·3 elements
			assert.Equal(t, []int{0, 1}, a.Axes)
		}},
		ruleCase{name: "mean over the batch: 1/N", op: graph.OpMean, attrs: graph.Attrs{Axes: []int{0}}, in: ts(fb(0, 4, 3)), want: f(3), check: scalarIs(1.0 / 4)},
		ruleCase{name: "mean over batch and axis 2", op: graph.OpMean, attrs: graph.Attrs{Axes: []int{0, 2}}, in: ts(fb(0, 4, 2, 3)), want: f(2), check: scalarIs(1.0 / 12)},
		ruleCase{name: "mean over a folded batch: 1/(N·T)", op: graph.OpMean, attrs: graph.Attrs{Axes: []int{0}}, in: ts(fp(0, 2, 8, 3)), want: f(3), check: scalarIs(1.0 / 8)},
		ruleCase{name: "mean per sample keeps the batch", op: graph.OpMean, attrs: graph.Attrs{Axes: []int{1}, KeepDim: true}, in: ts(fb(0, 4, 5)), want: fb(0, 4, 1), check: scalarIs(1.0 / 5)},
		ruleCase{name: "max keepdim", op: graph.OpMax, attrs: graph.Attrs{Axes: []int{1}, KeepDim: true}, in: ts(fb(0, 4, 3)), want: fb(0, 4, 1)},
		ruleCase{name: "max over the batch", op: graph.OpMax, attrs: graph.Attrs{Axes: []int{0}}, in: ts(fb(0, 4, 3)), want: f(3)},
		ruleCase{name: "max keeps folded PerSample", op: graph.OpMax, attrs: graph.Attrs{Axes: []int{0}}, in: ts(fp(1, 2, 3, 8)), want: fp(0, 2, 8)},
	)

	// Normalisation.
	for _, op := range []graph.Op{graph.OpSoftmax, graph.OpLogSoftmax} {
		add(ruleCase{name: "axis -1", op: op, attrs: graph.Attrs{Axis: -1}, in: ts(fb(0, 4, 3)), want: fb(0, 4, 3),
			check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, 1, a.Axis) }},
			ruleCase{name: "axis 0 of a vector", op: op, in: ts(f(7)), want: f(7)})
	}
	add(
		ruleCase{name: "no affine", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 1, Eps: 1e-5}, in: ts(fb(0, 4, 5)), want: fb(0, 4, 5)},
		ruleCase{name: "weight and bias", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 1, Eps: 1e-5}, in: ts(fb(0, 4, 5), f(5), f(5)), want: fb(0, 4, 5)},
		ruleCase{name: "two trailing dims", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 2, Eps: 1e-5}, in: ts(fb(0, 4, 2, 5), f(2, 5)), want: fb(0, 4, 2, 5)},
	)
	bnTrain, bnEval := graph.Attrs{Training: true, Eps: 1e-5}, graph.Attrs{Eps: 1e-5}
	add(
		ruleCase{name: "training, no affine", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(fb(0, 4, 3, 5, 5)), want: fb(0, 4, 3, 5, 5)},
		ruleCase{name: "training, weight", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(fb(0, 4, 3, 5, 5), f(3)), want: fb(0, 4, 3, 5, 5)},
		ruleCase{name: "training, weight and bias", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(fb(0, 4, 3, 5, 5), f(3), f(3)), want: fb(0, 4, 3, 5, 5)},
		ruleCase{name: "training, [N, C]", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(fb(0, 4, 3)), want: fb(0, 4, 3)},
		ruleCase{name: "training, one sample, two values per channel", op: graph.OpBatchNorm, attrs: bnTrain, batch: 1, in: ts(fp(0, 1, 1, 3, 2)), want: fp(0, 1, 1, 3, 2)},
		ruleCase{name: "eval, running statistics only", op: graph.OpBatchNorm, attrs: bnEval, in: ts(fb(0, 4, 3, 5, 5), f(3), f(3)), want: fb(0, 4, 3, 5, 5)},
		ruleCase{name: "eval, weight and bias", op: graph.OpBatchNorm, attrs: bnEval, in: ts(fb(0, 4, 3, 5, 5), f(3), f(3), f(3), f(3)), want: fb(0, 4, 3, 5, 5)},
		ruleCase{name: "eval, one value per channel", op: graph.OpBatchNorm, attrs: bnEval, batch: 1, in: ts(fp(0, 1, 1, 3), f(3), f(3)), want: fp(0, 1, 1, 3)},
		ruleCase{name: "training, per-chunk statistics", op: graph.OpBatchNorm, attrs: graph.Attrs{Training: true, PerChunk: true, Eps: 1e-5},
			in: ts(fb(0, 4, 3, 5, 5), f(3), f(3)), want: fb(0, 4, 3, 5, 5)},
		// Mixed precision: 16-bit x, float32 weight, bias and running
		// statistics, x's dtype out.
		ruleCase{name: "bfloat16 x, float32 weight and bias", op: graph.OpBatchNorm, attrs: bnTrain,
			in: ts(as(fb(0, 4, 3, 5, 5), graph.BFloat16), f(3), f(3)), want: as(fb(0, 4, 3, 5, 5), graph.BFloat16)},
		ruleCase{name: "float16 x, float32 running statistics", op: graph.OpBatchNorm, attrs: bnEval,
			in: ts(as(fb(0, 4, 3, 5, 5), graph.Float16), f(3), f(3)), want: as(fb(0, 4, 3, 5, 5), graph.Float16)},
		ruleCase{name: "NCHW", op: graph.OpBatchNormStats, in: ts(fb(0, 4, 3, 5, 5)), want: f(2, 3)},
		ruleCase{name: "[N, C]", op: graph.OpBatchNormStats, in: ts(fb(0, 4, 3)), want: f(2, 3)},
		ruleCase{name: "batch on the channels stays", op: graph.OpBatchNormStats, in: ts(fp(1, 2, 3, 8, 5)), want: fp(1, 2, 2, 8)},
		ruleCase{name: "bfloat16", op: graph.OpBatchNormStats, in: ts(graph.Type{Shape: []int{4, 3}, DType: graph.BFloat16, BatchAxis: -1, PerSample: 1}),
			want: graph.Type{Shape: []int{2, 3}, DType: graph.BFloat16, BatchAxis: -1, PerSample: 1}},
	)

	// Reshape with N = 4, T = 2, C = 3.
	add(
		ruleCase{name: "[B,T,C]→[B*T,C] keeps axis 0, PerSample T", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{8, 3}}, in: ts(fb(0, 4, 2, 3)), want: fp(0, 2, 8, 3)},
		ruleCase{name: "[B,T,C]→[B,T*C]", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{4, 6}}, in: ts(fb(0, 4, 2, 3)), want: fb(0, 4, 6)},
		ruleCase{name: "[T,B,C]→[T*B,C] loses the batch axis", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{8, 3}}, in: ts(fb(1, 2, 4, 3)), want: f(8, 3)},
		ruleCase{name: "[T,B,C]→[T,B*C]", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{2, 12}}, in: ts(fb(1, 2, 4, 3)), want: fp(1, 3, 2, 12)},
		ruleCase{name: "-1 resolved: [B,T,C]→[-1,C]", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{-1, 3}}, in: ts(fb(0, 4, 2, 3)), want: fp(0, 2, 8, 3), check: shapeAttrIs(8, 3)},
		ruleCase{name: "-1 in the middle", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{4, -1, 1}}, in: ts(fb(0, 4, 2, 3)), want: fb(0, 4, 6, 1), check: shapeAttrIs(4, 6, 1)},
		ruleCase{name: "unfold [B*T,C]→[B,T*C]", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{4, 6}}, in: ts(fp(0, 2, 8, 3)), want: fb(0, 4, 6)},
		ruleCase{name: "scalar to [1,1]", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{1, 1}}, in: ts(f()), want: f(1, 1)},
		ruleCase{name: "[1] to scalar", op: graph.OpReshape, in: ts(f(1)), want: f(), check: shapeAttrIs()},
		ruleCase{name: "empty", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{3, 0}}, in: ts(f(0, 3)), want: f(3, 0)},
	)

	add(
		ruleCase{name: "rotate", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{2, 0, 1}}, in: ts(fb(0, 4, 2, 3)), want: fb(1, 3, 4, 2)},
		ruleCase{name: "negative axes normalised", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{-1, 0, 1}}, in: ts(fb(0, 4, 2, 3)), want: fb(1, 3, 4, 2),
			check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, []int{2, 0, 1}, a.Perm) }},
		ruleCase{name: "keeps folded PerSample", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{1, 0}}, in: ts(fp(0, 2, 8, 3)), want: fp(1, 2, 3, 8)},
		ruleCase{name: "scalar", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{}}, in: ts(f()), want: f()},
	)

	add(
		ruleCase{name: "step 2", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, Start: 1, End: 5, Step: 2}, in: ts(fb(0, 4, 6)), want: fb(0, 4, 2)},
		ruleCase{name: "uneven step rounds up", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, Start: 0, End: 6, Step: 4}, in: ts(fb(0, 4, 6)), want: fb(0, 4, 2)},
		ruleCase{name: "axis -1, step 0 means 1", op: graph.OpSlice, attrs: graph.Attrs{Axis: -1, Start: 2, End: 6}, in: ts(fb(0, 4, 6)), want: fb(0, 4, 4),
			check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, 1, a.Axis); assert.Equal(t, 1, a.Step) }},
		ruleCase{name: "empty slice", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, Start: 3, End: 3, Step: 1}, in: ts(fb(0, 4, 6)), want: fb(0, 4, 0)},
		ruleCase{name: "along the batch loses it", op: graph.OpSlice, attrs: graph.Attrs{Axis: 0, Start: 0, End: 2, Step: 1}, in: ts(fb(0, 4, 6)), want: f(2, 6)},
	)

	add(
		ruleCase{name: "batched along axis 1", op: graph.OpConcat, attrs: graph.Attrs{Axis: 1}, in: ts(fb(0, 4, 2), fb(0, 4, 3)), want: fb(0, 4, 5)},
		ruleCase{name: "axis -1 with three inputs", op: graph.OpConcat, attrs: graph.Attrs{Axis: -1}, in: ts(f(2, 1), f(2, 0), f(2, 3)), want: f(2, 4),
			check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, 1, a.Axis) }},
		ruleCase{name: "one input", op: graph.OpConcat, attrs: graph.Attrs{Axis: 1}, in: ts(fb(0, 4, 2)), want: fb(0, 4, 2)},
		ruleCase{name: "int64", op: graph.OpConcat, in: ts(i(2), i(3)), want: i(5)},
		ruleCase{name: "along the batch loses it", op: graph.OpConcat, in: ts(fb(0, 4, 2), fb(0, 4, 2)), want: f(8, 2)},
	)

	add(
		ruleCase{name: "batched indices", op: graph.OpEmbedding, in: ts(ib(0, 4, 7), f(10, 16)), want: fb(0, 4, 7, 16)},
		ruleCase{name: "scalar index", op: graph.OpEmbedding, in: ts(i(), f(10, 16)), want: f(16)},
		ruleCase{name: "batch on axis 1", op: graph.OpEmbedding, in: ts(ib(1, 7, 4), f(10, 16)), want: fb(1, 7, 4, 16)},
	)

	// Conv output: (in + 2·pad − dil·(k−1) − 1)/stride + 1.
	conv := func(name string, o graph.Attrs, in []graph.Type, want graph.Type) ruleCase {
		return ruleCase{name: name, op: graph.OpConv2d, attrs: o, in: in, want: want}
	}
	add(
		ruleCase{name: "defaults normalised", op: graph.OpConv2d, in: ts(fb(0, 4, 3, 8, 8), f(6, 3, 3, 3)), want: fb(0, 4, 6, 6, 6), // (8−2−1)/1+1 = 6
			check: func(t *testing.T, a graph.Attrs) {
				assert.Equal(t, [2]int{1, 1}, a.Stride)
				assert.Equal(t, [2]int{1, 1}, a.Dilation)
				assert.Equal(t, 1, a.Groups)
			}},
		conv("stride 2 pad 1", graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, ts(fb(0, 4, 3, 8, 8), f(6, 3, 3, 3)), fb(0, 4, 6, 4, 4)), // (8+2−2−1)/2+1 = 4
		conv("dilation 2", graph.Attrs{Dilation: [2]int{2, 2}}, ts(fb(0, 4, 3, 8, 8), f(6, 3, 3, 3)), fb(0, 4, 6, 4, 4)),                          // (8−4−1)/1+1 = 4
		conv("stride 3 floors", graph.Attrs{Stride: [2]int{3, 3}}, ts(fb(0, 4, 3, 8, 8), f(6, 3, 3, 3)), fb(0, 4, 6, 2, 2)),                       // (8−2−1)/3+1 = 2
		conv("per-axis options", graph.Attrs{Stride: [2]int{1, 2}, Padding: [2]int{0, 1}, Dilation: [2]int{2, 1}}, ts(fb(0, 4, 3, 8, 9), f(6, 3, 3, 3)), // H: (8−4−1)/1+1 = 4; W: (9+2−2−1)/2+1 = 5
			fb(0, 4, 6, 4, 5)),
		conv("groups 3", graph.Attrs{Groups: 3}, ts(fb(0, 4, 6, 5, 5), f(9, 2, 3, 3)), fb(0, 4, 9, 3, 3)),
		conv("depthwise", graph.Attrs{Groups: 4}, ts(fb(0, 4, 4, 5, 5), f(8, 1, 1, 1)), fb(0, 4, 8, 5, 5)),
		conv("bias", graph.Attrs{}, ts(fb(0, 4, 3, 5, 5), f(2, 3, 5, 5), f(2)), fb(0, 4, 2, 1, 1)),
		conv("kernel equal to the padded input", graph.Attrs{Padding: [2]int{1, 1}}, ts(f(1, 3, 3, 3), f(2, 3, 5, 5)), f(1, 2, 1, 1)),
		conv("batch on channels is consumed", graph.Attrs{}, ts(fb(1, 2, 4, 5, 5), f(3, 4, 1, 1)), f(2, 3, 5, 5)),
	)
	pool := func(op graph.Op, name string, o graph.Attrs, in, want graph.Type) ruleCase {
		return ruleCase{name: name, op: op, attrs: o, in: ts(in), want: want}
	}
	for _, op := range []graph.Op{graph.OpMaxPool2d, graph.OpAvgPool2d} {
		add(
			ruleCase{name: "stride defaults to kernel", op: op, attrs: graph.Attrs{Kernel: [2]int{2, 2}}, in: ts(fb(0, 4, 3, 8, 8)), want: fb(0, 4, 3, 4, 4),
				check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, [2]int{2, 2}, a.Stride) }},
			pool(op, "kernel 3 stride 2 pad 1", graph.Attrs{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, fb(0, 4, 3, 8, 8), fb(0, 4, 3, 4, 4)), // (8+2−2−1)/2+1 = 4
			pool(op, "rectangular", graph.Attrs{Kernel: [2]int{2, 3}}, fb(0, 4, 3, 8, 9), fb(0, 4, 3, 4, 3)),                                                          // 8/2, 9/3
			pool(op, "batch on channels kept", graph.Attrs{Kernel: [2]int{2, 2}}, fb(1, 2, 4, 4, 4), fb(1, 2, 4, 2, 2)),
			pool(op, "batch on H consumed", graph.Attrs{Kernel: [2]int{2, 2}}, fb(2, 2, 3, 4, 4), f(2, 3, 2, 2)),
		)
	}
	add(pool(graph.OpMaxPool2d, "dilation 2", graph.Attrs{Kernel: [2]int{3, 3}, Stride: [2]int{1, 1}, Dilation: [2]int{2, 2}}, fb(0, 4, 3, 8, 8), fb(0, 4, 3, 4, 4))) // (8−4−1)/1+1 = 4

	// Losses are scalars; a mean reduction carries 1/count at the full batch.
	add(
		ruleCase{name: "mean", op: graph.OpCrossEntropy, in: ts(fb(0, 4, 10), ib(0, 4)), want: f(), check: scalarIs(1.0 / 4)},
		ruleCase{name: "sum", op: graph.OpCrossEntropy, attrs: graph.Attrs{Reduction: graph.ReduceSum}, in: ts(fb(0, 4, 10), ib(0, 4)), want: f(), check: scalarIs(1)},
		ruleCase{name: "folded batch: 1/(N·T)", op: graph.OpCrossEntropy, in: ts(fp(0, 2, 8, 10), ib(0, 8)), want: f(), check: scalarIs(1.0 / 8)},
		ruleCase{name: "7 of 10 columns are classes", op: graph.OpCrossEntropy, attrs: graph.Attrs{End: 7}, in: ts(fb(0, 4, 10), ib(0, 4)), want: f(), check: scalarIs(1.0 / 4)},
		ruleCase{name: "end = every column", op: graph.OpCrossEntropy, attrs: graph.Attrs{End: 10}, in: ts(fb(0, 4, 10), ib(0, 4)), want: f(), check: scalarIs(1.0 / 4)},
		ruleCase{name: "mean", op: graph.OpMSE, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: f(), check: scalarIs(1.0 / 12)},
		ruleCase{name: "sum", op: graph.OpMSE, attrs: graph.Attrs{Reduction: graph.ReduceSum}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: f(), check: scalarIs(1)},
		ruleCase{name: "scalars", op: graph.OpMSE, in: ts(f(), f()), want: f(), check: scalarIs(1)},
	)
	return append(append(append(append(cs, gradValidCases()...), attentionValidCases()...), append(llamaValidCases(), pointwiseValidCases()...)...), lceValidCases()...)
}

func runRule(c ruleCase) (graph.Type, graph.Attrs, error) {
	n := c.batch
	if n == 0 {
		n = N
	}
	a := c.attrs
	got, err := shapeinfer.Rule(c.op, &a, c.in, n)
	return got, a, err
}

func TestRuleValid(t *testing.T) {
	for _, c := range validCases() {
		t.Run(c.op.String()+"/"+c.name, func(t *testing.T) {
			got, a, err := runRule(c)
			require.NoError(t, err)
			assert.Equal(t, c.want.Shape, got.Shape, "shape")
			assert.Equal(t, c.want.DType, got.DType, "dtype")
			assert.Equal(t, c.want.BatchAxis, got.BatchAxis, "batch axis")
			if got.BatchAxis >= 0 {
				assert.Equal(t, c.want.PerSample, got.PerSample, "PerSample")
			}
			if c.check != nil {
				c.check(t, a)
			}
		})
	}
}

// TestEveryOpHasRule walks the op table, so an op added without a shape rule
// or without a case in validCases (and rejectCases) fails here.
func TestEveryOpHasRule(t *testing.T) {
	valid := map[graph.Op]int{}
	for _, c := range validCases() {
		if _, _, err := runRule(c); err == nil {
			valid[c.op]++
		}
	}
	rejected := map[graph.Op]int{}
	for _, c := range rejectCases() {
		rejected[c.op]++
	}
	for op := graph.Op(0); int(op) < graph.NumOps; op++ {
		if op.Category() == graph.CatSource {
			continue
		}
		assert.Positive(t, valid[op], "op %s has no accepted case in validCases", op)
		assert.Positive(t, rejected[op], "op %s has no rejected case in rejectCases", op)
	}
}

type rejectCase struct {
	name  string
	op    graph.Op
	attrs graph.Attrs
	in    []graph.Type
	batch int
	want  error // sentinel
}

func rejectCases() []rejectCase {
	var cs []rejectCase
	add := func(c ...rejectCase) { cs = append(cs, c...) }

	for _, op := range []graph.Op{graph.OpNeg, graph.OpExp, graph.OpLog, graph.OpSqrt, graph.OpAbs, graph.OpTanh,
		graph.OpSigmoid, graph.OpRelu, graph.OpGelu, graph.OpSign, graph.OpSilu, graph.OpAddScalar, graph.OpSubScalar, graph.OpRSubScalar,
		graph.OpMulScalar, graph.OpDivScalar, graph.OpRDivScalar, graph.OpPowScalar, graph.OpMaximumScalar} {
		add(rejectCase{name: "int64", op: op, in: ts(ib(0, 4, 3)), want: graph.ErrDType},
			rejectCase{name: "two inputs", op: op, in: ts(f(3), f(3)), want: graph.ErrArity})
	}
	add(rejectCase{name: "int64 input", op: graph.OpCast, attrs: graph.Attrs{Target: graph.Type{DType: graph.Float32}}, in: ts(i(3)), want: graph.ErrDType},
		rejectCase{name: "int64 target", op: graph.OpCast, attrs: graph.Attrs{Target: graph.Type{DType: graph.Int64}}, in: ts(f(3)), want: graph.ErrDType},
		rejectCase{name: "no target", op: graph.OpCast, in: ts(f(3)), want: graph.ErrDType},
		rejectCase{name: "matmul of bfloat16 and float32", op: graph.OpMatMul, in: ts(graph.Type{Shape: []int{2, 3}, DType: graph.BFloat16, BatchAxis: -1}, f(3, 2)), want: graph.ErrDType})
	for _, op := range []graph.Op{graph.OpAdd, graph.OpSub, graph.OpMul, graph.OpDiv, graph.OpPow, graph.OpMaximum} {
		add(rejectCase{name: "[2,3] with [3,2]", op: op, in: ts(f(2, 3), f(3, 2)), want: graph.ErrShape},
			rejectCase{name: "[4] with [2,3]", op: op, in: ts(f(4), f(2, 3)), want: graph.ErrShape},
			rejectCase{name: "size 0 with size 2", op: op, in: ts(f(0, 3), f(2, 3)), want: graph.ErrShape},
			rejectCase{name: "batch axes do not line up", op: op, in: ts(fb(0, 4, 4), fb(1, 4, 4)), want: graph.ErrShape},
			rejectCase{name: "batch axes do not line up after broadcasting", op: op, in: ts(fb(0, 4, 3), fb(0, 4, 4, 3)), want: graph.ErrShape},
			rejectCase{name: "int64 operands", op: op, in: ts(i(3), i(3)), want: graph.ErrDType},
			rejectCase{name: "float32 with int64", op: op, in: ts(f(3), i(3)), want: graph.ErrDType},
			rejectCase{name: "one input", op: op, in: ts(f(3)), want: graph.ErrArity})
	}
	add(
		rejectCase{name: "inner dims", op: graph.OpMatMul, in: ts(f(2, 3), f(4, 5)), want: graph.ErrShape},
		rejectCase{name: "rank 1", op: graph.OpMatMul, in: ts(f(3), f(3, 5)), want: graph.ErrShape},
		rejectCase{name: "leading dims", op: graph.OpMatMul, in: ts(f(2, 2, 3), f(3, 3, 5)), want: graph.ErrShape},
		rejectCase{name: "batch axes land apart", op: graph.OpMatMul, in: ts(fb(0, 4, 3), fb(1, 3, 4)), want: graph.ErrShape},
		rejectCase{name: "int64", op: graph.OpMatMul, in: ts(i(2, 3), i(3, 5)), want: graph.ErrDType},
		rejectCase{name: "inner dims with TransA", op: graph.OpMatMul, attrs: graph.Attrs{TransA: true}, in: ts(f(2, 3), f(3, 5)), want: graph.ErrShape},
		rejectCase{name: "batch axes land apart with TransB", op: graph.OpMatMul, attrs: graph.Attrs{TransB: true}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: graph.ErrShape},
		rejectCase{name: "rank 1", op: graph.OpCausalMask, in: ts(f(3)), want: graph.ErrShape},
		rejectCase{name: "int64", op: graph.OpCausalMask, in: ts(i(3, 3)), want: graph.ErrDType},
		rejectCase{name: "p = 1", op: graph.OpDropout, attrs: graph.Attrs{Scalar: 1}, in: ts(f(3)), want: graph.ErrAttr},
		rejectCase{name: "negative p", op: graph.OpDropout, attrs: graph.Attrs{Scalar: -0.1}, in: ts(f(3)), want: graph.ErrAttr},
		rejectCase{name: "NaN p", op: graph.OpDropout, attrs: graph.Attrs{Scalar: math.NaN()}, in: ts(f(3)), want: graph.ErrAttr},
		rejectCase{name: "int64", op: graph.OpDropout, in: ts(i(3)), want: graph.ErrDType},
		rejectCase{name: "three inputs", op: graph.OpMatMul, in: ts(f(2, 3), f(3, 5), f(5)), want: graph.ErrArity},

		rejectCase{name: "weight rank 1", op: graph.OpLinear, in: ts(fb(0, 4, 3), f(3)), want: graph.ErrShape},
		rejectCase{name: "scalar input", op: graph.OpLinear, in: ts(f(), f(5, 3)), want: graph.ErrShape},
		rejectCase{name: "features", op: graph.OpLinear, in: ts(fb(0, 4, 3), f(5, 4)), want: graph.ErrShape},
		rejectCase{name: "bias shape", op: graph.OpLinear, in: ts(fb(0, 4, 3), f(5, 3), f(3)), want: graph.ErrShape},
		rejectCase{name: "int64 weight", op: graph.OpLinear, in: ts(fb(0, 4, 3), i(5, 3)), want: graph.ErrDType},
		rejectCase{name: "four inputs", op: graph.OpLinear, in: ts(f(3), f(5, 3), f(5), f(5)), want: graph.ErrArity},
	)
	for _, op := range []graph.Op{graph.OpSum, graph.OpMean, graph.OpMax} {
		add(rejectCase{name: "repeated axis", op: op, attrs: graph.Attrs{Axes: []int{1, 1}}, in: ts(fb(0, 4, 3)), want: graph.ErrAttr},
			rejectCase{name: "repeated after normalising", op: op, attrs: graph.Attrs{Axes: []int{1, -1}}, in: ts(fb(0, 4, 3)), want: graph.ErrAttr},
			rejectCase{name: "axis out of range", op: op, attrs: graph.Attrs{Axes: []int{2}}, in: ts(fb(0, 4, 3)), want: graph.ErrAttr},
			rejectCase{name: "negative axis out of range", op: op, attrs: graph.Attrs{Axes: []int{-3}}, in: ts(fb(0, 4, 3)), want: graph.ErrAttr},
			rejectCase{name: "axis of a scalar", op: op, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f()), want: graph.ErrAttr},
			rejectCase{name: "int64", op: op, in: ts(i(3)), want: graph.ErrDType})
	}
	add(
		rejectCase{name: "over an empty axis", op: graph.OpMean, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f(0, 3)), want: graph.ErrShape},
		rejectCase{name: "over an empty axis", op: graph.OpMax, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f(0, 3)), want: graph.ErrShape},
	)
	for _, op := range []graph.Op{graph.OpSoftmax, graph.OpLogSoftmax} {
		add(rejectCase{name: "axis 2 of rank 2", op: op, attrs: graph.Attrs{Axis: 2}, in: ts(f(2, 3)), want: graph.ErrAttr},
			rejectCase{name: "axis -3 of rank 2", op: op, attrs: graph.Attrs{Axis: -3}, in: ts(f(2, 3)), want: graph.ErrAttr},
			rejectCase{name: "scalar", op: op, in: ts(f()), want: graph.ErrAttr},
			rejectCase{name: "int64", op: op, attrs: graph.Attrs{Axis: 1}, in: ts(i(2, 3)), want: graph.ErrDType})
	}
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	add(
		rejectCase{name: "eps 0", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 1}, in: ts(fb(0, 4, 5)), want: graph.ErrAttr},
		rejectCase{name: "eps negative", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 1, Eps: -1e-5}, in: ts(fb(0, 4, 5)), want: graph.ErrAttr},
		rejectCase{name: "eps NaN", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 1, Eps: math.NaN()}, in: ts(fb(0, 4, 5)), want: graph.ErrAttr},
		rejectCase{name: "no norm dims", op: graph.OpLayerNorm, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(0, 4, 5)), want: graph.ErrAttr},
		rejectCase{name: "more norm dims than rank", op: graph.OpLayerNorm, attrs: graph.Attrs{NormDims: 3, Eps: 1e-5}, in: ts(fb(0, 4, 5)), want: graph.ErrAttr},
		rejectCase{name: "weight shape", op: graph.OpLayerNorm, attrs: ln, in: ts(fb(0, 4, 5), f(4)), want: graph.ErrShape},
		rejectCase{name: "bias shape", op: graph.OpLayerNorm, attrs: ln, in: ts(fb(0, 4, 5), f(5), f(1, 5)), want: graph.ErrShape},
		rejectCase{name: "int64 weight", op: graph.OpLayerNorm, attrs: ln, in: ts(fb(0, 4, 5), i(5)), want: graph.ErrDType},
		rejectCase{name: "int64 input", op: graph.OpLayerNorm, attrs: ln, in: ts(i(4, 5)), want: graph.ErrDType},
	)
	bnTrain, bnEval := graph.Attrs{Training: true, Eps: 1e-5}, graph.Attrs{Eps: 1e-5}
	x4 := fb(0, 4, 3, 5, 5)
	add(
		rejectCase{name: "eval without running statistics", op: graph.OpBatchNorm, attrs: bnEval, in: ts(x4), want: graph.ErrArity},
		rejectCase{name: "eval with running mean only", op: graph.OpBatchNorm, attrs: bnEval, in: ts(x4, f(3)), want: graph.ErrArity},
		rejectCase{name: "training with running statistics and affine", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(x4, f(3), f(3), f(3)), want: graph.ErrArity},
		rejectCase{name: "eps 0", op: graph.OpBatchNorm, attrs: graph.Attrs{Training: true}, in: ts(x4), want: graph.ErrAttr},
		rejectCase{name: "eps NaN", op: graph.OpBatchNorm, attrs: graph.Attrs{Eps: math.NaN()}, in: ts(x4, f(3), f(3)), want: graph.ErrAttr},
		rejectCase{name: "rank 1", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(fb(0, 4)), want: graph.ErrShape},
		rejectCase{name: "weight shape", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(x4, f(5)), want: graph.ErrShape},
		rejectCase{name: "float32 x, bfloat16 weight", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(x4, withDType(f(3), graph.BFloat16)), want: graph.ErrDType},
		rejectCase{name: "bfloat16 x, float16 weight", op: graph.OpBatchNorm, attrs: bnTrain,
			in: ts(withDType(x4, graph.BFloat16), withDType(f(3), graph.Float16)), want: graph.ErrDType},
		rejectCase{name: "bias shape", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(x4, f(3), f(1, 3)), want: graph.ErrShape},
		rejectCase{name: "running_var shape", op: graph.OpBatchNorm, attrs: bnEval, in: ts(x4, f(3), f(4)), want: graph.ErrShape},
		rejectCase{name: "int64 running_mean", op: graph.OpBatchNorm, attrs: bnEval, in: ts(x4, i(3), f(3)), want: graph.ErrDType},
		rejectCase{name: "int64 input", op: graph.OpBatchNorm, attrs: bnTrain, in: ts(i(4, 3, 5, 5)), want: graph.ErrDType},
		rejectCase{name: "training with one value per channel", op: graph.OpBatchNorm, attrs: bnTrain, batch: 1, in: ts(fp(0, 1, 1, 3, 1, 1)), want: graph.ErrShape},
		rejectCase{name: "per-chunk statistics in evaluation mode", op: graph.OpBatchNorm, attrs: graph.Attrs{PerChunk: true, Eps: 1e-5}, in: ts(x4, f(3), f(3)), want: graph.ErrAttr},
		rejectCase{name: "rank 1", op: graph.OpBatchNormStats, in: ts(fb(0, 4)), want: graph.ErrShape},
		rejectCase{name: "one value per channel", op: graph.OpBatchNormStats, batch: 1, in: ts(fp(0, 1, 1, 3, 1, 1)), want: graph.ErrShape},
		rejectCase{name: "int64 input", op: graph.OpBatchNormStats, in: ts(i(4, 3)), want: graph.ErrDType},
		rejectCase{name: "two inputs", op: graph.OpBatchNormStats, in: ts(x4, f(3)), want: graph.ErrArity},

		rejectCase{name: "size mismatch", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{5, 5}}, in: ts(fb(0, 4, 6)), want: graph.ErrShape},
		rejectCase{name: "two -1", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{-1, -1}}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "-2", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{-2, -12}}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "-1 does not divide", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{-1, 5}}, in: ts(fb(0, 4, 6)), want: graph.ErrShape},
		rejectCase{name: "-1 with a zero", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{-1, 0}}, in: ts(f(0, 3)), want: graph.ErrShape},
		rejectCase{name: "scalar to [2]", op: graph.OpReshape, attrs: graph.Attrs{Shape: []int{2}}, in: ts(f()), want: graph.ErrShape},

		rejectCase{name: "repeated axis", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{0, 0}}, in: ts(f(2, 3)), want: graph.ErrAttr},
		rejectCase{name: "repeated after normalising", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{1, -1}}, in: ts(f(2, 3)), want: graph.ErrAttr},
		rejectCase{name: "too short", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{0}}, in: ts(f(2, 3)), want: graph.ErrAttr},
		rejectCase{name: "out of range", op: graph.OpPermute, attrs: graph.Attrs{Perm: []int{0, 2}}, in: ts(f(2, 3)), want: graph.ErrAttr},

		rejectCase{name: "end past the axis", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, End: 7, Step: 1}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "start past end", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, Start: 4, End: 3, Step: 1}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "negative start", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, Start: -1, End: 3, Step: 1}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "negative step", op: graph.OpSlice, attrs: graph.Attrs{Axis: 1, End: 3, Step: -1}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "axis out of range", op: graph.OpSlice, attrs: graph.Attrs{Axis: 2, End: 1, Step: 1}, in: ts(fb(0, 4, 6)), want: graph.ErrAttr},
		rejectCase{name: "scalar", op: graph.OpSlice, in: ts(f()), want: graph.ErrAttr},

		rejectCase{name: "rank mismatch", op: graph.OpConcat, attrs: graph.Attrs{Axis: 0}, in: ts(f(2, 3), f(3)), want: graph.ErrShape},
		rejectCase{name: "size off the axis", op: graph.OpConcat, attrs: graph.Attrs{Axis: 1}, in: ts(f(2, 3), f(3, 3)), want: graph.ErrShape},
		rejectCase{name: "dtype mismatch", op: graph.OpConcat, attrs: graph.Attrs{Axis: 0}, in: ts(f(2), i(2)), want: graph.ErrDType},
		rejectCase{name: "axis out of range", op: graph.OpConcat, attrs: graph.Attrs{Axis: 2}, in: ts(f(2, 3), f(2, 3)), want: graph.ErrAttr},
		rejectCase{name: "scalars", op: graph.OpConcat, in: ts(f(), f()), want: graph.ErrAttr},
		rejectCase{name: "batch axes do not line up", op: graph.OpConcat, attrs: graph.Attrs{Axis: 0}, in: ts(fb(0, 4, 4), fb(1, 4, 4)), want: graph.ErrShape},
		rejectCase{name: "no inputs", op: graph.OpConcat, want: graph.ErrArity},

		rejectCase{name: "float indices", op: graph.OpEmbedding, in: ts(fb(0, 4, 7), f(10, 16)), want: graph.ErrDType},
		rejectCase{name: "int64 weight", op: graph.OpEmbedding, in: ts(ib(0, 4, 7), i(10, 16)), want: graph.ErrDType},
		rejectCase{name: "weight rank 3", op: graph.OpEmbedding, in: ts(ib(0, 4, 7), f(10, 16, 1)), want: graph.ErrShape},
		rejectCase{name: "one input", op: graph.OpEmbedding, in: ts(ib(0, 4, 7)), want: graph.ErrArity},

		rejectCase{name: "groups do not divide input channels", op: graph.OpConv2d, attrs: graph.Attrs{Groups: 2}, in: ts(fb(0, 4, 3, 5, 5), f(4, 1, 3, 3)), want: graph.ErrAttr},
		rejectCase{name: "groups do not divide output channels", op: graph.OpConv2d, attrs: graph.Attrs{Groups: 2}, in: ts(fb(0, 4, 4, 5, 5), f(3, 2, 3, 3)), want: graph.ErrAttr},
		rejectCase{name: "negative groups", op: graph.OpConv2d, attrs: graph.Attrs{Groups: -1}, in: ts(fb(0, 4, 3, 5, 5), f(3, 3, 3, 3)), want: graph.ErrAttr},
		rejectCase{name: "weight channels", op: graph.OpConv2d, in: ts(fb(0, 4, 3, 5, 5), f(6, 2, 3, 3)), want: graph.ErrShape},
		rejectCase{name: "weight channels per group", op: graph.OpConv2d, attrs: graph.Attrs{Groups: 3}, in: ts(fb(0, 4, 6, 5, 5), f(6, 6, 3, 3)), want: graph.ErrShape},
		rejectCase{name: "kernel larger than the input", op: graph.OpConv2d, in: ts(fb(0, 4, 3, 2, 2), f(6, 3, 3, 3)), want: graph.ErrShape},
		rejectCase{name: "kernel larger than the padded input", op: graph.OpConv2d, attrs: graph.Attrs{Padding: [2]int{1, 1}}, in: ts(fb(0, 4, 3, 2, 2), f(6, 3, 5, 5)), want: graph.ErrShape},
		// (2 − 3)/2 truncates to 0 in Go, which would give an output of 1.
		rejectCase{name: "kernel larger than the input, stride 2", op: graph.OpConv2d, attrs: graph.Attrs{Stride: [2]int{2, 2}}, in: ts(fb(0, 4, 3, 2, 2), f(6, 3, 3, 3)), want: graph.ErrShape},
		rejectCase{name: "dilated kernel larger than the input", op: graph.OpConv2d, attrs: graph.Attrs{Dilation: [2]int{3, 3}}, in: ts(fb(0, 4, 3, 6, 6), f(6, 3, 3, 3)), want: graph.ErrShape},
		rejectCase{name: "empty kernel", op: graph.OpConv2d, in: ts(fb(0, 4, 3, 5, 5), f(6, 3, 0, 3)), want: graph.ErrShape},
		rejectCase{name: "bias shape", op: graph.OpConv2d, in: ts(fb(0, 4, 3, 5, 5), f(6, 3, 3, 3), f(3)), want: graph.ErrShape},
		rejectCase{name: "rank 3 input", op: graph.OpConv2d, in: ts(fb(0, 4, 5, 5), f(6, 3, 3, 3)), want: graph.ErrShape},
		rejectCase{name: "negative padding", op: graph.OpConv2d, attrs: graph.Attrs{Padding: [2]int{-1, 0}}, in: ts(fb(0, 4, 3, 5, 5), f(6, 3, 3, 3)), want: graph.ErrAttr},
		rejectCase{name: "negative stride", op: graph.OpConv2d, attrs: graph.Attrs{Stride: [2]int{1, -1}}, in: ts(fb(0, 4, 3, 5, 5), f(6, 3, 3, 3)), want: graph.ErrAttr},
		rejectCase{name: "int64 input", op: graph.OpConv2d, in: ts(ib(0, 4, 3, 5, 5), f(6, 3, 3, 3)), want: graph.ErrDType},
		rejectCase{name: "int64 bias", op: graph.OpConv2d, in: ts(fb(0, 4, 3, 5, 5), f(6, 3, 3, 3), i(6)), want: graph.ErrDType},
	)
	for _, op := range []graph.Op{graph.OpMaxPool2d, graph.OpAvgPool2d} {
		k2 := [2]int{2, 2}
		add(rejectCase{name: "kernel 0", op: op, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},
			rejectCase{name: "kernel 0 on one axis", op: op, attrs: graph.Attrs{Kernel: [2]int{2, 0}}, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},
			rejectCase{name: "padding over half the kernel", op: op, attrs: graph.Attrs{Kernel: k2, Padding: [2]int{2, 0}}, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},
			rejectCase{name: "negative stride", op: op, attrs: graph.Attrs{Kernel: k2, Stride: [2]int{-1, 1}}, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},
			rejectCase{name: "kernel larger than the input", op: op, attrs: graph.Attrs{Kernel: [2]int{5, 5}}, in: ts(fb(0, 4, 3, 4, 4)), want: graph.ErrShape},
			rejectCase{name: "kernel larger than the input, stride 2", op: op, attrs: graph.Attrs{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}}, in: ts(fb(0, 4, 3, 2, 2)), want: graph.ErrShape},
			rejectCase{name: "rank 3", op: op, attrs: graph.Attrs{Kernel: k2}, in: ts(fb(0, 4, 8, 8)), want: graph.ErrShape},
			rejectCase{name: "int64", op: op, attrs: graph.Attrs{Kernel: k2}, in: ts(ib(0, 4, 3, 8, 8)), want: graph.ErrDType})
	}
	add(
		rejectCase{name: "dilation", op: graph.OpAvgPool2d, attrs: graph.Attrs{Kernel: [2]int{2, 2}, Dilation: [2]int{2, 2}}, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},
		rejectCase{name: "negative dilation", op: graph.OpMaxPool2d, attrs: graph.Attrs{Kernel: [2]int{2, 2}, Dilation: [2]int{-1, 1}}, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},

		rejectCase{name: "float labels", op: graph.OpCrossEntropy, in: ts(fb(0, 4, 10), fb(0, 4)), want: graph.ErrDType},
		rejectCase{name: "int64 logits", op: graph.OpCrossEntropy, in: ts(ib(0, 4, 10), ib(0, 4)), want: graph.ErrDType},
		rejectCase{name: "N mismatch", op: graph.OpCrossEntropy, in: ts(fb(0, 4, 10), i(3)), want: graph.ErrShape},
		rejectCase{name: "logits rank 3", op: graph.OpCrossEntropy, in: ts(fb(0, 4, 2, 10), ib(0, 4)), want: graph.ErrShape},
		rejectCase{name: "labels rank 2", op: graph.OpCrossEntropy, in: ts(fb(0, 4, 10), ib(0, 4, 1)), want: graph.ErrShape},
		rejectCase{name: "zero classes", op: graph.OpCrossEntropy, in: ts(fb(0, 4, 0), ib(0, 4)), want: graph.ErrShape},
		rejectCase{name: "end past the columns", op: graph.OpCrossEntropy, attrs: graph.Attrs{End: 11}, in: ts(fb(0, 4, 10), ib(0, 4)), want: graph.ErrShape},
		rejectCase{name: "negative end", op: graph.OpCrossEntropy, attrs: graph.Attrs{End: -1}, in: ts(fb(0, 4, 10), ib(0, 4)), want: graph.ErrShape},
		rejectCase{name: "gradient's end past the columns", op: graph.OpCrossEntropyGrad, attrs: graph.Attrs{End: 11}, in: ts(f(), fb(0, 4, 10), ib(0, 4)), want: graph.ErrShape},

		rejectCase{name: "shape mismatch", op: graph.OpMSE, in: ts(fb(0, 4, 3), fb(0, 4, 1)), want: graph.ErrShape},
		rejectCase{name: "int64 target", op: graph.OpMSE, in: ts(fb(0, 4, 3), ib(0, 4, 3)), want: graph.ErrDType},
		rejectCase{name: "empty", op: graph.OpMSE, in: ts(f(0, 3), f(0, 3)), want: graph.ErrShape},
		rejectCase{name: "batch axes differ", op: graph.OpMSE, in: ts(fb(0, 4, 4), fb(1, 4, 4)), want: graph.ErrShape},
	)
	return append(append(append(append(cs, gradRejectCases()...), attentionRejectCases()...), append(llamaRejectCases(), pointwiseRejectCases()...)...), lceRejectCases()...)
}

func TestRuleRejects(t *testing.T) {
	for _, c := range rejectCases() {
		t.Run(c.op.String()+"/"+c.name, func(t *testing.T) {
			_, _, err := runRule(ruleCase{op: c.op, attrs: c.attrs, in: c.in, batch: c.batch})
			require.Error(t, err)
			assert.ErrorIs(t, err, c.want)
		})
	}
}

// TestRuleArity feeds every op one input too many (or, for variadic ops,
// none at all).
func TestRuleArity(t *testing.T) {
	for op := graph.Op(0); int(op) < graph.NumOps+2; op++ {
		t.Run(op.String(), func(t *testing.T) {
			info := op.Info()
			n := info.MaxArity + 1
			switch {
			case info.Arity == graph.Variadic:
				n = info.MinArity - 1
			case info.MaxArity == 0:
				n = info.Arity + 1
			}
			in := make([]graph.Type, n)
			for k := range in {
				in[k] = f(2, 2)
			}
			var a graph.Attrs
			_, err := shapeinfer.Rule(op, &a, in, N)
			assert.ErrorIs(t, err, graph.ErrArity, "%d inputs", n)
		})
	}
}

func TestBroadcastShapes(t *testing.T) {
	for _, c := range []struct {
		a, b, want []int
	}{
		{[]int{}, []int{2, 3}, []int{2, 3}},
		{[]int{}, []int{}, []int{}},
		{[]int{3, 1}, []int{1, 4}, []int{3, 4}},
		{[]int{5}, []int{2, 3, 5}, []int{2, 3, 5}},
		{[]int{0, 3}, []int{1, 3}, []int{0, 3}},
		{[]int{1}, []int{0}, []int{0}},
		{[]int{2, 1, 4}, []int{3, 1}, []int{2, 3, 4}},
	} {
		t.Run(fmt.Sprint(c.a, c.b), func(t *testing.T) {
			got, err := shapeinfer.BroadcastShapes(c.a, c.b)
			require.NoError(t, err)
			assert.Equal(t, c.want, got)
			got, err = shapeinfer.BroadcastShapes(c.b, c.a)
			require.NoError(t, err)
			assert.Equal(t, c.want, got, "broadcasting is symmetric")
		})
	}
	for _, c := range [][2][]int{{{2}, {3}}, {{0}, {2}}, {{2, 3}, {3, 2}}} {
		_, err := shapeinfer.BroadcastShapes(c[0], c[1])
		assert.ErrorIs(t, err, graph.ErrShape, "%v with %v", c[0], c[1])
	}
}

func TestConvOut(t *testing.T) {
	for _, c := range []struct{ in, k, s, p, d, want int }{
		{8, 3, 1, 0, 1, 6},   // (8−2−1)/1+1
		{8, 3, 2, 1, 1, 4},   // (8+2−2−1)/2+1
		{8, 3, 1, 0, 2, 4},   // (8−4−1)/1+1
		{7, 2, 2, 0, 1, 3},   // (7−1−1)/2+1: the last row is dropped
		{32, 7, 2, 3, 1, 16}, // ResNet stem: (32+6−6−1)/2+1
		{5, 5, 1, 0, 1, 1},
	} {
		assert.Equal(t, c.want, shapeinfer.ConvOut(c.in, c.k, c.s, c.p, c.d), "%+v", c)
	}
}

// errors.Is must see through whatever the rules wrap.
func TestRuleErrorsAreSentinels(t *testing.T) {
	a := graph.Attrs{}
	_, err := shapeinfer.Rule(graph.OpAdd, &a, ts(f(2), f(3)), N)
	require.Error(t, err)
	assert.True(t, errors.Is(err, graph.ErrShape))
	assert.False(t, errors.Is(err, graph.ErrDType))
}
