package batchfit_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
)

// A Llama step on CUDA with the fused head and loss (the Session's
// default) trains as the unfused one: over three steps from the
// same parameters (SGD, so updates follow the gradients) the losses agree
// within 1e-5 relative in fp32 and 1e-2 under bf16-mixed (16-bit GEMMs
// summing in other orders; dW accumulated in bfloat16 over token chunks),
// the parameters within 1e-4 and 2e-2 of the update's size (‖fused −
// unfused‖/‖unfused − start‖), and each
// step's plan peaks plus Overhead are the measured ones, with the token
// chunk forced (64, several chunks) and the planner's.
func TestSessionCUDAFusedLossEqualsUnfused(t *testing.T) {
	const steps, n, seq = 3, 4, 64
	ctx := context.Background()
	for _, c := range []struct {
		prec       precision.Policy
		rtol, ptol float64
	}{{precision.FP32, 1e-5, 1e-4}, {precision.BF16Mixed, 1e-2, 2e-2}} {
		for _, chunk := range []int{64, 0} {
			t.Run(fmt.Sprintf("%s/chunk=%d", c.prec, chunk), func(t *testing.T) {
				cfg := llamaCUDAConfig()
				run := func(fused bool) ([]float32, [][]float32, [][]float32) {
					sess := cudaSession(t, batchfit.Options{Precision: string(c.prec), NoFusedLoss: !fused, LossChunk: chunk})
					m := models.NewLlama(nn.Seed(41), cfg)
					start := paramData(nn.ParamTensors(m))
					opt := optim.NewSGD(0.5, 0) // updates proportional to the gradients
					rng := rand.New(rand.NewPCG(43, 44))
					var losses []float32
					for step := range steps {
						l, err := sess.Step(ctx, llamaLoss(m, llamaCorpus(rng, cfg.Vocab, n, seq)), nn.ParamTensors(m), opt)
						require.NoError(t, err)
						require.False(t, math.IsNaN(float64(l)))
						losses = append(losses, l)
						pl, used := sess.LastPlan(), sess.LastUsage()
						require.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "fused %v step %d: peak reserved", fused, step)
						require.Equal(t, pl.PeakAllocated+sess.Overhead(), used.PeakAllocated, "fused %v step %d: peak allocated", fused, step)
						if fused {
							require.Positive(t, pl.LossChunk)
							has := false
							for _, nd := range sess.LastProgram().Graph.Nodes() {
								has = has || nd.Op == graph.OpLinearCrossEntropy
							}
							require.True(t, has, "the step runs linear_cross_entropy")
						}
					}
					require.NoError(t, sess.SyncParams())
					return losses, start, paramData(nn.ParamTensors(m))
				}
				ul, start, up := run(false)
				fl, _, fp := run(true)
				for i := range ul {
					require.InEpsilon(t, ul[i], fl[i], c.rtol, "step %d loss", i)
				}
				for i := range up {
					for j := range up[i] {
						up[i][j] -= start[i][j]
						fp[i][j] -= start[i][j]
					}
				}
				r := relDiff(fp, up)
				t.Logf("chunk %d: losses unfused %v fused %v; update ‖Δ‖ rel %.3g", chunk, ul, fl, r)
				require.Less(t, r, c.ptol)
			})
		}
	}
}
