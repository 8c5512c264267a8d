package planner_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/planner"
)

// A Split describes the chunks Chunks lists.
func TestSplitDescribesChunks(t *testing.T) {
	for n := 1; n <= 40; n++ {
		for k := 1; k <= n; k++ {
			s := planner.Split{N: n, K: k}
			listed := planner.Chunks(n, k)
			require.Equal(t, listed, s.List(), "%d in %d", n, k)
			require.Equal(t, len(listed), s.Len())
			for i, c := range listed {
				require.Equal(t, c, s.At(i), "%d in %d, chunk %d", n, k, i)
			}
			require.Equal(t, listed[0].Size, s.Largest())
			require.Equal(t, planner.DescribeSizes(planner.Sizes(listed)), s.String())
			var sizes []int
			for _, r := range s.Runs() {
				for range r.Count {
					sizes = append(sizes, r.Size)
				}
			}
			require.Equal(t, planner.Sizes(listed), sizes, "%d in %d", n, k)
		}
		for b := 1; b <= n+1; b++ {
			require.Equal(t, planner.ChunksOf(n, b), planner.SplitOf(n, b).List(), "%d by %d", n, b)
		}
	}
	s := planner.SplitOf(1_000_000_000, 3)
	assert.Equal(t, planner.Split{N: 1_000_000_000, K: 333333334}, s)
	assert.Equal(t, "333333332 × 3 + 2 × 2", s.String())
	assert.Equal(t, planner.Chunk{Index: 333333333, Start: 999999998, Size: 2}, s.At(333333333))
}

// Planning a batch takes memory and time that do not grow with it: no
// chunk list is made while bisecting, and replays skip repeating chunks a
// run of equal sizes at a time. (A list of 10⁷ chunks alone is 240 MB.)
func TestPlanMemoryDoesNotGrowWithBatch(t *testing.T) {
	const n = 10_000_000
	p := dense(t, n)
	// Room for about half the batch: Make tries the whole batch, chunks of
	// one, and bisects in between.
	half := peak(t, p, planner.Chunks(n, 2)).PeakReserved
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	pl, err := planner.Make(p, planner.Options{Budget: half})
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	require.NoError(t, err)
	assert.Equal(t, n/2, pl.Chunk)
	assert.Len(t, pl.Chunks, 2)
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("batch %d: %d replays, %d KiB allocated in %v", n, pl.Replays, allocated>>10, elapsed)
	assert.Less(t, allocated, uint64(16<<20), "bytes allocated by Make")
	assert.Less(t, elapsed, 10*time.Second)
}

// NoChunkList keeps the chosen plan's chunks described only, and a
// timeline can be limited to the first chunks.
func TestPlanWithoutChunkList(t *testing.T) {
	const n = 64
	p := dense(t, n)
	budget := peak(t, p, planner.Chunks(n, 8)).PeakReserved
	listed, err := planner.Make(p, planner.Options{Budget: budget, Timeline: true})
	require.NoError(t, err)
	require.Greater(t, len(listed.Chunks), 1)
	described, err := planner.Make(p, planner.Options{Budget: budget, Timeline: true, TimelineChunks: 1, NoChunkList: true})
	require.NoError(t, err)
	assert.Nil(t, described.Chunks)
	assert.Equal(t, listed.Split.List(), listed.Chunks)
	assert.Equal(t, listed.Split, described.Split)
	assert.Equal(t, listed.PeakReserved, described.PeakReserved)
	assert.Equal(t, listed.PeakAllocated, described.PeakAllocated)
	var first []planner.Point
	for _, pt := range listed.Timeline {
		if pt.Chunk <= 0 {
			first = append(first, pt)
		}
	}
	assert.Equal(t, first, described.Timeline, "the persistent allocations and chunk 0")
	assert.Greater(t, len(listed.Timeline), len(first), "every chunk without a limit")

	var c planner.Cache
	a, err := c.Plan(p, planner.Options{Budget: budget, NoChunkList: true})
	require.NoError(t, err)
	b, err := c.Plan(p, planner.Options{Budget: budget})
	require.NoError(t, err)
	assert.Nil(t, a.Chunks)
	assert.NotNil(t, b.Chunks, "a plan without its list is not served to an executor")
}

func TestFormatPeak(t *testing.T) {
	assert.Equal(t, "more than 1 EiB", planner.FormatPeak(-1))
	assert.Equal(t, "2.00 MiB", planner.FormatPeak(2<<20))
}
