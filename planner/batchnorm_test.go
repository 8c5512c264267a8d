package planner_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// bnStep compiles one training step of conv → batch_norm → relu → mean over
// a batch of n NCHW images: the loss and the gradients of every parameter
// are outputs, the gradients kept (accumulated across chunks).
func bnStep(t *testing.T, n int, training bool) (p *planner.Program, bnNode int) {
	t.Helper()
	const c = 16
	spec := func(name string, shape ...int) *lazy.Tensor { return lazy.ParamSpec(shape, graph.Float32, name) }
	k, w, b := spec("conv.weight", c, 3, 3, 3), spec("bn.weight", c), spec("bn.bias", c)
	mean, variance := spec("bn.running_mean", c), spec("bn.running_var", c)
	x := lazy.Placeholder([]int{n, 3, 32, 32}, graph.Float32, 0)
	h := x.Conv2d(k, nil, lazy.ConvOptions{Padding: [2]int{1, 1}})
	y := h.BatchNorm2d(w, b, mean, variance, training, 1e-5)
	loss := y.Relu().Mean()
	grads := lazy.Grad(loss, k, w, b)
	outs := []int{loss.ID()}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
	}
	ir := x.Graph().IR()
	info, err := shapeinfer.Analyze(ir, outs...)
	require.NoError(t, err)
	p, err = planner.Compile(ir, info, outs, planner.CompileOptions{Kept: outs[1:]})
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
