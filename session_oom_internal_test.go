package batchfit

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// TestStepReplansWhenMemoryIsTaken injects an out-of-memory between a
// step's plan and its run: the session gave its cache back, the step was
// planned whole within the budget, and then another user took device
// memory. The run hits OOM, the step is planned again in smaller chunks and
// completes; its parameters equal those of a session nobody disturbed
// (within float32 rounding of the chunk sums, 1e-5 relative), so no chunk
// was lost or counted twice.
func TestStepReplansWhenMemoryIsTaken(t *testing.T) {
	const budget = 64 << 20
	const n, in = 2048, 256
	data, labels := sineBatch(n, in, 0.37)
	train := func(disturb bool) ([]float32, *Session) {
		model := nn.MLP(nn.Seed(3), []int{in, 1024, 10}, nn.ReLU{})
		sess := NewSession(Options{Device: DeviceCPU, Budget: budget})
		opt := optim.NewSGD(0.1, 0.9)
		for step := range 2 {
			if step == 1 && disturb {
				// The session gives its cache back (as empty_cache would);
				// after the step is planned, another process takes part of
				// the device, leaving less than the whole-batch plan needs.
				require.NoError(t, sess.Allocator().EmptyCache())
				whole := sess.LastPlan().PeakReserved
				sess.beforeRun = func() {
					sess.beforeRun = nil
					_, err := sess.Allocator().Backend().Malloc(budget - (whole - 8<<20))
					require.NoError(t, err)
				}
			}
			x := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(data)), 0)
			y := x.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(labels)), 0)
			loss := model.Forward(x).CrossEntropy(y, graph.ReduceMean)
			_, err := sess.Step(context.Background(), loss, nn.ParamTensors(model), opt)
			require.NoError(t, err, "step %d", step)
		}
		return nn.ParamTensors(model)[0].Value().Data().([]float32), sess
	}
	want, calm := train(false)
	got, disturbed := train(true)
	require.Len(t, calm.LastPlan().Chunks, 1, "undisturbed, the batch runs whole")
	require.Greater(t, len(disturbed.LastPlan().Chunks), 1, "after the memory was taken the step re-planned in chunks")
	for i := range want {
		require.InDelta(t, want[i], got[i], 1e-5*math.Max(1, math.Abs(float64(want[i]))), "parameter element %d", i)
	}
}
