package alloc_test

import (
	"math"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TraceEntries outside 0…MaxTraceEntries fails Validate with ErrInvalid.
func TestOptionsValidate(t *testing.T) {
	for _, n := range []int{0, 1, 65536, alloc.MaxTraceEntries} {
		assert.NoError(t, alloc.Options{TraceEntries: n}.Validate(), n)
	}
	for _, n := range []int{-1, alloc.MaxTraceEntries + 1, math.MaxInt} {
		assert.ErrorIs(t, alloc.Options{TraceEntries: n}.Validate(), alloc.ErrInvalid, n)
	}
}

// New takes any TraceEntries without panicking or reserving the trace up
// front (a huge one made a slice of that capacity and panicked), and
// traces as a ring of that many events.
func TestNewWithHugeTraceEntries(t *testing.T) {
	for _, n := range []int{math.MaxInt, math.MaxInt32, alloc.MaxTraceEntries + 1, -5} {
		var a *alloc.Allocator
		require.NotPanics(t, func() { a, _ = newAlloc(GiB, n) }, n)
		b := mustMalloc(t, a, 4*KiB)
		require.NoError(t, a.Free(b))
		if n < 0 {
			assert.Nil(t, a.Trace(), "a negative TraceEntries traces nothing")
		} else {
			assert.Len(t, a.Trace(), 3, "segment_alloc, alloc, free")
		}
	}
	a, _ := newAlloc(GiB, 2)
	for range 3 {
		require.NoError(t, a.Free(mustMalloc(t, a, 4*KiB)))
	}
	tr := a.Trace()
	require.Len(t, tr, 2, "the ring keeps the last 2")
	assert.Equal(t, []int64{5, 6}, []int64{tr[0].Seq, tr[1].Seq})
}
