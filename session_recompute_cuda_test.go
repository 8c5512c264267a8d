package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// Recompute plans on the GPU: at the smallest budget where the
// search (with the CUDA executor's workspaces) finds a plan only with
// recompute, and at the smallest where it prefers recompute in several
// chunks, a CUDA session with Options.Recompute auto trains three Adam
// steps of the four-layer GPT; each step recomputes, and the measured
// peaks equal the plan's plus Overhead to the byte, within the budget.
// Skips without a GPU.
func TestCUDARecomputePeaksMeasured(t *testing.T) {
	const n, steps = 8, 3
	ctx := context.Background()
	overhead := cudaSession(t, batchfit.Options{}).Overhead()
	loss, params := deepGPT().Build(rand.New(rand.NewPCG(1, 2)), n)
	st := recomputeStepOn(t, cuda.Workspace, loss, params, 2)
	var budgets []int64
	var onlyRe, chunked bool
	for b := int64(2 << 20); len(budgets) < 2; b += 2 << 20 {
		res, err := recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: b}})
		require.NoError(t, err)
		if res.Best == nil {
			continue
		}
		if res.Best.Name == "none" && res.Best.Plan.Split.K == 1 {
			break
		}
		switch {
		case !onlyRe && res.Plain.Plan == nil && res.Best.Name != "none":
			onlyRe = true
			budgets = append(budgets, b)
		case !chunked && res.Plain.Plan != nil && res.Best.Name != "none" && res.Best.Plan.Split.K > 1:
			chunked = true
			budgets = append(budgets, b)
		}
	}
	require.NotEmpty(t, budgets)
	for _, budget := range budgets {
		sess := cudaSession(t, batchfit.Options{Budget: budget + overhead, Recompute: recompute.Auto})
		m, rng := deepGPT(), rand.New(rand.NewPCG(3, 4))
		opt := optim.NewAdam(1e-3)
		for step := range steps {
			loss, params := m.Build(rng, n)
			_, err := sess.Step(ctx, loss, params, opt)
			require.NoError(t, err, "budget %d, step %d", budget, step)
			pl, used, re := sess.LastPlan(), sess.LastUsage(), sess.LastRecompute()
			require.NotEqual(t, "none", re.Strategy, "budget %d, step %d", budget, step)
			require.LessOrEqual(t, pl.PeakReserved, budget)
			// Measured peaks hold the cuBLAS workspace too (Overhead).
			require.Equal(t, pl.PeakReserved+overhead, used.PeakReserved, "budget %d, step %d: reserved", budget, step)
			require.Equal(t, pl.PeakAllocated+overhead, used.PeakAllocated, "budget %d, step %d: allocated", budget, step)
			t.Logf("budget %d B: %s (%d copies) in %s, peak %d B", budget, re.Strategy, re.Copies, pl.Split, pl.PeakReserved)
		}
	}
}
