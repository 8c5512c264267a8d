package batchfit_test

import (
	"context"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// What the planner predicts is what the
// executor measures, chunked steps equal whole-batch steps, and plans are
// tight. The models are small, but their per-sample memory is large enough
// that budgets a few 2 MiB segments apart give different chunk counts.

// mlpModel is 784 → 64 → 64 → 10 with ReLU, with dropout or without
// (testutil.MLPModel).
func mlpModel(dropout bool) testutil.TrainModel { return testutil.MLPModel(784, 64, dropout) }

// gptModel makes two-layer GPTs over 16 tokens of a vocabulary of vocab
// tokens (testutil.GPTModel).
func gptModel(vocab int) func(dropout bool) testutil.TrainModel {
	return func(dropout bool) testutil.TrainModel { return testutil.GPTModel(vocab, dropout) }
}

// fusedGPTModel is gptModel with the fused attention op
// (testutil.FusedGPTModel).
func fusedGPTModel(vocab int) func(dropout bool) testutil.TrainModel {
	return func(dropout bool) testutil.TrainModel { return testutil.FusedGPTModel(vocab, dropout) }
}

// convModel makes two-stage ConvNets over 3×size×size images
// (testutil.ConvModel).
func convModel(size int) func(dropout bool) testutil.TrainModel {
	return func(dropout bool) testutil.TrainModel { return testutil.ConvModel(size, dropout) }
}

// stepProgram compiles the program a CPU session's Step runs for loss
// (testutil.StepProgram with the CPU executor's workspace rule).
func stepProgram(t *testing.T, loss *lazy.Tensor, params []*lazy.Tensor, slots int, extra ...int) *planner.Program {
	t.Helper()
	return testutil.StepProgram(t, cpu.Workspace, loss, params, slots, extra...)
}

// Predicted == measured, to the byte: at every chunk count the planner
// chooses for two batch sizes (each count tested once, at the smaller size
// that gives it), over consecutive Adam steps (the first allocates
// parameters and optimizer state; later ones find them resident and run in
// the cached segments), the plan's peaks are the peaks the executor's
// allocator measured during the step and the peaks in its Stats.
func TestPlannedPeaksAreMeasured(t *testing.T) {
	const steps = 3
	ctx := context.Background()
	for _, c := range []struct {
		model func(dropout bool) testutil.TrainModel
		sizes []int
	}{
		{mlpModel, []int{500, 1000}},
		{gptModel(512), []int{40, 64}},
		{fusedGPTModel(512), []int{40, 64}},
		{convModel(32), []int{30, 40}},
	} {
		name := c.model(false).Name
		seen := map[int]bool{}
		for _, n := range c.sizes {
			loss, params := c.model(false).Build(rand.New(rand.NewPCG(uint64(n), 1)), n)
			budgets := testutil.TightBudgets(t, stepProgram(t, loss, params, 2))
			for _, k := range testutil.Counts(budgets) {
				if seen[k] {
					continue // tested at another batch size
				}
				seen[k] = true
				budget := budgets[k]
				t.Run(fmt.Sprintf("%s/N=%d/chunks=%d", name, n, k), func(t *testing.T) {
					t.Parallel()
					m, rng := c.model(false), rand.New(rand.NewPCG(uint64(n), uint64(k)))
					// The program's graph is the unfused step's (StepProgram).
					sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget, NoFusedLoss: true})
					opt := optim.NewAdam(1e-3)
					var calls [steps][3]int64 // device allocations, frees and retries after each step
					for step := range steps {
						loss, params := m.Build(rng, n)
						_, err := sess.Step(ctx, loss, params, opt)
						require.NoError(t, err, "step %d", step)
						pl, used, st := sess.LastPlan(), sess.LastUsage(), sess.Allocator().Stats()
						_, capacity, err := sess.Allocator().Backend().MemInfo()
						require.NoError(t, err)
						require.Equal(t, budget, capacity, "the session's device has the budget's capacity")
						require.Len(t, pl.Chunks, k, "step %d", step)
						require.LessOrEqual(t, pl.PeakReserved, budget, "step %d", step)
						require.Equal(t, pl.PeakReserved, used.PeakReserved, "step %d: reserved", step)
						require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "step %d: allocated", step)
						require.Equal(t, pl.PeakReserved, st.ReservedBytes[alloc.All].Peak, "step %d: stats reserved", step)
						require.Equal(t, pl.PeakAllocated, st.AllocatedBytes[alloc.All].Peak, "step %d: stats allocated", step)
						require.Zero(t, st.NumOOMs, "step %d", step)
						calls[step] = [3]int64{st.NumDeviceAlloc, st.NumDeviceFree, st.NumAllocRetries}
					}
					// Steady state: a plan that fits without releasing cached
					// segments reserves nothing after the first step; one that
					// needs a release and retry (the smallest budgets can) makes
					// the same device calls every step.
					if calls[0][2] == 0 {
						require.Equal(t, calls[0], calls[steps-1], "later steps called the device")
					}
					for step := 2; step < steps; step++ {
						for i := range 3 {
							require.Equal(t, calls[1][i]-calls[0][i], calls[step][i]-calls[step-1][i], "step %d: device calls (allocations, frees, retries) differ from step 1's", step)
						}
					}
				})
			}
		}
		for _, k := range []int{1, 2, 3} {
			require.True(t, seen[k], "%s: no budget gave %d chunks; chunk counts seen: %v", name, k, seen)
		}
		require.True(t, slices.ContainsFunc(slices.Collect(maps.Keys(seen)), func(k int) bool { return k > 3 }),
			"%s: no budget gave more than 3 chunks: %v", name, seen)
	}
}

// dropoutNodes lists the dropout nodes of g.
func dropoutNodes(g *graph.Graph) []int {
	var ids []int
	for _, nd := range g.Nodes() {
		if nd.Op == graph.OpDropout {
			ids = append(ids, nd.ID)
		}
	}
	return ids
}

// Chunked == whole: one training graph with dropout on, run in 1, 2, 3 and
// 7 balanced chunks of an uneven batch of 10 (5+5, 4+3+3, 2+2+2+1+1+1+1),
// gives the whole batch's loss, every parameter gradient and every dropout
// mask. The whole-batch run itself is checked against the float64
// reference first.
//
// Tolerances: chunking changes only the order of float32 sums (the mean
// loss and the gradients add per-chunk partial sums), so every value is
// held to rtol 1e-5 plus, for entries near zero where cancellation leaves
// only rounding, atol 1e-6·max|value| of its tensor. Chunked against whole
// needs atol 1e-7·max here, the whole run against the float64 reference
// 2e-7·max. The dropout masks (which elements are zero) must match exactly.
func TestChunkedStepMatchesWholeBatch(t *testing.T) {
	const n, rtol, atolScale = 10, 1e-5, 1e-6
	ctx := context.Background()
	for _, newModel := range []func(bool) testutil.TrainModel{mlpModel, gptModel(64), fusedGPTModel(64), convModel(16)} {
		m := newModel(true)
		t.Run(m.Name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(31, 32))
			loss, params := m.Build(rng, n)
			drops := dropoutNodes(loss.Graph().IR())
			require.NotEmpty(t, drops)
			p := stepProgram(t, loss, params, 0, drops...)
			wantRef, err := ref.Eval(p.Graph, nil, p.Outputs...)
			require.NoError(t, err)

			near := func(t *testing.T, what string, want []float64, got []float32) {
				t.Helper()
				require.Len(t, got, len(want), what)
				var scale float64
				for _, w := range want {
					scale = max(scale, math.Abs(w))
				}
				for i, w := range want {
					if d := math.Abs(w - float64(got[i])); d > rtol*math.Abs(w)+atolScale*scale {
						require.Failf(t, "values differ", "%s[%d]: got %g, want %g (|diff| %g)", what, i, got[i], w, d)
					}
				}
			}
			var whole []*tensor.Dense
			for _, k := range []int{1, 2, 3, 7} {
				chunks := planner.Chunks(n, k)
				if k == 3 {
					require.Equal(t, []int{4, 3, 3}, []int{chunks[0].Size, chunks[1].Size, chunks[2].Size})
				}
				res, err := cpu.New().Execute(ctx, p, chunks, cpu.ExecOptions{})
				require.NoError(t, err, "%d chunks", k)
				if k == 1 {
					whole = res.Outputs
					for i, v := range wantRef {
						near(t, fmt.Sprintf("whole vs float64: output %d", i), v.Data, testutil.Float32s(t, whole[i]))
					}
					continue
				}
				for i, out := range res.Outputs {
					want := testutil.Float32s(t, whole[i])
					got := testutil.Float32s(t, out)
					near(t, fmt.Sprintf("%d chunks: output %d", k, i), to64(want), got)
					if i >= len(p.Outputs)-len(drops) {
						for j := range want {
							require.Equal(t, want[j] == 0, got[j] == 0, "%d chunks: dropout node %d, element %d", k, p.Outputs[i], j)
						}
					}
				}
			}
		})
	}
}

// Tightness: at the smallest budget giving k chunks (which runs within the
// budget on a device of exactly that capacity: TestPlannedPeaksAreMeasured),
// the next size up, the balanced list of k−1 chunks, runs out of memory on
// that device, in a plain replay and in the executor alike; and the plan's
// own chunks run out of memory 2 MiB (the allocator's granularity) below
// the budget.
func TestPlansAreTight(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		model testutil.TrainModel
		n     int
	}{
		{mlpModel(false), 1000},
		{gptModel(512)(false), 64},
		{convModel(32)(false), 40},
	} {
		rng := rand.New(rand.NewPCG(41, uint64(c.n)))
		loss, params := c.model.Build(rng, c.n)
		p := stepProgram(t, loss, params, 2)
		budgets := testutil.TightBudgets(t, p)
		for _, k := range testutil.Counts(budgets) {
			budget := budgets[k]
			t.Run(fmt.Sprintf("%s/N=%d/chunks=%d", c.model.Name, c.n, k), func(t *testing.T) {
				onDevice := func(capacity int64) *alloc.Allocator {
					return alloc.New(alloc.NewSimBackend(capacity), alloc.Options{})
				}
				pl, err := planner.Make(p, planner.Options{Budget: budget})
				require.NoError(t, err)
				require.Len(t, pl.Chunks, k)
				_, err = planner.Replay(p, pl.Chunks, onDevice(budget), nil, false)
				require.NoError(t, err)
				_, err = planner.Replay(p, pl.Chunks, onDevice(budget-alloc.RoundLarge), nil, false)
				require.ErrorIs(t, err, alloc.ErrOutOfMemory, "the plan's chunks fit 2 MiB below the budget")
				if k == 1 {
					return
				}
				fewer := planner.Chunks(c.n, k-1)
				_, err = planner.Replay(p, fewer, onDevice(budget), nil, false)
				require.ErrorIs(t, err, alloc.ErrOutOfMemory, "%d chunks fit the budget", k-1)
				var oom *alloc.OOMError
				require.ErrorAs(t, err, &oom)
				require.LessOrEqual(t, oom.Reserved, budget)
				_, err = cpu.NewOn(onDevice(budget)).Execute(ctx, p, fewer, cpu.ExecOptions{})
				require.ErrorIs(t, err, alloc.ErrOutOfMemory, "%d chunks ran within the budget", k-1)
			})
		}
	}
}

// A steady training loop plans once: every step rebuilds the graph and
// dropout draws a fresh mask (its counter advances), but the signature is
// the same, so every step after the first gets the first step's plan.
func TestSessionPlansOnce(t *testing.T) {
	const n, steps = 500, 4
	m := mlpModel(true)
	rng := rand.New(rand.NewPCG(51, 52))
	loss, params := m.Build(rng, n)
	budgets := testutil.TightBudgets(t, stepProgram(t, loss, params, 2))
	require.Contains(t, budgets, 3)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[3]})
	opt := optim.NewAdam(1e-3)
	var first *planner.Plan
	masks := map[[2]uint64]bool{} // (seed, counter) of every dropout node run
	for step := range steps {
		loss, params := m.Build(rng, n)
		for _, id := range dropoutNodes(loss.Graph().IR()) {
			a := loss.Graph().IR().Node(id).Attrs
			masks[[2]uint64{a.Seed, a.Counter}] = true
		}
		_, err := sess.Step(context.Background(), loss, params, opt)
		require.NoError(t, err)
		require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved, "step %d", step)
		if step == 0 {
			first = sess.LastPlan()
			require.Len(t, first.Chunks, 3)
			continue
		}
		require.Same(t, first, sess.LastPlan(), "step %d planned again", step)
	}
	require.Len(t, masks, 2*steps, "dropout drew the same mask twice") // two dropout modules
}

// A graph that cannot be chunked (it centres every sample on the batch
// mean) runs whole when the whole batch fits the budget, and is refused
// with a typed error naming both causes when it does not.
func TestSessionNotChunkable(t *testing.T) {
	const n = 64
	rng := rand.New(rand.NewPCG(61, 62))
	w := lazy.Param(testutil.UniformF32(rng, 1024), "w")
	build := func() *lazy.Tensor {
		x := lazy.Wrap(testutil.UniformF32(rng, n, 8, 1024), 0)
		return x.Sub(x.MeanKeepDim(0)).Mul(w).Tanh().Mean()
	}
	loss := build()
	p := stepProgram(t, loss, []*lazy.Tensor{w}, 1)
	require.False(t, p.Info.Chunkable())
	budgets := testutil.TightBudgets(t, p)
	require.Equal(t, []int{1}, testutil.Counts(budgets), "a non-chunkable graph was planned in chunks")

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[1]})
	_, err := sess.Step(context.Background(), build(), []*lazy.Tensor{w}, optim.NewSGD(0.1, 0.9))
	require.NoError(t, err)
	require.Len(t, sess.LastPlan().Chunks, 1)
	require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved)
	require.NoError(t, sess.Close()) // frees w for the session below (ErrParamOwned)

	sess = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[1] - alloc.RoundLarge})
	var lossVal float32
	require.NotPanics(t, func() {
		lossVal, err = sess.Step(context.Background(), build(), []*lazy.Tensor{w}, optim.NewSGD(0.1, 0.9))
	})
	require.ErrorIs(t, err, planner.ErrDoesNotFit)
	require.ErrorIs(t, err, graph.ErrNotChunkable)
	require.Zero(t, lossVal)
}
