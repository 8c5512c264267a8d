package cuda_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
)

// TestDriverMappingReserve measures how close to cuMemGetInfo's free bytes
// cuMemAlloc can go: once with one allocation, once filling the device in
// 1 GiB pieces and then the largest last piece that still succeeds. The
// difference is memory the driver needs to map allocations, which a plan
// that fills the card must leave free (logged; it checks only that the
// device gives back what it lent).
//
// It is a measurement, and filling the card took minutes once after the
// NCCL tests: it runs only with BATCHFIT_MEASURE_RESERVE=1.
func TestDriverMappingReserve(t *testing.T) {
	if os.Getenv("BATCHFIT_MEASURE_RESERVE") != "1" {
		t.Skip("a measurement of the driver's reserve: set BATCHFIT_MEASURE_RESERVE=1 to run it")
	}
	d := device(t)
	be := d.Backend()
	free, _, err := be.MemInfo()
	require.NoError(t, err)
	const step = 2 << 20
	largest := func(lo, hi int64) int64 { // lo succeeds (or is 0), hi fails
		for hi-lo > step {
			mid := (lo + (hi-lo)/2) / step * step
			if p, err := be.Malloc(mid); err == nil {
				require.NoError(t, be.Free(p))
				lo = mid
			} else {
				hi = mid
			}
		}
		return lo
	}
	one := largest(0, free+step)
	t.Logf("free %d B: one cuMemAlloc of at most %d B, %d B (%.1f MiB) short of free", free, one, free-one, float64(free-one)/(1<<20))

	var held []alloc.Ptr
	var total int64
	for {
		p, err := be.Malloc(1 << 30)
		if err != nil {
			break
		}
		held = append(held, p)
		total += 1 << 30
	}
	last := largest(0, 1<<30)
	t.Logf("in 1 GiB pieces: %d pieces and a last one of %d B, %d B (%.1f MiB) short of free", len(held), last, free-total-last, float64(free-total-last)/(1<<20))
	for _, p := range held {
		require.NoError(t, be.Free(p))
	}
	after, _, err := be.MemInfo()
	require.NoError(t, err)
	require.Equal(t, free, after, "every byte given back")
}
