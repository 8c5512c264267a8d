package batchfit

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// BenchmarkSessionStepHost times Session.Step on the CPU for a GPT with
// GPT-2 small's depth (12 layers, so its graph has GPT-2 small's node
// count) but tiny tensors (width 16, 8 tokens, batch 2): the step is
// mostly host work, which a training loop pays every step. host-µs/step
// is Session.StepHostTime: Step's own work before the executor starts. The graph is
// built again every iteration, as a loop does; "templates" reuses the step
// graph (step templates), "differentiate" runs the precision pass and
// autodiff every step, as before them. Compare the two in one run:
//
//	go test -run '^$' -bench SessionStepHost -count 6 . | benchstat -col /cache -
func BenchmarkSessionStepHost(b *testing.B) {
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		for _, cache := range []string{"templates", "differentiate"} {
			b.Run("precision="+prec+"/cache="+cache, func(b *testing.B) {
				ctx := context.Background()
				sess := NewSession(Options{Device: DeviceCPU, Precision: prec})
				defer sess.Close()
				sess.stepCacheOff = cache == "differentiate"
				m := models.NewGPT(nn.Seed(3), models.GPTConfig{Vocab: 32, Context: 8, Layers: 12, Heads: 2, Dim: 16})
				opt := optim.NewAdamW(1e-3)
				rng := rand.New(rand.NewPCG(1, 2))
				var host time.Duration
				for b.Loop() {
					tokens := lazy.Wrap(testutil.Classes(rng, 32, 2, 8), 0)
					targets := tokens.Graph().Wrap(testutil.Classes(rng, 32, 2, 8), 0)
					loss := models.Loss(m.Forward(tokens), targets)
					if _, err := sess.Step(ctx, loss, nn.ParamTensors(m), opt); err != nil {
						b.Fatal(err)
					}
					host += sess.StepHostTime()
				}
				b.ReportMetric(float64(sess.StepGraphHits()), "step-graph-hits")
				b.ReportMetric(float64(host.Microseconds())/float64(b.N), "host-µs/step")
			})
		}
	}
}

// BenchmarkSessionStepGraph times only what Session.Step does before
// planning, for GPT-2 small's graph (shapes of batch 8 × 1024, 12 layers,
// built shape-only): the forward graph's key and then either a step
// template instantiated with its data ("templates") or the precision pass
// and autodiff ("differentiate"). The forward graph is built outside the
// timer, as the training loop builds it before calling Step.
func BenchmarkSessionStepGraph(b *testing.B) {
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		for _, cache := range []string{"templates", "differentiate"} {
			b.Run("precision="+prec+"/cache="+cache, func(b *testing.B) {
				sess := NewSession(Options{Device: DeviceCPU, Precision: prec})
				defer sess.Close()
				sess.stepCacheOff = cache == "differentiate"
				m := models.NewGPT(nn.Options{ShapeOnly: true}, gpt2Written())
				params := nn.ParamTensors(m)
				build := func() *lazy.Tensor {
					tokens := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
					targets := tokens.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0)
					return models.Loss(m.Forward(tokens), targets)
				}
				_, _, release, err := sess.backward(build(), params, nil) // the first step fills the cache
				if err != nil {
					b.Fatal(err)
				}
				release()
				for b.Loop() {
					b.StopTimer()
					loss := build()
					b.StartTimer()
					_, _, release, err := sess.backward(loss, params, nil)
					if err != nil {
						b.Fatal(err)
					}
					release()
				}
			})
		}
	}
}

// gpt2Written is GPT-2 small with attention written out, the graph the
// README's figures for this benchmark were measured on.
func gpt2Written() models.GPTConfig {
	cfg := models.GPT2Small()
	cfg.WrittenOutAttention = true
	return cfg
}
