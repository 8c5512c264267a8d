package alloc_test

import (
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	tagA = alloc.Tag{Node: 1, Op: "matmul", Scope: "mlp.fc1"}
	tagB = alloc.Tag{Node: 2, Op: "relu", Scope: "mlp"}
	tagC = alloc.Tag{Node: 3, Op: "softmax", Scope: "attn"}
	tagD = alloc.Tag{Node: 4, Op: "add"}
)

// ev is an event as a test expects it; Seq is its index in the list.
type ev struct {
	kind                alloc.EventKind
	addr                alloc.Ptr
	size                int64
	tag                 alloc.Tag
	allocated, reserved int64
}

func requireTrace(t *testing.T, got []alloc.Event, firstSeq int64, want ...ev) {
	t.Helper()
	require.Len(t, got, len(want))
	for i, w := range want {
		g := got[i]
		assert.Equal(t, firstSeq+int64(i), g.Seq, "event %d", i)
		assert.Equal(t, w, ev{g.Kind, g.Addr, g.Size, g.Tag, g.Allocated, g.Reserved}, "event %d (%v)", i, g.Kind)
	}
}

func TestTrace(t *testing.T) {
	a, _ := newAlloc(24*MiB, 64)
	// Sizes are multiples of 512 so requested and rounded agree.
	x, err := a.Malloc(1024, tagA)
	require.NoError(t, err)
	y, err := a.Malloc(4*MiB, tagB)
	require.NoError(t, err)
	s1, s2 := x.Ptr(), y.Ptr()
	require.NoError(t, a.Free(x))
	// 20 MiB needs a 20 MiB segment: 22 + 20 > 24, so the whole small
	// segment is released; 20 + 20 > 24 still, so it fails.
	_, err = a.Malloc(20*MiB, tagC)
	require.ErrorIs(t, err, alloc.ErrOutOfMemory)
	require.NoError(t, a.Free(y))
	require.NoError(t, a.EmptyCache())

	requireTrace(t, a.Trace(), 0,
		ev{alloc.EventSegmentAlloc, s1, 2 * MiB, tagA, 0, 2 * MiB},
		ev{alloc.EventAlloc, s1, 1024, tagA, 1024, 2 * MiB},
		ev{alloc.EventSegmentAlloc, s2, 20 * MiB, tagB, 1024, 22 * MiB},
		ev{alloc.EventAlloc, s2, 4 * MiB, tagB, 4*MiB + 1024, 22 * MiB},
		ev{alloc.EventFree, s1, 1024, tagA, 4 * MiB, 22 * MiB},
		ev{alloc.EventSegmentFree, s1, 2 * MiB, noTag, 4 * MiB, 20 * MiB},
		ev{alloc.EventOOM, 0, 20 * MiB, tagC, 4 * MiB, 20 * MiB},
		ev{alloc.EventFree, s2, 4 * MiB, tagB, 0, 20 * MiB},
		ev{alloc.EventSegmentFree, s2, 20 * MiB, noTag, 0, 0},
	)
	assert.Equal(t, a.Trace(), a.Snapshot().Trace)

	for k, name := range map[alloc.EventKind]string{
		alloc.EventAlloc: "alloc", alloc.EventFree: "free", alloc.EventSegmentAlloc: "segment_alloc",
		alloc.EventSegmentFree: "segment_free", alloc.EventOOM: "oom",
	} {
		assert.Equal(t, name, k.String())
	}
}

// The ring keeps the newest N events, oldest first, with their sequence
// numbers counting every event ever recorded.
func TestTraceWraparound(t *testing.T) {
	a, _ := newAlloc(GiB, 4)
	// Events: 0 segment_alloc, then for k = 0..4 alloc (seq 1+2k) and
	// free (seq 2+2k): 11 events, seq 0..10. The last 4 are seq 7..10:
	// alloc and free of k = 3, alloc and free of k = 4.
	var p alloc.Ptr
	for k := range 5 {
		tag := alloc.Tag{Node: k, Op: "op"}
		b, err := a.Malloc(512, tag)
		require.NoError(t, err)
		p = b.Ptr()
		require.NoError(t, a.Free(b))
	}
	t3, t4 := alloc.Tag{Node: 3, Op: "op"}, alloc.Tag{Node: 4, Op: "op"}
	requireTrace(t, a.Trace(), 7,
		ev{alloc.EventAlloc, p, 512, t3, 512, 2 * MiB},
		ev{alloc.EventFree, p, 512, t3, 0, 2 * MiB},
		ev{alloc.EventAlloc, p, 512, t4, 512, 2 * MiB},
		ev{alloc.EventFree, p, 512, t4, 0, 2 * MiB},
	)

	// Exactly full, then one more: the oldest goes.
	a, _ = newAlloc(GiB, 3)
	b := mustMalloc(t, a, 512) // seq 0 segment_alloc, 1 alloc
	mustFree(t, a, b)          // seq 2
	require.Len(t, a.Trace(), 3)
	assert.Equal(t, int64(0), a.Trace()[0].Seq)
	mustMalloc(t, a, 512) // seq 3
	tr := a.Trace()
	require.Len(t, tr, 3)
	assert.Equal(t, []int64{1, 2, 3}, []int64{tr[0].Seq, tr[1].Seq, tr[2].Seq})
}

func TestTraceDisabled(t *testing.T) {
	a, _ := newAlloc(GiB, 0)
	mustFree(t, a, mustMalloc(t, a, 512))
	assert.Nil(t, a.Trace())
	assert.Nil(t, a.Snapshot().Trace)
}

func TestSnapshot(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	malloc := func(n int64, tag alloc.Tag) *alloc.Block {
		b, err := a.Malloc(n, tag)
		require.NoError(t, err)
		return b
	}
	x := malloc(1000, tagA)  // small segment S1 at +0, 1024 B
	y := malloc(4*MiB, tagB) // large segment S2 at +0
	z := malloc(2000, tagC)  // S1 at +1024, 2048 B
	w := malloc(4*MiB, tagD) // S2 at +4 MiB
	s1, s2 := x.Ptr(), y.Ptr()
	mustFree(t, a, x)
	mustFree(t, a, y)

	snap := a.Snapshot()
	require.Len(t, snap.Segments, 2)
	g1, g2 := snap.Segments[0], snap.Segments[1]
	assert.Equal(t, s1, g1.Addr)
	assert.Equal(t, 2*MiB, g1.Size)
	assert.Equal(t, alloc.SmallPool, g1.Pool)
	assert.Equal(t, int64(2048), g1.Allocated)
	requireBlocks(t, g1,
		blk{0, 1024, alloc.Inactive},
		blk{1024, 2048, alloc.ActiveAllocated},
		blk{3072, 2*MiB - 3072, alloc.Inactive})
	assert.Equal(t, tagC, g1.Blocks[1].Tag)
	assert.Equal(t, int64(2000), g1.Blocks[1].Requested)
	assert.Equal(t, z.Ptr(), g1.Blocks[1].Addr)

	assert.Equal(t, s2, g2.Addr)
	assert.Equal(t, 20*MiB, g2.Size)
	assert.Equal(t, alloc.LargePool, g2.Pool)
	assert.Equal(t, 4*MiB, g2.Allocated)
	requireBlocks(t, g2,
		blk{0, 4 * MiB, alloc.Inactive},
		blk{4 * MiB, 4 * MiB, alloc.ActiveAllocated},
		blk{8 * MiB, 12 * MiB, alloc.Inactive})
	assert.Equal(t, tagD, g2.Blocks[1].Tag)
	assert.Equal(t, w.Ptr(), g2.Blocks[1].Addr)
	for _, g := range snap.Segments {
		for _, b := range g.Blocks {
			if b.State == alloc.Inactive {
				assert.Zero(t, b.Requested)
				assert.Equal(t, noTag, b.Tag, "free block at %#x belongs to no node", b.Addr)
			}
		}
	}
	require.NoError(t, checkState(a, be, []*alloc.Block{z, w}))
}

// Segments come out in address order however many there are (they live in
// a map inside the allocator).
func TestSnapshotAddressOrder(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	var live []*alloc.Block
	for i := range 40 {
		size := 12*MiB + int64(i%3)*2*MiB // own segments of 12, 14, 16 MiB
		if i%2 == 1 {
			size = MiB // fills a 2 MiB small segment in two
		}
		live = append(live, mustMalloc(t, a, size))
	}
	segs := a.Snapshot().Segments
	require.Len(t, segs, 20+10)
	for i := 1; i < len(segs); i++ {
		require.Less(t, segs[i-1].Addr, segs[i].Addr)
	}
	require.NoError(t, checkState(a, be, live))
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{
		0: "0 B", 1023: "1023 B", 1024: "1.00 KiB", 1536: "1.50 KiB",
		20 * MiB: "20.00 MiB", 3 * GiB: "3.00 GiB", 2048 * GiB: "2.00 TiB",
	} {
		assert.Equal(t, want, alloc.FormatBytes(n))
	}
}

// release_cached_blocks frees the large pool's whole segments before the
// small pool's, each pool in (size, address) order: the order in which
// segment_free events (and device frees) appear.
func TestReleaseOrder(t *testing.T) {
	a, _ := newAlloc(GiB, 64)
	// Small segments S1 < S2, then large segments L1 (20 MiB) < L2 (12 MiB).
	s1 := mustMalloc(t, a, MiB)
	s1b := mustMalloc(t, a, MiB) // fills S1
	s2 := mustMalloc(t, a, MiB)
	l1 := mustMalloc(t, a, 4*MiB)
	l1b := mustMalloc(t, a, 16*MiB) // fills L1
	l2 := mustMalloc(t, a, 12*MiB)
	for _, b := range []*alloc.Block{s1, s1b, s2, l1, l1b, l2} {
		mustFree(t, a, b)
	}
	n := len(a.Trace())
	require.NoError(t, a.EmptyCache())
	var got []alloc.Ptr
	var sizes []int64
	for _, e := range a.Trace()[n:] {
		require.Equal(t, alloc.EventSegmentFree, e.Kind)
		got = append(got, e.Addr)
		sizes = append(sizes, e.Size)
	}
	// Large by (size, address): L2 (12 MiB) before L1 (20 MiB); then small
	// by address: S1, S2.
	assert.Equal(t, []alloc.Ptr{l2.Ptr(), l1.Ptr(), s1.Ptr(), s2.Ptr()}, got)
	assert.Equal(t, []int64{12 * MiB, 20 * MiB, 2 * MiB, 2 * MiB}, sizes)
}
