package alloc_test

import (
	"fmt"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/require"
)

const (
	KiB = int64(1) << 10
	MiB = int64(1) << 20
	GiB = int64(1) << 30
)

var noTag = alloc.Tag{Node: -1}

// newAlloc returns an allocator over a fresh simulated device.
func newAlloc(capacity int64, traceEntries int) (*alloc.Allocator, *alloc.SimBackend) {
	be := alloc.NewSimBackend(capacity)
	return alloc.New(be, alloc.Options{TraceEntries: traceEntries}), be
}

func mustMalloc(t testing.TB, a *alloc.Allocator, size int64) *alloc.Block {
	t.Helper()
	b, err := a.Malloc(size, alloc.Tag{Node: 1, Op: "test"})
	require.NoError(t, err, "malloc %d", size)
	return b
}

func mustFree(t testing.TB, a *alloc.Allocator, b *alloc.Block) {
	t.Helper()
	require.NoError(t, a.Free(b))
}

// segmentOf returns the snapshot segment holding p.
func segmentOf(t testing.TB, a *alloc.Allocator, p alloc.Ptr) alloc.SegmentInfo {
	t.Helper()
	for _, s := range a.Snapshot().Segments {
		if p >= s.Addr && p < s.Addr+alloc.Ptr(s.Size) {
			return s
		}
	}
	t.Fatalf("no segment holds %#x", p)
	return alloc.SegmentInfo{}
}

// blk is a block as a test expects it: offset from its segment's base.
type blk struct {
	off, size int64
	state     alloc.BlockState
}

// requireBlocks checks a segment's blocks, offsets relative to its base.
func requireBlocks(t testing.TB, s alloc.SegmentInfo, want ...blk) {
	t.Helper()
	var got []blk
	for _, b := range s.Blocks {
		got = append(got, blk{int64(b.Addr - s.Addr), b.Size, b.State})
	}
	require.Equal(t, want, got)
}

// checkState verifies every structural invariant of the allocator and that
// its stats agree with a recomputation from a snapshot. live are the blocks
// the caller holds; each must appear, allocated, with its size.
func checkState(a *alloc.Allocator, be *alloc.SimBackend, live []*alloc.Block) error {
	return checkSnapshot(a, be, live, a.Snapshot(), a.Stats())
}

// checkSnapshot is checkState on a snapshot and stats already taken.
func checkSnapshot(a *alloc.Allocator, be *alloc.SimBackend, live []*alloc.Block, snap alloc.Snapshot, st alloc.Stats) error {
	if err := alloc.CheckFreeLists(a); err != nil {
		return err
	}

	type sums struct{ allocs, allocBytes, segs, reserved, inactive, inactiveBytes, requested int64 }
	var want [3]sums // indexed by alloc.Pool
	add := func(p alloc.Pool, f func(*sums)) { f(&want[alloc.All]); f(&want[p]) }

	allocated := map[alloc.Ptr]alloc.BlockInfo{}
	var prevEnd alloc.Ptr
	for i, s := range snap.Segments {
		if i > 0 && s.Addr < prevEnd {
			return fmt.Errorf("segment %#x overlaps the previous one (ends %#x)", s.Addr, prevEnd)
		}
		prevEnd = s.Addr + alloc.Ptr(s.Size)
		if s.Pool != alloc.SmallPool && s.Pool != alloc.LargePool {
			return fmt.Errorf("segment %#x in pool %v", s.Addr, s.Pool)
		}
		if err := checkSegmentSize(s); err != nil {
			return err
		}
		add(s.Pool, func(w *sums) { w.segs++; w.reserved += s.Size })
		next, segAlloc := s.Addr, int64(0)
		for j, b := range s.Blocks {
			if b.Addr != next {
				return fmt.Errorf("segment %#x: block %d at %#x, want %#x (blocks must tile the segment)", s.Addr, j, b.Addr, next)
			}
			if b.Size <= 0 || b.Size%alloc.MinBlockSize != 0 {
				return fmt.Errorf("segment %#x: block at %#x has size %d", s.Addr, b.Addr, b.Size)
			}
			next += alloc.Ptr(b.Size)
			switch b.State {
			case alloc.ActiveAllocated:
				if b.Requested <= 0 || b.Requested > b.Size {
					return fmt.Errorf("block at %#x: requested %d of size %d", b.Addr, b.Requested, b.Size)
				}
				segAlloc += b.Size
				allocated[b.Addr] = b
				add(s.Pool, func(w *sums) { w.allocs++; w.allocBytes += b.Size; w.requested += b.Requested })
			case alloc.Inactive:
				if j > 0 && s.Blocks[j-1].State == alloc.Inactive {
					return fmt.Errorf("segment %#x: adjacent free blocks at %#x and %#x (not coalesced)", s.Addr, s.Blocks[j-1].Addr, b.Addr)
				}
				if b.Requested != 0 || b.Tag != noTag {
					return fmt.Errorf("free block at %#x keeps requested %d, tag %+v", b.Addr, b.Requested, b.Tag)
				}
				if len(s.Blocks) > 1 {
					add(s.Pool, func(w *sums) { w.inactive++; w.inactiveBytes += b.Size })
				}
			default:
				return fmt.Errorf("block at %#x in state %q", b.Addr, b.State)
			}
		}
		if end := s.Addr + alloc.Ptr(s.Size); next != end {
			return fmt.Errorf("segment %#x: blocks end at %#x, segment at %#x", s.Addr, next, end)
		}
		if segAlloc != s.Allocated {
			return fmt.Errorf("segment %#x: Allocated %d, blocks say %d", s.Addr, s.Allocated, segAlloc)
		}
	}

	if len(live) != len(allocated) {
		return fmt.Errorf("caller holds %d blocks, snapshot shows %d allocated", len(live), len(allocated))
	}
	for _, b := range live {
		info, ok := allocated[b.Ptr()]
		if !ok || info.Size != b.Size() || info.Requested != b.Requested() {
			return fmt.Errorf("held block %#x (%d B) not allocated in the snapshot (%+v)", b.Ptr(), b.Size(), info)
		}
	}

	for _, p := range []alloc.Pool{alloc.All, alloc.SmallPool, alloc.LargePool} {
		w := want[p]
		for _, c := range []struct {
			name      string
			got, want int64
		}{
			{"allocation", st.Allocation[p].Current, w.allocs},
			{"allocated_bytes", st.AllocatedBytes[p].Current, w.allocBytes},
			{"active", st.Active[p].Current, w.allocs},
			{"active_bytes", st.ActiveBytes[p].Current, w.allocBytes},
			{"segment", st.Segment[p].Current, w.segs},
			{"reserved_bytes", st.ReservedBytes[p].Current, w.reserved},
			{"inactive_split", st.InactiveSplit[p].Current, w.inactive},
			{"inactive_split_bytes", st.InactiveSplitBytes[p].Current, w.inactiveBytes},
			{"requested_bytes", st.RequestedBytes[p].Current, w.requested},
		} {
			if c.got != c.want {
				return fmt.Errorf("%s.%s.current = %d, snapshot says %d", c.name, p, c.got, c.want)
			}
		}
	}
	if err := checkCounters(st); err != nil {
		return err
	}
	if used := be.Used(); used != st.ReservedBytes[alloc.All].Current {
		return fmt.Errorf("device has %d bytes in use, reserved_bytes is %d", used, st.ReservedBytes[alloc.All].Current)
	}
	if d := st.NumDeviceAlloc - st.NumDeviceFree; d != int64(len(snap.Segments)) {
		return fmt.Errorf("num_device_alloc − num_device_free = %d, %d segments", d, len(snap.Segments))
	}
	return nil
}

// checkSegmentSize checks a segment against get_allocation_size: small
// segments are 2 MiB, large ones 20 MiB or a multiple of 2 MiB from 10 MiB.
func checkSegmentSize(s alloc.SegmentInfo) error {
	ok := s.Size == 2*MiB
	if s.Pool == alloc.LargePool {
		ok = s.Size == 20*MiB || (s.Size >= 10*MiB && s.Size%(2*MiB) == 0)
	}
	if !ok {
		return fmt.Errorf("%s segment %#x has size %d", s.Pool, s.Addr, s.Size)
	}
	return nil
}

// checkCounters checks the arithmetic every Stat keeps: nothing negative,
// current = allocated − freed (accumulated stats are never reset), peak ≥
// current, and the aggregate equal to the sum of the pools.
func checkCounters(st alloc.Stats) error {
	if st.NumAllocRetries < 0 || st.NumOOMs < 0 || st.NumDeviceAlloc < 0 || st.NumDeviceFree < 0 {
		return fmt.Errorf("negative counter in %+v", st)
	}
	for _, na := range statArrays(st) {
		name, arr := na.name, na.arr
		for _, p := range []alloc.Pool{alloc.All, alloc.SmallPool, alloc.LargePool} {
			s := arr[p]
			if s.Current < 0 || s.Peak < 0 || s.Allocated < 0 || s.Freed < 0 {
				return fmt.Errorf("%s.%s: negative in %+v", name, p, s)
			}
			if s.Current != s.Allocated-s.Freed {
				return fmt.Errorf("%s.%s: current %d ≠ allocated %d − freed %d", name, p, s.Current, s.Allocated, s.Freed)
			}
			if s.Peak < s.Current {
				return fmt.Errorf("%s.%s: peak %d < current %d", name, p, s.Peak, s.Current)
			}
		}
		all, sm, lg := arr[alloc.All], arr[alloc.SmallPool], arr[alloc.LargePool]
		if all.Current != sm.Current+lg.Current || all.Allocated != sm.Allocated+lg.Allocated || all.Freed != sm.Freed+lg.Freed {
			return fmt.Errorf("%s: all %+v ≠ small %+v + large %+v", name, all, sm, lg)
		}
	}
	return nil
}

type namedStatArray struct {
	name string
	arr  alloc.StatArray
}

// statArrays lists the stat arrays under their memory_stats names.
func statArrays(st alloc.Stats) []namedStatArray {
	return []namedStatArray{
		{"allocation", st.Allocation}, {"segment", st.Segment}, {"active", st.Active},
		{"inactive_split", st.InactiveSplit}, {"allocated_bytes", st.AllocatedBytes},
		{"reserved_bytes", st.ReservedBytes}, {"active_bytes", st.ActiveBytes},
		{"inactive_split_bytes", st.InactiveSplitBytes}, {"requested_bytes", st.RequestedBytes},
	}
}
