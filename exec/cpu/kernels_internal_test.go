package cpu

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// Kernels check the buffers they are handed, so a mismatch (a chunk that
// does not fit the node's attributes, say) is a typed error, never a panic.
func TestKernelsRejectBadBuffers(t *testing.T) {
	f := func(shape ...int) *buf { return emptyBuf(shape...) }
	i := func(shape ...int) *buf { return &buf{shape: shape, i: make([]int64, graph.Numel(shape))} }
	cases := []struct {
		name string
		want error
		call func() error
	}{
		{"unary length", graph.ErrShape, func() error { return unaryKernel(graph.OpExp, &graph.Attrs{}, f(2, 3), f(3)) }},
		{"unary op", graph.ErrAttr, func() error { return unaryKernel(graph.OpAdd, &graph.Attrs{}, f(2), f(2)) }},
		{"binary broadcast", graph.ErrShape, func() error { return binaryKernel(graph.OpAdd, f(2, 3), f(4), f(2, 3)) }},
		{"binary rank", graph.ErrShape, func() error { return binaryKernel(graph.OpAdd, f(1, 2, 3), f(3), f(2, 3)) }},
		{"binary op", graph.ErrAttr, func() error { return binaryKernel(graph.OpExp, f(3), f(3), f(3)) }},
		{"reduce axis", graph.ErrAttr, func() error { return reduceKernel(graph.OpSum, &graph.Attrs{Axes: []int{2}}, f(2, 3), f(2)) }},
		{"reduce output", graph.ErrShape, func() error { return reduceKernel(graph.OpSum, &graph.Attrs{Axes: []int{1}}, f(2, 3), f(3)) }},
		{"reduce op", graph.ErrAttr, func() error { return reduceKernel(graph.OpExp, &graph.Attrs{Axes: []int{1}}, f(2, 3), f(2)) }},
		{"softmax axis", graph.ErrAttr, func() error { return softmaxKernel(false, 2, f(2, 3), f(2, 3)) }},
		{"softmax output", graph.ErrShape, func() error { return softmaxKernel(true, 1, f(2, 3), f(3)) }},
		{"layer_norm dims", graph.ErrAttr, func() error { return layerNormKernel(&graph.Attrs{NormDims: 3, Eps: 1e-5}, f(2, 3), nil, nil, f(2, 3)) }},
		{"layer_norm weight", graph.ErrShape, func() error {
			return layerNormKernel(&graph.Attrs{NormDims: 1, Eps: 1e-5}, f(2, 3), f(2), nil, f(2, 3))
		}},
		{"batch_norm rank", graph.ErrShape, func() error {
			return batchNormKernel(&graph.Attrs{Training: true, Eps: 1e-5}, []*buf{f(3)}, f(3))
		}},
		{"batch_norm eval without statistics", graph.ErrShape, func() error {
			return batchNormKernel(&graph.Attrs{Eps: 1e-5}, []*buf{f(2, 3)}, f(2, 3))
		}},
		{"batch_norm running_var", graph.ErrShape, func() error {
			return batchNormKernel(&graph.Attrs{Eps: 1e-5}, []*buf{f(2, 3), f(3), f(2)}, f(2, 3))
		}},
		{"batch_norm weight", graph.ErrShape, func() error {
			return batchNormKernel(&graph.Attrs{Training: true, Eps: 1e-5}, []*buf{f(2, 3), f(2)}, f(2, 3))
		}},
		{"batch_norm output", graph.ErrShape, func() error {
			return batchNormKernel(&graph.Attrs{Training: true, Eps: 1e-5}, []*buf{f(2, 3)}, f(3))
		}},
		{"batch_norm_grad_x gradient", graph.ErrShape, func() error {
			return batchNormGradX(&graph.Attrs{Training: true, Eps: 1e-5}, f(2, 2), f(2, 3), nil, f(2, 3))
		}},
		{"batch_norm_grad_w output", graph.ErrShape, func() error {
			return batchNormGradW(&graph.Attrs{Training: true, Eps: 1e-5}, []*buf{f(2, 3), f(2, 3)}, f(2))
		}},
		{"reshape size", graph.ErrShape, func() error { return reshapeKernel(f(2, 3), f(5)) }},
		{"reshape dtype", graph.ErrDType, func() error { return reshapeKernel(i(6), f(6)) }},
		{"permute perm", graph.ErrAttr, func() error { return permuteKernel([]int{0, 0}, f(2, 3), f(2, 3)) }},
		{"permute shape", graph.ErrAttr, func() error { return permuteKernel([]int{1, 0}, f(2, 3), f(2, 3)) }},
		{"slice past the end", graph.ErrAttr, func() error {
			return sliceKernel(&graph.Attrs{Axis: 0, Start: 1, End: 4, Step: 1}, f(2, 3), f(3, 3))
		}},
		{"slice output", graph.ErrShape, func() error {
			return sliceKernel(&graph.Attrs{Axis: 1, Start: 0, End: 3, Step: 2}, f(2, 3), f(2, 1))
		}},
		{"concat sizes", graph.ErrShape, func() error { return concatKernel(0, []*buf{f(1, 3), f(2, 3)}, f(4, 3)) }},
		{"concat other axis", graph.ErrShape, func() error { return concatKernel(0, []*buf{f(1, 3), f(2, 2)}, f(3, 3)) }},
		{"concat dtype", graph.ErrDType, func() error { return concatKernel(0, []*buf{i(1, 3), f(2, 3)}, f(3, 3)) }},
		{"embedding indices", graph.ErrShape, func() error { return embeddingKernel(f(3), f(4, 2), f(3, 2)) }},
		{"embedding output", graph.ErrShape, func() error { return embeddingKernel(i(3), f(4, 2), f(3, 3)) }},
		{"cross_entropy labels", graph.ErrShape, func() error { return crossEntropyKernel(&graph.Attrs{Scalar: 1}, f(3, 4), i(2), f()) }},
		{"mse lengths", graph.ErrShape, func() error { return mseKernel(&graph.Attrs{Scalar: 1}, f(3), f(4), f()) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.ErrorIs(t, c.call(), c.want)
		})
	}
}
