package planner_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

const mib = 1 << 20

// wide is a shape-only training step over n samples of 1 MiB each (x is
// [n, 256, 1024] float32): Σ tanh(x·w) with w [1024]. Every per-sample
// buffer of a chunk of 10 samples or more is a large allocation of its own
// rounded to 2 MiB, so peaks move with every sample or two.
func wide(t testing.TB, n int) *planner.Program {
	x := lazy.Placeholder([]int{n, 256, 1024}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{1024}, graph.Float32, "w")
	return testutil.StepProgram(t, nil, x.Mul(w).Tanh().Sum(), []*lazy.Tensor{w}, 2)
}

// dense is a shape-only training step with 4 MiB of weights: Σ tanh(x·Wᵀ)
// over x [n, 64, 1024], W [1024, 1024], trained with Adam (two state
// tensors), so the persistent memory is 12 MiB.
func dense(t testing.TB, n int) *planner.Program {
	x := lazy.Placeholder([]int{n, 64, 1024}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{1024, 1024}, graph.Float32, "W")
	return testutil.StepProgram(t, nil, x.Linear(w, nil).Tanh().Sum(), []*lazy.Tensor{w}, 2)
}

// centered is not chunkable: it subtracts the batch mean from every sample.
func centered(t testing.TB, n int) *planner.Program {
	x := lazy.Placeholder([]int{n, 64, 1024}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{1024}, graph.Float32, "w")
	return testutil.StepProgram(t, nil, x.Sub(x.MeanKeepDim(0)).Mul(w).Tanh().Sum(), []*lazy.Tensor{w}, 2)
}

// peak replays chunks on an unlimited simulated device.
func peak(t testing.TB, p *planner.Program, chunks []planner.Chunk) planner.Usage {
	t.Helper()
	u, err := planner.Replay(p, chunks, alloc.New(alloc.NewSimBackend(1<<60), alloc.Options{}), nil, false)
	require.NoError(t, err)
	return u
}

// sizes lists the chunk sizes.
func sizes(cs []planner.Chunk) []int {
	s := make([]int, len(cs))
	for i, c := range cs {
		s[i] = c.Size
	}
	return s
}

func TestChunksAreBalanced(t *testing.T) {
	assert.Equal(t, []int{25, 25, 25, 25}, sizes(planner.Chunks(100, 4)))
	assert.Equal(t, []int{25, 25, 25, 25}, sizes(planner.ChunksOf(100, 30)))
	assert.Equal(t, []int{4, 3, 3}, sizes(planner.Chunks(10, 3)))
	assert.Equal(t, []int{2, 2, 2, 1, 1, 1, 1}, sizes(planner.Chunks(10, 7)))
	assert.Equal(t, []int{10}, sizes(planner.ChunksOf(10, 10)))
	assert.Equal(t, []int{10}, sizes(planner.ChunksOf(10, 64)))
	assert.Equal(t, []planner.Chunk{{Index: 0, Start: 0, Size: 4}, {Index: 1, Start: 4, Size: 3}, {Index: 2, Start: 7, Size: 3}},
		planner.Chunks(10, 3))

	// Every split covers the batch in order, sizes differing by at most
	// one, larger first; ChunksOf(n, b) is the fewest chunks of at most b.
	for n := 1; n <= 40; n++ {
		for k := 1; k <= n; k++ {
			cs := planner.Chunks(n, k)
			require.Len(t, cs, k)
			start := 0
			for i, c := range cs {
				require.Equal(t, i, c.Index)
				require.Equal(t, start, c.Start)
				require.LessOrEqual(t, cs[0].Size-c.Size, 1, "Chunks(%d, %d)", n, k)
				if i > 0 {
					require.LessOrEqual(t, c.Size, cs[i-1].Size)
				}
				start += c.Size
			}
			require.Equal(t, n, start)

			b := k
			of := planner.ChunksOf(n, b)
			require.LessOrEqual(t, of[0].Size, b)
			require.Len(t, of, (n+b-1)/b)
		}
	}
}

// A batch of 100 whose largest fitting chunk is 30 runs as 25, 25, 25, 25:
// the budget is the smallest at which chunks of 30 (30, 30, 30, 10) run,
// so chunks of 31 do not, and the balanced split needs less than either.
func TestPlanBalancesChunks(t *testing.T) {
	const n = 100
	p := wide(t, n)
	fits := func(chunks []planner.Chunk, budget int64) bool {
		_, err := planner.Replay(p, chunks, alloc.New(alloc.NewSimBackend(budget), alloc.Options{}), nil, false)
		if err != nil {
			require.ErrorIs(t, err, alloc.ErrOutOfMemory)
		}
		return err == nil
	}
	uneven := func(b int) []planner.Chunk { // ⌊n/b⌋ chunks of b, then the rest
		var cs []planner.Chunk
		for start := 0; start < n; start += b {
			cs = append(cs, planner.Chunk{Index: len(cs), Start: start, Size: min(b, n-start)})
		}
		return cs
	}
	// Search the smallest budget, in the allocator's 2 MiB steps, at which
	// chunks of 30 fit.
	lo, hi := int64(0), peak(t, p, uneven(30)).PeakReserved/alloc.RoundLarge // hi fits, lo does not
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if fits(uneven(30), mid*alloc.RoundLarge) {
			hi = mid
		} else {
			lo = mid
		}
	}
	budget := hi * alloc.RoundLarge
	require.False(t, fits(uneven(31), budget), "chunks of 31 fit too")

	pl, err := planner.Make(p, planner.Options{Budget: budget})
	require.NoError(t, err)
	assert.Equal(t, []int{25, 25, 25, 25}, sizes(pl.Chunks))
	assert.Equal(t, 25, pl.Chunk)
	assert.Less(t, pl.PeakReserved, budget, "balanced chunks need less than chunks of 30")
	assert.Equal(t, peak(t, p, planner.Chunks(n, 4)).PeakReserved, pl.PeakReserved)
}

// Plans are cached by the program's signature and the options. A training
// loop rebuilds its graph every step, and dropout's counter advances, yet
// the rebuilt program has the same signature and gets the same plan.
func TestCachePlansOnce(t *testing.T) {
	build := func(n int, step uint64) *planner.Program {
		x := lazy.Placeholder([]int{n, 64, 1024}, graph.Float32, 0)
		w := lazy.ParamSpec([]int{1024, 1024}, graph.Float32, "W")
		return testutil.StepProgram(t, nil, x.Dropout(0.1, 1, step).Linear(w, nil).Tanh().Sum(), []*lazy.Tensor{w}, 2)
	}
	var c planner.Cache
	o := planner.Options{Budget: 48 * mib}
	first, err := c.Plan(build(64, 1), o)
	require.NoError(t, err)
	require.Greater(t, len(first.Chunks), 1, "the budget should force chunks")
	for step := uint64(2); step <= 5; step++ {
		pl, err := c.Plan(build(64, step), o)
		require.NoError(t, err)
		require.Same(t, first, pl, "step %d planned again", step)
	}
	require.Equal(t, 4, c.Hits())

	other, err := c.Plan(build(64, 6), planner.Options{Budget: 64 * mib})
	require.NoError(t, err)
	require.NotSame(t, first, other, "another budget reused the plan")
	smaller, err := c.Plan(build(32, 7), o)
	require.NoError(t, err)
	require.NotSame(t, first, smaller, "another batch size reused the plan")
	require.Equal(t, 32, smaller.Batch)
	require.Equal(t, 4, c.Hits())
}

// Bad input gives typed errors, never a panic.
func TestPlanErrors(t *testing.T) {
	const n = 16
	plan := func(p *planner.Program, o planner.Options) (pl *planner.Plan, err error) {
		t.Helper()
		require.NotPanics(t, func() { pl, err = planner.Make(p, o) })
		return pl, err
	}
	p := dense(t, n)
	const fixed = 12 * mib // W and two Adam state tensors

	t.Run("budget below the fixed memory", func(t *testing.T) {
		_, err := plan(p, planner.Options{Budget: 8 * mib})
		require.ErrorIs(t, err, planner.ErrDoesNotFit)
		require.NotErrorIs(t, err, graph.ErrNotChunkable)
		var e *planner.DoesNotFitError
		require.ErrorAs(t, err, &e)
		assert.Equal(t, 1, e.Chunk)
		assert.Equal(t, int64(8*mib), e.Available)
		assert.Equal(t, int64(fixed), e.Fixed)
		assert.Greater(t, e.Fixed, e.Available)
		assert.Greater(t, e.Needed, e.Fixed)
		assert.Equal(t, peak(t, p, planner.Chunks(n, n)).PeakReserved, e.Needed)
		assert.Equal(t, peak(t, p, planner.Chunks(n, 1)).PeakReserved, e.Whole)
		require.NotEmpty(t, e.Largest)
		for i := 1; i < len(e.Largest); i++ {
			assert.GreaterOrEqual(t, e.Largest[i-1].Bytes, e.Largest[i].Bytes)
		}
		assert.Nil(t, e.Reason)
		assert.NotEmpty(t, e.Error())
	})

	t.Run("batch of one does not fit", func(t *testing.T) {
		one := peak(t, p, planner.Chunks(n, n)).PeakReserved
		budget := one - alloc.RoundLarge
		require.Greater(t, budget, int64(fixed))
		_, err := plan(p, planner.Options{Budget: budget})
		require.ErrorIs(t, err, planner.ErrDoesNotFit)
		var e *planner.DoesNotFitError
		require.ErrorAs(t, err, &e)
		assert.Equal(t, 1, e.Chunk)
		assert.Equal(t, one, e.Needed)
		assert.Equal(t, budget, e.Available)
		assert.Less(t, e.Fixed, e.Available)
		assert.Greater(t, e.Needed, e.Available)
		assert.Greater(t, e.Whole, e.Needed)
	})

	t.Run("a batch of one sample does not fit", func(t *testing.T) {
		// No batch norm here: the error says the step does not fit and
		// splits what one sample needs into persistent and the rest,
		// with no talk of chunks that batch statistics would need.
		one := dense(t, 1)
		need := peak(t, one, planner.Chunks(1, 1)).PeakReserved
		_, err := plan(one, planner.Options{Budget: need - alloc.RoundLarge})
		require.ErrorIs(t, err, planner.ErrDoesNotFit)
		require.NotErrorIs(t, err, graph.ErrNotChunkable)
		var e *planner.DoesNotFitError
		require.ErrorAs(t, err, &e)
		assert.Nil(t, e.Reason)
		assert.Equal(t, 1, e.Chunk)
		assert.Equal(t, need, e.Needed)
		assert.Equal(t, int64(fixed), e.Fixed)
		msg := e.Error()
		assert.NotContains(t, msg, "batch statistics")
		assert.Contains(t, msg, alloc.FormatBytes(fixed)+" persistent (parameters, optimizer state)")
		assert.Contains(t, msg, alloc.FormatBytes(need-fixed)+" for the step's work at 1 sample a chunk")
	})

	t.Run("headroom", func(t *testing.T) {
		// Headroom comes off the budget: what fits 64 MiB does not fit
		// 64 MiB less 60 MiB of headroom.
		_, err := plan(p, planner.Options{Budget: 64 * mib, Headroom: 60 * mib})
		var e *planner.DoesNotFitError
		require.ErrorAs(t, err, &e)
		assert.Equal(t, int64(4*mib), e.Available)
		pl, err := plan(p, planner.Options{Budget: 64 * mib})
		require.NoError(t, err)
		assert.LessOrEqual(t, pl.PeakReserved, int64(64*mib))
	})

	t.Run("not chunkable and over budget", func(t *testing.T) {
		c := centered(t, n)
		require.False(t, c.Info.Chunkable())
		whole := peak(t, c, planner.Chunks(n, 1)).PeakReserved
		_, err := plan(c, planner.Options{Budget: whole - alloc.RoundLarge})
		require.ErrorIs(t, err, planner.ErrDoesNotFit)
		require.ErrorIs(t, err, graph.ErrNotChunkable)
		var e *planner.DoesNotFitError
		require.ErrorAs(t, err, &e)
		var ce *shapeinfer.ChunkError
		require.ErrorAs(t, err, &ce)
		assert.Equal(t, n, e.Chunk, "a graph that cannot be chunked is tried whole only")
		assert.Equal(t, whole, e.Needed)
		assert.Equal(t, whole, e.Whole)
	})

	t.Run("not chunkable within budget runs whole", func(t *testing.T) {
		c := centered(t, n)
		whole := peak(t, c, planner.Chunks(n, 1))
		pl, err := plan(c, planner.Options{Budget: whole.PeakReserved})
		require.NoError(t, err)
		assert.Equal(t, []int{n}, sizes(pl.Chunks))
		assert.Equal(t, whole.PeakReserved, pl.PeakReserved)
		assert.Equal(t, whole.PeakAllocated, pl.PeakAllocated)
	})

	t.Run("no batched input", func(t *testing.T) {
		w := lazy.ParamSpec([]int{4, 4}, graph.Float32, "w")
		loss := w.Mul(w).Sum()
		require.NoError(t, loss.Err())
		require.Zero(t, loss.Graph().IR().Batch())
		_, err := plan(testutil.StepProgram(t, nil, loss, []*lazy.Tensor{w}, 2), planner.Options{Budget: 64 * mib})
		require.ErrorIs(t, err, planner.ErrNoBatch)
	})

	t.Run("empty batch axis", func(t *testing.T) {
		for _, shape := range [][]int{{0, 4}, {0}} {
			x := lazy.Placeholder(shape, graph.Float32, 0)
			require.ErrorIs(t, x.Err(), graph.ErrShape, "%v", shape)
			require.ErrorIs(t, x.Sum().Err(), graph.ErrShape, "%v: the error sticks", shape)
		}
	})

	for _, c := range []struct {
		name string
		o    planner.Options
	}{
		{"negative budget", planner.Options{Budget: -1}},
		{"negative headroom", planner.Options{Budget: 64 * mib, Headroom: -1}},
		{"headroom above budget", planner.Options{Budget: 64 * mib, Headroom: 64*mib + 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := plan(p, c.o)
			require.ErrorIs(t, err, planner.ErrBudget)
			require.False(t, errors.Is(err, planner.ErrDoesNotFit))
		})
	}
}

// randomProgram is a program of nbuf chunk buffers of random sizes in all
// three size classes (small, mid-size in 20 MiB segments, large), each
// allocated once and freed at a random later step, after a few persistent
// buffers. Replays without hooks never look at a graph, so it has none.
func randomProgram(rng *rand.Rand, n, nbuf int) *planner.Program {
	p := &planner.Program{Batch: n}
	size := func() int64 {
		switch rng.IntN(4) {
		case 0:
			return 0
		case 1:
			return rng.Int64N(64 << 10) // small pool
		case 2:
			return rng.Int64N(1 * mib) // small or mid-size, by chunk size
		}
		return rng.Int64N(4 * mib) // mid-size or large
	}
	add := func(b planner.Buffer) int {
		p.Buffers = append(p.Buffers, b)
		return len(p.Buffers) - 1
	}
	for range 1 + rng.IntN(3) {
		p.Persistent = append(p.Persistent, add(planner.Buffer{Kind: planner.BufParam, Fixed: 1 + size()}))
	}
	var live []int
	free := func() {
		j := rng.IntN(len(live))
		p.Steps = append(p.Steps, planner.Step{Kind: planner.StepFree, Buf: live[j]})
		live = append(live[:j], live[j+1:]...)
	}
	for range nbuf {
		b := add(planner.Buffer{Kind: planner.BufOutput, Fixed: size() / 4, PerSample: size() / 8})
		if p.Buffers[b].Fixed+p.Buffers[b].PerSample == 0 {
			p.Buffers[b].Fixed = 1
		}
		p.Steps = append(p.Steps, planner.Step{Kind: planner.StepAlloc, Buf: b})
		live = append(live, b)
		for len(live) > 0 && rng.IntN(2) == 0 {
			free()
		}
	}
	for len(live) > 0 {
		free()
	}
	return p
}

// A bare replay (no hooks, no timeline) skips chunks that would repeat the
// previous one step for step. It must measure what the full replay does:
// the same peaks, and out of memory exactly when the full replay is, for
// random programs at every chunk count, on unlimited devices and on tight
// ones. A chunk does not always repeat its predecessor (see
// TestSecondChunkPeaksHigher), so only chunks after one that made no
// device call are skipped.
func TestBareReplayMeasuresTheFullReplay(t *testing.T) {
	rng := rand.New(rand.NewPCG(71, 72))
	replay := func(p *planner.Program, chunks []planner.Chunk, capacity int64, record bool) (planner.Usage, error) {
		return planner.Replay(p, chunks, alloc.New(alloc.NewSimBackend(capacity), alloc.Options{}), nil, record)
	}
	for range 150 {
		n := 2 + rng.IntN(8)
		p := randomProgram(rng, n, 2+rng.IntN(40))
		for k := 2; k <= n; k++ {
			chunks := planner.Chunks(n, k)
			top := peak(t, p, chunks).PeakReserved
			for _, capacity := range []int64{1 << 60, top, top - alloc.RoundLarge, top * 3 / 4} {
				bare, errBare := replay(p, chunks, capacity, false)
				full, errFull := replay(p, chunks, capacity, true)
				require.Equal(t, errFull == nil, errBare == nil, "%d chunks, capacity %d: %v / %v", k, capacity, errFull, errBare)
				if errFull != nil {
					require.ErrorIs(t, errBare, alloc.ErrOutOfMemory)
					continue
				}
				require.Equal(t, full.PeakReserved, bare.PeakReserved, "%d chunks, capacity %d", k, capacity)
				require.Equal(t, full.PeakAllocated, bare.PeakAllocated, "%d chunks, capacity %d", k, capacity)
			}
		}
	}
}

// On a tight device the second chunk can peak above the first: chunk 0
// reserves three small segments, then needs a 20 MiB mid-size segment and
// releases the two it no longer uses; chunk 1 starts with that mid-size
// segment cached and reserves a small segment on top of it before it has to
// release it. Every chunk after the first makes device calls, so a bare
// replay skips none and measures the 24 MiB peak too.
func TestSecondChunkPeaksHigher(t *testing.T) {
	p := &planner.Program{Batch: 3, Persistent: []int{0},
		Buffers: []planner.Buffer{{Kind: planner.BufParam, Fixed: 1 << 10}}}
	for range 5 { // two per small segment, one beside the parameter
		p.Buffers = append(p.Buffers, planner.Buffer{Kind: planner.BufOutput, Fixed: 1 * mib})
	}
	p.Buffers = append(p.Buffers, planner.Buffer{Kind: planner.BufOutput, Fixed: 5 * mib})
	for _, kind := range []planner.StepKind{planner.StepAlloc, planner.StepFree} {
		for b := 1; b <= 5; b++ {
			p.Steps = append(p.Steps, planner.Step{Kind: kind, Buf: b})
		}
	}
	p.Steps = append(p.Steps, planner.Step{Kind: planner.StepAlloc, Buf: 6}, planner.Step{Kind: planner.StepFree, Buf: 6})

	const capacity = 24 * mib
	replay := func(chunks []planner.Chunk, record bool) planner.Usage {
		u, err := planner.Replay(p, chunks, alloc.New(alloc.NewSimBackend(capacity), alloc.Options{}), nil, record)
		require.NoError(t, err)
		return u
	}
	chunks := planner.Chunks(3, 3)
	full := replay(chunks, true)
	require.Equal(t, int64(24*mib), full.PeakReserved)
	for _, pt := range full.Timeline {
		if pt.Chunk == 0 {
			require.LessOrEqual(t, pt.Reserved, int64(22*mib), "chunk 0 at step %d", pt.Step)
		}
	}
	bare := replay(chunks, false)
	assert.Equal(t, full.PeakReserved, bare.PeakReserved)
	assert.Equal(t, full.PeakAllocated, bare.PeakAllocated)
}

// Two programs of one graph that keep different outputs free different
// buffers, so the cache must not hand one the other's plan: x → h → y → z,
// with h kept to the end in the second, peaks at three buffers, not two.
func TestCacheTellsOutputsApart(t *testing.T) {
	x := lazy.Placeholder([]int{64, 64, 1024}, graph.Float32, 0)
	h := x.Relu()
	z := h.Exp().Exp()
	require.NoError(t, z.Err())
	g := x.Graph().IR()
	program := func(outs ...int) *planner.Program {
		info, err := shapeinfer.Analyze(g, outs...)
		require.NoError(t, err)
		p, err := planner.Compile(g, info, outs, planner.CompileOptions{})
		require.NoError(t, err)
		return p
	}
	var c planner.Cache
	o := planner.Options{Budget: 1 << 30}
	for _, p := range []*planner.Program{program(z.ID()), program(h.ID(), z.ID())} {
		pl, err := c.Plan(p, o)
		require.NoError(t, err)
		want, err := planner.Make(p, o)
		require.NoError(t, err)
		assert.Equal(t, want.PeakReserved, pl.PeakReserved, "outputs %v", p.Outputs)
	}
}

// MaxChunk fixes a micro-batch: chunks of at most MaxChunk samples where
// memory holds the whole batch, and still smaller ones where MaxChunk
// samples do not fit; the plan's peak is that split's replay. Graphs that
// cannot be chunked, MaxChunk below the least chunk and a negative
// MaxChunk are ErrBudget errors.
func TestMaxChunk(t *testing.T) {
	const n = 100
	p := wide(t, n)
	pl, err := planner.Make(p, planner.Options{Budget: 1 << 40, MaxChunk: 30})
	require.NoError(t, err)
	assert.Equal(t, []int{25, 25, 25, 25}, sizes(pl.Chunks), "balanced chunks of at most 30")
	assert.Equal(t, peak(t, p, planner.Chunks(n, 4)).PeakReserved, pl.PeakReserved)

	whole, err := planner.Make(p, planner.Options{Budget: 1 << 40, MaxChunk: n})
	require.NoError(t, err)
	assert.Equal(t, []int{n}, sizes(whole.Chunks), "MaxChunk = the batch: one chunk")

	// A budget in which only chunks of 10 or fewer fit wins over MaxChunk 30.
	budget := peak(t, p, planner.Chunks(n, 10)).PeakReserved
	tight, err := planner.Make(p, planner.Options{Budget: budget, MaxChunk: 30})
	require.NoError(t, err)
	free, err := planner.Make(p, planner.Options{Budget: budget})
	require.NoError(t, err)
	assert.Equal(t, sizes(free.Chunks), sizes(tight.Chunks))
	assert.LessOrEqual(t, tight.Chunk, 30)

	// The cache tells MaxChunk apart.
	var c planner.Cache
	a, err := c.Plan(p, planner.Options{Budget: 1 << 40, MaxChunk: 30})
	require.NoError(t, err)
	b, err := c.Plan(p, planner.Options{Budget: 1 << 40, MaxChunk: 50})
	require.NoError(t, err)
	assert.Equal(t, []int{25, 25, 25, 25}, sizes(a.Chunks))
	assert.Equal(t, []int{50, 50}, sizes(b.Chunks))

	_, err = planner.Make(p, planner.Options{Budget: 1 << 40, MaxChunk: -1})
	assert.ErrorIs(t, err, planner.ErrBudget)
	_, err = planner.Make(centered(t, 16), planner.Options{Budget: 1 << 40, MaxChunk: 4})
	assert.ErrorIs(t, err, planner.ErrBudget)
	assert.ErrorIs(t, err, graph.ErrNotChunkable, "the reason it cannot be chunked")
}
