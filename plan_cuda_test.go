package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// On CUDA, Plan is the plan Step runs, with the executor's own
// workspaces, within Options.Budget (so that the card's free memory
// moving between a plan and its step changes nothing): over three steps
// of each model the next Step's plan is the one planned before it, and
// the measured peaks are the plan's plus Overhead, to the byte. MaxBatch on the card is exact too:
// a step at the batch it found runs in one chunk, one sample more in
// several.
func TestPlanIsStepsPlanOnCUDA(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name  string
		model testutil.TrainModel
		batch int
		opts  batchfit.Options
	}{
		{"mlp fp32 chunked", mlpModel(false), 4000, batchfit.Options{Budget: 64 << 20}},
		{"gpt bf16-mixed chunked", fusedGPTModel(512)(false), 256, batchfit.Options{Budget: 96 << 20, Precision: "bf16-mixed"}},
		{"convnet fp32", convModel(32)(false), 200, batchfit.Options{Budget: 256 << 20}},
	} {
		t.Run(c.name, func(t *testing.T) {
			sess := cudaSession(t, c.opts)
			opt := optim.NewAdam(1e-3)
			for step := range 3 {
				loss, params := c.model.Build(rand.New(rand.NewPCG(uint64(step), 1)), c.batch)
				sp, err := sess.Plan(loss, params, opt)
				require.NoError(t, err)
				loss, params = c.model.Build(rand.New(rand.NewPCG(uint64(step), 1)), c.batch)
				_, err = sess.Step(ctx, loss, params, opt)
				require.NoError(t, err)
				samePlan(t, sess.LastPlan(), sp.Plan, c.name)
				u := sess.LastUsage()
				t.Logf("%s step %d: %s, predicted %d + %d, measured %d", c.name, step, sp.Plan.Split, sp.Plan.PeakReserved, sp.Overhead, u.PeakReserved)
				assert.Equal(t, sp.Plan.PeakReserved+sp.Overhead, u.PeakReserved, "step %d", step)
				assert.Equal(t, sp.Plan.PeakAllocated+sp.Overhead, u.PeakAllocated, "step %d", step)
			}
		})
	}

	opts := batchfit.Options{Budget: 96 << 20, Precision: "bf16-mixed"}
	model := fusedGPTModel(512)(false)
	rng := rand.New(rand.NewPCG(5, 5))
	search := cudaSession(t, opts)
	fit, err := search.MaxBatch(func(n int) (*lazy.Tensor, []*lazy.Tensor) { return model.Build(rng, n) }, optim.NewAdam(1e-3),
		batchfit.MaxBatchOptions{Limit: 1 << 14})
	require.NoError(t, err)
	require.Positive(t, fit.Batch)
	t.Logf("largest one-chunk batch within 96 MiB on CUDA: %d (%d plans)", fit.Batch, fit.Plans)
	for _, n := range []int{fit.Batch, fit.Batch + 1} {
		sess := cudaSession(t, opts)
		loss, params := model.Build(rng, n)
		_, err := sess.Step(ctx, loss, params, optim.NewAdam(1e-3))
		require.NoError(t, err)
		assert.Equal(t, n == fit.Batch, sess.LastPlan().Split.Len() == 1, "batch %d runs as %s", n, sess.LastPlan().Split)
		assert.Equal(t, sess.LastPlan().PeakReserved+sess.Overhead(), sess.LastUsage().PeakReserved)
		require.NoError(t, sess.Close()) // frees the parameters for the session that follows (ErrParamOwned)
	}
}
