package memviz_test

import (
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
)

// Totals over a snapshot whose sizes add up past int64 (three devices of
// one 6 EiB segment each: valid, as each device has an address space of
// its own) saturate at math.MaxInt64 instead of wrapping to negative
// bytes: Allocated, Reserved, Stacks and TotalBytes.
func TestSnapshotTotalsSaturate(t *testing.T) {
	const size = 6 << 60
	var s memviz.Snapshot
	for d := range 3 {
		s.Devices = append(s.Devices, memviz.DeviceSnapshot{Device: d, Segments: []alloc.SegmentInfo{{
			Addr: 0, Size: size, Blocks: []alloc.BlockInfo{{Addr: 0, Size: size, Requested: size, State: alloc.ActiveAllocated,
				Tag: alloc.Tag{Node: 1, Op: "matmul", Scope: "h.0"}}}}}})
	}
	require.NoError(t, s.Validate())
	assert.Equal(t, int64(math.MaxInt64), s.Reserved())
	assert.Equal(t, int64(math.MaxInt64), s.Allocated())
	st := memviz.Stacks(s, nil)
	require.Len(t, st, 3, "one stack per device")
	assert.Equal(t, int64(math.MaxInt64), memviz.TotalBytes(st))
	for _, x := range st {
		assert.Equal(t, int64(size), x.Bytes)
	}
}

// ReadFolded refuses counts whose total passes int64 (ErrTooLarge), and
// reads one that reaches it exactly.
func TestReadFoldedTotalPastInt64(t *testing.T) {
	_, err := memviz.ReadFolded(strings.NewReader("a 9223372036854775807\nb 1\n"))
	require.ErrorIs(t, err, memviz.ErrTooLarge)
	require.ErrorIs(t, err, memviz.ErrFormat)
	st, err := memviz.ReadFolded(strings.NewReader("a 9223372036854775806\na 1\n"))
	require.NoError(t, err)
	assert.Equal(t, int64(math.MaxInt64), memviz.TotalBytes(st))
}
