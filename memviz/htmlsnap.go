package memviz

import (
	"fmt"
	"io"

	"github.com/batchfit/batchfit/alloc"
)

// WriteHTMLSnapshot writes the report page of a snapshot read from a file
// (ReadPickle: batchfit's or PyTorch's): the allocated and reserved bytes
// over its allocator trace, the blocks live after any event by kind and
// module path (named from their tags, as NewReport names blocks without a
// program), and its segments as the snapshot holds them. It draws the
// first device. Blocks allocated before the trace's first event show as
// "allocated before the trace". o.Plan, o.Measured and o.Names' program
// do not apply; o.Title, o.Subtitle, o.Alternatives and o.MaxPoints do.
func WriteHTMLSnapshot(w io.Writer, s Snapshot, o HTMLOptions) error {
	pg, err := newSnapshotPage(s, o)
	if err != nil {
		return err
	}
	return pg.write(w)
}

// Runs of a snapshot page: what trace events other than block allocations
// and frees did.
var snapshotRuns = map[alloc.EventKind]string{alloc.EventSegmentAlloc: "segment_alloc", alloc.EventSegmentFree: "segment_free", alloc.EventOOM: "oom"}

func newSnapshotPage(s Snapshot, o HTMLOptions) (*page, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if len(s.Devices) == 0 {
		return nil, fmt.Errorf("%w: no device", ErrSnapshot)
	}
	d := s.Devices[0]
	n := NewNames(nil, o.Names)
	pg := newPageOf(o)
	pg.Source = "snapshot"
	pg.SegmentsAt = "when the snapshot was taken"
	if len(s.Devices) > 1 {
		pg.SegmentsAt += fmt.Sprintf(" (device %d of %d devices)", d.Device, len(s.Devices))
	}

	// Point 0 is the state before the trace (the whole snapshot when it
	// has no trace), point i+1 the state after event i.
	ev := d.Trace
	before := func() (int64, int64) {
		if len(ev) == 0 {
			return d.Allocated(), d.Reserved()
		}
		a, r := ev[0].Allocated, ev[0].Reserved
		switch ev[0].Kind {
		case alloc.EventAlloc:
			a -= ev[0].Size
		case alloc.EventFree:
			a += ev[0].Size
		case alloc.EventSegmentAlloc:
			r -= ev[0].Size
		case alloc.EventSegmentFree:
			r += ev[0].Size
		}
		return max(a, 0), max(r, 0)
	}
	at := func(i int) (int64, int64) {
		if i == 0 {
			return before()
		}
		return max(ev[i-1].Allocated, 0), max(ev[i-1].Reserved, 0)
	}
	pg.Points = len(ev) + 1
	carried := pg.carry(pg.Points, at, o.MaxPoints)
	lt := newLifetimes(pg, carried)
	pg.Chunks = []pageChunk{{Index: 0, Start: 0, End: len(pg.Index), Label: "allocator trace"}}
	if len(ev) == 0 {
		pg.Chunks[0].Label = "the snapshot (no trace)"
	}
	pg.Runs = []string{"(before the trace)", "segment_alloc", "segment_free", "oom"}
	runIndex := map[string]int{}
	for i, r := range pg.Runs {
		runIndex[r] = i
	}

	type tagSize struct {
		tag  alloc.Tag
		size int64
	}
	tensorOf := map[tagSize]int{}
	tensor := func(tag alloc.Tag, size int64) int {
		k := tagSize{tag, size}
		ti, ok := tensorOf[k]
		if !ok {
			ti = len(pg.Tensors)
			tensorOf[k] = ti
			pg.Tensors = append(pg.Tensors, tagTensor(n.Of(tag), tag, size))
		}
		return ti
	}
	// Blocks allocated before the trace live from point 0: those it frees,
	// and those the snapshot holds that it never allocated. What the
	// first point holds beyond them (nothing, in a consistent snapshot)
	// is one block of unknown owner.
	early, _ := before()
	seen := map[alloc.Ptr]bool{}
	for _, e := range ev {
		if e.Kind == alloc.EventAlloc {
			seen[e.Addr] = true
		}
	}
	for _, seg := range d.Segments {
		for _, b := range seg.Blocks {
			if active(b.State) && !seen[b.Addr] {
				early -= b.Size
				lt.start(int64(b.Addr), 0, tensor(b.Tag, b.Size), b.Size)
			}
		}
	}
	seen = map[alloc.Ptr]bool{}
	for _, e := range ev {
		switch e.Kind {
		case alloc.EventAlloc:
			seen[e.Addr] = true
		case alloc.EventFree:
			if !seen[e.Addr] {
				seen[e.Addr] = true
				early -= e.Size
				lt.start(int64(e.Addr), 0, tensor(e.Tag, e.Size), e.Size)
			}
		}
	}
	if early > 0 {
		lt.start(-1, 0, tensor(alloc.Tag{Node: -1, Op: "allocated before the trace"}, early), early)
	}
	for i, e := range ev {
		p := i + 1
		shown := pg.Index[carried[p]] == p
		what := -1
		switch e.Kind {
		case alloc.EventAlloc:
			ti := tensor(e.Tag, e.Size)
			lt.start(int64(e.Addr), p, ti, e.Size)
			what = 3 * ti
		case alloc.EventFree:
			if ti, ok := lt.end(int64(e.Addr), p); ok {
				what = 3*ti + 1
			}
		default:
			if r, ok := snapshotRuns[e.Kind]; ok {
				what = 3*runIndex[r] + 2
			}
		}
		if shown && what >= 0 {
			pg.What[carried[p]] = what
		}
	}
	lt.endAll(pg.Points)
	pg.Step[0] = -1
	if pg.Index[0] == 0 {
		pg.What[0] = 2 // (before the trace)
	}
	pg.finish(n, alloc.Snapshot{Segments: d.Segments}, nil)
	return pg, nil
}

// tagTensor describes a block of size bytes with tag t, labelled l.
func tagTensor(l Label, t alloc.Tag, size int64) pageTensor {
	return pageTensor{Name: l.Name, Kind: kindIndex(l.Kind), Op: t.Op, Req: size,
		Path: joinPath(l.Stack), buf: -1}
}
