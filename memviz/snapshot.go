package memviz

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/batchfit/batchfit/alloc"
)

// Errors. Readers wrap ErrFormat (and io.ErrUnexpectedEOF when the input
// ends early, ErrTooLarge when it passes one of the reader's caps on size
// or work); a snapshot whose blocks do not tile its segments, read or
// given, wraps ErrSnapshot; a timeline that does not fit its program wraps
// ErrTimeline.
var (
	ErrFormat   = errors.New("memviz: malformed input")
	ErrTooLarge = errors.New("memviz: input past the reader's limits")
	ErrSnapshot = errors.New("memviz: inconsistent snapshot")
	ErrTimeline = errors.New("memviz: timeline does not match the program")
)

// FormatError reports where a reader gave up.
type FormatError struct {
	Format string // "pickle", "folded", "pprof"
	Offset int64  // byte offset (pickle) or line number (folded); −1 when the content, not a position, is wrong
	Msg    string
	Err    error // a further cause (io.ErrUnexpectedEOF, ErrTooLarge, ErrSnapshot), or nil
}

func (e *FormatError) Error() string {
	where := "offset"
	if e.Format == "folded" {
		where = "line"
	}
	s := fmt.Sprintf("%v: %s at %s %d: %s", ErrFormat, e.Format, where, e.Offset, e.Msg)
	if e.Offset < 0 {
		s = fmt.Sprintf("%v: %s: %s", ErrFormat, e.Format, e.Msg)
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

func (e *FormatError) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrFormat, e.Err}
	}
	return []error{ErrFormat}
}

// Snapshot is the allocator state of one or more devices: the form memviz
// reports on, exports and reads back.
type Snapshot struct {
	Devices []DeviceSnapshot
}

// DeviceSnapshot is one device's segments (address order) and trace
// (oldest first), as alloc.Allocator.Snapshot returns them.
type DeviceSnapshot struct {
	Device   int
	Segments []alloc.SegmentInfo
	Trace    []alloc.Event
}

// NewSnapshot wraps an allocator snapshot of device.
func NewSnapshot(device int, s alloc.Snapshot) Snapshot {
	return Snapshot{Devices: []DeviceSnapshot{{Device: device, Segments: s.Segments, Trace: s.Trace}}}
}

// Allocated is the bytes in active blocks: the allocator's
// allocated_bytes.all.current when the snapshot was taken.
func (d *DeviceSnapshot) Allocated() int64 {
	var n int64
	for _, s := range d.Segments {
		for _, b := range s.Blocks {
			if active(b.State) {
				n = addBytes(n, b.Size)
			}
		}
	}
	return n
}

// Reserved is the bytes held in segments.
func (d *DeviceSnapshot) Reserved() int64 {
	var n int64
	for _, s := range d.Segments {
		n = addBytes(n, s.Size)
	}
	return n
}

// Allocated sums the devices' allocated bytes.
func (s *Snapshot) Allocated() int64 {
	var n int64
	for i := range s.Devices {
		n = addBytes(n, s.Devices[i].Allocated())
	}
	return n
}

// Reserved sums the devices' reserved bytes.
func (s *Snapshot) Reserved() int64 {
	var n int64
	for i := range s.Devices {
		n = addBytes(n, s.Devices[i].Reserved())
	}
	return n
}

// addBytes is a + b saturated at int64's bounds: byte totals of a file's
// blocks (segments up to 2⁶⁴ bytes apart, thousands of devices) stay at
// 8 EiB rather than wrap to negative sizes.
func addBytes(a, b int64) int64 {
	switch {
	case b > 0 && a > math.MaxInt64-b:
		return math.MaxInt64
	case b < 0 && a < math.MinInt64-b:
		return math.MinInt64
	}
	return a + b
}

// active reports whether a block holds an allocation. PyTorch's
// "active_awaiting_free" (freed, waiting on another stream) still occupies
// its bytes.
func active(s alloc.BlockState) bool {
	return s == alloc.ActiveAllocated || s == "active_awaiting_free" || s == "active_pending_free"
}

func validState(s alloc.BlockState) bool { return active(s) || s == alloc.Inactive }

// Validate checks that devices are distinct, segments do not overlap and
// each segment's blocks tile it exactly in address order.
func (s *Snapshot) Validate() error {
	seen := map[int]bool{}
	for _, d := range s.Devices {
		if seen[d.Device] {
			return fmt.Errorf("%w: device %d listed twice", ErrSnapshot, d.Device)
		}
		seen[d.Device] = true
		if err := d.validate(); err != nil {
			return err
		}
	}
	return nil
}

func (d *DeviceSnapshot) validate() error {
	segs := slices.Clone(d.Segments)
	slices.SortFunc(segs, func(a, b alloc.SegmentInfo) int { return cmpPtr(a.Addr, b.Addr) })
	for i, seg := range segs {
		if seg.Size <= 0 {
			return fmt.Errorf("%w: device %d: segment %#x has size %d", ErrSnapshot, d.Device, seg.Addr, seg.Size)
		}
		end := seg.Addr + alloc.Ptr(seg.Size)
		if end < seg.Addr {
			return fmt.Errorf("%w: device %d: segment %#x of %d bytes wraps the address space", ErrSnapshot, d.Device, seg.Addr, seg.Size)
		}
		if i+1 < len(segs) && segs[i+1].Addr < end {
			return fmt.Errorf("%w: device %d: segments %#x and %#x overlap", ErrSnapshot, d.Device, seg.Addr, segs[i+1].Addr)
		}
		at := seg.Addr
		for _, b := range seg.Blocks {
			switch {
			case b.Addr != at:
				return fmt.Errorf("%w: device %d: segment %#x: block at %#x, want %#x", ErrSnapshot, d.Device, seg.Addr, b.Addr, at)
			case b.Size <= 0 || b.Size > int64(end-at):
				return fmt.Errorf("%w: device %d: segment %#x: block at %#x has size %d", ErrSnapshot, d.Device, seg.Addr, b.Addr, b.Size)
			case b.Requested < 0 || b.Requested > b.Size:
				return fmt.Errorf("%w: device %d: block at %#x requested %d of %d bytes", ErrSnapshot, d.Device, b.Addr, b.Requested, b.Size)
			case !validState(b.State):
				return fmt.Errorf("%w: device %d: block at %#x has state %q", ErrSnapshot, d.Device, b.Addr, b.State)
			}
			at += alloc.Ptr(b.Size)
		}
		if at != end {
			return fmt.Errorf("%w: device %d: segment %#x of %d bytes: blocks cover %d", ErrSnapshot, d.Device, seg.Addr, seg.Size, int64(at-seg.Addr))
		}
	}
	return nil
}

func cmpPtr(a, b alloc.Ptr) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
