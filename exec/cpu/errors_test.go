package cpu_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// runErr evaluates y and checks that the executor's error wraps want.
func runErr(t *testing.T, y *lazy.Tensor, want error) {
	t.Helper()
	require.NoError(t, y.Err())
	_, err := cpu.New().Run(context.Background(), y.Graph().IR(), y.ID())
	require.Error(t, err)
	require.ErrorIs(t, err, want)
}

func TestErrors(t *testing.T) {
	t.Run("embedding index out of range", func(t *testing.T) {
		w := param([]int{4, 2}, uniform(newRNG(700), 8, -1, 1))
		for _, bad := range []int64{4, -1} {
			idx := lazy.Wrap(denseInt([]int{3}, []int64{0, bad, 1}), 0)
			y := idx.Embedding(w)
			runErr(t, y, graph.ErrAttr)
			_, err := cpu.New().Run(context.Background(), y.Graph().IR(), y.ID())
			var opErr *graph.OpError
			require.ErrorAs(t, err, &opErr)
			require.Equal(t, "embedding", opErr.Op)
		}
	})
	t.Run("cross entropy label out of range", func(t *testing.T) {
		x := input([]int{3, 4}, uniform(newRNG(701), 12, -1, 1))
		for _, bad := range []int64{4, -2} {
			l := lazy.Const(denseInt([]int{3}, []int64{1, 2, bad}))
			runErr(t, x.CrossEntropy(l, graph.ReduceMean), graph.ErrAttr)
		}
	})
	t.Run("placeholder has no data", func(t *testing.T) {
		runErr(t, lazy.Placeholder([]int{2, 3}, graph.Float32, 0).Exp(), graph.ErrNoData)
	})
	t.Run("size-0 output", func(t *testing.T) {
		// gorgonia.org/tensor cannot hold a tensor with a size-0 axis.
		x := input([]int{2, 3}, uniform(newRNG(702), 6, -1, 1))
		runErr(t, x.Slice(1, 1, 1), graph.ErrShape)
	})
	t.Run("chunk too small for a slice along the batch axis", func(t *testing.T) {
		// Such a graph is not chunkable; running it in chunks anyway must
		// fail cleanly.
		d := uniform(newRNG(706), 12, -1, 1)
		y := input([]int{4, 3}, d).Slice(0, 1, 4)
		require.NoError(t, y.Err())
		feed := func(int) tensor.Tensor { return dense([]int{2, 3}, d[:6]) }
		_, err := cpu.New().RunBatch(context.Background(), y.Graph().IR(), 2, feed, y.ID())
		require.ErrorIs(t, err, graph.ErrAttr)
	})
	t.Run("feed of the wrong shape", func(t *testing.T) {
		x := input([]int{4, 3}, uniform(newRNG(703), 12, -1, 1))
		y := x.Relu()
		require.NoError(t, y.Err())
		for _, shape := range [][]int{{2, 4}, {3, 3}, {6}} {
			feed := func(int) tensor.Tensor { return dense(shape, uniform(newRNG(704), numel(shape), -1, 1)) }
			_, err := cpu.New().RunBatch(context.Background(), y.Graph().IR(), 2, feed, y.ID())
			require.ErrorIs(t, err, graph.ErrShape, "feed %v for a chunk of 2", shape)
		}
		// Wrong dtype: int64 data for a float32 input.
		feed := func(int) tensor.Tensor { return denseInt([]int{2, 3}, randInts(705, 6)) }
		_, err := cpu.New().RunBatch(context.Background(), y.Graph().IR(), 2, feed, y.ID())
		require.True(t, errors.Is(err, graph.ErrDType), "got %v", err)
	})
}

// Execute refuses several chunks of a graph that is not chunkable: running
// training-mode batch_norm per chunk would normalise each chunk by its own
// statistics, silently. One chunk of the whole batch runs.
func TestExecuteRefusesChunksOfUnchunkableGraph(t *testing.T) {
	x := input([]int{4, 3}, uniform(newRNG(702), 12, -1, 1))
	y := x.BatchNorm(nil, nil, nil, nil, true, 1e-5)
	require.NoError(t, y.Err())
	g := y.Graph().IR()
	info, err := shapeinfer.Analyze(g, y.ID())
	require.NoError(t, err)
	p, err := planner.Compile(g, info, []int{y.ID()}, planner.CompileOptions{Workspace: cpu.Workspace})
	require.NoError(t, err)
	_, err = cpu.New().Execute(context.Background(), p, planner.ChunksOf(4, 2), cpu.ExecOptions{})
	require.ErrorIs(t, err, graph.ErrNotChunkable)
	_, err = cpu.New().Execute(context.Background(), p, planner.ChunksOf(4, 4), cpu.ExecOptions{})
	require.NoError(t, err)
}
