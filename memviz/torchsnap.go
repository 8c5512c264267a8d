package memviz

import (
	"fmt"
	"io"
	"math"
	"slices"

	"github.com/batchfit/batchfit/alloc"
)

// WritePickle writes s as the dict torch.cuda.memory._snapshot() returns,
// pickled: pytorch.org/memory_viz loads it, and so do
// torch.cuda._memory_viz's tools. The layout:
//
//	{"segments": [{"device", "address", "total_size", "allocated_size",
//	    "active_size", "requested_size", "stream", "segment_type",
//	    "segment_pool_id", "is_expandable", "frames",
//	    "blocks": [{"address", "size", "requested_size", "state", "frames"}]}],
//	 "device_traces": [[{"action", "addr", "frames", "size", "stream",
//	    "time_us"}], ...]}  // one list per device index
//
// A block's tag is its stack: one frame {"filename": module path, "line":
// node, "name": op}. A free is written as PyTorch records it on one
// stream, "free_requested" then "free_completed"; time_us is the event's
// sequence number, as batchfit's trace has no clock; an "oom" entry's
// device_free is 0, which the trace does not record.
func WritePickle(w io.Writer, s Snapshot) error {
	if err := s.Validate(); err != nil {
		return err
	}
	devs := slices.Clone(s.Devices)
	slices.SortFunc(devs, func(a, b DeviceSnapshot) int { return a.Device - b.Device })
	segs := &pyList{}
	traces := &pyList{}
	for _, d := range devs {
		if d.Device < 0 || d.Device > maxDevice {
			return fmt.Errorf("%w: device %d", ErrSnapshot, d.Device)
		}
		for _, seg := range d.Segments {
			segs.items = append(segs.items, segmentDict(d.Device, seg))
		}
		for len(traces.items) <= d.Device {
			traces.items = append(traces.items, &pyList{})
		}
		tl := traces.items[d.Device].(*pyList)
		for _, e := range d.Trace {
			tl.items = append(tl.items, traceDicts(e)...)
		}
	}
	top := &pyDict{}
	top.set("segments", segs)
	top.set("device_traces", traces)
	return writePickle(w, top)
}

func segmentDict(device int, seg alloc.SegmentInfo) *pyDict {
	var allocated, requested int64
	blocks := &pyList{}
	for _, b := range seg.Blocks {
		bd := &pyDict{}
		bd.set("address", int64(b.Addr))
		bd.set("size", b.Size)
		bd.set("requested_size", b.Requested)
		bd.set("state", string(b.State))
		if active(b.State) {
			allocated += b.Size
			requested += b.Requested
			bd.set("frames", frames(b.Tag))
		} else {
			bd.set("frames", &pyList{})
		}
		blocks.items = append(blocks.items, bd)
	}
	typ := "large"
	if seg.Pool == alloc.SmallPool {
		typ = "small"
	}
	d := &pyDict{}
	d.set("device", int64(device))
	d.set("address", int64(seg.Addr))
	d.set("total_size", seg.Size)
	d.set("allocated_size", allocated)
	d.set("active_size", allocated)
	d.set("requested_size", requested)
	d.set("stream", int64(0))
	d.set("segment_type", typ)
	d.set("segment_pool_id", pyTuple{int64(0), int64(0)})
	d.set("is_expandable", false)
	d.set("frames", &pyList{})
	d.set("blocks", blocks)
	return d
}

// frames is a tag as a one-frame stack; an empty tag has none.
func frames(t alloc.Tag) *pyList {
	if t.Op == "" && t.Scope == "" {
		return &pyList{}
	}
	f := &pyDict{}
	f.set("filename", t.Scope)
	f.set("line", int64(t.Node))
	f.set("name", t.Op)
	return &pyList{items: []any{f}}
}

func traceDicts(e alloc.Event) []any {
	entry := func(action string) *pyDict {
		d := &pyDict{}
		d.set("action", action)
		if e.Kind != alloc.EventOOM {
			d.set("addr", int64(e.Addr))
		}
		d.set("frames", frames(e.Tag))
		d.set("size", e.Size)
		d.set("stream", int64(0))
		d.set("time_us", e.Seq)
		if e.Kind == alloc.EventOOM {
			d.set("device_free", int64(0))
		}
		return d
	}
	switch e.Kind {
	case alloc.EventFree:
		return []any{entry("free_requested"), entry("free_completed")}
	case alloc.EventAlloc, alloc.EventSegmentAlloc, alloc.EventSegmentFree, alloc.EventOOM:
		return []any{entry(e.Kind.String())}
	}
	return nil
}

// maxDevice bounds device indices: the pickle holds a trace list for every
// index up to the largest.
const maxDevice = 1 << 12

// ReadPickle's caps. maxPickleBytes bounds its input: 1 GiB. It converts at
// most one segment, block or trace entry per pickleBytesPerItem (4) input
// bytes, counting a dict or list each time a memo reference repeats it, so
// that a small pickle of references to one large segment or trace cannot
// make it build a large snapshot: every such item takes at least that many
// bytes in a pickle that does not repeat it. The tags of its blocks and
// trace entries hold at most pickleTextPerByte (16) bytes of text (frame
// filename and name) per input byte, counted per tag: PyTorch shares frame
// lists among blocks, and a long name shared by many blocks would make
// every consumer that splits or joins tags (Stacks, NewReport) quadratic.
// A PyTorch snapshot's tags hold a few bytes of text per input byte.
const (
	maxPickleBytes     = 1 << 30
	pickleBytesPerItem = 4
	pickleTextPerByte  = 16
	// maxPickleItems bounds the segments, blocks and trace entries of any
	// pickle, whatever its size: 2²⁰, so that a snapshot, its report and
	// a comparison of two stay within a gigabyte. Its decoded values are
	// bounded likewise (maxDecoded, 256 MiB estimated).
	maxPickleItems = 1 << 20
	// maxPickleText bounds the tags' text likewise: 256 MiB, counted per
	// tag (Stacks joins each block's frames into a string of its own).
	maxPickleText = 256 << 20
)

// ReadPickle reads a snapshot pickle written by WritePickle or by PyTorch
// (torch.cuda.memory._dump_snapshot). A device appears when it has
// segments or trace entries. Frames become tags (filename → module path,
// line → node, name → op, from the innermost frame); trace entries'
// Allocated and Reserved are recomputed backwards from the segments, which
// is exact for batchfit's snapshots (taken right after their last event);
// free_requested entries are dropped, free_completed ones become frees.
// Malformed input gives a *FormatError wrapping ErrFormat; input past
// ReadPickle's caps (over 1 GiB, or more than one segment, block or trace
// entry per 4 bytes, repeats included, or 2²⁰ in all; decoded values past
// 256 MiB; tags of more than 16 bytes of text per input byte, or 256 MiB
// in all) one wrapping
// ErrFormat and ErrTooLarge. Its time and
// memory are linear in the input's size (the tests hold it to 256 allocated
// bytes per input byte).
func ReadPickle(r io.Reader) (Snapshot, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxPickleBytes+1))
	if err != nil {
		return Snapshot{}, err
	}
	if len(data) > maxPickleBytes {
		return Snapshot{}, &FormatError{Format: "pickle", Offset: maxPickleBytes, Msg: "larger than 1 GiB", Err: ErrTooLarge}
	}
	v, err := readPickle(data)
	if err != nil {
		return Snapshot{}, err
	}
	s, err := snapshotOf(v, &budget{items: min(len(data)/pickleBytesPerItem, maxPickleItems), text: min(len(data)*pickleTextPerByte, maxPickleText)})
	if err != nil {
		return Snapshot{}, err
	}
	if err := s.Validate(); err != nil {
		return Snapshot{}, &FormatError{Format: "pickle", Offset: int64(len(data)), Msg: "snapshot", Err: err}
	}
	return s, nil
}

// schemaError reports a decoded pickle that is not a snapshot.
func schemaError(format string, args ...any) error {
	return &FormatError{Format: "pickle", Offset: -1, Msg: fmt.Sprintf(format, args...)}
}

// budget is what is left of ReadPickle's caps on a pickle: segments, blocks
// and trace entries, and bytes of tag text.
type budget struct{ items, text int }

// spend takes n items from b, or reports that the pickle has too many.
func (b *budget) spend(n int) error {
	if n > b.items {
		return &FormatError{Format: "pickle", Offset: -1, Err: ErrTooLarge,
			Msg: fmt.Sprintf("more segments, blocks and trace entries than one per %d input bytes or %d in all (memo references count each time they repeat one)", pickleBytesPerItem, maxPickleItems)}
	}
	b.items -= n
	return nil
}

// spendText takes t's text from b, or reports that the tags hold too much.
func (b *budget) spendText(t alloc.Tag) error {
	n := len(t.Op) + len(t.Scope)
	if n > b.text {
		return &FormatError{Format: "pickle", Offset: -1, Err: ErrTooLarge,
			Msg: fmt.Sprintf("tags hold more than %d bytes of frame text per input byte or %d MiB in all (shared frames count each time)", pickleTextPerByte, maxPickleText>>20)}
	}
	b.text -= n
	return nil
}

// snapshotOf converts a decoded pickle to a snapshot within left.
func snapshotOf(v any, left *budget) (Snapshot, error) {
	top, ok := v.(*pyDict)
	if !ok {
		return Snapshot{}, schemaError("top level is a %s, want a dict", pyType(v))
	}
	segsV, ok := top.get("segments")
	if !ok {
		return Snapshot{}, schemaError(`no "segments"`)
	}
	segs, ok := segsV.(*pyList)
	if !ok {
		return Snapshot{}, schemaError(`"segments" is a %s, want a list`, pyType(segsV))
	}
	byDev := map[int]*DeviceSnapshot{}
	dev := func(i int) *DeviceSnapshot {
		if byDev[i] == nil {
			byDev[i] = &DeviceSnapshot{Device: i}
		}
		return byDev[i]
	}
	for i, sv := range segs.items {
		d, ok := sv.(*pyDict)
		if !ok {
			return Snapshot{}, schemaError("segment %d is a %s, want a dict", i, pyType(sv))
		}
		device, seg, err := segmentOf(d, i, left)
		if err != nil {
			return Snapshot{}, err
		}
		ds := dev(device)
		ds.Segments = append(ds.Segments, seg)
	}
	if tv, ok := top.get("device_traces"); ok {
		traces, ok := tv.(*pyList)
		if !ok {
			return Snapshot{}, schemaError(`"device_traces" is a %s, want a list`, pyType(tv))
		}
		if len(traces.items) > maxDevice+1 {
			return Snapshot{}, schemaError(`"device_traces" lists %d devices`, len(traces.items))
		}
		for i, lv := range traces.items {
			l, ok := lv.(*pyList)
			if !ok {
				return Snapshot{}, schemaError("device_traces[%d] is a %s, want a list", i, pyType(lv))
			}
			if err := left.spend(len(l.items)); err != nil {
				return Snapshot{}, err
			}
			var evs []alloc.Event
			what := &where{trace: true, dev: i}
			for j, ev := range l.items {
				what.entry = j
				e, keep, err := eventOf(ev, j, what, left)
				if err != nil {
					return Snapshot{}, err
				}
				if keep {
					evs = append(evs, e)
				}
			}
			if len(evs) > 0 {
				dev(i).Trace = evs
			}
		}
	}
	var s Snapshot
	for _, d := range byDev {
		slices.SortFunc(d.Segments, func(a, b alloc.SegmentInfo) int { return cmpPtr(a.Addr, b.Addr) })
		totals(d)
		s.Devices = append(s.Devices, *d)
	}
	slices.SortFunc(s.Devices, func(a, b DeviceSnapshot) int { return a.Device - b.Device })
	return s, nil
}

// field reads key k of d as a T; optional fields may be absent.
// where names the value being read, for errors only: one per pickle,
// updated as the reader goes, instead of a name formatted for every block.
type where struct {
	trace      bool // device_traces[dev][entry], else segment seg (block block when ≥ 0)
	seg, block int
	dev, entry int
	frame      bool // the value's innermost frame
}

func (w *where) String() string {
	var s string
	switch {
	case w.trace:
		s = fmt.Sprintf("device_traces[%d][%d]", w.dev, w.entry)
	case w.block >= 0:
		s = fmt.Sprintf("segment %d block %d", w.seg, w.block)
	default:
		s = fmt.Sprintf("segment %d", w.seg)
	}
	if w.frame {
		s += " frame"
	}
	return s
}

func field[T any](d *pyDict, k string, what *where, optional bool) (T, bool, error) {
	var zero T
	v, ok := d.get(k)
	if !ok {
		if optional {
			return zero, false, nil
		}
		return zero, false, schemaError("%s has no %q", what, k)
	}
	t, ok := v.(T)
	if !ok {
		return zero, false, schemaError("%s: %q is a %s, want %s", what, k, pyType(v), pyType(zero))
	}
	return t, true, nil
}

// count reads a non-negative integer field.
func count(d *pyDict, k string, what *where, optional bool) (int64, bool, error) {
	n, ok, err := field[int64](d, k, what, optional)
	if err == nil && n < 0 {
		err = schemaError("%s: %q is %d, want ≥ 0", what, k, n)
	}
	return n, ok, err
}

func segmentOf(d *pyDict, i int, left *budget) (int, alloc.SegmentInfo, error) {
	if err := left.spend(1); err != nil {
		return 0, alloc.SegmentInfo{}, err
	}
	what := &where{seg: i, block: -1}
	device, _, err := count(d, "device", what, true)
	if err != nil {
		return 0, alloc.SegmentInfo{}, err
	}
	if device > maxDevice {
		return 0, alloc.SegmentInfo{}, schemaError("%s: device %d", what, device)
	}
	addr, _, err := count(d, "address", what, false)
	if err != nil {
		return 0, alloc.SegmentInfo{}, err
	}
	size, _, err := count(d, "total_size", what, false)
	if err != nil {
		return 0, alloc.SegmentInfo{}, err
	}
	seg := alloc.SegmentInfo{Addr: alloc.Ptr(addr), Size: size, Pool: alloc.LargePool}
	typ, ok, err := field[string](d, "segment_type", what, true)
	switch {
	case err != nil:
		return 0, seg, err
	case typ == "small" || (!ok && size <= alloc.SmallBuffer):
		seg.Pool = alloc.SmallPool
	case ok && typ != "large":
		return 0, seg, schemaError("%s: segment_type %q", what, typ)
	}
	blocks, _, err := field[*pyList](d, "blocks", what, false)
	if err != nil {
		return 0, seg, err
	}
	if err := left.spend(len(blocks.items)); err != nil {
		return 0, seg, err
	}
	at := seg.Addr
	for j, bv := range blocks.items {
		what.block = j
		bd, ok := bv.(*pyDict)
		if !ok {
			return 0, seg, schemaError("%s is a %s, want a dict", what, pyType(bv))
		}
		b, err := blockOf(bd, at, what, left)
		if err != nil {
			return 0, seg, err
		}
		if active(b.State) {
			seg.Allocated = addBytes(seg.Allocated, b.Size)
		}
		seg.Blocks = append(seg.Blocks, b)
		at = b.Addr + alloc.Ptr(b.Size)
	}
	return int(device), seg, nil
}

func blockOf(d *pyDict, at alloc.Ptr, what *where, left *budget) (alloc.BlockInfo, error) {
	// Old snapshots have no block addresses: blocks follow each other.
	addr, ok, err := count(d, "address", what, true)
	if err != nil {
		return alloc.BlockInfo{}, err
	}
	if ok {
		at = alloc.Ptr(addr)
	}
	size, _, err := count(d, "size", what, false)
	if err != nil {
		return alloc.BlockInfo{}, err
	}
	req, ok, err := count(d, "requested_size", what, true)
	if err != nil {
		return alloc.BlockInfo{}, err
	}
	if !ok {
		req = size
	}
	state, _, err := field[string](d, "state", what, false)
	if err != nil {
		return alloc.BlockInfo{}, err
	}
	b := alloc.BlockInfo{Addr: at, Size: size, Requested: req, State: alloc.BlockState(state), Tag: alloc.Tag{Node: -1}}
	if !validState(b.State) {
		return b, schemaError("%s: state %q", what, state)
	}
	if active(b.State) {
		if b.Tag, err = tagOf(d, what, left); err != nil {
			return b, err
		}
	}
	return b, nil
}

// tagOf reads the innermost frame of d's "frames" as a tag, taking its
// text from left.
func tagOf(d *pyDict, what *where, left *budget) (alloc.Tag, error) {
	fs, ok, err := field[*pyList](d, "frames", what, true)
	if err != nil || !ok || len(fs.items) == 0 {
		return alloc.Tag{Node: -1}, err
	}
	f, ok := fs.items[0].(*pyDict)
	if !ok {
		return alloc.Tag{}, schemaError("%s: frame is a %s, want a dict", what, pyType(fs.items[0]))
	}
	what.frame = true
	defer func() { what.frame = false }()
	fwhat := what
	name, _, err := field[string](f, "name", fwhat, false)
	if err != nil {
		return alloc.Tag{}, err
	}
	file, _, err := field[string](f, "filename", fwhat, false)
	if err != nil {
		return alloc.Tag{}, err
	}
	line, _, err := field[int64](f, "line", fwhat, false)
	if err != nil {
		return alloc.Tag{}, err
	}
	if line < math.MinInt32 || line > math.MaxInt32 {
		return alloc.Tag{}, schemaError("%s: line %d", fwhat, line)
	}
	t := alloc.Tag{Node: int(line), Op: name, Scope: file}
	return t, left.spendText(t)
}

// eventOf converts trace entry j of device i; keep is false for entries
// with no allocator event of their own.
func eventOf(v any, j int, what *where, left *budget) (alloc.Event, bool, error) {
	d, ok := v.(*pyDict)
	if !ok {
		return alloc.Event{}, false, schemaError("%s is a %s, want a dict", what, pyType(v))
	}
	action, _, err := field[string](d, "action", what, false)
	if err != nil {
		return alloc.Event{}, false, err
	}
	var kind alloc.EventKind
	switch action {
	case "alloc":
		kind = alloc.EventAlloc
	case "free", "free_completed":
		kind = alloc.EventFree
	case "segment_alloc", "segment_map":
		kind = alloc.EventSegmentAlloc
	case "segment_free", "segment_unmap":
		kind = alloc.EventSegmentFree
	case "oom":
		kind = alloc.EventOOM
	case "free_requested", "snapshot", "annotate":
		return alloc.Event{}, false, nil
	default:
		return alloc.Event{}, false, schemaError("%s: action %q", what, action)
	}
	e := alloc.Event{Kind: kind, Seq: int64(j)}
	addr, _, err := count(d, "addr", what, kind == alloc.EventOOM)
	if err != nil {
		return e, false, err
	}
	e.Addr = alloc.Ptr(addr)
	if e.Size, _, err = count(d, "size", what, false); err != nil {
		return e, false, err
	}
	if t, ok, err := field[int64](d, "time_us", what, true); err != nil {
		return e, false, err
	} else if ok {
		e.Seq = t
	}
	if e.Tag, err = tagOf(d, what, left); err != nil {
		return e, false, err
	}
	return e, true, nil
}

// totals fills the events' Allocated and Reserved backwards from the
// device's state after the last event.
func totals(d *DeviceSnapshot) {
	allocated, reserved := d.Allocated(), d.Reserved()
	for i := len(d.Trace) - 1; i >= 0; i-- {
		e := &d.Trace[i]
		e.Allocated, e.Reserved = allocated, reserved
		switch e.Kind { // sizes from a file: saturated, never wrapped
		case alloc.EventAlloc:
			allocated = addBytes(allocated, -e.Size)
		case alloc.EventFree:
			allocated = addBytes(allocated, e.Size)
		case alloc.EventSegmentAlloc:
			reserved = addBytes(reserved, -e.Size)
		case alloc.EventSegmentFree:
			reserved = addBytes(reserved, e.Size)
		}
	}
}
