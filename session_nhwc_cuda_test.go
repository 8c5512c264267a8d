package batchfit_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
				cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", MaxChunk: maxChunk, NoChannelsLast: true})
				ts := newTwinSteps(cpu, gpu, newModel, 95)
				for step := range steps {
					pl := ts.step(t, ctx, step, n, 2e-2, fmt.Sprintf("chunked %t", chunked))
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
