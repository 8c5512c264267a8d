package alloc_test

import (
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// round_size: below 512 rounds to 512, otherwise up to a multiple of 512.
func TestRoundSize(t *testing.T) {
	for _, c := range []struct{ n, want int64 }{
		{1, 512},
		{511, 512},
		{512, 512},
		{513, 1024},
		{1000, 1024},
		{MiB, MiB},
		{MiB + 1, MiB + 512},
		{10*MiB - 1, 10 * MiB},
	} {
		assert.Equal(t, c.want, alloc.RoundSize(c.n), "RoundSize(%d)", c.n)
	}

	// The block handed out has the rounded size: in the small pool every
	// remainder is a multiple of 512 ≥ 512, so the block is split exactly.
	a, _ := newAlloc(GiB, 0)
	for _, c := range []struct{ n, want int64 }{{1, 512}, {512, 512}, {513, 1024}} {
		b := mustMalloc(t, a, c.n)
		assert.Equal(t, c.want, b.Size(), "block for %d bytes", c.n)
		assert.Equal(t, c.n, b.Requested())
	}
}

// A zero-byte request gets an empty block that occupies nothing; freeing
// it is a no-op, as cudaFree of the null pointer PyTorch hands out.
func TestMallocZero(t *testing.T) {
	a, be := newAlloc(GiB, 16)
	b, err := a.Malloc(0, alloc.Tag{Node: 3, Op: "empty"})
	require.NoError(t, err)
	assert.Zero(t, b.Size())
	assert.Zero(t, b.Ptr())
	assert.Zero(t, be.Mallocs)
	assert.Equal(t, alloc.Stats{}, a.Stats())
	assert.Empty(t, a.Snapshot().Segments)
	require.NoError(t, a.Free(b))
	require.NoError(t, a.Free(b), "the empty block may be freed again")
	assert.Equal(t, alloc.Stats{}, a.Stats())
	assert.Empty(t, a.Trace())
}

func TestMallocNegative(t *testing.T) {
	a, be := newAlloc(GiB, 16)
	b, err := a.Malloc(-1, alloc.Tag{})
	require.ErrorIs(t, err, alloc.ErrInvalid)
	assert.Nil(t, b)
	assert.Zero(t, be.Mallocs)
	assert.Equal(t, alloc.Stats{}, a.Stats())
}

// get_pool: a rounded size ≤ 1 MiB is small, anything larger is large.
func TestPoolBoundary(t *testing.T) {
	a, be := newAlloc(GiB, 0)

	// 1 MiB is still small: a 2 MiB small segment, split 1 MiB + 1 MiB.
	small := mustMalloc(t, a, MiB)
	st := a.Stats()
	assert.Equal(t, MiB, st.AllocatedBytes[alloc.SmallPool].Current)
	assert.Equal(t, 2*MiB, st.ReservedBytes[alloc.SmallPool].Current)
	assert.Zero(t, st.AllocatedBytes[alloc.LargePool].Current)
	assert.Equal(t, alloc.SmallPool, segmentOf(t, a, small.Ptr()).Pool)

	// 1 MiB + 1 rounds to 1 MiB + 512 and goes to the large pool: a 20 MiB
	// segment (rounded < 10 MiB), even though the small segment's free
	// 1 MiB is close in size.
	large := mustMalloc(t, a, MiB+1)
	assert.Equal(t, MiB+512, large.Size())
	st = a.Stats()
	assert.Equal(t, MiB+512, st.AllocatedBytes[alloc.LargePool].Current)
	assert.Equal(t, 20*MiB, st.ReservedBytes[alloc.LargePool].Current)
	assert.Equal(t, alloc.LargePool, segmentOf(t, a, large.Ptr()).Pool)
	assert.Equal(t, 2, be.Mallocs)
	require.NoError(t, checkState(a, be, []*alloc.Block{small, large}))
}

// get_allocation_size: 2 MiB for the small pool, 20 MiB for rounded sizes
// below 10 MiB, otherwise the rounded size rounded up to 2 MiB.
func TestSegmentSize(t *testing.T) {
	for _, c := range []struct {
		name           string
		request        int64
		segment, block int64 // segment reserved, block handed out
		splits         bool  // a free remainder follows the block
	}{
		// 1 → 512 B block in a 2 MiB segment.
		{"1B", 1, 2 * MiB, 512, true},
		// 1 MiB is the largest small request: 2 MiB segment, 1 MiB left.
		{"1MiB", MiB, 2 * MiB, MiB, true},
		// 1 MiB + 1 → 1 MiB + 512: large, 20 MiB segment, 19 MiB − 512 left.
		{"1MiB+1", MiB + 1, 20 * MiB, MiB + 512, true},
		// 10 MiB − 512 rounds to itself, still below 10 MiB: 20 MiB segment,
		// 10 MiB + 512 left over > 1 MiB, so it splits.
		{"10MiB-512", 10*MiB - 512, 20 * MiB, 10*MiB - 512, true},
		// 10 MiB − 1 rounds up to 10 MiB: a segment of its own size.
		{"10MiB-1", 10*MiB - 1, 10 * MiB, 10 * MiB, false},
		// 10 MiB exactly: a 10 MiB segment, nothing left over.
		{"10MiB", 10 * MiB, 10 * MiB, 10 * MiB, false},
		// 11 MiB + 1 → 11 MiB + 512 → segment rounded up to 12 MiB; the
		// 1 MiB − 512 left over is ≤ 1 MiB, so the block keeps all 12 MiB.
		{"11MiB+1", 11*MiB + 1, 12 * MiB, 12 * MiB, false},
		// 12 MiB is already a multiple of 2 MiB.
		{"12MiB", 12 * MiB, 12 * MiB, 12 * MiB, false},
		// 100 MiB + 1 → 102 MiB segment; 2 MiB − 512 left over > 1 MiB splits.
		{"100MiB+1", 100*MiB + 1, 102 * MiB, 100*MiB + 512, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.segment, alloc.SegmentSize(alloc.RoundSize(c.request)))
			a, be := newAlloc(GiB, 0)
			b := mustMalloc(t, a, c.request)
			assert.Equal(t, 1, be.Mallocs)
			assert.Equal(t, c.segment, be.Used())
			assert.Equal(t, c.block, b.Size())
			assert.Equal(t, c.request, b.Requested())
			seg := segmentOf(t, a, b.Ptr())
			assert.Equal(t, c.segment, seg.Size)
			assert.Equal(t, seg.Addr, b.Ptr(), "the request keeps the segment's lowest addresses")
			want := []blk{{0, c.block, alloc.ActiveAllocated}}
			if c.splits {
				want = append(want, blk{c.block, c.segment - c.block, alloc.Inactive})
			}
			requireBlocks(t, seg, want...)
			st := a.Stats()
			assert.Equal(t, c.block, st.AllocatedBytes[alloc.All].Current)
			assert.Equal(t, c.request, st.RequestedBytes[alloc.All].Current)
			split := int64(0)
			if c.splits {
				split = 1
			}
			assert.Equal(t, split, st.InactiveSplit[alloc.All].Current)
			require.NoError(t, checkState(a, be, []*alloc.Block{b}))
		})
	}
}

// get_free_block: lower_bound on (size, address) finds the smallest free
// block that is large enough and, among equals, the lowest address.
func TestBestFit(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	// One 2 MiB small segment at base S:
	//   S+0      g1  4 KiB   (freed below)
	//   S+4K     s1  512 B   separator, stays allocated
	//   S+4.5K   g2  2 KiB   (freed below)
	//   S+6.5K   s2  512 B
	//   S+7K     g3  2 KiB   (freed below)
	//   S+9K     s3  512 B
	//   S+9.5K   tail, free: 2 MiB − 9.5 KiB
	g1 := mustMalloc(t, a, 4*KiB)
	s1 := mustMalloc(t, a, 512)
	g2 := mustMalloc(t, a, 2*KiB)
	s2 := mustMalloc(t, a, 512)
	g3 := mustMalloc(t, a, 2*KiB)
	s3 := mustMalloc(t, a, 512)
	base := g1.Ptr()
	at := func(off int64) alloc.Ptr { return base + alloc.Ptr(off) }
	require.Equal(t, at(4608), g2.Ptr())
	require.Equal(t, at(7168), g3.Ptr())
	g2Addr, g3Addr := g2.Ptr(), g3.Ptr()
	for _, b := range []*alloc.Block{g1, g2, g3} {
		mustFree(t, a, b)
	}
	// Free blocks: 4 KiB @0, 2 KiB @4.5K, 2 KiB @7K, tail @9.5K.

	// 1536 B: the two 2 KiB blocks tie on size; the lower address wins.
	// The 512 B remainder splits off (small pool: remainder ≥ 512).
	b1 := mustMalloc(t, a, 1536)
	assert.Equal(t, g2Addr, b1.Ptr())
	assert.Equal(t, int64(1536), b1.Size())

	// 2 KiB: the 512 B piece at 6K is too small; the other 2 KiB fits
	// exactly, ahead of the 4 KiB block and the tail.
	b2 := mustMalloc(t, a, 2*KiB)
	assert.Equal(t, g3Addr, b2.Ptr())

	// 3 KiB: only the 4 KiB block and the tail are large enough; the
	// smaller one wins though the tail is not much further away.
	b3 := mustMalloc(t, a, 3*KiB)
	assert.Equal(t, at(0), b3.Ptr())

	// 600 B rounds to 1 KiB: the 512 B piece at 6K is too small, the 1 KiB
	// left of the 4 KiB block (at 3K) fits exactly.
	b4 := mustMalloc(t, a, 600)
	assert.Equal(t, at(3072), b4.Ptr())

	// 512 B: now the 512 B piece at 6K is the best (and only exact) fit.
	b5 := mustMalloc(t, a, 512)
	assert.Equal(t, at(6144), b5.Ptr())

	assert.Equal(t, 1, be.Mallocs, "every request was served from the one segment")
	require.NoError(t, checkState(a, be, []*alloc.Block{s1, s2, s3, b1, b2, b3, b4, b5}))
}

// Equal-sized free blocks in different segments: the lower address wins
// across segments too, and a smaller block in a later segment beats a
// larger one in an earlier segment.
func TestBestFitAcrossSegments(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	// Two 20 MiB large segments, each filled by a 4 MiB block and a 16 MiB
	// block (the 16 MiB request takes the free remainder exactly).
	x1 := mustMalloc(t, a, 4*MiB)
	y1 := mustMalloc(t, a, 16*MiB)
	x2 := mustMalloc(t, a, 4*MiB)
	y2 := mustMalloc(t, a, 16*MiB)
	require.Equal(t, 2, be.Mallocs)
	seg1, seg2 := x1.Ptr(), x2.Ptr()
	require.Less(t, seg1, seg2)
	require.Equal(t, seg1+alloc.Ptr(4*MiB), y1.Ptr())
	mustFree(t, a, x1)
	mustFree(t, a, x2)

	// 3 MiB: two free 4 MiB blocks tie; the lower address (segment 1)
	// wins. The 1 MiB left over is not > 1 MiB, so the block stays 4 MiB.
	z := mustMalloc(t, a, 3*MiB)
	assert.Equal(t, seg1, z.Ptr())
	assert.Equal(t, 4*MiB, z.Size())

	// Free segment 1's 16 MiB: now segment 1 has 16 MiB free at +4 MiB and
	// segment 2 has 4 MiB free at its base. 2 MiB takes the smaller block
	// in the later segment, and its 2 MiB remainder (> 1 MiB) splits off.
	mustFree(t, a, y1)
	w := mustMalloc(t, a, 2*MiB)
	assert.Equal(t, seg2, w.Ptr())
	assert.Equal(t, 2*MiB, w.Size())
	assert.Equal(t, 2, be.Mallocs)
	require.NoError(t, checkState(a, be, []*alloc.Block{y2, z, w}))
}

// should_split, small pool: split when the remainder is ≥ 512.
func TestSplitSmall(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	// 1 MiB from a fresh 2 MiB segment: 1 MiB remainder splits off.
	b1 := mustMalloc(t, a, MiB)
	// 1 MiB − 512 from the 1 MiB free block: remainder exactly 512 ≥ 512,
	// so it splits and the block is exactly 1 MiB − 512.
	b2 := mustMalloc(t, a, MiB-512)
	assert.Equal(t, MiB-512, b2.Size())
	seg := segmentOf(t, a, b1.Ptr())
	requireBlocks(t, seg,
		blk{0, MiB, alloc.ActiveAllocated},
		blk{MiB, MiB - 512, alloc.ActiveAllocated},
		blk{2*MiB - 512, 512, alloc.Inactive})
	st := a.Stats()
	assert.Equal(t, int64(1), st.InactiveSplit[alloc.SmallPool].Current)
	assert.Equal(t, int64(512), st.InactiveSplitBytes[alloc.SmallPool].Current)

	// 1 B rounds to 512 and takes the 512 B block: remainder 0, no split.
	b3 := mustMalloc(t, a, 1)
	assert.Equal(t, int64(512), b3.Size())
	requireBlocks(t, segmentOf(t, a, b1.Ptr()),
		blk{0, MiB, alloc.ActiveAllocated},
		blk{MiB, MiB - 512, alloc.ActiveAllocated},
		blk{2*MiB - 512, 512, alloc.ActiveAllocated})
	st = a.Stats()
	assert.Zero(t, st.InactiveSplit[alloc.SmallPool].Current)
	assert.Zero(t, st.InactiveSplitBytes[alloc.SmallPool].Current)
	assert.Equal(t, 1, be.Mallocs)
	require.NoError(t, checkState(a, be, []*alloc.Block{b1, b2, b3}))
}

// should_split, large pool: split only when the remainder is > 1 MiB.
func TestSplitLarge(t *testing.T) {
	// Each case starts from a 20 MiB segment holding a 2 MiB block and an
	// 18 MiB free remainder (18 MiB > 1 MiB, so that first request split).
	setup := func(t *testing.T) (*alloc.Allocator, *alloc.SimBackend, *alloc.Block) {
		a, be := newAlloc(GiB, 0)
		first := mustMalloc(t, a, 2*MiB)
		requireBlocks(t, segmentOf(t, a, first.Ptr()),
			blk{0, 2 * MiB, alloc.ActiveAllocated},
			blk{2 * MiB, 18 * MiB, alloc.Inactive})
		return a, be, first
	}

	t.Run("remainder 1MiB keeps the block whole", func(t *testing.T) {
		a, be, first := setup(t)
		// 17 MiB from the 18 MiB block leaves exactly 1 MiB: not > 1 MiB,
		// so the block is handed out whole, 18 MiB.
		b := mustMalloc(t, a, 17*MiB)
		assert.Equal(t, 18*MiB, b.Size())
		requireBlocks(t, segmentOf(t, a, b.Ptr()),
			blk{0, 2 * MiB, alloc.ActiveAllocated},
			blk{2 * MiB, 18 * MiB, alloc.ActiveAllocated})
		st := a.Stats()
		// allocated_bytes counts the whole block; requested the request.
		assert.Equal(t, 20*MiB, st.AllocatedBytes[alloc.LargePool].Current)
		assert.Equal(t, 19*MiB, st.RequestedBytes[alloc.LargePool].Current)
		// The split free block became active: no inactive split left.
		assert.Zero(t, st.InactiveSplit[alloc.LargePool].Current)
		assert.Zero(t, st.InactiveSplitBytes[alloc.LargePool].Current)
		assert.Equal(t, 1, be.Mallocs)
		require.NoError(t, checkState(a, be, []*alloc.Block{first, b}))
	})

	t.Run("remainder 1MiB+512 splits", func(t *testing.T) {
		a, be, first := setup(t)
		// 17 MiB − 512 leaves 1 MiB + 512 > 1 MiB: split.
		b := mustMalloc(t, a, 17*MiB-512)
		assert.Equal(t, 17*MiB-512, b.Size())
		requireBlocks(t, segmentOf(t, a, b.Ptr()),
			blk{0, 2 * MiB, alloc.ActiveAllocated},
			blk{2 * MiB, 17*MiB - 512, alloc.ActiveAllocated},
			blk{19*MiB - 512, MiB + 512, alloc.Inactive})
		st := a.Stats()
		assert.Equal(t, int64(1), st.InactiveSplit[alloc.LargePool].Current)
		assert.Equal(t, MiB+512, st.InactiveSplitBytes[alloc.LargePool].Current)
		// The remainder stays in the large pool: 1 MiB + 1 (→ 1 MiB + 512)
		// takes it exactly, while a 1 MiB request goes to a small segment.
		c := mustMalloc(t, a, MiB+1)
		assert.Equal(t, first.Ptr()+alloc.Ptr(19*MiB-512), c.Ptr())
		d := mustMalloc(t, a, MiB)
		assert.Equal(t, alloc.SmallPool, segmentOf(t, a, d.Ptr()).Pool)
		assert.Equal(t, 2, be.Mallocs)
		require.NoError(t, checkState(a, be, []*alloc.Block{first, b, c, d}))
	})
}

// free_block merges a freed block with free neighbours of its segment.
func TestCoalesce(t *testing.T) {
	// Each case: one 2 MiB small segment holding x, y, z (4 KiB each) and
	// the free tail (2 MiB − 12 KiB).
	setup := func(t *testing.T) (*alloc.Allocator, *alloc.SimBackend, [3]*alloc.Block) {
		a, be := newAlloc(GiB, 0)
		var b [3]*alloc.Block
		for i := range b {
			b[i] = mustMalloc(t, a, 4*KiB)
		}
		return a, be, b
	}
	tail := 2*MiB - 12*KiB

	t.Run("previous", func(t *testing.T) {
		a, be, b := setup(t)
		mustFree(t, a, b[0]) // x free: neighbours nil and y (allocated)
		mustFree(t, a, b[1]) // y merges with the free x before it
		requireBlocks(t, segmentOf(t, a, b[2].Ptr()),
			blk{0, 8 * KiB, alloc.Inactive},
			blk{8 * KiB, 4 * KiB, alloc.ActiveAllocated},
			blk{12 * KiB, tail, alloc.Inactive})
		st := a.Stats()
		assert.Equal(t, int64(2), st.InactiveSplit[alloc.SmallPool].Current)
		assert.Equal(t, 8*KiB+tail, st.InactiveSplitBytes[alloc.SmallPool].Current)
		require.NoError(t, checkState(a, be, []*alloc.Block{b[2]}))
	})

	t.Run("next", func(t *testing.T) {
		a, be, b := setup(t)
		mustFree(t, a, b[1]) // y free between allocated x and z
		mustFree(t, a, b[0]) // x merges with the free y after it
		requireBlocks(t, segmentOf(t, a, b[2].Ptr()),
			blk{0, 8 * KiB, alloc.Inactive},
			blk{8 * KiB, 4 * KiB, alloc.ActiveAllocated},
			blk{12 * KiB, tail, alloc.Inactive})
		require.NoError(t, checkState(a, be, []*alloc.Block{b[2]}))
	})

	t.Run("both", func(t *testing.T) {
		a, be, b := setup(t)
		mustFree(t, a, b[0])
		mustFree(t, a, b[2]) // z merges with the tail
		st := a.Stats()
		assert.Equal(t, int64(2), st.InactiveSplit[alloc.SmallPool].Current)
		assert.Equal(t, 4*KiB+4*KiB+tail, st.InactiveSplitBytes[alloc.SmallPool].Current)
		// y merges with x before it and z+tail after it: one free block
		// covers the whole segment, which is no longer split.
		mustFree(t, a, b[1])
		seg := a.Snapshot().Segments
		require.Len(t, seg, 1)
		requireBlocks(t, seg[0], blk{0, 2 * MiB, alloc.Inactive})
		st = a.Stats()
		assert.Zero(t, st.InactiveSplit[alloc.SmallPool].Current)
		assert.Zero(t, st.InactiveSplitBytes[alloc.SmallPool].Current)
		require.NoError(t, checkState(a, be, nil))
	})
}

// A freed block is reused by a later request of its pool: no new segment.
func TestReuse(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	b := mustMalloc(t, a, 4*KiB)
	p := b.Ptr()
	mustFree(t, a, b)
	again := mustMalloc(t, a, 3*KiB+1) // rounds to 3.5 KiB, same best fit
	assert.Equal(t, p, again.Ptr())
	assert.Equal(t, 1, be.Mallocs)

	big := mustMalloc(t, a, 4*MiB)
	mustFree(t, a, big)
	big2 := mustMalloc(t, a, 4*MiB)
	assert.Equal(t, big.Ptr(), big2.Ptr())
	assert.Equal(t, 2, be.Mallocs, "one small and one large segment")
	st := a.Stats()
	assert.Equal(t, int64(2), st.NumDeviceAlloc)
	assert.Equal(t, int64(2), st.Segment[alloc.All].Current)
	require.NoError(t, checkState(a, be, []*alloc.Block{again, big2}))
}

func TestDoubleFree(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	keep := mustMalloc(t, a, 512)
	b := mustMalloc(t, a, 4*KiB)
	mustFree(t, a, b)
	before := a.Stats()
	require.ErrorIs(t, a.Free(b), alloc.ErrInvalid)
	assert.Equal(t, before, a.Stats(), "a rejected free changes nothing")

	// A block merged into its neighbour is just as dead.
	c := mustMalloc(t, a, 4*KiB)
	d := mustMalloc(t, a, 4*KiB)
	mustFree(t, a, d)
	mustFree(t, a, c) // absorbs d
	require.ErrorIs(t, a.Free(d), alloc.ErrInvalid)
	require.ErrorIs(t, a.Free(nil), alloc.ErrInvalid)
	require.NoError(t, checkState(a, be, []*alloc.Block{keep}))
}

// Freeing a block another allocator handed out is rejected, as PyTorch
// rejects a pointer it did not allocate ("invalid device pointer"), and
// neither allocator changes.
func TestFreeForeignBlock(t *testing.T) {
	a1, be1 := newAlloc(GiB, 0)
	a2, be2 := newAlloc(GiB, 0)
	b := mustMalloc(t, a1, 4*KiB)
	own := mustMalloc(t, a2, 4*KiB)
	before := a2.Stats()
	require.ErrorIs(t, a2.Free(b), alloc.ErrInvalid)
	assert.Equal(t, before, a2.Stats())
	require.NoError(t, checkState(a2, be2, []*alloc.Block{own}))
	require.NoError(t, checkState(a1, be1, []*alloc.Block{b}))
	mustFree(t, a1, b)
}
