package shapeinfer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// Cases for fill and the gradient ops autodiff appends. The first input of a
// gradient op is the upstream gradient g; ops that restore a shape read it
// from Attrs.Target.

func gradValidCases() []ruleCase {
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	k2 := [2]int{2, 2}
	return []ruleCase{
		{name: "seed", op: graph.OpFill, attrs: graph.Attrs{Target: f(), Scalar: 1}, want: f()},
		{name: "batched target is filled unbatched", op: graph.OpFill, attrs: graph.Attrs{Target: fb(0, 4, 3)}, want: f(4, 3)},

		{name: "batched", op: graph.OpReluGrad, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},
		{name: "unbatched g, batched y", op: graph.OpReluGrad, in: ts(f(4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},
		{name: "batched", op: graph.OpGeluGrad, attrs: graph.Attrs{Approx: true}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},
		{name: "batched", op: graph.OpSiluGrad, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},
		{name: "batched", op: graph.OpMaximumScalarGrad, attrs: graph.Attrs{Scalar: 0.5}, in: ts(fb(1, 2, 4), fb(1, 2, 4)), want: fb(1, 2, 4)},
		// maximum_grad gives the broadcast output's shape; autodiff sums it down.
		{name: "for a", op: graph.OpMaximumGrad, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(3)), want: fb(0, 4, 3)},
		{name: "for b", op: graph.OpMaximumGrad, attrs: graph.Attrs{Axis: 1}, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(3)), want: fb(0, 4, 3)},

		{name: "axis -1", op: graph.OpSoftmaxGrad, attrs: graph.Attrs{Axis: -1}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3),
			check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, 1, a.Axis) }},
		{name: "axis 1", op: graph.OpLogSoftmaxGrad, attrs: graph.Attrs{Axis: 1}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},

		{name: "mean over the batch", op: graph.OpExpand, attrs: graph.Attrs{Target: fb(0, 4, 3)}, in: ts(f(3)), want: fb(0, 4, 3)},
		{name: "keepdim", op: graph.OpExpand, attrs: graph.Attrs{Target: fb(0, 4, 3)}, in: ts(f(4, 1)), want: fb(0, 4, 3)},
		{name: "seed to a scalar", op: graph.OpExpand, attrs: graph.Attrs{Target: f(2, 3)}, in: ts(f()), want: f(2, 3)},
		{name: "PerSample 0 becomes 1", op: graph.OpExpand, attrs: graph.Attrs{Target: fp(0, 0, 4, 3)}, in: ts(f(3)), want: fb(0, 4, 3)},

		{name: "over the batch", op: graph.OpMaxGrad, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f(3), fb(0, 4, 3), f(3)), want: fb(0, 4, 3)},
		{name: "keepdim", op: graph.OpMaxGrad, attrs: graph.Attrs{Axes: []int{-1}, KeepDim: true}, in: ts(fb(0, 4, 1), fb(0, 4, 3), fb(0, 4, 1)), want: fb(0, 4, 3),
			check: axesAre(1)},

		{name: "no weight", op: graph.OpLayerNormGradX, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5)), want: fb(0, 4, 5)},
		{name: "weight", op: graph.OpLayerNormGradX, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5), f(5)), want: fb(0, 4, 5)},
		{name: "added, weight", op: graph.OpLayerNormGradXAdd, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5), fb(0, 4, 5), f(5)), want: fb(0, 4, 5)},
		{name: "added, no weight", op: graph.OpLayerNormGradXAdd, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5), fb(0, 4, 5)), want: fb(0, 4, 5)},
		{name: "sums over leading axes", op: graph.OpLayerNormGradW, attrs: graph.Attrs{NormDims: 2, Eps: 1e-5}, in: ts(fb(0, 4, 2, 5), fb(0, 4, 2, 5)), want: f(2, 5)},

		{name: "weight", op: graph.OpBatchNormGradX, attrs: graph.Attrs{Training: true, Eps: 1e-5}, in: ts(fb(0, 4, 3, 5, 5), fb(0, 4, 3, 5, 5), f(3)), want: fb(0, 4, 3, 5, 5)},
		{name: "no weight", op: graph.OpBatchNormGradX, attrs: graph.Attrs{Training: true, Eps: 1e-5}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},
		{name: "training", op: graph.OpBatchNormGradW, attrs: graph.Attrs{Training: true, Eps: 1e-5}, in: ts(fb(0, 4, 3, 5, 5), fb(0, 4, 3, 5, 5)), want: f(3)},
		{name: "eval", op: graph.OpBatchNormGradW, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(0, 4, 3, 5, 5), fb(0, 4, 3, 5, 5), f(3), f(3)), want: f(3)},
		{name: "samples on the channel axis", op: graph.OpBatchNormGradW, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(1, 2, 4, 5), fb(1, 2, 4, 5), f(4), f(4)), want: fb(0, 4)},

		{name: "step 2", op: graph.OpSliceGrad, attrs: graph.Attrs{Axis: 1, Start: 1, End: 5, Step: 2, Target: fb(0, 4, 6)}, in: ts(fb(0, 4, 2)), want: fb(0, 4, 6)},
		{name: "scatter-add rows", op: graph.OpEmbeddingGrad, attrs: graph.Attrs{Target: f(10, 16)}, in: ts(fb(0, 4, 7, 16), ib(0, 4, 7)), want: f(10, 16)},

		{name: "stride 2 pad 1", op: graph.OpConv2dGradInput, attrs: graph.Attrs{Stride: k2, Padding: [2]int{1, 1}, Target: fb(0, 4, 3, 8, 8)},
			in: ts(fb(0, 4, 6, 4, 4), f(6, 3, 3, 3)), want: fb(0, 4, 3, 8, 8)},
		{name: "groups", op: graph.OpConv2dGradWeight, attrs: graph.Attrs{Groups: 3, Target: f(9, 2, 3, 3)},
			in: ts(fb(0, 4, 9, 3, 3), fb(0, 4, 6, 5, 5)), want: f(9, 2, 3, 3)},
		{name: "kernel 2", op: graph.OpMaxPool2dGrad, attrs: graph.Attrs{Kernel: k2}, in: ts(fb(0, 4, 3, 4, 4), fb(0, 4, 3, 8, 8)), want: fb(0, 4, 3, 8, 8)},
		{name: "kernel 2", op: graph.OpAvgPool2dGrad, attrs: graph.Attrs{Kernel: k2, Target: fb(0, 4, 3, 8, 8)}, in: ts(fb(0, 4, 3, 4, 4)), want: fb(0, 4, 3, 8, 8)},

		{name: "mean", op: graph.OpCrossEntropyGrad, attrs: graph.Attrs{Scalar: 0.25}, in: ts(f(), fb(0, 4, 10), ib(0, 4)), want: fb(0, 4, 10)},
		{name: "mean", op: graph.OpMSEGrad, in: ts(f(), fb(0, 4, 3), fb(0, 4, 3)), want: fb(0, 4, 3)},

		{name: "mlp", op: graph.OpMatMulGeluGrad, attrs: graph.Attrs{Approx: true}, in: ts(fb(0, 4, 5, 3), f(3, 7), fb(0, 4, 5, 7)), want: fb(0, 4, 5, 7)},
		{name: "transposed weight", op: graph.OpMatMulGeluGrad, attrs: graph.Attrs{TransB: true}, in: ts(fb(0, 4, 3), f(7, 3), fb(0, 4, 7)), want: fb(0, 4, 7)},
	}
}

func gradRejectCases() []rejectCase {
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	k2 := [2]int{2, 2}
	return []rejectCase{
		{name: "int64 target", op: graph.OpFill, attrs: graph.Attrs{Target: i(3)}, want: graph.ErrDType},
		{name: "no dtype", op: graph.OpFill, want: graph.ErrDType},
		{name: "negative dim", op: graph.OpFill, attrs: graph.Attrs{Target: f(2, -1)}, want: graph.ErrShape},
		{name: "an input", op: graph.OpFill, attrs: graph.Attrs{Target: f(3)}, in: ts(f(3)), want: graph.ErrArity},

		{name: "shapes differ", op: graph.OpReluGrad, in: ts(fb(0, 4, 3), fb(0, 4, 2)), want: graph.ErrShape},
		{name: "int64 gradient", op: graph.OpReluGrad, in: ts(ib(0, 4, 3), fb(0, 4, 3)), want: graph.ErrDType},
		{name: "shapes differ", op: graph.OpSiluGrad, in: ts(fb(0, 4, 3), fb(0, 4, 2)), want: graph.ErrShape},
		{name: "dtypes differ", op: graph.OpGeluGrad, in: ts(fb(0, 4, 3), ib(0, 4, 3)), want: graph.ErrShape},
		{name: "shapes differ", op: graph.OpMaximumScalarGrad, in: ts(fb(0, 4, 3), f(3)), want: graph.ErrShape},
		{name: "batch axes do not line up", op: graph.OpReluGrad, in: ts(fb(0, 4, 4), fb(1, 4, 4)), want: graph.ErrShape},

		{name: "operand 2", op: graph.OpMaximumGrad, attrs: graph.Attrs{Axis: 2}, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(3)), want: graph.ErrAttr},
		{name: "gradient shape", op: graph.OpMaximumGrad, in: ts(f(3), fb(0, 4, 3), f(3)), want: graph.ErrShape},
		{name: "operands do not broadcast", op: graph.OpMaximumGrad, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(2)), want: graph.ErrShape},

		{name: "axis out of range", op: graph.OpSoftmaxGrad, attrs: graph.Attrs{Axis: 2}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: graph.ErrAttr},
		{name: "shapes differ", op: graph.OpLogSoftmaxGrad, in: ts(fb(0, 4, 3), fb(0, 4, 2)), want: graph.ErrShape},

		{name: "does not broadcast", op: graph.OpExpand, attrs: graph.Attrs{Target: fb(0, 4, 3)}, in: ts(f(4)), want: graph.ErrShape},
		{name: "higher rank than target", op: graph.OpExpand, attrs: graph.Attrs{Target: f(3)}, in: ts(f(1, 3)), want: graph.ErrShape},
		{name: "int64 target", op: graph.OpExpand, attrs: graph.Attrs{Target: i(3)}, in: ts(f(3)), want: graph.ErrAttr},
		{name: "target batch axis out of range", op: graph.OpExpand, attrs: graph.Attrs{Target: fp(2, 1, 4, 3)}, in: ts(f(3)), want: graph.ErrAttr},

		{name: "max output shape", op: graph.OpMaxGrad, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f(3), fb(0, 4, 3), f(4)), want: graph.ErrShape},
		{name: "gradient shape", op: graph.OpMaxGrad, attrs: graph.Attrs{Axes: []int{0}}, in: ts(f(4), fb(0, 4, 3), f(3)), want: graph.ErrShape},
		{name: "repeated axis", op: graph.OpMaxGrad, attrs: graph.Attrs{Axes: []int{0, 0}}, in: ts(f(3), fb(0, 4, 3), f(3)), want: graph.ErrAttr},

		{name: "eps 0", op: graph.OpLayerNormGradX, attrs: graph.Attrs{NormDims: 1}, in: ts(fb(0, 4, 5), fb(0, 4, 5)), want: graph.ErrAttr},
		{name: "gradient shape", op: graph.OpLayerNormGradX, attrs: ln, in: ts(fb(0, 4, 4), fb(0, 4, 5)), want: graph.ErrShape},
		{name: "weight shape", op: graph.OpLayerNormGradX, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5), f(4)), want: graph.ErrShape},
		{name: "added gradient shape", op: graph.OpLayerNormGradXAdd, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5), fb(0, 4, 4), f(5)), want: graph.ErrShape},
		{name: "added weight shape", op: graph.OpLayerNormGradXAdd, attrs: ln, in: ts(fb(0, 4, 5), fb(0, 4, 5), fb(0, 4, 5), f(4)), want: graph.ErrShape},
		{name: "no norm dims", op: graph.OpLayerNormGradW, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(0, 4, 5), fb(0, 4, 5)), want: graph.ErrAttr},

		{name: "eval mode", op: graph.OpBatchNormGradX, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(0, 4, 3, 5, 5), fb(0, 4, 3, 5, 5)), want: graph.ErrAttr},
		{name: "gradient shape", op: graph.OpBatchNormGradX, attrs: graph.Attrs{Training: true, Eps: 1e-5}, in: ts(fb(0, 4, 3, 5, 4), fb(0, 4, 3, 5, 5)), want: graph.ErrShape},
		{name: "weight shape", op: graph.OpBatchNormGradX, attrs: graph.Attrs{Training: true, Eps: 1e-5}, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(4)), want: graph.ErrShape},
		{name: "eval without running statistics", op: graph.OpBatchNormGradW, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(0, 4, 3), fb(0, 4, 3)), want: graph.ErrArity},
		{name: "training with running statistics", op: graph.OpBatchNormGradW, attrs: graph.Attrs{Training: true, Eps: 1e-5}, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(3), f(3)), want: graph.ErrArity},
		{name: "running_var shape", op: graph.OpBatchNormGradW, attrs: graph.Attrs{Eps: 1e-5}, in: ts(fb(0, 4, 3), fb(0, 4, 3), f(3), f(2)), want: graph.ErrShape},

		{name: "gradient shape", op: graph.OpSliceGrad, attrs: graph.Attrs{Axis: 1, Start: 1, End: 5, Step: 2, Target: fb(0, 4, 6)}, in: ts(fb(0, 4, 3)), want: graph.ErrShape},
		{name: "slice out of range", op: graph.OpSliceGrad, attrs: graph.Attrs{Axis: 1, End: 7, Step: 1, Target: fb(0, 4, 6)}, in: ts(fb(0, 4, 7)), want: graph.ErrAttr},
		{name: "float indices", op: graph.OpEmbeddingGrad, attrs: graph.Attrs{Target: f(10, 16)}, in: ts(fb(0, 4, 7, 16), fb(0, 4, 7)), want: graph.ErrDType},
		{name: "gradient shape", op: graph.OpEmbeddingGrad, attrs: graph.Attrs{Target: f(10, 16)}, in: ts(fb(0, 4, 7, 8), ib(0, 4, 7)), want: graph.ErrShape},

		{name: "gradient shape", op: graph.OpConv2dGradInput, attrs: graph.Attrs{Target: fb(0, 4, 3, 8, 8)}, in: ts(fb(0, 4, 6, 8, 8), f(6, 3, 3, 3)), want: graph.ErrShape},
		{name: "groups", op: graph.OpConv2dGradWeight, attrs: graph.Attrs{Groups: 2, Target: f(9, 2, 3, 3)}, in: ts(fb(0, 4, 9, 3, 3), fb(0, 4, 6, 5, 5)), want: graph.ErrAttr},
		{name: "kernel 0", op: graph.OpMaxPool2dGrad, in: ts(fb(0, 4, 3, 4, 4), fb(0, 4, 3, 8, 8)), want: graph.ErrAttr},
		{name: "gradient shape", op: graph.OpAvgPool2dGrad, attrs: graph.Attrs{Kernel: k2, Target: fb(0, 4, 3, 8, 8)}, in: ts(fb(0, 4, 3, 8, 8)), want: graph.ErrShape},

		{name: "gradient not a scalar", op: graph.OpCrossEntropyGrad, in: ts(f(1), fb(0, 4, 10), ib(0, 4)), want: graph.ErrShape},
		{name: "float labels", op: graph.OpCrossEntropyGrad, in: ts(f(), fb(0, 4, 10), fb(0, 4)), want: graph.ErrDType},
		{name: "shapes differ", op: graph.OpMSEGrad, in: ts(f(), fb(0, 4, 3), fb(0, 4, 2)), want: graph.ErrShape},

		{name: "GELU input shape", op: graph.OpMatMulGeluGrad, in: ts(fb(0, 4, 3), f(3, 7), fb(0, 4, 6)), want: graph.ErrShape},
		{name: "inner dims", op: graph.OpMatMulGeluGrad, in: ts(fb(0, 4, 3), f(2, 7), fb(0, 4, 7)), want: graph.ErrShape},
		{name: "GELU input dtype", op: graph.OpMatMulGeluGrad, in: ts(fb(0, 4, 3), f(3, 7), ib(0, 4, 7)), want: graph.ErrDType},
	}
}
