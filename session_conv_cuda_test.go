package batchfit_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
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
				ts := newTwinSteps(cpu, gpu, newModel, 97)
				for step := range steps {
					pl := ts.step(t, ctx, step, n, 1e-4, fmt.Sprintf("chunked %t", chunked))
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
