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

// TestSessionChannelsLastCPU trains conv nets on the CPU channels last
// (Options.ChannelsLast) and NCHW (Options.NoChannelsLast, since channels
// last is bf16-mixed's default), whole and in chunks (Options.MaxChunk): the losses of three SGD steps
// agree within 1e-5 relative in fp32 (float32 convolutions stay NCHW, so
// the step is the same) and 2e-2 in bf16-mixed and fp16-mixed (the CPU
// computes channels-last nodes in NCHW, but a float32 sum in another order
// may round to the neighbouring 16-bit value), and predicted = measured
// peaks hold with the conversions planned.
func TestSessionChannelsLastCPU(t *testing.T) {
	ctx := context.Background()
	for _, pc := range []struct {
		precision string
		rtol      float64
	}{{"fp32", 1e-5}, {"bf16-mixed", 2e-2}, {"fp16-mixed", 2e-2}} {
		for _, mc := range []struct {
			newModel func() testutil.TrainModel
			n        int
			maxChunk int
		}{
			{func() testutil.TrainModel { return resnetModel(false) }, 8, 0},
			{func() testutil.TrainModel { return resnetPerChunkModel(false) }, 16, 4},
			{func() testutil.TrainModel { return testutil.ConvModel(12, true) }, 64, 16},
		} {
			t.Run(pc.precision+"/"+mc.newModel().Name, func(t *testing.T) {
				var sess [2]*batchfit.Session
				for i, last := range []bool{false, true} {
					sess[i] = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: pc.precision,
						MaxChunk: mc.maxChunk, ChannelsLast: last, NoChannelsLast: !last})
					require.NoError(t, sess[i].Err())
					defer sess[i].Close()
				}
				ms := [2]testutil.TrainModel{mc.newModel(), mc.newModel()}
				rngs := [2]*rand.Rand{rand.New(rand.NewPCG(5, 6)), rand.New(rand.NewPCG(5, 6))}
				opts := [2]*optim.SGD{optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)}
				for step := range 3 {
					var loss [2]float32
					for i := range 2 {
						l, params := ms[i].Build(rngs[i], mc.n)
						var err error
						loss[i], err = sess[i].Step(ctx, l, params, opts[i])
						require.NoError(t, err, "step %d, channels last %t", step, i == 1)
						pl, used := sess[i].LastPlan(), sess[i].LastUsage()
						assert.Equal(t, pl.PeakReserved+sess[i].Overhead(), used.PeakReserved, "step %d: peak reserved", step)
						assert.Equal(t, pl.PeakAllocated+sess[i].Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
						if mc.maxChunk > 0 && step == 0 {
							t.Logf("channels last %t: %d chunks", i == 1, len(pl.Chunks))
						}
					}
					assert.InEpsilon(t, loss[0], loss[1], pc.rtol, "step %d loss", step)
				}
			})
		}
	}
}
