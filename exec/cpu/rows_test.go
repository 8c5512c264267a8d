package cpu_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// TestRowErrorOnLaterBatchAxis: a bad embedding index of seq-first
// indices [L, N] (batch axis 1), found in a chunk of samples 4 and 5, is
// named at the caller's sample and position, whole batch or chunks alike.
func TestRowErrorOnLaterBatchAxis(t *testing.T) {
	const l, n, v = 3, 8, 4
	ids := make([]int64, l*n)
	for i := range ids {
		ids[i] = int64(i % v)
	}
	ids[2*n+5] = v // token 2 of sample 5
	idx := lazy.Wrap(tensor.New(tensor.WithShape(l, n), tensor.WithBacking(ids)), 1)
	w := lazy.Param(tensor.New(tensor.WithShape(v, 2), tensor.WithBacking(make([]float32, 2*v))), "w")
	y := idx.Embedding(w)
	require.NoError(t, y.Err())
	g := y.Graph().IR()
	info, err := shapeinfer.Analyze(g, y.ID())
	require.NoError(t, err)
	p, _, err := exec.Single(g, info, n, cpu.Workspace, []int{y.ID()})
	require.NoError(t, err)
	for _, chunks := range [][]planner.Chunk{planner.ChunksOf(n, n), planner.ChunksOf(n, 2)} {
		_, err := cpu.New().Execute(context.Background(), p, chunks, cpu.ExecOptions{})
		require.ErrorIs(t, err, graph.ErrAttr)
		var re *exec.RowError
		require.ErrorAs(t, err, &re)
		want := exec.RowError{Op: "embedding", What: "index", Value: v, Limit: v, Input: 0, Shape: []int{l, n}, Pos: 2*n + 5, Row: 5}
		require.Equal(t, want, *re, "%d chunks: %v", len(chunks), err)
		require.ErrorContains(t, err, "embedding index 4 at position 21 (row 5 along the batch axis) outside [0, 4)")
	}
}
