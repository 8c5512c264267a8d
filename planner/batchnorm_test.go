package planner_test

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// bnStep compiles one training step of conv → batch_norm → relu → mean over
// a batch of n NCHW images: the loss and the gradients of every parameter
// are outputs, the gradients kept (accumulated across chunks).
func bnStep(t *testing.T, n int, training bool) (p *planner.Program, bnNode int) {
	return bnStepWith(t, n, training, false)
}

// bnStepWith is bnStep, with per-chunk statistics when perChunk is set
// (training mode), whose batch_norm_stats of the batch_norm input is an
// output too, as a Session's step updating the running statistics has it.
func bnStepWith(t *testing.T, n int, training, perChunk bool) (p *planner.Program, bnNode int) {
	t.Helper()
	const c = 16
	spec := func(name string, shape ...int) *lazy.Tensor { return lazy.ParamSpec(shape, graph.Float32, name) }
	k, w, b := spec("conv.weight", c, 3, 3, 3), spec("bn.weight", c), spec("bn.bias", c)
	mean, variance := spec("bn.running_mean", c), spec("bn.running_var", c)
	x := lazy.Placeholder([]int{n, 3, 32, 32}, graph.Float32, 0)
	h := x.Conv2d(k, nil, lazy.ConvOptions{Padding: [2]int{1, 1}})
	y := h.BatchNorm2d(w, b, mean, variance, training, 1e-5)
	var stats *lazy.Tensor
	if perChunk {
		y, stats = h.BatchNorm2dPerChunk(w, b, 1e-5), h.BatchStats()
	}
	loss := y.Relu().Mean()
	grads := lazy.Grad(loss, k, w, b)
	outs := []int{loss.ID()}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
	}
	kept := slices.Clone(outs[1:])
	if stats != nil {
		outs = append(outs, stats.ID())
	}
	ir := x.Graph().IR()
	info, err := shapeinfer.Analyze(ir, outs...)
	require.NoError(t, err)
	p, err = planner.Compile(ir, info, outs, planner.CompileOptions{Kept: kept})
	require.NoError(t, err)
	return p, y.ID()
}

// wholeBatchPeak is the peak reserved bytes of running the batch in one chunk.
func wholeBatchPeak(t *testing.T, p *planner.Program) int64 {
	t.Helper()
	pl, err := planner.Make(p, planner.Options{Budget: 1 << 50})
	require.NoError(t, err)
	require.Len(t, pl.Chunks, 1)
	return pl.PeakReserved
}

// With a budget below what the whole batch needs, training-mode batch_norm
// (which normalises with the whole batch's statistics) must not be split:
// the planner says it does not fit and why. The same model in evaluation
// mode is per-sample and runs in chunks within the budget.
func TestBatchNormPlanning(t *testing.T) {
	const n = 64
	train, bn := bnStep(t, n, true)
	eval, _ := bnStep(t, n, false)
	budget := min(wholeBatchPeak(t, train), wholeBatchPeak(t, eval)) / 2

	_, err := planner.Make(train, planner.Options{Budget: budget})
	require.Error(t, err)
	assert.ErrorIs(t, err, planner.ErrDoesNotFit)
	assert.ErrorIs(t, err, graph.ErrNotChunkable)
	var dnf *planner.DoesNotFitError
	require.ErrorAs(t, err, &dnf)
	assert.Equal(t, n, dnf.Chunk, "only the whole batch was tried")
	assert.Greater(t, dnf.Whole, dnf.Available)
	var ce *shapeinfer.ChunkError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, bn, ce.Node, "the batch_norm node is blamed")
	assert.Equal(t, "batch_norm", ce.Op)

	pl, err := planner.Make(eval, planner.Options{Budget: budget})
	require.NoError(t, err)
	assert.Greater(t, len(pl.Chunks), 1, "evaluation mode runs in chunks")
	assert.LessOrEqual(t, pl.PeakReserved, pl.Available())
	total := 0
	for _, c := range pl.Chunks {
		total += c.Size
	}
	assert.Equal(t, n, total)

	// Given room for the whole batch, training mode plans as one chunk.
	pl, err = planner.Make(train, planner.Options{Budget: wholeBatchPeak(t, train)})
	require.NoError(t, err)
	assert.Len(t, pl.Chunks, 1)
}

// With per-chunk statistics the same training step plans in chunks under
// the budget the default refuses, and the plan says which statistics are
// in force: per chunk when it splits, the whole batch's in one chunk. The
// default in one chunk says whole-batch; evaluation mode says nothing.
func TestPerChunkBatchNormPlanning(t *testing.T) {
	const n = 64
	perChunk, _ := bnStepWith(t, n, true, true)
	train, _ := bnStep(t, n, true)
	eval, _ := bnStep(t, n, false)
	require.True(t, perChunk.Info.Chunkable(), "%v", perChunk.Info.NotChunkable)
	budget := wholeBatchPeak(t, train) / 2

	_, err := planner.Make(train, planner.Options{Budget: budget})
	require.ErrorIs(t, err, graph.ErrNotChunkable)
	pl, err := planner.Make(perChunk, planner.Options{Budget: budget})
	require.NoError(t, err)
	require.Greater(t, pl.Split.Len(), 1)
	assert.LessOrEqual(t, pl.PeakReserved, pl.Available())
	assert.Equal(t, planner.PerChunkStats, pl.BatchStats)
	assert.Equal(t, 1, pl.BatchNormNodes)
	assert.Contains(t, pl.StatsNote(), "per-chunk statistics: 1 batch_norm node normalises")
	assert.Contains(t, pl.StatsNote(), pl.Split.String())

	pl, err = planner.Make(perChunk, planner.Options{Budget: 1 << 40})
	require.NoError(t, err)
	require.Equal(t, 1, pl.Split.Len())
	assert.Equal(t, planner.WholeBatchStats, pl.BatchStats)
	assert.Contains(t, pl.StatsNote(), "all 64 samples")

	pl, err = planner.Make(train, planner.Options{Budget: 1 << 40})
	require.NoError(t, err)
	assert.Equal(t, planner.WholeBatchStats, pl.BatchStats)

	pl, err = planner.Make(eval, planner.Options{Budget: budget})
	require.NoError(t, err)
	assert.Empty(t, pl.BatchStats)
	assert.Empty(t, pl.StatsNote())
}

// Per-chunk statistics of x [N, C] need two samples a chunk: at every
// budget the planner splits 5 samples into chunks of at least 2 (3 + 2 at
// the most chunks), and below what chunks of 3 need it says so, naming 3
// as the smallest chunk tried, where chunks of 1 would have fitted.
func TestPerChunkBatchNormMinChunk(t *testing.T) {
	const n, c = 5, 1 << 22 // 16 MiB a sample: large blocks, rounded to 2 MiB
	x := lazy.Placeholder([]int{n, c}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{c}, graph.Float32, "w")
	loss := x.BatchNormPerChunk(w, nil, 1e-5).Mean()
	grads := lazy.Grad(loss, w)
	outs := []int{loss.ID(), grads[0].ID(), x.BatchStats().ID()}
	ir := x.Graph().IR()
	info, err := shapeinfer.Analyze(ir, outs...)
	require.NoError(t, err)
	require.Equal(t, 2, info.MinChunk)
	p, err := planner.Compile(ir, info, outs, planner.CompileOptions{Kept: outs[1:2]})
	require.NoError(t, err)

	counts := map[int]bool{}
	var refused *planner.DoesNotFitError
	for b := int64(alloc.RoundLarge); ; b += alloc.RoundLarge {
		pl, err := planner.Make(p, planner.Options{Budget: b})
		if err != nil {
			var dnf *planner.DoesNotFitError
			require.ErrorAs(t, err, &dnf)
			refused = dnf
			continue
		}
		for _, ch := range pl.Chunks {
			require.GreaterOrEqual(t, ch.Size, 2, "budget %d: chunks %v", b, planner.Sizes(pl.Chunks))
		}
		counts[len(pl.Chunks)] = true
		if len(pl.Chunks) == 1 {
			break
		}
	}
	assert.Equal(t, map[int]bool{1: true, 2: true}, counts)
	require.NotNil(t, refused)
	assert.Equal(t, 3, refused.Chunk, "the smallest chunk tried")
	sim := alloc.New(alloc.NewSimBackend(planner.Unlimited), alloc.Options{})
	one, err := planner.Replay(p, planner.ChunksOf(n, 1), sim, nil, false)
	require.NoError(t, err)
	assert.Less(t, one.PeakReserved, refused.Needed, "chunks of 1 would have needed less")

	// Executors refuse chunks below MinChunk, as the planner never makes them.
	require.ErrorIs(t, exec.CheckChunks(p, planner.ChunksOf(n, 1)), graph.ErrShape)
	require.NoError(t, exec.CheckChunks(p, planner.ChunksOf(n, 3)))

	// A micro-batch (MaxChunk) below the least chunk is refused; at it, the
	// plan runs 3 + 2.
	_, err = planner.Make(p, planner.Options{Budget: 1 << 40, MaxChunk: 2})
	require.ErrorIs(t, err, planner.ErrBudget)
	pl, err := planner.Make(p, planner.Options{Budget: 1 << 40, MaxChunk: 3})
	require.NoError(t, err)
	assert.Equal(t, []int{3, 2}, planner.Sizes(pl.Chunks))
}
