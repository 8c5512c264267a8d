package alloc

import "sort"

// EventKind names a trace event, with PyTorch's memory-snapshot spelling.
type EventKind uint8

const (
	EventAlloc EventKind = iota
	EventFree
	EventSegmentAlloc
	EventSegmentFree
	EventOOM
)

func (k EventKind) String() string {
	return [...]string{"alloc", "free", "segment_alloc", "segment_free", "oom"}[k]
}

// Event is one trace entry. Allocated and Reserved are the totals right
// after it.
type Event struct {
	Seq       int64
	Kind      EventKind
	Addr      Ptr
	Size      int64
	Tag       Tag
	Allocated int64
	Reserved  int64
}

// ring keeps the last n events. Its buffer grows as events come, so a
// large n costs nothing until that many events happen.
type ring struct {
	buf  []Event
	n    int
	next int64
}

func newRing(n int) *ring { return &ring{n: n} }

func (r *ring) add(e Event) {
	e.Seq = r.next
	r.next++
	if len(r.buf) < r.n {
		r.buf = append(r.buf, e)
		return
	}
	r.buf[e.Seq%int64(r.n)] = e
}

// events returns the kept events oldest first.
func (r *ring) events() []Event {
	out := append([]Event(nil), r.buf...)
	sort.Slice(out, func(i, j int) bool { return out[i].Seq < out[j].Seq })
	return out
}

func (a *Allocator) record(k EventKind, p Ptr, size int64, tag Tag) {
	if a.trace == nil {
		return
	}
	a.trace.add(Event{Kind: k, Addr: p, Size: size, Tag: tag,
		Allocated: a.stats.AllocatedBytes[All].Current, Reserved: a.stats.ReservedBytes[All].Current})
}

// Trace returns the recorded events, oldest first (nil when tracing is off).
func (a *Allocator) Trace() []Event {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.trace == nil {
		return nil
	}
	return a.trace.events()
}

// BlockState is a block's state in a snapshot.
type BlockState string

const (
	ActiveAllocated BlockState = "active_allocated"
	Inactive        BlockState = "inactive"
)

// BlockInfo describes one block of a segment.
type BlockInfo struct {
	Addr      Ptr
	Size      int64
	Requested int64
	State     BlockState
	Tag       Tag
}

// SegmentInfo describes one segment and its blocks in address order.
type SegmentInfo struct {
	Addr      Ptr
	Size      int64
	Pool      Pool
	Allocated int64 // bytes of its allocated blocks
	Blocks    []BlockInfo
}

// Snapshot is the allocator's state: segments in address order, and the
// trace when enabled.
type Snapshot struct {
	Segments []SegmentInfo
	Trace    []Event
}

// Snapshot captures every segment and block.
func (a *Allocator) Snapshot() Snapshot {
	a.mu.Lock()
	defer a.mu.Unlock()
	var s Snapshot
	for _, seg := range a.segments {
		si := SegmentInfo{Addr: seg.base, Size: seg.size, Pool: seg.pool}
		for b := seg.head; b != nil; b = b.next {
			st := Inactive
			if b.allocated {
				st = ActiveAllocated
				si.Allocated += b.size
			}
			si.Blocks = append(si.Blocks, BlockInfo{Addr: b.ptr, Size: b.size, Requested: b.requested, State: st, Tag: b.tag})
		}
		s.Segments = append(s.Segments, si)
	}
	sort.Slice(s.Segments, func(i, j int) bool { return s.Segments[i].Addr < s.Segments[j].Addr })
	if a.trace != nil {
		s.Trace = a.trace.events()
	}
	return s
}
