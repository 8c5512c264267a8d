package memviz

import (
	"bufio"
	"fmt"
	"io"
	"strings"

	"github.com/batchfit/batchfit/alloc"
)

// SegmentRef is one segment of one device.
type SegmentRef struct {
	Device int
	alloc.SegmentInfo
}

// Diff is how two snapshots' segments differ, as
// torch.cuda._memory_viz.compare reports it: a segment is the same when
// device, address and size agree.
type Diff struct {
	OnlyBefore, OnlyAfter []SegmentRef // in device, then address order
	Common                int          // segments in both
	// Totals of each snapshot, over all devices.
	ReservedBefore, ReservedAfter   int64
	AllocatedBefore, AllocatedAfter int64
}

type segKey struct {
	device int
	addr   alloc.Ptr
	size   int64
}

// Compare lists the segments only before and only after.
func Compare(before, after Snapshot) *Diff {
	d := &Diff{ReservedBefore: before.Reserved(), ReservedAfter: after.Reserved(),
		AllocatedBefore: before.Allocated(), AllocatedAfter: after.Allocated()}
	keys := func(s Snapshot) map[segKey]bool {
		m := map[segKey]bool{}
		for _, dev := range s.Devices {
			for _, seg := range dev.Segments {
				m[segKey{dev.Device, seg.Addr, seg.Size}] = true
			}
		}
		return m
	}
	kb, ka := keys(before), keys(after)
	only := func(s Snapshot, other map[segKey]bool) []SegmentRef {
		var out []SegmentRef
		for _, dev := range s.Devices {
			for _, seg := range dev.Segments {
				if !other[segKey{dev.Device, seg.Addr, seg.Size}] {
					out = append(out, SegmentRef{Device: dev.Device, SegmentInfo: seg})
				}
			}
		}
		return out
	}
	d.OnlyBefore, d.OnlyAfter = only(before, ka), only(after, kb)
	for k := range kb {
		if ka[k] {
			d.Common++
		}
	}
	return d
}

func sumSize(segs []SegmentRef) int64 {
	var n int64
	for _, s := range segs {
		n += s.Size
	}
	return n
}

// WriteText summarises the diff, one line per differing segment.
func (d *Diff) WriteText(w io.Writer) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "reserved %s → %s, allocated %s → %s; %d segments in both\n",
		alloc.FormatBytes(d.ReservedBefore), alloc.FormatBytes(d.ReservedAfter),
		alloc.FormatBytes(d.AllocatedBefore), alloc.FormatBytes(d.AllocatedAfter), d.Common)
	for _, part := range []struct {
		name string
		segs []SegmentRef
	}{{"only before", d.OnlyBefore}, {"only after", d.OnlyAfter}} {
		fmt.Fprintf(bw, "%s: %d segments, %s\n", part.name, len(part.segs), alloc.FormatBytes(sumSize(part.segs)))
		for _, s := range part.segs {
			fmt.Fprintf(bw, "  device %d segment %#x: %s %s, %s allocated in %d blocks\n", s.Device, uint64(s.Addr),
				alloc.FormatBytes(s.Size), s.Pool, alloc.FormatBytes(s.Allocated), len(s.Blocks))
		}
	}
	return bw.Flush()
}

// WriteFolded writes the blocks of differing segments as folded stacks,
// "only_after;device_0;seg_0x…;state;stack… bytes", the lines
// torch.cuda._memory_viz.compare feeds flamegraph.pl; n names blocks (nil:
// from their tags).
func (d *Diff) WriteFolded(w io.Writer, n *Names) error {
	bw := bufio.NewWriter(w)
	for _, part := range []struct {
		name string
		segs []SegmentRef
	}{{"only_before", d.OnlyBefore}, {"only_after", d.OnlyAfter}} {
		for _, s := range part.segs {
			for _, b := range s.Blocks {
				stack := []string{"<free>"}
				if active(b.State) {
					stack = n.Of(b.Tag).Stack
				}
				fmt.Fprintf(bw, "%s;device_%d;seg_%#x;%s;%s %d\n", part.name, s.Device, uint64(s.Addr), b.State,
					strings.Join(sanitize(stack), ";"), b.Size)
			}
		}
	}
	return bw.Flush()
}
