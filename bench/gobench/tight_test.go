package main

import (
	"flag"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/precision"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
)

// defaultConfig is gobench's configuration with its flags' defaults.
func defaultConfig(t *testing.T, args ...string) config {
	t.Helper()
	var c config
	fs := flag.NewFlagSet("gobench", flag.ContinueOnError)
	registerFlags(fs, &c)
	require.NoError(t, fs.Parse(args))
	return c
}

// The -tight-batch-* defaults do not fit whole in 8GiB, less the default
// cuBLAS workspace (the executor's Overhead): the planner splits each in
// three chunks or more (shape-only programs, planned here without a GPU).
// simulateSteps, gobench's copy of the planner's two-step simulation,
// gives the plan's own peaks for the plan's chunks, and the next larger
// chunk size needs more than the budget and runs out of memory in it.
func TestTightDefaultsSplitWithin8GiB(t *testing.T) {
	c := defaultConfig(t, "-budget", "8GiB")
	require.Equal(t, int64(8<<30), c.budget)
	ms, err := benchModels(c)
	require.NoError(t, err)
	require.Len(t, ms, 3, "mlp, gpt and conv by default")
	budget := c.budget - cuda.DefaultWorkspace
	for _, m := range ms {
		t.Run(m.name, func(t *testing.T) {
			mod := m.module(nn.Options{ShapeOnly: true})
			loss, _ := m.build(mod, m.tight, nil)
			p, _, err := compileStep(cuda.Workspace, precision.FP32, compile.Options{}, loss, nn.ParamTensors(mod), 2)
			require.NoError(t, err)
			tp, err := planTight(p, budget)
			require.NoError(t, err)
			pl := tp.plan
			t.Logf("batch %d: %s, peak %s; next %s needs %s", m.tight, planner.DescribeSizes(planner.Sizes(pl.Chunks)),
				alloc.FormatBytes(pl.PeakReserved), planner.DescribeSizes(planner.Sizes(tp.next)), alloc.FormatBytes(tp.nextUsage.PeakReserved))
			require.GreaterOrEqual(t, len(pl.Chunks), 3)
			require.LessOrEqual(t, pl.PeakReserved, budget)

			u, fits, err := simulateSteps(p, pl.Chunks, budget)
			require.NoError(t, err)
			require.True(t, fits)
			require.Equal(t, pl.PeakReserved, u.PeakReserved)
			require.Equal(t, pl.PeakAllocated, u.PeakAllocated)

			// A device larger than the budget (the H100) with the allocator
			// capped at the budget, as tightness runs it: the same peaks.
			// Uncapped, the allocator can keep segments the simulation
			// released when it ran out of room (the conv net's 3 × 16384 kept
			// a 2 GiB segment too many on the H100 while convolutions unfolded
			// one image at a time; alloc's TestLimitActsAsASmallerDevice
			// covers the cap itself).
			capped := alloc.New(alloc.NewSimBackend(unlimitedCapacity), alloc.Options{})
			capped.SetLimit(budget)
			u, fits, err = replaySteps(p, pl.Chunks, capped)
			require.NoError(t, err)
			require.True(t, fits)
			require.Equal(t, pl.PeakReserved, u.PeakReserved, "capped")
			uncapped, _, err := replaySteps(p, pl.Chunks, alloc.New(alloc.NewSimBackend(unlimitedCapacity), alloc.Options{}))
			require.NoError(t, err)
			t.Logf("uncapped on a large device: peak %s (%d cache releases in the plan's replay)",
				alloc.FormatBytes(uncapped.PeakReserved), capped.Stats().NumAllocRetries)

			require.Len(t, tp.next, len(pl.Chunks)-1)
			require.Greater(t, tp.next[0].Size, pl.Chunk)
			require.False(t, tp.nextFits)
			require.Greater(t, tp.nextUsage.PeakReserved, budget)
		})
	}
}

// One chunk: nothing larger to simulate.
func TestTightWholeBatch(t *testing.T) {
	ms, err := benchModels(defaultConfig(t, "-models", "mlp"))
	require.NoError(t, err)
	mod := ms[0].module(nn.Options{ShapeOnly: true})
	loss, _ := ms[0].build(mod, 64, nil)
	p, _, err := compileStep(cuda.Workspace, precision.FP32, compile.Options{}, loss, nn.ParamTensors(mod), 2)
	require.NoError(t, err)
	tp, err := planTight(p, 8<<30)
	require.NoError(t, err)
	require.Len(t, tp.plan.Chunks, 1)
	require.Nil(t, tp.next)

	_, err = planTight(p, 1<<20)
	require.ErrorIs(t, err, planner.ErrDoesNotFit, "the parameters alone are more than 1MiB")
}

func TestBudgetFlag(t *testing.T) {
	require.Zero(t, defaultConfig(t).budget, "off by default")
	require.Equal(t, int64(512<<20), defaultConfig(t, "-budget", "512MiB").budget)
	require.Equal(t, int64(8e9), defaultConfig(t, "-budget", "8GB").budget)
	require.Equal(t, int64(12345), defaultConfig(t, "-budget", "12345").budget)
	var n int64
	require.ErrorIs(t, bytesFlag{&n}.Set("lots"), alloc.ErrSize)
	require.ErrorIs(t, bytesFlag{&n}.Set("-1GiB"), alloc.ErrSize)
	require.Zero(t, n)
}

func TestDescribeChunks(t *testing.T) {
	require.Equal(t, "2 × 16384 + 1 × 16383", planner.DescribeSizes(planner.Sizes(planner.Chunks(3*16384-1, 3))))
	require.Equal(t, "1 × 64", planner.DescribeSizes([]int{64}))
	require.Equal(t, "", planner.DescribeSizes(nil))
}
