package batchfit_test

import (
	"os"
	"testing"

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
	models := []convTwin{
		{func() testutil.TrainModel { return resnetModel(false) }, 64, false},
		{func() testutil.TrainModel { return resnetPerChunkModel(false) }, 64, true},
		{func() testutil.TrainModel { return testutil.ConvModel(12, false) }, 512, true},
	}
	twinConvNets(t, models, batchfit.Options{}, batchfit.Options{}, 97, 1e-4, func(t *testing.T, gpu *batchfit.Session) {
		if os.Getenv("BATCHFIT_CUDNN_FIND") != "0" {
			require.Contains(t, gpu.Device(), "timed search")
		}
	})
}
