package alloc

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// downBackend is a device whose driver places each new segment below the
// previous ones (a real driver places segments where it likes), with
// nothing behind the addresses.
type downBackend struct {
	next Ptr
	live map[Ptr]int64
}

func (d *downBackend) Malloc(size int64) (Ptr, error) {
	d.next -= Ptr((size + segmentAlign - 1) / segmentAlign * segmentAlign)
	d.live[d.next] = size
	return d.next, nil
}

func (d *downBackend) Free(p Ptr) error {
	delete(d.live, p)
	return nil
}

func (d *downBackend) MemInfo() (int64, int64, error) { return 1 << 50, 1 << 50, nil }

// Where the driver puts segments must not change which cached block serves
// a request: the same random sequence of mallocs and frees (sizes from 1
// byte to 64 MiB, so both pools, splits and whole-segment reuse occur) on a
// device with increasing addresses and on one with decreasing addresses
// gives every block the same segment and offset, and the same peaks. With
// ties broken by address alone the layouts part ways.
func TestPlacementDoesNotDependOnAddresses(t *testing.T) {
	up := New(NewSimBackend(1<<50), Options{})
	down := New(&downBackend{next: 1 << 48, live: map[Ptr]int64{}}, Options{})
	rng := rand.New(rand.NewPCG(31, 37))
	var ups, downs []*Block
	where := func(a *Allocator, b *Block) [2]int64 {
		return [2]int64{int64(b.seg.seq), int64(b.ptr - b.seg.base)}
	}
	for op := range 20000 {
		if len(ups) > 0 && rng.IntN(5) < 2 {
			i := rng.IntN(len(ups))
			require.NoError(t, up.Free(ups[i]))
			require.NoError(t, down.Free(downs[i]))
			ups = append(ups[:i], ups[i+1:]...)
			downs = append(downs[:i], downs[i+1:]...)
			continue
		}
		size := int64(1) << rng.IntN(27)
		size += rng.Int64N(size)
		bu, err := up.Malloc(size, Tag{})
		require.NoError(t, err)
		bd, err := down.Malloc(size, Tag{})
		require.NoError(t, err)
		require.Equal(t, where(up, bu), where(down, bd), "op %d: malloc of %d bytes", op, size)
		ups, downs = append(ups, bu), append(downs, bd)
	}
	su, sd := up.Stats(), down.Stats()
	require.Equal(t, su.ReservedBytes, sd.ReservedBytes)
	require.Equal(t, su.AllocatedBytes, sd.AllocatedBytes)
	require.Equal(t, su.NumAllocRetries, sd.NumAllocRetries)
}

// An allocator capped by SetLimit on a large device behaves exactly as one
// on a device of the limit's size: the same random mallocs and frees give
// the same layout, the same peaks, retries (cached segments released when a
// segment would pass the cap) and out-of-memory errors.
func TestLimitActsAsASmallerDevice(t *testing.T) {
	const limit = 512 << 20
	small := New(NewSimBackend(limit), Options{})
	capped := New(NewSimBackend(1<<50), Options{})
	capped.SetLimit(limit)
	require.Equal(t, int64(limit), capped.Limit())
	rng := rand.New(rand.NewPCG(41, 43))
	var smalls, cappeds []*Block
	ooms := 0
	for op := range 20000 {
		if len(smalls) > 0 && rng.IntN(5) < 2 {
			i := rng.IntN(len(smalls))
			require.NoError(t, small.Free(smalls[i]))
			require.NoError(t, capped.Free(cappeds[i]))
			smalls = append(smalls[:i], smalls[i+1:]...)
			cappeds = append(cappeds[:i], cappeds[i+1:]...)
			continue
		}
		size := int64(1) << rng.IntN(26)
		size += rng.Int64N(size)
		bs, errS := small.Malloc(size, Tag{})
		bc, errC := capped.Malloc(size, Tag{})
		var oomS, oomC *OOMError
		require.Equal(t, errors.As(errS, &oomS), errors.As(errC, &oomC), "op %d: malloc of %d bytes: %v / %v", op, size, errS, errC)
		if errS != nil {
			ooms++
			continue
		}
		require.NoError(t, errC)
		require.Equal(t, [2]int64{int64(bs.seg.seq), int64(bs.ptr - bs.seg.base)},
			[2]int64{int64(bc.seg.seq), int64(bc.ptr - bc.seg.base)}, "op %d: malloc of %d bytes", op, size)
		smalls, cappeds = append(smalls, bs), append(cappeds, bc)
	}
	ss, sc := small.Stats(), capped.Stats()
	require.Equal(t, ss.ReservedBytes, sc.ReservedBytes)
	require.Equal(t, ss.AllocatedBytes, sc.AllocatedBytes)
	require.Equal(t, ss.NumAllocRetries, sc.NumAllocRetries)
	require.Equal(t, ss.NumOOMs, sc.NumOOMs)
	require.Positive(t, sc.NumAllocRetries, "the cap made the allocator release its cache")
	require.Positive(t, ooms, "the cap ran out")
	require.LessOrEqual(t, sc.ReservedBytes[All].Peak, int64(limit))
}
