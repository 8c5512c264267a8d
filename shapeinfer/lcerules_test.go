package shapeinfer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// The rules of the fused head and loss: linear_cross_entropy (h [N, C], W
// [V, C], labels [N], an optional float32 scale) and its two gradients,
// and embedding_grad's addend.
func lceValidCases() []ruleCase {
	h, w, y := fb(0, 4, 6), f(10, 6), ib(0, 4)
	chunk := func(want int) func(*testing.T, graph.Attrs) {
		return func(t *testing.T, a graph.Attrs) {
			t.Helper()
			assert.Equal(t, want, a.LossChunk, "LossChunk")
			assert.Equal(t, graph.Float32, a.Target.DType, "the chunk's dtype")
		}
	}
	return []ruleCase{
		{name: "mean", op: graph.OpLinearCrossEntropy, in: ts(h, w, y), want: f(), check: scalarIs(1.0 / 4)},
		{name: "default chunk", op: graph.OpLinearCrossEntropy, in: ts(h, w, y), want: f(), check: chunk(graph.DefaultLossChunk)},
		{name: "sum of 7 classes, scaled, chunk 2", op: graph.OpLinearCrossEntropy, attrs: graph.Attrs{Reduction: graph.ReduceSum, End: 7, LossChunk: 2},
			in: ts(h, w, y, f()), want: f(), check: chunk(2)},
		{name: "bfloat16: a float32 loss", op: graph.OpLinearCrossEntropy, in: ts(withDType(h, graph.BFloat16), withDType(w, graph.BFloat16), y), want: f()},
		{name: "h's gradient", op: graph.OpLinearCrossEntropyGradH, attrs: graph.Attrs{Scalar: 0.25}, in: ts(f(), h, w, y), want: h},
		{name: "W's gradient", op: graph.OpLinearCrossEntropyGradW, attrs: graph.Attrs{Scalar: 0.25}, in: ts(f(), h, w, y, f()), want: w},
		{name: "onto r", op: graph.OpEmbeddingGrad, attrs: graph.Attrs{Target: f(10, 16)}, in: ts(fb(0, 4, 7, 16), ib(0, 4, 7), f(10, 16)), want: f(10, 16)},
	}
}

func lceRejectCases() []rejectCase {
	h, w, y := fb(0, 4, 6), f(10, 6), ib(0, 4)
	return []rejectCase{
		{name: "W with a batch axis", op: graph.OpLinearCrossEntropy, in: ts(h, fb(0, 4, 6), y), want: graph.ErrShape},
		{name: "float labels", op: graph.OpLinearCrossEntropy, in: ts(h, w, fb(0, 4)), want: graph.ErrDType},
		{name: "W's width", op: graph.OpLinearCrossEntropy, in: ts(h, f(10, 5), y), want: graph.ErrShape},
		{name: "bfloat16 scale", op: graph.OpLinearCrossEntropy, in: ts(h, w, y, withDType(f(), graph.BFloat16)), want: graph.ErrShape},
		{name: "end past W", op: graph.OpLinearCrossEntropy, attrs: graph.Attrs{End: 11}, in: ts(h, w, y), want: graph.ErrShape},
		{name: "gradient not a scalar", op: graph.OpLinearCrossEntropyGradH, in: ts(f(1), h, w, y), want: graph.ErrShape},
		{name: "bfloat16 gradient", op: graph.OpLinearCrossEntropyGradW, in: ts(withDType(f(), graph.BFloat16), h, w, y), want: graph.ErrDType},
		{name: "addend of another shape", op: graph.OpEmbeddingGrad, attrs: graph.Attrs{Target: f(10, 16)}, in: ts(fb(0, 4, 7, 16), ib(0, 4, 7), f(10, 8)), want: graph.ErrShape},
	}
}
