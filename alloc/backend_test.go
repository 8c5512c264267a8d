package alloc_test

import (
	"math"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSimBackend(t *testing.T) {
	be := alloc.NewSimBackend(GiB)
	p, err := be.Malloc(3 * MiB)
	require.NoError(t, err)
	// Refused: one byte more than is left, and a size whose sum with the
	// bytes in use overflows an int64 (it used to wrap negative and pass).
	for _, n := range []int64{GiB - 3*MiB + 1, math.MaxInt64, math.MaxInt64 - MiB} {
		_, err = be.Malloc(n)
		require.ErrorIs(t, err, alloc.ErrDeviceOOM, "malloc %d", n)
	}
	_, err = be.Malloc(0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, alloc.ErrDeviceOOM, "a bad size is not out of memory")

	q, err := be.Malloc(GiB - 3*MiB) // exactly what is left
	require.NoError(t, err)
	assert.Equal(t, GiB, be.Used())
	free, total, err := be.MemInfo()
	require.NoError(t, err)
	assert.Zero(t, free)
	assert.Equal(t, GiB, total)
	// Segments start on 2 MiB boundaries and do not overlap.
	assert.Zero(t, p%(2<<20))
	assert.Zero(t, q%(2<<20))
	assert.GreaterOrEqual(t, q, p+alloc.Ptr(3*MiB))

	require.NoError(t, be.Free(p))
	require.Error(t, be.Free(p), "double free")
	require.Error(t, be.Free(12345), "unknown address")
	assert.Equal(t, GiB-3*MiB, be.Used())
	assert.Equal(t, 2, be.Mallocs)
	assert.Equal(t, 1, be.Frees)
}

// The largest request whose segment size fits an int64 reaches the device,
// which must refuse it however much is in use.
func TestMallocLargestRequest(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	keep := mustMalloc(t, a, 1000)
	n := int64(math.MaxInt64) &^ (2*MiB - 1)
	_, err := a.Malloc(n, tagA)
	var oom *alloc.OOMError
	require.ErrorAs(t, err, &oom)
	assert.Equal(t, n, oom.Rounded)
	assert.Equal(t, GiB-2*MiB, oom.DeviceFree)
	require.NoError(t, checkState(a, be, []*alloc.Block{keep}))
}
