package cpu

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// fbuf is a float buffer of the given shape with non-zero data.
func fbuf(shape ...int) *buf {
	b := &buf{shape: shape, f: make([]float32, graph.Numel(shape))}
	for i := range b.f {
		b.f[i] = float32(i%7) - 3
	}
	return b
}

// The kernels re-check what shape inference promised, so an inconsistent
// buffer gives a typed error instead of a panic inside BLAS.
func TestLinalgKernelsRejectBadBuffers(t *testing.T) {
	conv := &graph.Attrs{Stride: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}
	pool := &graph.Attrs{Kernel: [2]int{2, 2}, Stride: [2]int{2, 2}, Dilation: [2]int{1, 1}}
	short := fbuf(2, 3)
	short.f = short.f[:5]
	ints := &buf{shape: []int{2, 3}, i: make([]int64, 6)}
	cases := []struct {
		name string
		err  error
		run  func() error
	}{
		{"matmul inner mismatch", graph.ErrShape, func() error { return matmulKernel(false, false, fbuf(2, 3), fbuf(4, 5), fbuf(2, 5)) }},
		{"matmul rank 1", graph.ErrShape, func() error { return matmulKernel(false, false, fbuf(3), fbuf(3, 5), fbuf(5)) }},
		{"matmul leading axes", graph.ErrShape, func() error { return matmulKernel(false, false, fbuf(2, 2, 3), fbuf(3, 3, 4), fbuf(3, 2, 4)) }},
		{"matmul wrong out", graph.ErrShape, func() error { return matmulKernel(false, false, fbuf(2, 3), fbuf(3, 4), fbuf(2, 5)) }},
		{"matmul short data", graph.ErrShape, func() error { return matmulKernel(false, false, short, fbuf(3, 4), fbuf(2, 4)) }},
		{"matmul int64 operand", graph.ErrDType, func() error { return matmulKernel(false, false, ints, fbuf(3, 4), fbuf(2, 4)) }},
		{"linear features", graph.ErrShape, func() error { return linearKernel(fbuf(2, 3), fbuf(4, 5), nil, fbuf(2, 4)) }},
		{"linear bias", graph.ErrShape, func() error { return linearKernel(fbuf(2, 3), fbuf(4, 3), fbuf(3), fbuf(2, 4)) }},
		{"linear missing weight", graph.ErrArity, func() error { return linearKernel(fbuf(2, 3), nil, nil, fbuf(2, 4)) }},
		{"conv groups", graph.ErrShape, func() error {
			return conv2dKernel(&graph.Attrs{Stride: conv.Stride, Dilation: conv.Dilation, Groups: 2}, fbuf(1, 3, 4, 4), fbuf(2, 3, 3, 3), nil, fbuf(1, 2, 2, 2))
		}},
		{"conv out shape", graph.ErrShape, func() error { return conv2dKernel(conv, fbuf(1, 3, 4, 4), fbuf(2, 3, 3, 3), nil, fbuf(1, 2, 3, 3)) }},
		{"conv zero stride", graph.ErrAttr, func() error {
			return conv2dKernel(&graph.Attrs{Dilation: conv.Dilation, Groups: 1}, fbuf(1, 3, 4, 4), fbuf(2, 3, 3, 3), nil, fbuf(1, 2, 2, 2))
		}},
		{"conv bias", graph.ErrShape, func() error { return conv2dKernel(conv, fbuf(1, 3, 4, 4), fbuf(2, 3, 3, 3), fbuf(3), fbuf(1, 2, 2, 2)) }},
		{"max pool rank 3", graph.ErrShape, func() error { return maxPool2dKernel(pool, fbuf(3, 4, 4), fbuf(3, 2, 2)) }},
		{"max pool out shape", graph.ErrShape, func() error { return maxPool2dKernel(pool, fbuf(1, 3, 4, 4), fbuf(1, 3, 3, 3)) }},
		{"avg pool dilation", graph.ErrAttr, func() error {
			return avgPool2dKernel(&graph.Attrs{Kernel: pool.Kernel, Stride: pool.Stride, Dilation: [2]int{2, 2}}, fbuf(1, 3, 4, 4), fbuf(1, 3, 2, 2))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.ErrorIs(t, c.run(), c.err)
		})
	}
}

// Empty extents (k = 0, no rows) must not reach BLAS, which panics on them.
func TestGemmEmptyExtents(t *testing.T) {
	out := fbuf(2, 3)
	assert.NoError(t, matmulKernel(false, false, fbuf(2, 0), fbuf(0, 3), out))
	assert.Equal(t, make([]float32, 6), out.f, "a product over an empty inner axis is zero")
	assert.NoError(t, matmulKernel(false, false, fbuf(0, 2, 4), fbuf(4, 3), fbuf(0, 2, 3)))
	lin := fbuf(2, 3)
	assert.NoError(t, linearKernel(fbuf(2, 0), fbuf(3, 0), &buf{shape: []int{3}, f: []float32{1, 2, 3}}, lin))
	assert.Equal(t, []float32{1, 2, 3, 1, 2, 3}, lin.f, "only the bias remains")
}
