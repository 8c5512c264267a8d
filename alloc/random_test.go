package alloc_test

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/stretchr/testify/require"
)

// model restates PyTorch's caching-allocator rules as plainly as possible
// (address-ordered slices, linear scans, no free lists) so the randomized
// test can check every decision the allocator makes, not just invariants.
type model struct {
	capacity, used int64
	segs           []*mSegment // address order
	retries, ooms  int64
	released       int // segments given back to the device
}

type mSegment struct {
	addr, size int64
	pool       alloc.Pool
	blocks     []mBlock // address order, tiling the segment
}

type mBlock struct {
	addr, size, requested int64
	allocated             bool
}

func mRound(n int64) int64 {
	if n < 512 {
		return 512
	}
	if n%512 == 0 {
		return n
	}
	return n - n%512 + 512
}

func mPool(rounded int64) alloc.Pool {
	if rounded <= MiB {
		return alloc.SmallPool
	}
	return alloc.LargePool
}

func mSegmentSize(rounded int64) int64 {
	switch {
	case rounded <= MiB:
		return 2 * MiB
	case rounded < 10*MiB:
		return 20 * MiB
	case rounded%(2*MiB) == 0:
		return rounded
	}
	return rounded - rounded%(2*MiB) + 2*MiB
}

// bestFit scans every free block of the pool for the smallest one of at
// least rounded bytes, the lowest address among equals.
func (m *model) bestFit(pool alloc.Pool, rounded int64) (*mSegment, int) {
	var bs *mSegment
	bi := -1
	for _, s := range m.segs {
		if s.pool != pool {
			continue
		}
		for i, b := range s.blocks {
			if b.allocated || b.size < rounded {
				continue
			}
			if bs == nil || b.size < bs.blocks[bi].size || (b.size == bs.blocks[bi].size && b.addr < bs.blocks[bi].addr) {
				bs, bi = s, i
			}
		}
	}
	return bs, bi
}

// place hands out block i of s, splitting off the remainder per
// should_split: ≥ 512 B in the small pool, > 1 MiB in the large pool.
func (m *model) place(s *mSegment, i int, rounded, requested int64) mBlock {
	b := s.blocks[i]
	rest := b.size - rounded
	if (s.pool == alloc.SmallPool && rest >= 512) || (s.pool == alloc.LargePool && rest > MiB) {
		s.blocks = slices.Insert(s.blocks, i+1, mBlock{addr: b.addr + rounded, size: rest})
		s.blocks[i].size = rounded
	}
	s.blocks[i].allocated, s.blocks[i].requested = true, requested
	return s.blocks[i]
}

// releaseWhole gives back every segment that is a single free block.
func (m *model) releaseWhole() {
	m.segs = slices.DeleteFunc(m.segs, func(s *mSegment) bool {
		if len(s.blocks) == 1 && !s.blocks[0].allocated {
			m.used -= s.size
			m.released++
			return true
		}
		return false
	})
}

func (m *model) free(addr int64) {
	for _, s := range m.segs {
		for i, b := range s.blocks {
			if b.addr != addr || !b.allocated {
				continue
			}
			s.blocks[i] = mBlock{addr: b.addr, size: b.size}
			if i+1 < len(s.blocks) && !s.blocks[i+1].allocated {
				s.blocks[i].size += s.blocks[i+1].size
				s.blocks = slices.Delete(s.blocks, i+1, i+2)
			}
			if i > 0 && !s.blocks[i-1].allocated {
				s.blocks[i-1].size += s.blocks[i].size
				s.blocks = slices.Delete(s.blocks, i, i+1)
			}
			return
		}
	}
	panic(fmt.Sprintf("model: free of unknown block %#x", addr))
}

func (m *model) allocatedBytes() int64 {
	var n int64
	for _, s := range m.segs {
		for _, b := range s.blocks {
			if b.allocated {
				n += b.size
			}
		}
	}
	return n
}

// malloc applies a request to the model and checks the allocator's answer
// to the same request against it.
func (m *model) malloc(size int64, got *alloc.Block, err error, be *alloc.SimBackend, mallocsBefore int) error {
	rounded := mRound(size)
	pool := mPool(rounded)
	if s, i := m.bestFit(pool, rounded); s != nil {
		want := m.place(s, i, rounded, size)
		if err != nil {
			return fmt.Errorf("malloc %d: %v, want the cached block at %#x", size, err, want.addr)
		}
		if be.Mallocs != mallocsBefore {
			return fmt.Errorf("malloc %d: new segment, want the cached block at %#x", size, want.addr)
		}
		return checkBlock(got, want)
	}
	segSize := mSegmentSize(rounded)
	if m.used+segSize > m.capacity {
		m.releaseWhole()
		m.retries++
		if m.used+segSize > m.capacity {
			m.ooms++
			var oom *alloc.OOMError
			if !errors.As(err, &oom) || !errors.Is(err, alloc.ErrOutOfMemory) {
				return fmt.Errorf("malloc %d: got %v, want an OOM error", size, err)
			}
			want := alloc.OOMError{Requested: size, Rounded: rounded, DeviceFree: m.capacity - m.used,
				DeviceTotal: m.capacity, Allocated: m.allocatedBytes(), Reserved: m.used, Tag: oom.Tag}
			if *oom != want {
				return fmt.Errorf("malloc %d: OOM error %+v, want %+v", size, *oom, want)
			}
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("malloc %d: %v, want a new %d B segment", size, err, segSize)
	}
	if be.Mallocs != mallocsBefore+1 {
		return fmt.Errorf("malloc %d: %d device mallocs, want 1", size, be.Mallocs-mallocsBefore)
	}
	s := &mSegment{addr: int64(got.Ptr()), size: segSize, pool: pool, blocks: []mBlock{{addr: int64(got.Ptr()), size: segSize}}}
	at, _ := slices.BinarySearchFunc(m.segs, s.addr, func(x *mSegment, a int64) int { return cmp.Compare(x.addr, a) })
	m.segs = slices.Insert(m.segs, at, s)
	m.used += segSize
	return checkBlock(got, m.place(s, 0, rounded, size))
}

func checkBlock(got *alloc.Block, want mBlock) error {
	if int64(got.Ptr()) != want.addr || got.Size() != want.size || got.Requested() != want.requested {
		return fmt.Errorf("block %#x (%d B for %d), want %#x (%d B for %d)",
			got.Ptr(), got.Size(), got.Requested(), want.addr, want.size, want.requested)
	}
	return nil
}

// compare checks the allocator's snapshot and counters against the model.
func (m *model) compare(be *alloc.SimBackend, snap alloc.Snapshot, st alloc.Stats) error {
	segs := snap.Segments
	if len(segs) != len(m.segs) {
		return fmt.Errorf("%d segments, model has %d", len(segs), len(m.segs))
	}
	for i, g := range segs {
		w := m.segs[i]
		if int64(g.Addr) != w.addr || g.Size != w.size || g.Pool != w.pool || len(g.Blocks) != len(w.blocks) {
			return fmt.Errorf("segment %d: %#x %d B %v with %d blocks, model %#x %d B %v with %d",
				i, g.Addr, g.Size, g.Pool, len(g.Blocks), w.addr, w.size, w.pool, len(w.blocks))
		}
		for j, b := range g.Blocks {
			wb := w.blocks[j]
			if int64(b.Addr) != wb.addr || b.Size != wb.size || b.Requested != wb.requested || (b.State == alloc.ActiveAllocated) != wb.allocated {
				return fmt.Errorf("segment %#x block %d: %+v, model %+v", g.Addr, j, b, wb)
			}
		}
	}
	if st.NumAllocRetries != m.retries || st.NumOOMs != m.ooms {
		return fmt.Errorf("retries %d, ooms %d; model %d, %d", st.NumAllocRetries, st.NumOOMs, m.retries, m.ooms)
	}
	if be.Frees != m.released || be.Used() != m.used {
		return fmt.Errorf("device frees %d, used %d; model %d, %d", be.Frees, be.Used(), m.released, m.used)
	}
	return nil
}

// randomSize mixes small, medium (1–10 MiB) and large requests, with the
// size-class boundaries drawn often.
func randomSize(r *rand.Rand) int64 {
	boundaries := []int64{1, 511, 512, 513, MiB - 512, MiB, MiB + 1, 10*MiB - 512, 10*MiB - 1, 10 * MiB, 10*MiB + 1}
	switch p := r.IntN(100); {
	case p < 8:
		return boundaries[r.IntN(len(boundaries))]
	case p < 30:
		return 1 + r.Int64N(4*KiB)
	case p < 50:
		return 1 + r.Int64N(MiB)
	case p < 80:
		return MiB + 1 + r.Int64N(9*MiB)
	}
	return 10*MiB + 1 + r.Int64N(54*MiB)
}

// TestRandomized drives the allocator with a seeded mix of requests, frees
// in random order and occasional EmptyCache calls on a device small enough
// that some requests need a retry and some fail. After every operation the
// allocator must agree with the model and with its own invariants.
func TestRandomized(t *testing.T) {
	for _, seed := range []uint64{1, 2} {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) {
			randomRun(t, seed, 10_000, 640*MiB)
		})
	}
}

func randomRun(t *testing.T, seed uint64, ops int, capacity int64) {
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	a, be := newAlloc(capacity, 0)
	m := &model{capacity: capacity}
	var live []*alloc.Block
	var mallocs, cached, emptyCaches, doubleFrees int
	// Growing and shrinking phases of random length make the live set swing
	// between near-empty and more than the device holds.
	freeShare, phaseEnd := 300, 0
	for op := range ops {
		if op == phaseEnd {
			freeShare, phaseEnd = 1000-freeShare, op+50+r.IntN(250)
		}
		var err error
		switch p := r.IntN(1000); {
		case p < 5:
			emptyCaches++
			err = a.EmptyCache()
			m.releaseWhole()
		case p < 10:
			var b *alloc.Block
			if b, err = a.Malloc(0, alloc.Tag{Node: op}); err == nil && (b.Size() != 0 || a.Free(b) != nil) {
				err = fmt.Errorf("zero-size request: block of %d B", b.Size())
			}
		case len(live) > 0 && (p < 10+freeShare || len(live) > 60):
			i := r.IntN(len(live))
			b := live[i]
			live[i] = live[len(live)-1]
			live = live[:len(live)-1]
			m.free(int64(b.Ptr()))
			if err = a.Free(b); err == nil && p%50 == 0 {
				doubleFrees++
				if err = a.Free(b); errors.Is(err, alloc.ErrInvalid) {
					err = nil
				} else {
					err = fmt.Errorf("double free: %v, want ErrInvalid", err)
				}
			}
		default:
			size := randomSize(r)
			before := be.Mallocs
			b, merr := a.Malloc(size, alloc.Tag{Node: op, Op: "random"})
			if merr == nil {
				live = append(live, b)
				mallocs++
				if be.Mallocs == before {
					cached++
				}
			}
			err = m.malloc(size, b, merr, be, before)
		}
		if err == nil {
			snap, st := a.Snapshot(), a.Stats()
			if err = m.compare(be, snap, st); err == nil {
				err = checkSnapshot(a, be, live, snap, st)
			}
		}
		require.NoError(t, err, "seed %d, op %d", seed, op)
	}
	st := a.Stats()
	t.Logf("%d mallocs (%d from the cache), %d retries, %d OOMs, %d empty_cache, %d double frees; peak reserved %s",
		mallocs, cached, st.NumAllocRetries, st.NumOOMs, emptyCaches, doubleFrees, alloc.FormatBytes(st.ReservedBytes[alloc.All].Peak))
	// The run must have exercised the paths it is meant to.
	require.Greater(t, st.NumOOMs, int64(0), "no OOM: raise the load or lower the capacity")
	require.Greater(t, st.NumAllocRetries, st.NumOOMs, "no retry succeeded")
	require.Greater(t, cached, mallocs/2, "the cache served too few requests")
}

// Several goroutines malloc and free concurrently, with readers taking
// stats, snapshots and traces alongside. Run under -race this checks the
// locking; afterwards the allocator must be consistent, the blocks held
// by all goroutines must be disjoint, and freeing everything must leave
// nothing allocated.
func TestConcurrent(t *testing.T) {
	const workers, opsEach = 4, 3000
	// Small enough that some requests need a retry or fail: the release
	// path runs concurrently with the others too.
	be := alloc.NewSimBackend(1 * GiB)
	a := alloc.New(be, alloc.Options{TraceEntries: 256})
	held := make([][]*alloc.Block, workers)
	errs := make([]error, workers)
	var wg, readers sync.WaitGroup
	stop := make(chan struct{})
	readers.Add(1)
	go func() {
		defer readers.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			st := a.Stats()
			_ = st.Map()
			_ = a.Snapshot()
			_ = a.Trace()
			_ = a.Cached()
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 99))
			var mine []*alloc.Block
			for op := range opsEach {
				if len(mine) > 0 && r.IntN(2) == 0 {
					i := r.IntN(len(mine))
					if err := a.Free(mine[i]); err != nil {
						errs[w] = err
						return
					}
					mine = slices.Delete(mine, i, i+1)
					continue
				}
				if op%200 == 199 {
					if err := a.EmptyCache(); err != nil {
						errs[w] = err
						return
					}
				}
				b, err := a.Malloc(randomSize(r), alloc.Tag{Node: w, Op: "worker"})
				if errors.Is(err, alloc.ErrOutOfMemory) {
					continue
				}
				if err != nil {
					errs[w] = err
					return
				}
				mine = append(mine, b)
			}
			held[w] = mine
		}()
	}
	wg.Wait()
	close(stop)
	readers.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}

	var all []*alloc.Block
	for _, h := range held {
		all = append(all, h...)
	}
	slices.SortFunc(all, func(x, y *alloc.Block) int { return cmp.Compare(x.Ptr(), y.Ptr()) })
	for i := 1; i < len(all); i++ {
		require.LessOrEqual(t, all[i-1].Ptr()+alloc.Ptr(all[i-1].Size()), all[i].Ptr(), "blocks overlap")
	}
	require.NoError(t, checkState(a, be, all))

	// Free everything concurrently, then the cache holds only whole segments.
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, b := range held[w] {
				if err := a.Free(b); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, checkState(a, be, nil))
	st := a.Stats()
	t.Logf("%d retries, %d OOMs", st.NumAllocRetries, st.NumOOMs)
	require.Zero(t, st.AllocatedBytes[alloc.All].Current)
	require.Zero(t, st.InactiveSplit[alloc.All].Current)
	require.NoError(t, a.EmptyCache())
	require.Zero(t, be.Used())
}
