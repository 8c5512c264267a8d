package cpu

import (
	"math/rand/v2"
	"testing"

	"github.com/batchfit/batchfit/graph"
)

// benchBuf is a float buffer of shape filled with seeded values in [-2, 2).
func benchBuf(shape ...int) *buf {
	r := rand.New(rand.NewPCG(1, 2))
	b := &buf{shape: shape, f: make([]float32, graph.Numel(shape))}
	for i := range b.f {
		b.f[i] = float32(4*r.Float64() - 2)
	}
	return b
}

func emptyBuf(shape ...int) *buf {
	return &buf{shape: shape, f: make([]float32, graph.Numel(shape))}
}

// benchKernel times fn, reporting bytes of out written per run.
func benchKernel(b *testing.B, out *buf, fn func() error) {
	b.SetBytes(int64(4 * len(out.f)))
	for b.Loop() {
		if err := fn(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSoftmax_256x1024_lastAxis(b *testing.B) {
	x, out := benchBuf(256, 1024), emptyBuf(256, 1024)
	benchKernel(b, out, func() error { return softmaxKernel(false, 1, x, out) })
}

func BenchmarkSoftmax_64x256x64_middleAxis(b *testing.B) {
	x, out := benchBuf(64, 256, 64), emptyBuf(64, 256, 64)
	benchKernel(b, out, func() error { return softmaxKernel(false, 1, x, out) })
}

func BenchmarkAdd_512x1024_sameShape(b *testing.B) {
	x, y, out := benchBuf(512, 1024), benchBuf(512, 1024), emptyBuf(512, 1024)
	benchKernel(b, out, func() error { return binaryKernel(graph.OpAdd, x, y, out) })
}

func BenchmarkAdd_512x1024_rowBroadcast(b *testing.B) {
	x, y, out := benchBuf(512, 1024), benchBuf(1024), emptyBuf(512, 1024)
	benchKernel(b, out, func() error { return binaryKernel(graph.OpAdd, x, y, out) })
}

func BenchmarkMul_512x1024_columnBroadcast(b *testing.B) {
	x, y, out := benchBuf(512, 1024), benchBuf(512, 1), emptyBuf(512, 1024)
	benchKernel(b, out, func() error { return binaryKernel(graph.OpMul, x, y, out) })
}

func BenchmarkSum_512x1024_axis0(b *testing.B) {
	x, out := benchBuf(512, 1024), emptyBuf(1024)
	a := &graph.Attrs{Axes: []int{0}}
	b.SetBytes(int64(4 * len(x.f)))
	for b.Loop() {
		if err := reduceKernel(graph.OpSum, a, x, out); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkLayerNorm_512x1024(b *testing.B) {
	x, w, bias, out := benchBuf(512, 1024), benchBuf(1024), benchBuf(1024), emptyBuf(512, 1024)
	a := &graph.Attrs{NormDims: 1, Eps: 1e-5}
	benchKernel(b, out, func() error { return layerNormKernel(a, x, w, bias, out) })
}

func BenchmarkBatchNormTraining_32x64x32x32(b *testing.B) {
	x, w, bias, out := benchBuf(32, 64, 32, 32), benchBuf(64), benchBuf(64), emptyBuf(32, 64, 32, 32)
	a := &graph.Attrs{Training: true, Eps: 1e-5}
	benchKernel(b, out, func() error { return batchNormKernel(a, []*buf{x, w, bias}, out) })
}

func BenchmarkPermute_512x1024_transpose(b *testing.B) {
	x, out := benchBuf(512, 1024), emptyBuf(1024, 512)
	benchKernel(b, out, func() error { return permuteKernel([]int{1, 0}, x, out) })
}
