package main

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
)

// bisectReplays is gobench's largest-batch search as it was before
// Session.MaxBatch, kept as a reference: a single-chunk step at batch b
// fits when it runs on a fresh simulated device of budget bytes, bisected
// over 1…upper; 0 when one sample does not fit. The search that was
// replaced compiled the step once, at upper samples (atEach false), and
// judged one replay (steps 1). The reference MaxBatch is held to compiles
// the step at each batch it tries (atEach), as a training loop at that
// batch would, with gobench's own copy of the compile path (compileStep),
// and judges two steps (steps 2: simulateSteps, parameters and optimizer
// state resident and the first step's segments cached, gobench's copy of
// how the planner judges a training loop's steady state).
func bisectReplays(t *testing.T, c config, m benchModel, budget int64, atEach bool, steps int) int {
	t.Helper()
	mod := m.module(nn.Options{ShapeOnly: true})
	compile := func(n int) *planner.Program {
		loss, _ := m.build(mod, n, nil)
		p, _, err := compileStep(cuda.Workspace, c.policy(), c.train(), loss, nn.ParamTensors(mod), 2)
		require.NoError(t, err)
		return p
	}
	upper := compile(m.upper)
	fits := func(b int) bool {
		p, chunks := upper, []planner.Chunk{{Size: b}}
		if atEach {
			p = compile(b)
		}
		if steps == 2 {
			_, ok, err := simulateSteps(p, chunks, budget)
			require.NoError(t, err)
			return ok
		}
		_, err := planner.Replay(p, chunks, alloc.New(alloc.NewSimBackend(budget), alloc.Options{}), nil, false)
		if errors.Is(err, alloc.ErrOutOfMemory) {
			return false
		}
		require.NoError(t, err)
		return true
	}
	lo, hi := 0, m.upper+1
	if fits(m.upper) {
		lo = m.upper
	}
	for hi-lo > 1 {
		if mid := lo + (hi-lo)/2; fits(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// gobench's batch search (searchMaxBatch: Session.MaxBatch) gives the
// answer of the search it replaced, run on steps compiled at each batch
// and judged over two steps (bisectReplays), on every model gobench
// times, at CPU-friendly sizes and budgets, shape-only, with the CUDA
// executor's static workspaces on a dry-run session of the budget: fp32,
// and bf16-mixed (channels last for the conv nets) where the precision and
// layout passes change the graph. The answer is exact: the plan at it
// runs in one chunk and one sample more does not.
//
// The replaced search as it ran (one program compiled at the upper bound,
// one step judged) differs where either matters, and the log shows it:
// a step's second run may need a segment its first did not (the conv net
// within 512 MiB: 974 samples pass one step, 837 a training loop), and a
// program compiled at the upper bound declares the convolutions'
// workspaces for that batch (ResNet-50: 82 where 91 fit).
func TestMaxBatchIsGobenchsSearch(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		budget int64
	}{
		{[]string{"-models", "mlp,conv"}, 512 << 20},
		// The GPTs' head and loss unfused: compileStep's fused loss takes
		// the largest token chunk, the Session's planner its own.
		{[]string{"-models", "gpt,gpt-written", "-gpt-layers", "1", "-gpt-seq", "32", "-no-fused-loss"}, 2 << 30},
		{[]string{"-models", "resnet50", "-resnet-size", "64"}, 1 << 30},
		{[]string{"-models", "gpt,conv,resnet50", "-gpt-layers", "1", "-gpt-seq", "32", "-resnet-size", "64", "-precision", "bf16-mixed", "-no-fused-loss"}, 2 << 30},
	} {
		c := defaultConfig(t, tc.args...)
		require.NoError(t, c.resolvePrecision())
		ms, err := benchModels(c)
		require.NoError(t, err)
		for _, m := range ms {
			t.Run(c.precision+"/"+m.name, func(t *testing.T) {
				sess := batchfit.NewSession(batchfit.Options{Budget: tc.budget, Precision: c.precision, NoChannelsLast: !c.channelsLast,
					NoFusedLoss: c.noFusedLoss, DryRun: &batchfit.DryRun{Workspace: cuda.Workspace}})
				require.NoError(t, sess.Err())
				defer sess.Close()
				fit, err := searchMaxBatch(sess, m)
				require.NoError(t, err)
				want, was := bisectReplays(t, c, m, tc.budget, true, 2), bisectReplays(t, c, m, tc.budget, false, 1)
				t.Logf("%s within %s: batch %d in %d plans (the replaced search as it ran: %d)", m.name, alloc.FormatBytes(tc.budget),
					fit.Batch, fit.Plans, was)
				require.Positive(t, fit.Batch)
				assert.False(t, fit.AtLimit)
				assert.Equal(t, want, fit.Batch, "the replaced search's answer, each batch compiled and judged over two steps")
				assert.Equal(t, 1, fit.Plan.Plan.Split.Len())
				assert.LessOrEqual(t, fit.Plan.Plan.PeakReserved, tc.budget)

				mod := m.module(nn.Options{ShapeOnly: true})
				loss, _ := m.build(mod, fit.Batch+1, nil)
				sp, err := sess.Plan(loss, nn.ParamTensors(mod), m.optimizer())
				if err == nil {
					assert.Greater(t, sp.Plan.Split.Len(), 1, "one sample more needs chunks")
				} else {
					require.ErrorIs(t, err, planner.ErrDoesNotFit)
				}
			})
		}
	}
}
