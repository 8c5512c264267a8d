package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
)

// TestSessionCUDAChannelsLast trains conv nets with Options.ChannelsLast
// under bf16-mixed on CUDA (cuDNN's NHWC convolutions, the channels-last
// batch norm and pooling kernels, the permutes at the regions' borders)
// against the CPU session without it, for three SGD steps, whole and in
// four chunks (Options.MaxChunk): losses within bf16-mixed's tolerance
// (2e-2, as TestSessionCUDAMixedPrecision), and predicted = measured
// peaks, reserved and allocated, at every step. The ResNet with
// whole-batch statistics runs whole only; its per-chunk twin and the
// ConvNet both ways.
func TestSessionCUDAChannelsLast(t *testing.T) {
	const steps = 3
	ctx := context.Background()
	for _, mc := range []struct {
		newModel func() testutil.TrainModel
		n        int
		chunks   bool
	}{
		{func() testutil.TrainModel { return resnetModel(false) }, 64, false},
		{func() testutil.TrainModel { return resnetPerChunkModel(false) }, 64, true},
		{func() testutil.TrainModel { return testutil.ConvModel(12, true) }, 8192, true},
	} {
		newModel, n := mc.newModel, mc.n
		t.Run(newModel().Name, func(t *testing.T) {
			for _, chunked := range []bool{false, true} {
				if chunked && !mc.chunks {
					continue
				}
				var maxChunk int
				if chunked {
					maxChunk = n / 4
				}
				gpu := cudaSession(t, batchfit.Options{Precision: "bf16-mixed", MaxChunk: maxChunk, ChannelsLast: true})
				cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", MaxChunk: maxChunk})
				gm, cm := newModel(), newModel()
				grng, crng := rand.New(rand.NewPCG(95, 96)), rand.New(rand.NewPCG(95, 96))
				gopt, copt := optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)
				for step := range steps {
					loss, params := cm.Build(crng, n)
					want, err := cpu.Step(ctx, loss, params, copt)
					require.NoError(t, err, "cpu step %d", step)
					loss, params = gm.Build(grng, n)
					got, err := gpu.Step(ctx, loss, params, gopt)
					require.NoError(t, err, "cuda step %d", step)
					pl, used := gpu.LastPlan(), gpu.LastUsage()
					t.Logf("chunked %t step %d: loss cpu %.6f cuda %.6f; %d chunks, reserved predicted %d + %d, measured %d; allocated predicted %d + %d, measured %d",
						chunked, step, want, got, len(pl.Chunks), pl.PeakReserved, gpu.Overhead(), used.PeakReserved,
						pl.PeakAllocated, gpu.Overhead(), used.PeakAllocated)
					assert.InEpsilon(t, want, got, 2e-2, "step %d loss", step)
					assert.Equal(t, pl.PeakReserved+gpu.Overhead(), used.PeakReserved, "step %d: peak reserved", step)
					assert.Equal(t, pl.PeakAllocated+gpu.Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
					if chunked {
						assert.Len(t, pl.Chunks, 4)
					} else {
						assert.Len(t, pl.Chunks, 1)
					}
				}
				require.NoError(t, cpu.Close())
			}
		})
	}
}
