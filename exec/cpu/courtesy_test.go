package cpu_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

func TestZeroExecutorYields(t *testing.T) {
	var e cpu.Executor
	require.False(t, e.Yielded())
	require.NoError(t, e.Restore())
	require.NoError(t, e.Yield())
	require.True(t, e.Yielded())
	require.NoError(t, e.Restore())
	require.False(t, e.Yielded())
}

// A resident run after Yield restores the parameter's block; a run that
// keeps nothing resident leaves the executor yielded.
func TestYieldGivesBackResidentBlocks(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	w := make([]float32, 64*32)
	for i := range w {
		w[i] = float32(rng.NormFloat64())
	}
	x := make([]float32, 4*64)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	wt := lazy.Param(tensor.New(tensor.WithShape(32, 64), tensor.WithBacking(w)), "w")
	y := lazy.Wrap(tensor.New(tensor.WithShape(4, 64), tensor.WithBacking(x)), 0).Linear(wt, nil).Sum(0)
	require.NoError(t, y.Err())
	g := y.Graph().IR()
	info, err := shapeinfer.Analyze(g, y.ID())
	require.NoError(t, err)
	p, err := planner.Compile(g, info, []int{y.ID()}, planner.CompileOptions{Workspace: cpu.Workspace})
	require.NoError(t, err)

	e := cpu.New()
	a := e.Allocator()
	run := func(resident bool) []float32 {
		res, err := e.Execute(context.Background(), p, planner.Chunks(4, 1), cpu.ExecOptions{Resident: resident})
		require.NoError(t, err)
		return res.Outputs[0].Data().([]float32)
	}
	want := run(true)
	param := int64(32 * 64 * 4)
	require.Equal(t, param, a.Stats().RequestedBytes[alloc.All].Current, "the parameter stays resident")

	require.NoError(t, e.Yield())
	require.True(t, e.Yielded())
	require.Zero(t, a.Stats().ReservedBytes[alloc.All].Current)

	require.Equal(t, want, run(false), "a run that keeps nothing resident")
	require.True(t, e.Yielded(), "does not restore")
	require.Zero(t, a.Stats().AllocatedBytes[alloc.All].Current)

	require.Equal(t, want, run(true))
	require.False(t, e.Yielded(), "a resident run restores")
	require.Equal(t, param, a.Stats().RequestedBytes[alloc.All].Current)
}
