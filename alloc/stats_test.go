package alloc_test

import (
	"fmt"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Stats.Map uses torch.cuda.memory_stats' key names.
func TestStatsMapKeys(t *testing.T) {
	a, _ := newAlloc(GiB, 0)
	mustMalloc(t, a, 1000)
	st := a.Stats()
	m := st.Map()

	// 9 stat arrays × 3 pools × 4 fields, plus 4 scalar counters.
	assert.Len(t, m, 9*3*4+4)
	for _, k := range []string{
		"allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
		"inactive_split_bytes.small_pool.current", "requested_bytes.all.allocated",
		"allocation.all.current", "segment.small_pool.freed", "active.large_pool.peak",
		"inactive_split.all.current", "active_bytes.all.allocated",
		"num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
	} {
		assert.Contains(t, m, k)
	}
	for _, na := range statArrays(st) {
		name, arr := na.name, na.arr
		for _, p := range []alloc.Pool{alloc.All, alloc.SmallPool, alloc.LargePool} {
			s := arr[p]
			for field, v := range map[string]int64{"current": s.Current, "peak": s.Peak, "allocated": s.Allocated, "freed": s.Freed} {
				k := fmt.Sprintf("%s.%s.%s", name, p, field)
				assert.Equal(t, v, m[k], k)
			}
		}
	}
	assert.Equal(t, int64(1024), m["allocated_bytes.all.current"])
	assert.Equal(t, int64(1000), m["requested_bytes.small_pool.current"])
	assert.Equal(t, 2*MiB, m["reserved_bytes.small_pool.peak"])
	assert.Equal(t, 2*MiB-1024, m["inactive_split_bytes.small_pool.current"])
	assert.Equal(t, int64(1), m["num_device_alloc"])
}

// A scripted sequence with every counter worked out by hand, checked after
// each step. Keys not listed for a step are checked by checkCounters and
// checkState (arithmetic and recomputation from the snapshot).
func TestStatsScript(t *testing.T) {
	a, be := newAlloc(GiB, 0)
	var x, y, z *alloc.Block
	steps := []struct {
		name string
		do   func()
		live func() []*alloc.Block
		want map[string]int64
	}{
		{
			// 1000 → 1024 B, small: new 2 MiB segment, split; the
			// 2 MiB − 1 KiB remainder is a new inactive split block.
			"malloc 1000", func() { x = mustMalloc(t, a, 1000) },
			func() []*alloc.Block { return []*alloc.Block{x} },
			map[string]int64{
				"allocation.small_pool.current":           1,
				"allocated_bytes.small_pool.current":      1024,
				"requested_bytes.small_pool.current":      1000,
				"segment.small_pool.current":              1,
				"reserved_bytes.small_pool.current":       2 * MiB,
				"inactive_split.small_pool.current":       1,
				"inactive_split_bytes.small_pool.current": 2*MiB - 1024,
				"num_device_alloc":                        1,
			},
		},
		{
			// 3 MiB, large: new 20 MiB segment, 17 MiB remainder splits.
			"malloc 3MiB", func() { y = mustMalloc(t, a, 3*MiB) },
			func() []*alloc.Block { return []*alloc.Block{x, y} },
			map[string]int64{
				"allocated_bytes.large_pool.current":      3 * MiB,
				"allocated_bytes.all.current":             3*MiB + 1024,
				"requested_bytes.all.current":             3*MiB + 1000,
				"reserved_bytes.all.current":              22 * MiB,
				"reserved_bytes.large_pool.peak":          20 * MiB,
				"inactive_split.all.current":              2,
				"inactive_split_bytes.large_pool.current": 17 * MiB,
				"inactive_split_bytes.all.current":        17*MiB + 2*MiB - 1024,
				"num_device_alloc":                        2,
			},
		},
		{
			// 2000 → 2048 B from the already split small remainder: it
			// shrinks by 2048, still one inactive split block.
			"malloc 2000", func() { z = mustMalloc(t, a, 2000) },
			func() []*alloc.Block { return []*alloc.Block{x, y, z} },
			map[string]int64{
				"allocation.small_pool.current":           2,
				"allocated_bytes.small_pool.current":      3072,
				"requested_bytes.small_pool.current":      3000,
				"inactive_split.small_pool.current":       1,
				"inactive_split_bytes.small_pool.current": 2*MiB - 3072,
				"inactive_split_bytes.small_pool.freed":   2048,
				"num_device_alloc":                        2,
			},
		},
		{
			// Free x: z after it is allocated, nothing before it; x becomes
			// a second inactive split block of 1024 B.
			"free 1000", func() { mustFree(t, a, x) },
			func() []*alloc.Block { return []*alloc.Block{y, z} },
			map[string]int64{
				"allocation.small_pool.current":             1,
				"allocated_bytes.small_pool.current":        2048,
				"allocated_bytes.small_pool.allocated":      3072,
				"allocated_bytes.small_pool.freed":          1024,
				"requested_bytes.small_pool.current":        2000,
				"requested_bytes.small_pool.freed":          1000,
				"inactive_split.small_pool.current":         2,
				"inactive_split_bytes.small_pool.current":   2*MiB - 2048,
				"inactive_split_bytes.small_pool.allocated": 2*MiB - 1024 + 1024,
			},
		},
		{
			// Free z: merges with x before and the tail after; the segment
			// is whole again, so both inactive split blocks are gone.
			// inactive_split_bytes.small: allocated 2 MiB (2 MiB − 1 KiB,
			// then 1 KiB), freed 2048 + (2 MiB − 2048), peak 2 MiB − 1 KiB.
			"free 2000", func() { mustFree(t, a, z) },
			func() []*alloc.Block { return []*alloc.Block{y} },
			map[string]int64{
				"allocation.small_pool.current":           0,
				"allocated_bytes.small_pool.current":      0,
				"allocated_bytes.small_pool.peak":         3072,
				"requested_bytes.small_pool.current":      0,
				"inactive_split.small_pool.current":       0,
				"inactive_split.small_pool.peak":          2,
				"inactive_split_bytes.small_pool.current": 0,
				"inactive_split_bytes.small_pool.freed":   2 * MiB,
				"inactive_split_bytes.small_pool.peak":    2*MiB - 1024,
				"reserved_bytes.small_pool.current":       2 * MiB,
			},
		},
		{
			// Free y: merges with its 17 MiB remainder; the large segment
			// is whole.
			"free 3MiB", func() { mustFree(t, a, y) },
			func() []*alloc.Block { return nil },
			map[string]int64{
				"allocated_bytes.all.current":      0,
				"allocated_bytes.all.peak":         3*MiB + 3072,
				"inactive_split.all.current":       0,
				"inactive_split_bytes.all.current": 0,
				"reserved_bytes.all.current":       22 * MiB,
				"active.all.current":               0,
				"active.all.peak":                  3,
				"active_bytes.all.freed":           3*MiB + 3072,
			},
		},
		{
			"empty cache", func() { require.NoError(t, a.EmptyCache()) },
			func() []*alloc.Block { return nil },
			map[string]int64{
				"reserved_bytes.all.current":   0,
				"reserved_bytes.all.peak":      22 * MiB,
				"reserved_bytes.all.allocated": 22 * MiB,
				"reserved_bytes.all.freed":     22 * MiB,
				"segment.all.current":          0,
				"segment.all.freed":            2,
				"num_device_free":              2,
			},
		},
		{
			// After a peak reset, peaks start from the (zero) current values.
			"reset peak, malloc 1MiB", func() { a.ResetPeak(); x = mustMalloc(t, a, MiB) },
			func() []*alloc.Block { return []*alloc.Block{x} },
			map[string]int64{
				"allocated_bytes.all.peak":        MiB,
				"allocated_bytes.large_pool.peak": 0,
				"reserved_bytes.all.peak":         2 * MiB,
				"reserved_bytes.all.allocated":    24 * MiB,
				"inactive_split.all.peak":         1,
				"num_device_alloc":                3,
				"num_alloc_retries":               0,
				"num_ooms":                        0,
			},
		},
	}
	for _, s := range steps {
		s.do()
		st := a.Stats()
		m := st.Map()
		for k, v := range s.want {
			assert.Equal(t, v, m[k], "after %q: %s", s.name, k)
		}
		require.NoError(t, checkState(a, be, s.live()), "after %q", s.name)
	}
}
