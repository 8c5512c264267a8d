package alloc_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A request the device refuses at first but that fits once the cached
// whole segments are released: release_cached_blocks, one retry, success.
func TestRetrySucceedsAfterRelease(t *testing.T) {
	a, be := newAlloc(32*MiB, 0)
	// 4 MiB → 20 MiB large segment; freed, it is cached whole.
	big := mustMalloc(t, a, 4*MiB)
	mustFree(t, a, big)
	// 1 KiB → 2 MiB small segment, kept allocated. Device: 22 of 32 MiB.
	keep := mustMalloc(t, a, KiB)
	require.Equal(t, 22*MiB, be.Used())

	// 22 MiB: larger than the cached 20 MiB block, so it needs a 22 MiB
	// segment; 22 + 22 > 32 and the device refuses. Releasing the cached
	// 20 MiB segment leaves 2 + 22 ≤ 32: the retry succeeds. The small
	// segment is split (keep is in it), so it stays.
	b := mustMalloc(t, a, 22*MiB)
	st := a.Stats()
	assert.Equal(t, int64(1), st.NumAllocRetries)
	assert.Zero(t, st.NumOOMs)
	assert.Equal(t, int64(1), st.NumDeviceFree)
	assert.Equal(t, 1, be.Frees)
	assert.Equal(t, 3, be.Mallocs, "20 MiB, 2 MiB, then 22 MiB; the refused call reserves nothing")
	assert.Equal(t, 24*MiB, st.ReservedBytes[alloc.All].Current)
	assert.Equal(t, 24*MiB, be.Used())
	require.NoError(t, checkState(a, be, []*alloc.Block{keep, b}))
}

// When even the retry fails, Malloc returns an *OOMError: the whole cached
// segment was released on the way, the split one was not.
func TestOOM(t *testing.T) {
	a, be := newAlloc(24*MiB, 16)
	// 4 MiB → 20 MiB segment, split: 4 MiB allocated, 16 MiB free.
	held := mustMalloc(t, a, 4*MiB)
	// 1 KiB → a 2 MiB small segment, freed: cached whole. Device: 22 MiB.
	s := mustMalloc(t, a, KiB)
	mustFree(t, a, s)
	require.Equal(t, 22*MiB, be.Used())

	// 17 MiB + 1 → 17 MiB + 512, more than the cached 16 MiB free block,
	// so it needs an 18 MiB segment. 22 + 18 > 24: refused. Releasing the
	// whole small segment leaves 20 + 18 > 24: refused again.
	tag := alloc.Tag{Node: 7, Op: "matmul", Scope: "mlp.fc1"}
	b, err := a.Malloc(17*MiB+1, tag)
	require.Nil(t, b)
	require.ErrorIs(t, err, alloc.ErrOutOfMemory)
	var oom *alloc.OOMError
	require.True(t, errors.As(err, &oom))
	assert.Equal(t, 17*MiB+1, oom.Requested)
	assert.Equal(t, 17*MiB+512, oom.Rounded)
	assert.Equal(t, 4*MiB, oom.DeviceFree) // 24 − 20 after the release
	assert.Equal(t, 24*MiB, oom.DeviceTotal)
	assert.Equal(t, 4*MiB, oom.Allocated)
	assert.Equal(t, 20*MiB, oom.Reserved) // the split segment survived
	assert.Equal(t, tag, oom.Tag)

	st := a.Stats()
	assert.Equal(t, int64(1), st.NumAllocRetries)
	assert.Equal(t, int64(1), st.NumOOMs)
	assert.Equal(t, int64(1), st.NumDeviceFree)
	assert.Equal(t, 1, be.Frees)
	require.NoError(t, checkState(a, be, []*alloc.Block{held}))

	tr := a.Trace()
	last := tr[len(tr)-1]
	assert.Equal(t, alloc.EventOOM, last.Kind)
	assert.Equal(t, tag, last.Tag)
	assert.Equal(t, alloc.EventSegmentFree, tr[len(tr)-2].Kind)

	// Still usable: free the 4 MiB block and the segment is one free
	// 20 MiB block, which now serves the same request with no device call;
	// the 3 MiB − 512 left over (> 1 MiB) splits off.
	mustFree(t, a, held)
	b = mustMalloc(t, a, 17*MiB+1)
	assert.Equal(t, 17*MiB+512, b.Size())
	// The small segment went in the release: 1 KiB needs a new one, and
	// 20 + 2 ≤ 24 gets it with no retry.
	s = mustMalloc(t, a, KiB)
	assert.Equal(t, 3, be.Mallocs)
	st = a.Stats()
	assert.Equal(t, int64(1), st.NumAllocRetries)
	assert.Equal(t, int64(1), st.NumOOMs)
	require.NoError(t, checkState(a, be, []*alloc.Block{b, s}))
}

// A request larger than the whole device: refused before and after the
// release, however empty the allocator is.
func TestOOMLargerThanDevice(t *testing.T) {
	a, be := newAlloc(64*MiB, 0)
	_, err := a.Malloc(65*MiB, alloc.Tag{Node: -1})
	var oom *alloc.OOMError
	require.ErrorAs(t, err, &oom)
	assert.Equal(t, 64*MiB, oom.DeviceFree)
	assert.Zero(t, oom.Reserved)
	st := a.Stats()
	assert.Equal(t, int64(1), st.NumAllocRetries)
	assert.Equal(t, int64(1), st.NumOOMs)
	assert.Zero(t, be.Mallocs)
	require.NoError(t, checkState(a, be, nil))
}

// EmptyCache releases whole free segments only, as torch.cuda.empty_cache.
func TestEmptyCache(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	// Small: segment A filled by two 1 MiB blocks, then both freed (whole);
	// segment B holds s3 and 1 MiB free (split).
	s1 := mustMalloc(t, a, MiB)
	s2 := mustMalloc(t, a, MiB)
	s3 := mustMalloc(t, a, MiB)
	mustFree(t, a, s1)
	mustFree(t, a, s2)
	// Large: segment C filled by 4 + 16 MiB, then both freed (whole);
	// segment D holds l3 and 16 MiB free (split).
	l1 := mustMalloc(t, a, 4*MiB)
	l2 := mustMalloc(t, a, 16*MiB)
	l3 := mustMalloc(t, a, 4*MiB)
	mustFree(t, a, l1)
	mustFree(t, a, l2)
	require.Equal(t, 4, be.Mallocs)
	require.Equal(t, 44*MiB, be.Used()) // 2 + 2 + 20 + 20

	require.NoError(t, a.EmptyCache())
	assert.Equal(t, 2, be.Frees)
	st := a.Stats()
	assert.Equal(t, 22*MiB, st.ReservedBytes[alloc.All].Current) // B + D
	assert.Equal(t, 2*MiB, st.ReservedBytes[alloc.SmallPool].Current)
	assert.Equal(t, 20*MiB, st.ReservedBytes[alloc.LargePool].Current)
	assert.Equal(t, int64(2), st.Segment[alloc.All].Current)
	assert.Equal(t, MiB+16*MiB, st.InactiveSplitBytes[alloc.All].Current)
	assert.Zero(t, st.NumAllocRetries, "empty_cache is not a retry")
	segs := a.Snapshot().Segments
	require.Len(t, segs, 2)
	assert.Equal(t, s3.Ptr(), segs[0].Addr)
	assert.Equal(t, l3.Ptr(), segs[1].Addr)
	require.NoError(t, checkState(a, be, []*alloc.Block{s3, l3}))

	require.NoError(t, a.EmptyCache(), "nothing whole left")
	assert.Equal(t, 2, be.Frees)

	mustFree(t, a, s3)
	mustFree(t, a, l3)
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, be.Used())
	assert.Empty(t, a.Snapshot().Segments)
	require.NoError(t, checkState(a, be, nil))
}

// ResetPeak sets every peak to its current value; later growth raises it
// from there.
func TestResetPeak(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	x := mustMalloc(t, a, 4*MiB)
	y := mustMalloc(t, a, KiB)
	mustFree(t, a, x)
	st := a.Stats()
	assert.Equal(t, 4*MiB+KiB, st.AllocatedBytes[alloc.All].Peak)
	assert.Equal(t, KiB, st.AllocatedBytes[alloc.All].Current)

	a.ResetPeak()
	st = a.Stats()
	m := st.Map()
	for k, v := range m {
		if cur, ok := strings.CutSuffix(k, ".peak"); ok {
			assert.Equal(t, m[cur+".current"], v, k)
		}
	}
	assert.Equal(t, KiB, st.AllocatedBytes[alloc.All].Peak)
	assert.Equal(t, 22*MiB, st.ReservedBytes[alloc.All].Peak, "reserved stays: the 20 MiB is cached")
	// Accumulated totals are untouched by a peak reset.
	assert.Equal(t, 4*MiB+KiB, st.AllocatedBytes[alloc.All].Allocated)

	z := mustMalloc(t, a, 2*KiB)
	st = a.Stats()
	assert.Equal(t, 3*KiB, st.AllocatedBytes[alloc.All].Peak)
	assert.Equal(t, 3*KiB, st.AllocatedBytes[alloc.SmallPool].Peak)
	assert.Zero(t, st.AllocatedBytes[alloc.LargePool].Peak)
	require.NoError(t, checkState(a, be, []*alloc.Block{y, z}))
}

// A request too large for its size classes to fit in an int64 is refused
// like any request larger than the device: the cache is released, the
// retry fails and Malloc returns an *OOMError. (Rounding such a size used
// to overflow into a negative size that matched a cached small block.)
func TestMallocHugeRequest(t *testing.T) {
	for _, n := range []int64{math.MaxInt64, math.MaxInt64 - 511, math.MaxInt64 - 512, math.MaxInt64&^(2*MiB-1) + 1} {
		a, be := newAlloc(GiB, 0)
		mustFree(t, a, mustMalloc(t, a, 1000)) // a whole cached small segment
		b, err := a.Malloc(n, tagA)
		var oom *alloc.OOMError
		require.ErrorAs(t, err, &oom, "malloc(%d) gave %+v", n, b)
		assert.Equal(t, n, oom.Requested)
		assert.Equal(t, GiB, oom.DeviceFree, "the cached segment is released first")
		assert.Zero(t, oom.Reserved)
		st := a.Stats()
		assert.Equal(t, int64(1), st.NumAllocRetries)
		assert.Equal(t, int64(1), st.NumOOMs)
		require.NoError(t, checkState(a, be, nil))
	}
}

// flakyBackend is a simulated device that refuses to free one address.
type flakyBackend struct {
	*alloc.SimBackend
	failFree alloc.Ptr
}

var errDeviceBusy = errors.New("device busy")

func (f *flakyBackend) Free(p alloc.Ptr) error {
	if p == f.failFree {
		return errDeviceBusy
	}
	return f.SimBackend.Free(p)
}

// A device free failing half way through a release leaves the allocator
// consistent: segments already released are gone from the free lists, the
// one that failed is still cached, and a later release finishes the job.
func TestReleaseFailure(t *testing.T) {
	fb := &flakyBackend{SimBackend: alloc.NewSimBackend(GiB)}
	a := alloc.New(fb, alloc.Options{})
	// Two whole cached small segments: A (filled by two 1 MiB blocks) and
	// B; released in address order, A first.
	x := mustMalloc(t, a, MiB)
	y := mustMalloc(t, a, MiB)
	z := mustMalloc(t, a, MiB)
	for _, b := range []*alloc.Block{x, y, z} {
		mustFree(t, a, b)
	}
	segA, segB := x.Ptr(), z.Ptr()
	fb.failFree = segB

	require.ErrorIs(t, a.EmptyCache(), errDeviceBusy)
	require.NoError(t, checkState(a, fb.SimBackend, nil))
	segs := a.Snapshot().Segments
	require.Len(t, segs, 1)
	assert.Equal(t, segB, segs[0].Addr)

	// The next small request must come from B, not from released A.
	b := mustMalloc(t, a, KiB)
	assert.Equal(t, segB, b.Ptr())
	assert.NotEqual(t, segA, b.Ptr())
	mustFree(t, a, b)

	fb.failFree = 0
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, fb.Used())
	require.NoError(t, checkState(a, fb.SimBackend, nil))
}
