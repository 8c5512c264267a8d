package batchfit_test

import (
	"context"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
)

// TestSessionCUDAFP32ConvNets trains conv nets in plain float32 on CUDA,
// their convolutions on the algorithms cuDNN's timed search chose when
// the step was compiled (each node declaring the chosen algorithm's
// workspace), against the CPU session for three SGD steps: the ResNet
// with whole-batch statistics whole, its per-chunk twin and the ConvNet
// whole and in four chunks (Options.MaxChunk). Losses within 1e-4
// relative (float32 on both sides, sums in other orders), and
// predicted = measured peaks, reserved and allocated, at every step.
func TestSessionCUDAFP32ConvNets(t *testing.T) {
	const steps = 3
	ctx := context.Background()
	for _, mc := range []struct {
		newModel func() testutil.TrainModel
		n        int
		chunks   bool
	}{
		{func() testutil.TrainModel { return resnetModel(false) }, 64, false},
		{func() testutil.TrainModel { return resnetPerChunkModel(false) }, 64, true},
		{func() testutil.TrainModel { return testutil.ConvModel(12, false) }, 512, true},
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
				gpu := cudaSession(t, batchfit.Options{MaxChunk: maxChunk})
				if os.Getenv("BATCHFIT_CUDNN_FIND") != "0" {
					require.Contains(t, gpu.Device(), "timed search")
				}
				cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, MaxChunk: maxChunk})
				gm, cm := newModel(), newModel()
				grng, crng := rand.New(rand.NewPCG(97, 98)), rand.New(rand.NewPCG(97, 98))
				gopt, copt := optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)
				for step := range steps {
					loss, params := cm.Build(crng, n)
					want, err := cpu.Step(ctx, loss, params, copt)
					require.NoError(t, err, "cpu step %d", step)
					loss, params = gm.Build(grng, n)
					got, err := gpu.Step(ctx, loss, params, gopt)
					require.NoError(t, err, "cuda step %d", step)
					pl, used := gpu.LastPlan(), gpu.LastUsage()
					t.Logf("chunked %t step %d: loss cpu %.7f cuda %.7f; %d chunks, reserved predicted %d + %d, measured %d; allocated predicted %d + %d, measured %d",
						chunked, step, want, got, len(pl.Chunks), pl.PeakReserved, gpu.Overhead(), used.PeakReserved,
						pl.PeakAllocated, gpu.Overhead(), used.PeakAllocated)
					assert.InEpsilon(t, want, got, 1e-4, "step %d loss", step)
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
