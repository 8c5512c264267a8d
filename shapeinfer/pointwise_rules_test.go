package shapeinfer_test

import (
	"github.com/batchfit/batchfit/graph"
)

// rmsExpr is RMSNorm as a fused_pointwise expression of x [.., C] and w
// [C]: outputs the norm (bfloat16) and the per-row 1/rms (float32).
func rmsExpr() *graph.Pointwise {
	p, err := graph.NewPointwise([]graph.PWNode{
		{Op: graph.PWInput, In: 0}, {Op: graph.PWMul, A: 0, B: 0}, {Op: graph.PWRowSum, A: 1, Scalar: 1.0 / 16},
		{Op: graph.PWConst, Scalar: 1e-5}, {Op: graph.PWAdd, A: 2, B: 3}, {Op: graph.PWRsqrt, A: 4},
		{Op: graph.PWMul, A: 0, B: 5}, {Op: graph.PWInput, In: 1}, {Op: graph.PWMul, A: 6, B: 7},
	}, []graph.PWOut{{Node: 8, DType: graph.BFloat16}, {Node: 5, DType: graph.Float32}})
	if err != nil {
		panic(err)
	}
	return p
}

// fused_pointwise types each output of its expression: per element at
// the inputs' broadcast shape, per row with the last dimension 1.
func pointwiseValidCases() []ruleCase {
	x, w := fb(0, 4, 6, 16), f(16)
	return []ruleCase{
		{name: "norm", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr()}, in: ts(x, w), want: withDType(x, graph.BFloat16)},
		{name: "per-row output", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr(), Axis: 1}, in: ts(x, w), want: fb(0, 4, 6, 1)},
		{name: "bfloat16 input", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr(), Axis: 1}, in: ts(bf(x), w), want: fb(0, 4, 6, 1)},
	}
}

func pointwiseRejectCases() []rejectCase {
	x, w := fb(0, 4, 6, 16), f(16)
	return []rejectCase{
		{name: "no expression", op: graph.OpFusedPointwise, in: ts(x, w), want: graph.ErrAttr},
		{name: "output past the expression's", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr(), Axis: 2}, in: ts(x, w), want: graph.ErrAttr},
		{name: "too few inputs", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr()}, in: ts(x), want: graph.ErrArity},
		{name: "shapes do not broadcast", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr()}, in: ts(x, f(15)), want: graph.ErrShape},
		{name: "rows along the batch axis", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr()}, in: ts(fb(1, 4, 16), w), want: graph.ErrShape},
		{name: "int64", op: graph.OpFusedPointwise, attrs: graph.Attrs{Pointwise: rmsExpr()}, in: ts(ib(0, 4, 16), w), want: graph.ErrDType},
	}
}
