package cuda

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// The reduction, normalisation and loss kernels run on float32, bfloat16
// and float16: every instantiation their launches name is loaded with its
// file.
func TestRowsKernelsTyped(t *testing.T) {
	files := map[string][]string{
		"reduce.cu":    {kReduceRows, kReduceMid, kReduceSplits, kReduceStrided, kMaxGrad},
		"softmax.cu":   {kSoftmaxRows, kSoftmaxCols, kSoftmaxGradRows, kSoftmaxGradCols},
		"layernorm.cu": {kLayerNorm, kLayerNormGradX, kLayerNormStats, kLayerNormGradW, kLayerNormFused, kLayerNormGradWB},
		"batchnorm.cu": {kBatchNorm, kBatchNormRows, kBatchNormGradX},
		"loss.cu":      {kCrossEntropy, kCrossEntFused, kCrossEntGrad, kMSEPartial, kMSEGrad, kSumF64, kLinearCERows},
	}
	for file, names := range files {
		for _, n := range names {
			for _, dt := range floatDTypes {
				require.True(t, slices.Contains(kernelFiles[file], typed(n, dt)), "%s of %s", typed(n, dt), file)
			}
		}
	}
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} { // 16-bit only
		require.True(t, slices.Contains(kernelFiles["reduce.cu"], typed(kReduceMidV8, dt)), typed(kReduceMidV8, dt))
	}
	for _, n := range []string{kBatchNormCoef, kBatchNormGradCoef, kBatchNormMoment} { // dtypes at run time
		require.True(t, slices.Contains(kernelFiles["batchnorm.cu"], n), n)
	}
	require.True(t, slices.Contains(kernelFiles["loss.cu"], kLinearCEAcc), kLinearCEAcc) // no dtype
	require.Equal(t, "reduce_splits_bf16", typed(kReduceSplits, graph.BFloat16))
	require.Equal(t, "sum_f64_f16", typed(kSumF64, graph.Float16))
}

// Operands of different dtypes (or no float dtype) are typed errors,
// found before any launch: these kernels take one float dtype per node,
// int64 labels aside.
func TestRowsMixedDTypes(t *testing.T) {
	op := func(dt graph.DType, shape ...int) operand { return operand{shape: shape, dt: dt} }
	bf, f16, f32, i64 := graph.BFloat16, graph.Float16, graph.Float32, graph.Int64
	cases := []struct {
		name  string
		nd    graph.Node
		entry opKernel
		in    []operand
		out   operand
	}{
		{"sum into float32", graph.Node{Op: graph.OpSum, Attrs: graph.Attrs{Axes: []int{1}}}, reduceKernels[graph.OpSum],
			[]operand{op(bf, 2, 3)}, op(f32, 2)},
		{"sum of int64", graph.Node{Op: graph.OpSum, Attrs: graph.Attrs{Axes: []int{1}}}, reduceKernels[graph.OpSum],
			[]operand{op(i64, 2, 3)}, op(i64, 2)},
		{"max_grad", graph.Node{Op: graph.OpMaxGrad, Attrs: graph.Attrs{Axes: []int{1}}}, reduceKernels[graph.OpMaxGrad],
			[]operand{op(bf, 2), op(bf, 2, 3), op(f16, 2)}, op(bf, 2, 3)},
		{"softmax", graph.Node{Op: graph.OpSoftmax, Attrs: graph.Attrs{Axis: 1}}, normKernels[graph.OpSoftmax],
			[]operand{op(f16, 2, 3)}, op(bf, 2, 3)},
		{"softmax_grad", graph.Node{Op: graph.OpSoftmaxGrad, Attrs: graph.Attrs{Axis: 1}}, normKernels[graph.OpSoftmaxGrad],
			[]operand{op(bf, 2, 3), op(f32, 2, 3)}, op(bf, 2, 3)},
		{"layer_norm weight", graph.Node{Op: graph.OpLayerNorm, Attrs: graph.Attrs{NormDims: 1, Eps: 1e-5}}, normKernels[graph.OpLayerNorm],
			[]operand{op(bf, 2, 3), op(f32, 3)}, op(bf, 2, 3)},
		{"layer_norm_grad_w", graph.Node{Op: graph.OpLayerNormGradW, Attrs: graph.Attrs{NormDims: 1, Eps: 1e-5}}, normKernels[graph.OpLayerNormGradW],
			[]operand{op(bf, 2, 3), op(f32, 2, 3)}, op(bf, 3)},
		// 16-bit x with float32 per-channel values is mixed precision's
		// batch norm; other mixtures are not.
		{"batch_norm weight", graph.Node{Op: graph.OpBatchNorm, Attrs: graph.Attrs{Training: true, Eps: 1e-5}}, normKernels[graph.OpBatchNorm],
			[]operand{op(bf, 2, 3), op(f16, 3)}, op(bf, 2, 3)},
		{"batch_norm weight and bias", graph.Node{Op: graph.OpBatchNorm, Attrs: graph.Attrs{Training: true, Eps: 1e-5}}, normKernels[graph.OpBatchNorm],
			[]operand{op(bf, 2, 3), op(f32, 3), op(bf, 3)}, op(bf, 2, 3)},
		{"batch_norm running statistics", graph.Node{Op: graph.OpBatchNorm, Attrs: graph.Attrs{Eps: 1e-5}}, normKernels[graph.OpBatchNorm],
			[]operand{op(f32, 2, 3), op(bf, 3), op(bf, 3)}, op(f32, 2, 3)},
		{"batch_norm_grad_x weight", graph.Node{Op: graph.OpBatchNormGradX, Attrs: graph.Attrs{Training: true, Eps: 1e-5}}, normKernels[graph.OpBatchNormGradX],
			[]operand{op(f16, 2, 3), op(f16, 2, 3), op(bf, 3)}, op(f16, 2, 3)},
		{"cross_entropy loss not float32", graph.Node{Op: graph.OpCrossEntropy}, lossKernels[graph.OpCrossEntropy],
			[]operand{op(bf, 2, 3), op(i64, 2)}, op(bf)},
		{"cross_entropy_grad g not float32", graph.Node{Op: graph.OpCrossEntropyGrad}, lossKernels[graph.OpCrossEntropyGrad],
			[]operand{op(bf), op(bf, 2, 3), op(i64, 2)}, op(bf, 2, 3)},
		{"cross_entropy_grad", graph.Node{Op: graph.OpCrossEntropyGrad}, lossKernels[graph.OpCrossEntropyGrad],
			[]operand{op(bf), op(f16, 2, 3), op(i64, 2)}, op(bf, 2, 3)},
		{"mse", graph.Node{Op: graph.OpMSE}, lossKernels[graph.OpMSE],
			[]operand{op(bf, 2, 3), op(f16, 2, 3)}, op(bf)},
		{"mse_grad", graph.Node{Op: graph.OpMSEGrad}, lossKernels[graph.OpMSEGrad],
			[]operand{op(bf), op(bf, 2, 3), op(f32, 2, 3)}, op(bf, 2, 3)},
	}
	for _, c := range cases {
		k := &kctx{nd: &c.nd}
		err := c.entry.run(k, c.in, c.out)
		require.ErrorIs(t, err, graph.ErrDType, c.name)
	}
}
