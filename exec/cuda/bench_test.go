package cuda_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

var benchSizes = []struct {
	name string
	size int64
}{{"4KiB", 4 << 10}, {"256MiB", 256 << 20}}

// BenchmarkCachedAllocFree is a Malloc+Free pair through the caching
// allocator over CUDA: after the first segment, no driver call.
func BenchmarkCachedAllocFree(b *testing.B) {
	d := device(b)
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			a := alloc.New(d.Backend(), alloc.Options{})
			defer a.EmptyCache()
			tag := alloc.Tag{Node: -1, Op: "bench"}
			for b.Loop() {
				blk, err := a.Malloc(s.size, tag)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.Free(blk); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCuMemAllocFree is the raw cuMemAlloc_v2+cuMemFree_v2 pair the
// cache saves.
func BenchmarkCuMemAllocFree(b *testing.B) {
	be := device(b).Backend()
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			for b.Loop() {
				p, err := be.Malloc(s.size)
				if err != nil {
					b.Fatal(err)
				}
				if err := be.Free(p); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkLaunch launches an empty kernel: "sync" waits for each one,
// "async" queues them all and waits once at the end.
func BenchmarkLaunch(b *testing.B) {
	d := device(b)
	m := smokeModule(b, d)
	fn, err := m.Function("noop")
	require.NoError(b, err)
	one := [3]uint32{1, 1, 1}
	b.Run("sync", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := m.Launch(fn, one, one, 0); err != nil {
				b.Fatal(err)
			}
			if err := d.Synchronize(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("async", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := m.Launch(fn, one, one, 0); err != nil {
				b.Fatal(err)
			}
		}
		if err := d.Synchronize(); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkSgemm4096 is C = A·B for 4096×4096 matrices, reported in
// TFLOP/s (2·n³ per product).
func BenchmarkSgemm4096(b *testing.B) {
	d := device(b)
	a := alloc.New(d.Backend(), alloc.Options{})
	defer a.EmptyCache()
	bl, err := d.NewBLAS(a, cuda.DefaultWorkspace)
	require.NoError(b, err)
	defer bl.Close()
	const n = 4096
	r := newRand(8)
	var blocks [3]*alloc.Block
	for i := range blocks {
		blocks[i] = upload(b, d, a, testutil.RandFloats(r, n*n))
		defer a.Free(blocks[i])
	}
	A, B, C := blocks[0].Ptr(), blocks[1].Ptr(), blocks[2].Ptr()
	for _, mode := range []struct {
		name string
		tf32 bool
	}{{"FP32", false}, {"TF32", true}} {
		b.Run(mode.name, func(b *testing.B) {
			require.NoError(b, bl.SetTF32(mode.tf32))
			// Warm up: cuBLAS picks and loads its kernel on the first call.
			require.NoError(b, bl.Gemm(false, false, n, n, n, 1, A, n, B, n, 0, C, n))
			require.NoError(b, d.Synchronize())
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := bl.Gemm(false, false, n, n, n, 1, A, n, B, n, 0, C, n); err != nil {
					b.Fatal(err)
				}
			}
			if err := d.Synchronize(); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(2*n*n*n*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
		})
	}
}

// BenchmarkExecutorStep is one resident Adam training step of a 784 → 512
// → 512 → 10 MLP on the executor, the whole batch in one chunk: uploads of
// the batch, every launch of the forward and backward passes, the update on
// the device and the loss download, all in one call on the device thread.
func BenchmarkExecutorStep(b *testing.B) {
	e := freshExecutor(b, cuda.ExecutorOptions{})
	for _, n := range []int{256, 4096} {
		b.Run(fmt.Sprintf("mlp/batch=%d", n), func(b *testing.B) {
			loss, params := testutil.MLPModel(784, 512, false).Build(rand.New(rand.NewPCG(1, 2)), n)
			p := stepProgram(b, loss, params, 2)
			opt := optim.NewAdam(1e-3)
			o := cuda.ExecOptions{Resident: true, Optimizer: opt}
			chunks := planner.Chunks(n, 1)
			ctx := context.Background()
			for b.Loop() {
				if _, err := e.Execute(ctx, p, chunks, o); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkUpload uploads a ResNet-50 batch (64 × 3 × 224 × 224 float32,
// 38.5 MB) from Go memory: "staged" through the pinned buffers, as
// CopyHtoD does (waiting for the last piece), and "pageable", one
// cuMemcpyHtoD from the Go slice, as it did before; then staged with 1, 2
// and 8 goroutines copying each piece instead of 4. It reports bytes/s.
func BenchmarkUpload(b *testing.B) {
	d := device(b)
	src := make([]float32, 64*3*224*224)
	for i := range src {
		src[i] = float32(i%1000) / 1000
	}
	be := d.Backend()
	p, err := be.Malloc(int64(4 * len(src)))
	require.NoError(b, err)
	defer be.Free(p)
	for _, c := range []struct {
		name string
		copy func() error
	}{
		{"staged", func() error { return cuda.CopyHtoD(d, p, src) }},
		{"pageable", func() error { return cuda.CopyHtoDPageable(d, p, src) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(4 * len(src)))
			for b.Loop() {
				if err := c.copy(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	// The staged copy with other numbers of copying goroutines.
	for _, n := range []int{1, 2, 8} {
		b.Run(fmt.Sprintf("staged-copiers-%d", n), func(b *testing.B) {
			defer cuda.SetStageCopiers(cuda.SetStageCopiers(n))
			b.SetBytes(int64(4 * len(src)))
			for b.Loop() {
				if err := cuda.CopyHtoD(d, p, src); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
