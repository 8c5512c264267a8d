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
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// Activation recomputation on the CPU executor.

// recomputeStep is the step Session.Step compiles for loss, for
// recompute.Build: forward nodes below the loss's id + 1.
func recomputeStep(t *testing.T, loss *lazy.Tensor, params []*lazy.Tensor, slots int, extra ...int) recompute.Step {
	t.Helper()
	return recomputeStepOn(t, cpu.Workspace, loss, params, slots, extra...)
}

// recomputeStepOn is recomputeStep for an executor whose workspace rule
// is ws.
func recomputeStepOn(t *testing.T, ws planner.WorkspaceFunc, loss *lazy.Tensor, params []*lazy.Tensor, slots int, extra ...int) recompute.Step {
	t.Helper()
	g, outs, co := testutil.Step(t, loss, params, slots, extra...)
	co.Workspace = ws
	return recompute.Step{Graph: g, Boundary: loss.ID() + 1, Outputs: outs, Compile: co}
}

// everything marks every forward node: the whole forward pass is run
// again for backward, from the sources (dropout included).
func everything(st recompute.Step) recompute.Candidate {
	c := recompute.Candidate{Name: "everything"}
	for i := range st.Boundary {
		c.Set = append(c.Set, i)
	}
	return c
}

// Recompute plans compute the plain plan's loss and gradients: for the
// MLP, the GPT and the ConvNet, all with dropout (whose copies must draw
// the original's masks), and a small ResNet with per-chunk batch
// statistics (so that it may run in chunks), every candidate of the search plus "everything"
// runs whole and in 3 chunks on the CPU executor, and each output equals
// the plain program's at the same chunks to 1e-6 relative (the copies
// compute the same float32 operations, so in practice bit for bit).
func TestRecomputeGradientsMatch(t *testing.T) {
	const n, rtol = 10, 1e-6
	ctx := context.Background()
	for _, newModel := range []func(bool) testutil.TrainModel{mlpModel, gptModel(64), convModel(16), resnetPerChunkModel} {
		m := newModel(true)
		t.Run(m.Name, func(t *testing.T) {
			loss, params := m.Build(rand.New(rand.NewPCG(41, 42)), n)
			st := recomputeStep(t, loss, params, 0)
			cands := append(recompute.Candidates(st.Graph, st.Boundary), everything(st))
			require.Greater(t, len(cands), 2, "the search has candidates beyond none")
			plain, err := recompute.Build(st, "none", nil)
			require.NoError(t, err)
			want := map[int][][]float32{}
			for _, k := range []int{1, 3} {
				res, err := cpu.New().Execute(ctx, plain.Program, planner.Chunks(n, k), cpu.ExecOptions{})
				require.NoError(t, err)
				for _, o := range res.Outputs {
					want[k] = append(want[k], testutil.Float32s(t, o))
				}
			}
			for _, cd := range cands[1:] {
				c, err := recompute.Build(st, cd.Name, cd.Set)
				require.NoError(t, err, cd.Name)
				require.Positive(t, c.Copies, "%s copies nothing", cd.Name)
				if cd.Name == "everything" && countOp(st.Graph, graph.OpDropout) > 0 {
					require.Greater(t, countOp(c.Program.Graph, graph.OpDropout), countOp(st.Graph, graph.OpDropout),
						"dropout is recomputed")
				}
				if cd.Name == "everything" && countOp(st.Graph, graph.OpConv2d) > 0 {
					// Batch norm itself is never recomputed (recompute.Eligible).
					require.Greater(t, countOp(c.Program.Graph, graph.OpConv2d), countOp(st.Graph, graph.OpConv2d),
						"convolutions are recomputed")
				}
				for _, k := range []int{1, 3} {
					res, err := cpu.New().Execute(ctx, c.Program, planner.Chunks(n, k), cpu.ExecOptions{})
					require.NoError(t, err, "%s, %d chunks", cd.Name, k)
					for i, o := range res.Outputs {
						got := testutil.Float32s(t, o)
						for j, w := range want[k][i] {
							if d := math.Abs(float64(got[j] - w)); d > rtol*math.Abs(float64(w))+1e-12 {
								require.Failf(t, "values differ", "%s, %d chunks, output %d[%d]: got %g, want %g", cd.Name, k, i, j, got[j], w)
							}
						}
					}
				}
			}
		})
	}
}

func countOp(g *graph.Graph, op graph.Op) int {
	n := 0
	for _, nd := range g.Nodes() {
		if nd.Op == op {
			n++
		}
	}
	return n
}

// deepGPT is a four-layer GPT over 128 tokens whose attention scores
// dominate the per-sample memory (4 heads × 128² floats per score tensor):
// whole-block checkpoints save most of it.
func deepGPT() testutil.TrainModel { return deepGPTOf(false) }

// deepGPTOf is deepGPT with fused attention, or written out.
func deepGPTOf(writtenOut bool) testutil.TrainModel {
	const seq, vocab = 128, 64
	m := models.NewGPT(nn.Seed(24), models.GPTConfig{Vocab: vocab, Context: seq, Layers: 4, Heads: 4, Dim: 32, WrittenOutAttention: writtenOut})
	return testutil.TrainModel{Name: "gpt4", Build: func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		tokens := lazy.Wrap(testutil.Classes(rng, vocab, n, seq), 0)
		targets := tokens.Graph().Wrap(testutil.Classes(rng, vocab, n, seq), 0)
		return models.Loss(m.Forward(tokens), targets), nn.ParamTensors(m)
	}}
}

// recomputeBudgets sweeps budgets in 2 MiB steps up to the one where the
// plain step runs whole, and returns the search's answer at each.
func recomputeBudgets(t *testing.T, st recompute.Step) (budgets []int64, results []*recompute.Result) {
	t.Helper()
	for b := int64(2 << 20); ; b += 2 << 20 {
		res, err := recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: b}})
		require.NoError(t, err)
		budgets, results = append(budgets, b), append(results, res)
		if res.Best != nil && res.Best.Name == "none" && res.Best.Plan.Split.K == 1 {
			return budgets, results
		}
	}
}

// Predicted == measured, to the byte, for recompute plans through the
// Session (Options.Recompute auto): at the smallest budget where the
// search picks a recompute plan in one chunk, and at the smallest where
// it picks one in several chunks, three Adam steps each measure the
// plan's peaks, within the budget.
func TestRecomputePeaksMeasured(t *testing.T) {
	const n, steps = 8, 3
	ctx := context.Background()
	loss, params := deepGPT().Build(rand.New(rand.NewPCG(1, 2)), n)
	budgets, results := recomputeBudgets(t, recomputeStep(t, loss, params, 2))
	picked := map[bool]int64{} // several chunks → budget
	for i, res := range results {
		if res.Best == nil || res.Best.Name == "none" {
			continue
		}
		if _, ok := picked[res.Best.Plan.Split.K > 1]; !ok {
			picked[res.Best.Plan.Split.K > 1] = budgets[i]
		}
	}
	require.Len(t, picked, 2, "budgets where recompute wins in one chunk and in several")
	for _, chunked := range []bool{false, true} {
		budget := picked[chunked]
		t.Run(fmt.Sprintf("chunked=%v", chunked), func(t *testing.T) {
			m, rng := deepGPT(), rand.New(rand.NewPCG(3, 4))
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget, Recompute: recompute.Auto})
			opt := optim.NewAdam(1e-3)
			for step := range steps {
				loss, params := m.Build(rng, n)
				_, err := sess.Step(ctx, loss, params, opt)
				require.NoError(t, err, "step %d", step)
				pl, used, re := sess.LastPlan(), sess.LastUsage(), sess.LastRecompute()
				require.NotEqual(t, "none", re.Strategy, "step %d", step)
				require.Positive(t, re.Copies)
				require.Equal(t, chunked, pl.Split.K > 1, "step %d: %s", step, pl.Split)
				require.LessOrEqual(t, pl.PeakReserved, budget, "step %d", step)
				require.Equal(t, pl.PeakReserved, used.PeakReserved, "step %d: reserved", step)
				require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "step %d: allocated", step)
				t.Logf("budget %d MiB: %s in %s, peak %d B", budget>>20, re.Strategy, pl.Split, pl.PeakReserved)
			}
		})
	}
}

// A model whose single sample does not fit without recompute trains with
// it: at the smallest budget where the search finds any plan, chunks of
// one sample without recompute need more than the budget; the Session
// (recompute auto) trains two SGD steps there, and its losses and
// parameters equal those of a session without a budget, which runs the
// whole batch at once: to the chunked-versus-whole tolerance of
// TestChunkedStepMatchesWholeBatch (rtol 1e-5 plus 1e-6·max|value| of the
// tensor), since chunks add partial sums in another order. Recompute
// itself changes no bit at equal chunks (TestRecomputeGradientsMatch).
// The GPT writes attention out: its [T, T] scores per layer are what
// recompute frees; with fused attention one sample's activations are
// small enough that chunks of one fit wherever the search finds a plan.
func TestRecomputeFitsWhereChunksCannot(t *testing.T) {
	const n, steps = 4, 2
	ctx := context.Background()
	deepGPT := func() testutil.TrainModel { return deepGPTOf(true) }
	loss, params := deepGPT().Build(rand.New(rand.NewPCG(1, 2)), n)
	st := recomputeStep(t, loss, params, 0)
	budgets, results := recomputeBudgets(t, st)
	i := slices.IndexFunc(results, func(r *recompute.Result) bool { return r.Best != nil })
	require.GreaterOrEqual(t, i, 0)
	budget, best := budgets[i], results[i].Best
	require.NotEqual(t, "none", best.Name)
	_, err := planner.Make(results[i].Plain.Program, planner.Options{Budget: budget})
	var dnf *planner.DoesNotFitError
	require.ErrorAs(t, err, &dnf, "chunks alone do not fit")
	require.Equal(t, 1, dnf.Chunk)
	t.Logf("budget %d MiB: chunks of 1 need %d B without recompute; %s needs %d B (%s), %.3g extra flops per step",
		budget>>20, dnf.Needed, best.Name, best.Plan.PeakReserved, best.Plan.Split, best.ExtraFLOPs(results[i].Plain))
	require.Positive(t, best.ExtraFLOPs(results[i].Plain))

	m1, m2 := deepGPT(), deepGPT()
	r1, r2 := rand.New(rand.NewPCG(5, 6)), rand.New(rand.NewPCG(5, 6))
	tight := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget, Recompute: recompute.Auto})
	free := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	o1, o2 := optim.NewSGD(0.1, 0), optim.NewSGD(0.1, 0)
	var p1, p2 []*lazy.Tensor
	for step := range steps {
		var l1, l2 *lazy.Tensor
		l1, p1 = m1.Build(r1, n)
		l2, p2 = m2.Build(r2, n)
		v1, err := tight.Step(ctx, l1, p1, o1)
		require.NoError(t, err, "step %d", step)
		v2, err := free.Step(ctx, l2, p2, o2)
		require.NoError(t, err)
		require.InDelta(t, v2, v1, 1e-5*math.Abs(float64(v2)), "step %d: loss", step)
		require.NotEqual(t, "none", tight.LastRecompute().Strategy)
		require.LessOrEqual(t, tight.LastPlan().PeakReserved, budget)
		require.Equal(t, tight.LastPlan().PeakReserved, tight.LastUsage().PeakReserved)
	}
	for i := range p1 {
		a, b := testutil.Float32s(t, p1[i].Value().(*tensor.Dense)), testutil.Float32s(t, p2[i].Value().(*tensor.Dense))
		var scale float64
		for _, v := range b {
			scale = max(scale, math.Abs(float64(v)))
		}
		for j := range a {
			require.InDelta(t, b[j], a[j], 1e-5*math.Abs(float64(b[j]))+1e-6*scale, "parameter %d[%d]", i, j)
		}
	}
}

// Through the Session: one SGD step (lr 1, so the update is the gradient)
// of the MLP, the GPT and the ConvNet, all with dropout, and a small
// ResNet (Bottleneck blocks, batch norm in training mode, which is never
// recomputed, around convolutions that full checkpointing recomputes; no
// dropout; selective finds nothing to recompute), with
// Options.Recompute off, selective and full, on the whole batch: every
// parameter moves by the same gradient, to 1e-6 relative (in practice bit
// for bit: the copies compute the same float32 operations).
func TestRecomputeSessionGradients(t *testing.T) {
	const n = 6
	ctx := context.Background()
	for _, newModel := range []func(bool) testutil.TrainModel{mlpModel, gptModel(64), convModel(16), resnetModel} {
		t.Run(newModel(true).Name, func(t *testing.T) {
			var want [][]float32
			for _, mode := range []recompute.Mode{recompute.Off, recompute.SelectiveOnly, recompute.FullCheckpoint} {
				m := newModel(true)
				loss, params := m.Build(rand.New(rand.NewPCG(7, 8)), n)
				before := make([][]float32, len(params))
				for i, p := range params {
					before[i] = slices.Clone(testutil.Float32s(t, p.Value().(*tensor.Dense)))
				}
				sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Recompute: mode})
				_, err := sess.Step(ctx, loss, params, optim.NewSGD(1, 0))
				require.NoError(t, err, mode)
				re := sess.LastRecompute()
				switch {
				case mode == recompute.Off:
					require.Equal(t, "none", re.Strategy)
				case mode == recompute.SelectiveOnly && newModel(true).Name == "resnet":
					// Nothing of the ResNet's is cheap and read by backward:
					// its ReLUs' gradients read their outputs, which stay.
					require.Zero(t, re.Copies, "%s", mode)
				default:
					require.Positive(t, re.Copies, "%s recomputes something", mode)
				}
				var got [][]float32
				for i, p := range params {
					after := testutil.Float32s(t, p.Value().(*tensor.Dense))
					d := make([]float32, len(after))
					for j := range d {
						d[j] = before[i][j] - after[j]
					}
					got = append(got, d)
				}
				if want == nil {
					want = got
					continue
				}
				for i := range want {
					for j, w := range want[i] {
						if diff := math.Abs(float64(got[i][j] - w)); diff > 1e-6*math.Abs(float64(w)) {
							require.Failf(t, "gradients differ", "%s (%s): parameter %d[%d]: %g, plain %g", mode, re.Strategy, i, j, got[i][j], w)
						}
					}
				}
			}
		})
	}
}

// resnetModel is a small ResNet over 3×8×8 images: one Bottleneck per
// stage, width 4, the CIFAR stem, batch norm in training mode (its running
// statistics updated by the step), 10 classes. It has no dropout; the
// flag is ignored.
func resnetModel(bool) testutil.TrainModel { return resnetOf("resnet", nn.Seed(29)) }

// resnetPerChunkModel is resnetModel with per-chunk batch statistics
// (nn.Options.PerChunkStats), which lets its step run in chunks.
func resnetPerChunkModel(bool) testutil.TrainModel {
	opt := nn.Seed(29)
	opt.PerChunkStats = true
	return resnetOf("resnet-per-chunk", opt)
}

func resnetOf(name string, opt nn.Options) testutil.TrainModel {
	m := models.NewResNet(opt, models.ResNetConfig{Blocks: []int{1, 1, 1, 1}, Bottleneck: true, Width: 4,
		CIFARStem: true, ImageSize: 8, Classes: 10})
	return testutil.TrainModel{Name: name, Build: func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Wrap(testutil.UniformF32(rng, n, 3, 8, 8), 0)
		y := x.Graph().Wrap(testutil.Classes(rng, 10, n), 0)
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}}
}
