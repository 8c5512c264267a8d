package batchfit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// soakModel is 784 → 512 → 10 after a 784-wide mask made anew for every
// graph (a constant), as a loop that draws a feature mask per step does.
type soakModel struct{ m *nn.Sequential }

func newSoakModel() soakModel {
	opt := nn.Seed(61)
	return soakModel{nn.NewSequential(nn.NewLinear(opt, 784, 512, true), nn.ReLU{}, nn.NewLinear(opt, 512, 10, true))}
}

func (s soakModel) loss(rng *rand.Rand, n int) *lazy.Tensor {
	x := lazy.Wrap(testutil.UniformF32(rng, n, 784), 0)
	y := x.Graph().Wrap(testutil.Classes(rng, 10, n), 0)
	mask := lazy.Const(testutil.UniformF32(rng, 784))
	return s.m.Forward(x.Mul(mask)).CrossEntropy(y, graph.ReduceMean)
}

// soak runs steps of a loop that alternates a training step and an
// evaluation, over epochs of batches of n, n, n and a short last one of
// n/3, each graph with a constant of its own. At every step the peaks are
// measured as planned, and after it the allocator's allocated and reserved
// bytes are what they were after the first step of the same kind and batch
// size: nothing accumulates.
func soak(t *testing.T, sess *batchfit.Session, steps, n int) {
	t.Helper()
	ctx := context.Background()
	m := newSoakModel()
	rng := rand.New(rand.NewPCG(91, 92))
	opt := optim.NewAdam(1e-3)
	sizes := []int{n, n, n, n / 3}
	type after struct{ allocated, reserved int64 }
	seen := map[string]after{}
	for step := range steps {
		size := sizes[(step/2)%len(sizes)]
		train := step%2 == 0
		var err error
		if train {
			_, err = sess.Step(ctx, m.loss(rng, size), nn.ParamTensors(m.m), opt)
		} else {
			_, err = sess.Eval(ctx, m.loss(rng, size))
		}
		what := fmt.Sprintf("step %d (train %v, batch %d)", step, train, size)
		require.NoError(t, err, what)
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "%s: reserved, predicted vs measured", what)
		require.Equal(t, pl.PeakAllocated+sess.Overhead(), used.PeakAllocated, "%s: allocated, predicted vs measured", what)
		st := sess.Allocator().Stats()
		now := after{st.AllocatedBytes[alloc.All].Current, st.ReservedBytes[alloc.All].Current}
		key := fmt.Sprint(train, size)
		if first, ok := seen[key]; ok {
			require.Equal(t, first, now, "%s: allocated and reserved after the step", what)
		} else {
			seen[key] = now
		}
	}
}

// The short soak: 40 steps on the CPU within a budget
// that makes the full batches run in chunks.
func TestSoakCPU(t *testing.T) {
	const n = 512
	m := newSoakModel()
	rng := rand.New(rand.NewPCG(93, 94))
	budgets := testutil.TightBudgets(t, stepProgram(t, m.loss(rng, n), nn.ParamTensors(m.m), 2))
	cs := testutil.Counts(budgets)
	require.Greater(t, len(cs), 1, "the step runs in chunks at some budget")
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[cs[1]]})
	soak(t, sess, 40, n)
	require.NoError(t, sess.Close())
}
