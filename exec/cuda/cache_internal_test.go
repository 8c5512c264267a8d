package cuda

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cubinLike is the smallest image readCachedCubin takes for a cubin: an
// ELF64 little-endian header for EM_CUDA.
func cubinLike() []byte {
	b := make([]byte, 64)
	copy(b, "\x7fELF")
	b[4], b[5] = 2, 1
	b[18] = 190
	return b
}

// TestReadCachedCubin: a cache entry reaches the driver only when it is a
// regular file within the cap that starts like a cubin; anything else is a
// miss (the caller recompiles and rewrites it), and a garbled entry is
// dropped.
func TestReadCachedCubin(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, b, 0o644))
		return p
	}

	good := write("good.cubin", append(cubinLike(), "code"...))
	b, ok := readCachedCubin(good)
	assert.True(t, ok)
	assert.Equal(t, append(cubinLike(), "code"...), b)

	_, ok = readCachedCubin(filepath.Join(dir, "missing.cubin"))
	assert.False(t, ok, "missing")
	_, ok = readCachedCubin(dir)
	assert.False(t, ok, "a directory")

	wrongMachine := cubinLike()
	wrongMachine[18] = 62 // x86-64
	wrongClass := cubinLike()
	wrongClass[4] = 1
	for name, img := range map[string][]byte{
		"empty":     {},
		"garbage":   []byte("not a cubin at all, just text that is long enough to fill an ELF header......"),
		"truncated": cubinLike()[:20],
		"machine":   wrongMachine,
		"class":     wrongClass,
	} {
		p := write(name+".cubin", img)
		_, ok := readCachedCubin(p)
		assert.False(t, ok, name)
		assert.NoFileExists(t, p, "%s: a garbled entry is dropped", name)
	}

	// Over the cap: a sparse file, so the test writes next to nothing.
	big := filepath.Join(dir, "big.cubin")
	f, err := os.Create(big)
	require.NoError(t, err)
	_, err = f.Write(cubinLike())
	require.NoError(t, err)
	require.NoError(t, f.Truncate(maxCubinBytes+1))
	require.NoError(t, f.Close())
	_, ok = readCachedCubin(big)
	assert.False(t, ok, "over the cap")

	// A rewritten entry reads again.
	require.NoError(t, writeFileAtomic(big, cubinLike()))
	_, ok = readCachedCubin(big)
	assert.True(t, ok, "rewritten")
}
