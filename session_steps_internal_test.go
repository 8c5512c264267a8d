package batchfit

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
)

// A training loop builds the same forward graph every step; the session
// differentiates it once and reuses the step's graph with each step's data
// (stepTemplate). Trained with and without the templates from the same
// data, two copies of a model give bit-identical losses and parameters at
// every step, in every policy (fp16-mixed with its loss scaling, whose
// scale the templates take from each step), and the templates are used
// from the second step on. A batch of another size is another forward
// graph: a miss.
func TestStepTemplatesReuseTheGraphWithEachStepsData(t *testing.T) {
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed", "fp16-mixed"} {
		for _, mc := range []struct {
			m       func() testutil.TrainModel
			dropout bool
		}{
			{func() testutil.TrainModel { return testutil.MLPModel(16, 8, false) }, false},
			{func() testutil.TrainModel { return testutil.GPTModel(32, false) }, false},
			// nn.Dropout draws a new mask every build (its counter
			// advances), and dropout's gradient replays the mask: the
			// template takes each step's seeds into both.
			{func() testutil.TrainModel { return testutil.MLPModel(16, 8, true) }, true},
			{func() testutil.TrainModel { return testutil.GPTModel(32, true) }, true},
		} {
			m := mc.m
			name := prec + "/" + m().Name
			if mc.dropout {
				name += "-dropout"
			}
			t.Run(name, func(t *testing.T) {
				opts := Options{Device: DeviceCPU, Precision: prec}
				if prec == "fp16-mixed" { // a scale that overflows at first, so it changes
					opts.LossScale = precision.LossScale{Init: 1 << 40, Interval: 2}
				}
				cached, fresh := NewSession(opts), NewSession(opts)
				defer cached.Close()
				defer fresh.Close()
				fresh.stepCacheOff = true
				cm, fm := m(), m()
				crng, frng := rand.New(rand.NewPCG(5, 6)), rand.New(rand.NewPCG(5, 6))
				copt, fopt := optim.NewAdam(1e-2), optim.NewAdam(1e-2)
				const steps = 5
				for step := range steps {
					n := 8
					if step == steps-1 {
						n = 6
					}
					loss, cparams := cm.Build(crng, n)
					got, err := cached.Step(ctx, loss, cparams, copt)
					require.NoError(t, err, "step %d", step)
					loss, fparams := fm.Build(frng, n)
					want, err := fresh.Step(ctx, loss, fparams, fopt)
					require.NoError(t, err, "step %d", step)
					require.Equal(t, want, got, "step %d loss", step)
					for i := range cparams {
						require.Equal(t, testutil.Float32s(t, fparams[i].Value().(*tensor.Dense)),
							testutil.Float32s(t, cparams[i].Value().(*tensor.Dense)), "step %d, %s", step, cparams[i].Name())
					}
				}
				// Steps 1 to 3 reuse step 0's graph; the last (batch 6) does not.
				require.Equal(t, steps-2, cached.StepGraphHits())
				// The program cache keys an instance by its template's
				// signature instead of hashing the step graph again: they
				// agree (the data and seeds an instance patches in are not
				// part of a signature).
				loss, params := cm.Build(crng, 8)
				st, tmpl, release, err := cached.backward(loss, params, nil)
				require.NoError(t, err)
				defer release()
				require.Equal(t, st.Graph.Signature(), tmpl.sig, "the template's signature is its instances'")
				require.Zero(t, fresh.StepGraphHits())
				if prec == "fp16-mixed" {
					require.Positive(t, cached.LossScale().Skipped, "the first steps overflow")
					require.Equal(t, fresh.LossScale(), cached.LossScale())
				}
			})
		}
	}
}
