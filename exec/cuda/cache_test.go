package cuda_test

import (
	"os"
	"path/filepath"
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

// BenchmarkCompileCold compiles each kernel file with NVRTC and loads it,
// the cubin cache off (Options.NoCache): what a first run on a machine
// with an empty cache spends per module before its first launch. One
// sub-benchmark per file; run with -benchtime 1x for one compile of each.
func BenchmarkCompileCold(b *testing.B) {
	device(b)
	d, err := cuda.Open(cuda.Options{NoCache: true})
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, d.Close()) })
	for _, file := range cuda.Names() {
		src, err := cuda.Source(file)
		require.NoError(b, err)
		b.Run(file, func(b *testing.B) {
			for range b.N {
				m, err := d.Compile(file, src)
				require.NoError(b, err)
				require.False(b, m.Cached())
				require.NoError(b, m.Close())
			}
		})
	}
}
