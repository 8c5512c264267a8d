package batchfit_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// headModel is a language model for the fused loss's tests: its
// parameters, and its loss on a fresh batch of batch sequences drawn
// from rng.
type headModel struct {
	name   string
	params func() []*lazy.Tensor
	loss   func(rng *rand.Rand, batch int) *lazy.Tensor
}

// lossModels are llama-tiny (tied head, models.CausalLMLoss: a sum times
// 1/count, the last position of every sequence ignored) and a GPT over a
// vocabulary of 1,030 (tied, models.Loss's mean; under a mixed policy the
// head is padded to 1,088 rows, the loss scoring the first 1,030).
func lossModels(seed uint64) []headModel {
	llama := models.NewLlama(nn.Seed(seed), models.LlamaTiny())
	gpt := models.NewGPT(nn.Seed(seed), models.GPTConfig{Vocab: 1030, Context: 16, Layers: 1, Heads: 2, Dim: 16})
	return []headModel{
		{"llama-tiny", func() []*lazy.Tensor { return nn.ParamTensors(llama) }, func(rng *rand.Rand, batch int) *lazy.Tensor {
			return llamaLoss(llama, llamaCorpus(rng, models.LlamaTiny().Vocab, batch, 12))
		}},
		{"gpt-1030", func() []*lazy.Tensor { return nn.ParamTensors(gpt) }, func(rng *rand.Rand, batch int) *lazy.Tensor {
			tokens := lazy.Wrap(testutil.Classes(rng, 1030, batch, 16), 0)
			return models.Loss(gpt.Forward(tokens), tokens.Graph().Wrap(testutil.Classes(rng, 1030, batch, 16), 0))
		}},
	}
}

func paramData(ps []*lazy.Tensor) [][]float32 {
	var out [][]float32
	for _, p := range ps {
		out = append(out, slices.Clone(p.Value().(*tensor.Dense).Data().([]float32)))
	}
	return out
}

// relDiff is ‖a − b‖/‖b‖ over all of them.
func relDiff(a, b [][]float32) float64 {
	var num, den float64
	for i := range b {
		for j := range b[i] {
			d := float64(a[i][j]) - float64(b[i][j])
			num += d * d
			den += float64(b[i][j]) * float64(b[i][j])
		}
	}
	return math.Sqrt(num / den)
}

// The fused head and loss (linear_cross_entropy, the Session's default)
// train as the unfused linear and cross_entropy do on the CPU: one SGD
// step each from the same parameters gives the same loss and the same
// parameter update (so the same gradients), within 1e-5 relative in fp32
// (the sums in another order: token chunks of 16 rows) and 5e-3, about
// one bfloat16 ulp (2⁻⁸), under bf16-mixed (16-bit logits and their
// gradient rounded as the unfused graph rounds them, from a scale taken
// in double rather than float32, so an element's rounding may flip; dW
// summed over chunks before its one rounding). The
// fused step holds no [N, V] value, and its gradients come from the
// forward pass (companions of the linear_cross_entropy node).
func TestFusedLossEqualsUnfused(t *testing.T) {
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		for mi := range lossModels(1) {
			run := func(fused bool) (float32, [][]float32, *batchfit.Session) {
				m := lossModels(1)[mi]
				sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec, NoFusedLoss: !fused, LossChunk: 16})
				require.NoError(t, sess.Err())
				before := paramData(m.params())
				l, err := sess.Step(ctx, m.loss(rand.New(rand.NewPCG(3, 4)), 4), m.params(), optim.NewSGD(0.5, 0))
				require.NoError(t, err)
				require.NoError(t, sess.SyncParams())
				after := paramData(m.params())
				for i := range after {
					for j := range after[i] {
						after[i][j] -= before[i][j]
					}
				}
				return l, after, sess
			}
			name := lossModels(1)[mi].name
			t.Run(prec+"/"+name, func(t *testing.T) {
				lu, du, su := run(false)
				defer su.Close()
				lf, df, sf := run(true)
				defer sf.Close()
				tol := 1e-5
				if prec != "fp32" {
					tol = 5e-3
				}
				t.Logf("loss fused %.7g unfused %.7g; update ‖Δ‖ rel %.3g", lf, lu, relDiff(df, du))
				require.InEpsilon(t, lu, lf, tol, "loss")
				require.Less(t, relDiff(df, du), tol, "parameter update")
				p := sf.LastProgram()
				fusedOps := 0
				for _, nd := range p.Graph.Nodes() {
					if nd.Op != graph.OpLinearCrossEntropy || p.OutputBuf[nd.ID] < 0 {
						continue
					}
					fusedOps++
					require.Equal(t, 16, nd.Attrs.LossChunk)
					var cos []graph.Op
					for m := range p.Companions(nd.ID) {
						cos = append(cos, p.Graph.Node(m).Op)
					}
					require.Equal(t, []graph.Op{graph.OpLinearCrossEntropyGradH, graph.OpLinearCrossEntropyGradW}, cos, "gradients in the forward pass")
				}
				require.Equal(t, 1, fusedOps)
				for _, b := range p.Buffers {
					if b.Kind == planner.BufOutput {
						s := p.Graph.Node(b.Node).Type.Shape
						require.False(t, len(s) == 2 && s[1] >= 1030 && s[0] > 16, "an [N, V] value: node %d %s%v", b.Node, p.Graph.Node(b.Node).Op, s)
					}
				}
			})
		}
	}
}

// Predicted == measured, to the byte, with the fused loss on the CPU
// executor: a GPT over a vocabulary of 1,030 (padded under bf16-mixed),
// whole and in chunks of the batch (a budget halfway between the
// persistent bytes and the whole batch's peak), with the planner's own
// token chunk and with a forced one, over two AdamW steps.
func TestFusedLossPlannedPeaksAreMeasured(t *testing.T) {
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		for _, chunk := range []int{0, 16} {
			gpt := models.NewGPT(nn.Seed(2), models.GPTConfig{Vocab: 1030, Context: 32, Layers: 2, Heads: 2, Dim: 64})
			m := headModel{params: func() []*lazy.Tensor { return nn.ParamTensors(gpt) }, loss: func(rng *rand.Rand, batch int) *lazy.Tensor {
				tokens := lazy.Wrap(testutil.Classes(rng, 1030, batch, 32), 0)
				return models.Loss(gpt.Forward(tokens), tokens.Graph().Wrap(testutil.Classes(rng, 1030, batch, 32), 0))
			}}
			probe := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec, LossChunk: chunk})
			sp, err := probe.Plan(m.loss(rand.New(rand.NewPCG(5, 6)), 32), m.params(), optim.NewAdamW(1e-3))
			require.NoError(t, err)
			require.NoError(t, probe.Close())
			// Halfway between the persistent bytes and the whole batch's peak.
			half := (sp.Plan.Persistent + sp.Plan.PeakReserved) / 2
			for _, budget := range []int64{0, half} {
				name := fmt.Sprintf("%s/chunk=%d/budget=%d", prec, chunk, budget)
				sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec, LossChunk: chunk, Budget: budget})
				require.NoError(t, sess.Err())
				rng := rand.New(rand.NewPCG(5, 6))
				for step := range 2 {
					l, err := sess.Step(ctx, m.loss(rng, 32), m.params(), optim.NewAdamW(1e-3))
					require.NoError(t, err, "%s step %d", name, step)
					require.False(t, math.IsNaN(float64(l)))
					pl, used, st := sess.LastPlan(), sess.LastUsage(), sess.Allocator().Stats()
					at := fmt.Sprintf("%s (%d chunks, loss chunk %d) step %d", name, len(pl.Chunks), pl.LossChunk, step)
					require.Positive(t, pl.LossChunk, at)
					if chunk > 0 {
						require.Equal(t, chunk, pl.LossChunk, at)
					}
					require.Equal(t, pl.PeakReserved, used.PeakReserved, "%s: reserved", at)
					require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "%s: allocated", at)
					require.Equal(t, pl.PeakReserved, st.ReservedBytes[alloc.All].Peak, "%s: stats reserved", at)
					require.Zero(t, st.NumOOMs, at)
					if budget > 0 {
						require.LessOrEqual(t, pl.PeakReserved, budget, at)
						// The planner's token chunk may fit it whole: a smaller chunk than unbounded.
						require.True(t, len(pl.Chunks) > 1 || chunk == 0 && pl.LossChunk < sp.Plan.LossChunk,
							"%s: the budget chunks the batch, or the planner a smaller token chunk than %d", at, sp.Plan.LossChunk)
					}
				}
				require.NoError(t, sess.Close())
			}
		}
	}
}
