package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// BenchmarkSessionStepHost times Session.Step on the CPU for a GPT with
// GPT-2 small's depth (12 layers, so its graph has GPT-2 small's node
// count) but tiny tensors (width 16, 8 tokens, batch 2): the step is
// almost all host work, autodiff, the precision pass, the signature and
// the plan cache, which a training loop pays every step. One sub-benchmark
// per precision; the graph is built again every iteration, as a loop does.
func BenchmarkSessionStepHost(b *testing.B) {
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		b.Run(prec, func(b *testing.B) {
			ctx := context.Background()
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec})
			defer sess.Close()
			m := models.NewGPT(nn.Seed(3), models.GPTConfig{Vocab: 32, Context: 8, Layers: 12, Heads: 2, Dim: 16})
			opt := optim.NewAdamW(1e-3)
			rng := rand.New(rand.NewPCG(1, 2))
			for b.Loop() {
				tokens := lazy.Wrap(testutil.Classes(rng, 32, 2, 8), 0)
				targets := tokens.Graph().Wrap(testutil.Classes(rng, 32, 2, 8), 0)
				loss := models.Loss(m.Forward(tokens), targets)
				if _, err := sess.Step(ctx, loss, nn.ParamTensors(m), opt); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(sess.CacheHits()), "program-hits")
			b.ReportMetric(float64(sess.StepGraphHits()), "step-graph-hits")
		})
	}
}
