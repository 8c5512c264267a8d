package cuda_test

import (
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
)

// TestCompileGarbledCache: a cache entry that is not a cubin is a miss;
// Compile recompiles, rewrites the entry, and takes it from the cache next.
func TestCompileGarbledCache(t *testing.T) {
	device(t)
	dir := t.TempDir()
	d, err := cuda.Open(cuda.Options{CacheDir: dir})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	src, err := cuda.Source("smoke.cu")
	require.NoError(t, err)
	m, err := d.Compile("smoke.cu", src)
	require.NoError(t, err)
	require.NoError(t, m.Close())
	files, err := filepath.Glob(filepath.Join(dir, "*.cubin"))
	require.NoError(t, err)
	require.Len(t, files, 1)

	for _, garbage := range [][]byte{[]byte("\x7fELF but not a cubin"), make([]byte, 4096)} {
		require.NoError(t, os.WriteFile(files[0], garbage, 0o644))
		m, err = d.Compile("smoke.cu", src)
		require.NoError(t, err)
		assert.False(t, m.Cached(), "a garbled entry is recompiled")
		require.NoError(t, m.Close())
		b, err := os.ReadFile(files[0])
		require.NoError(t, err)
		assert.Equal(t, "\x7fELF", string(b[:4]), "and rewritten")
		m, err = d.Compile("smoke.cu", src)
		require.NoError(t, err)
		assert.True(t, m.Cached())
		require.NoError(t, m.Close())
	}
}

// BenchmarkCompileCold compiles each of the executor's NVRTC programs (a
// kernel file, or part of one) and loads it, the cubin cache off
// (Options.NoCache): what a first run on a machine with empty caches
// spends per program before its first launch, one at a time. One
// sub-benchmark per program; run with -benchtime 1x for one compile of
// each. The driver's own cache (CUDA_CACHE_PATH, ~/.nv/ComputeCache) keeps
// NVRTC's machine code too: point it at an empty directory for a cold
// figure.
func BenchmarkCompileCold(b *testing.B) {
	device(b)
	d, err := cuda.Open(cuda.Options{NoCache: true})
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, d.Close()) })
	names, srcs, err := cuda.KernelPrograms()
	require.NoError(b, err)
	for i, name := range names {
		b.Run(name, func(b *testing.B) {
			for range b.N {
				m, err := d.Compile(name, srcs[i])
				require.NoError(b, err)
				require.False(b, m.Cached())
				require.NoError(b, m.Close())
			}
		})
	}
}

// BenchmarkNewExecutorCold is an executor's start on an empty cubin cache
// (a fresh cache directory each time): every kernel program compiled by
// NVRTC, side by side on the host's cores, and loaded. BenchmarkCompileCold's
// slowest program bounds it from below, their sum from above; the driver's
// cache (CUDA_CACHE_PATH) must be empty too for a cold figure.
func BenchmarkNewExecutorCold(b *testing.B) {
	device(b)
	for range b.N {
		b.StopTimer()
		d, err := cuda.Open(cuda.Options{CacheDir: b.TempDir()})
		require.NoError(b, err)
		b.StartTimer()
		e, err := cuda.NewExecutor(d, cuda.ExecutorOptions{})
		require.NoError(b, err)
		b.StopTimer()
		require.NoError(b, e.Close())
		require.NoError(b, d.Close())
		b.StartTimer()
	}
}

// TestForEachRunsEveryIndexOnce: the kernel set's worker pool calls f for
// each index exactly once, whatever the number of workers (none, one, more
// than the work), and returns after the last.
func TestForEachRunsEveryIndexOnce(t *testing.T) {
	for _, c := range []struct{ workers, n int }{{0, 5}, {1, 7}, {4, 100}, {16, 3}, {8, 0}} {
		hits := make([]atomic.Int32, c.n)
		cuda.ForEach(c.workers, c.n, func(i int) { hits[i].Add(1) })
		for i := range hits {
			require.Equal(t, int32(1), hits[i].Load(), "workers %d, n %d: index %d", c.workers, c.n, i)
		}
	}
}
