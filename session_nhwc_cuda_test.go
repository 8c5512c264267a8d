package batchfit_test

import (
	"testing"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
)

// TestSessionCUDAChannelsLast trains conv nets with Options.ChannelsLast
// under bf16-mixed on CUDA (cuDNN's NHWC convolutions, the channels-last
// batch norm and pooling kernels, the permutes at the regions' borders)
// against the CPU session in NCHW (Options.NoChannelsLast), for three SGD steps, whole and in
// four chunks (Options.MaxChunk): losses within bf16-mixed's tolerance
// (2e-2, as TestSessionCUDAMixedPrecision), and predicted = measured
// peaks, reserved and allocated, at every step. The ResNet with
// whole-batch statistics runs whole only; its per-chunk twin and the
// ConvNet both ways.
func TestSessionCUDAChannelsLast(t *testing.T) {
	models := []convTwin{
		{func() testutil.TrainModel { return resnetModel(false) }, 64, false},
		{func() testutil.TrainModel { return resnetPerChunkModel(false) }, 64, true},
		{func() testutil.TrainModel { return testutil.ConvModel(12, true) }, 8192, true},
	}
	twinConvNets(t, models, batchfit.Options{Precision: "bf16-mixed", ChannelsLast: true},
		batchfit.Options{Precision: "bf16-mixed", NoChannelsLast: true}, 95, 2e-2, nil)
}
