package batchfit_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
)

// cudaSession returns a session on CUDA, closed when the test ends, or
// skips when there is no GPU.
func cudaSession(t *testing.T, o batchfit.Options) *batchfit.Session {
	t.Helper()
	o.Device = batchfit.DeviceCUDA
	sess := batchfit.NewSession(o)
	testutil.SkipWithoutGPU(t, sess.Err(), cuda.ErrNoGPU)
	t.Cleanup(func() { require.NoError(t, sess.Close()) })
	return sess
}

// twinSteps trains one model on the CPU and its twin on CUDA, step by
// step, from twin random streams and optimizers (SGD with momentum).
type twinSteps struct {
	cpu, gpu *batchfit.Session
	cm, gm   testutil.TrainModel
	crng     *rand.Rand
	grng     *rand.Rand
	copt     optim.Optimizer
	gopt     optim.Optimizer
}

func newTwinSteps(cpu, gpu *batchfit.Session, newModel func() testutil.TrainModel, seed uint64) *twinSteps {
	return &twinSteps{cpu: cpu, gpu: gpu, cm: newModel(), gm: newModel(),
		crng: rand.New(rand.NewPCG(seed, seed+1)), grng: rand.New(rand.NewPCG(seed, seed+1)),
		copt: optim.NewSGD(0.05, 0.9), gopt: optim.NewSGD(0.05, 0.9)}
}

// step runs step number step on n samples on both sessions, holds the CUDA
// loss to the CPU's within rtol and its peaks, reserved and allocated, to
// its plan's plus the overhead, to the byte; it returns the CUDA plan.
func (ts *twinSteps) step(t *testing.T, ctx context.Context, step, n int, rtol float64, what string) *planner.Plan {
	t.Helper()
	loss, params := ts.cm.Build(ts.crng, n)
	want, err := ts.cpu.Step(ctx, loss, params, ts.copt)
	require.NoError(t, err, "cpu step %d", step)
	loss, params = ts.gm.Build(ts.grng, n)
	got, err := ts.gpu.Step(ctx, loss, params, ts.gopt)
	require.NoError(t, err, "cuda step %d", step)
	gpu := ts.gpu
	pl, used := gpu.LastPlan(), gpu.LastUsage()
	t.Logf("%s step %d: loss cpu %.7f cuda %.7f; %d chunks, reserved predicted %d + %d, measured %d; allocated predicted %d + %d, measured %d",
		what, step, want, got, len(pl.Chunks), pl.PeakReserved, gpu.Overhead(), used.PeakReserved,
		pl.PeakAllocated, gpu.Overhead(), used.PeakAllocated)
	assert.InEpsilon(t, want, got, rtol, "step %d loss", step)
	assert.Equal(t, pl.PeakReserved+gpu.Overhead(), used.PeakReserved, "step %d: peak reserved", step)
	assert.Equal(t, pl.PeakAllocated+gpu.Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
	return pl
}

// convTwin is a conv net for twinConvNets: its maker, its batch, and
// whether it also runs in four chunks.
type convTwin struct {
	newModel func() testutil.TrainModel
	n        int
	chunks   bool
}

// twinConvNets trains each model three SGD steps on CUDA with gpuOpts and
// on the CPU with cpuOpts (twinSteps, seeded with seed, losses within
// rtol, predicted = measured on CUDA), whole and, where the model says so,
// in four chunks (Options.MaxChunk). check, when not nil, looks at each
// CUDA session before its steps.
func twinConvNets(t *testing.T, models []convTwin, gpuOpts, cpuOpts batchfit.Options, seed uint64, rtol float64,
	check func(*testing.T, *batchfit.Session)) {
	const steps = 3
	ctx := context.Background()
	for _, mc := range models {
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
				g, c := gpuOpts, cpuOpts
				g.MaxChunk, c.MaxChunk, c.Device = maxChunk, maxChunk, batchfit.DeviceCPU
				gpu := cudaSession(t, g)
				if check != nil {
					check(t, gpu)
				}
				cpu := batchfit.NewSession(c)
				ts := newTwinSteps(cpu, gpu, newModel, seed)
				for step := range steps {
					pl := ts.step(t, ctx, step, n, rtol, fmt.Sprintf("chunked %t", chunked))
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

// The default device is CUDA when a GPU is usable; without one the session
// runs on the CPU and its Device line says why.
func TestSessionAutoPicksCUDA(t *testing.T) {
	auto := batchfit.NewSession(batchfit.Options{})
	require.NoError(t, auto.Err(), "auto always finds an executor")
	defer func() { require.NoError(t, auto.Close()) }()
	t.Logf("Device(): %s", auto.Device())
	if strings.HasPrefix(auto.Device(), "cpu: ") {
		assert.True(t, strings.HasPrefix(auto.Device(), "cpu: no GPU (") || strings.HasPrefix(auto.Device(), "cpu: CUDA unusable ("),
			"the line says why: %q", auto.Device())
		forced := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA})
		require.Error(t, forced.Err(), "Device cuda without a usable GPU")
		_, err := forced.Step(context.Background(), lazy.Wrap(tensorOf([]float32{1}, 1), -1).Sum(), nil, optim.NewSGD(0.1, 0))
		require.ErrorIs(t, err, forced.Err())
		if os.Getenv(testutil.RequireGPUEnv) != "" {
			t.Fatalf("%s is set: %v", testutil.RequireGPUEnv, forced.Err())
		}
		t.Skipf("no GPU: %s", auto.Device())
	}
	require.True(t, strings.HasPrefix(auto.Device(), "cuda: "), "%q", auto.Device())
	assert.Contains(t, auto.Device(), "(sm_")
	assert.Positive(t, auto.Overhead(), "the cuBLAS workspace")
}

func TestSessionDeviceOption(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	assert.Equal(t, "cpu: chosen by Options.Device", sess.Device())
	assert.Zero(t, sess.Overhead())

	bad := batchfit.NewSession(batchfit.Options{Device: "tpu"})
	require.ErrorIs(t, bad.Err(), graph.ErrAttr)
	_, err := bad.Eval(context.Background(), lazy.Wrap(tensorOf([]float32{1, 2}), -1).Sum())
	require.ErrorIs(t, err, graph.ErrAttr)
	require.ErrorIs(t, bad.Yield(), graph.ErrAttr)
	require.ErrorIs(t, bad.Restore(), graph.ErrAttr)
	assert.False(t, bad.Yielded())
	assert.Nil(t, bad.Allocator())
	require.NoError(t, bad.Close())
}

// TestSessionCUDAMatchesCPU trains the same MLP on the same data for a few
// SGD steps with momentum in a CPU session and a CUDA one (full FP32, the
// default; the update runs on the device): every step's loss and
// parameters agree, so the CUDA session's host parameter tensors are
// current after every step.
//
// Tolerance: both compute in float32 and sum in different orders (cuBLAS,
// the device reductions), which moves results by about 1e-6 relative; SGD
// carries the differences linearly (Adam would not do: it turns a sign
// flip of a near-zero gradient into a full step). Losses are held to rtol
// 1e-4, parameters to 1e-6 plus rtol 1e-4, as exec/cuda's
// TestTrainingMatchesCPU.
func TestSessionCUDAMatchesCPU(t *testing.T) {
	const steps = 5
	gpuOpt := trainsLikeCPU(t, func() testutil.TrainModel { return mlpModel(false) }, steps, 81, 1e-6)
	assert.Equal(t, steps, gpuOpt.Steps())
}

// trainsLikeCPU trains two copies of a model at batch 64 with SGD
// (momentum 0.9), one on a CUDA session and one on a CPU session, from
// the same data: at every step the losses agree to rtol 1e-4 and the
// parameters to atol + 1e-4·|value|. It returns the CUDA side's optimizer.
func trainsLikeCPU(t *testing.T, newModel func() testutil.TrainModel, steps int, seed uint64, atol float64) *optim.SGD {
	const n = 64
	ctx := context.Background()
	gpu := cudaSession(t, batchfit.Options{})
	cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	cpuModel, gpuModel := newModel(), newModel()
	cpuRng, gpuRng := rand.New(rand.NewPCG(seed, seed+1)), rand.New(rand.NewPCG(seed, seed+1))
	cpuOpt, gpuOpt := optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)
	for step := range steps {
		loss, cpuParams := cpuModel.Build(cpuRng, n)
		want, err := cpu.Step(ctx, loss, cpuParams, cpuOpt)
		require.NoError(t, err, "cpu step %d", step)
		loss, gpuParams := gpuModel.Build(gpuRng, n)
		got, err := gpu.Step(ctx, loss, gpuParams, gpuOpt)
		require.NoError(t, err, "cuda step %d", step)
		t.Logf("step %d: loss cpu %.7f, cuda %.7f", step, want, got)
		assert.InEpsilon(t, want, got, 1e-4, "step %d loss", step)
		require.NoError(t, gpu.SyncParams(), "step %d", step)
		for i := range cpuParams {
			w, g := testutil.Float32s(t, cpuParams[i].Value().(*tensor.Dense)), testutil.Float32s(t, gpuParams[i].Value().(*tensor.Dense))
			require.Len(t, g, len(w))
			for j := range w {
				if d := math.Abs(float64(g[j]) - float64(w[j])); d > atol+1e-4*math.Abs(float64(w[j])) {
					require.Failf(t, "parameters differ", "step %d, %s[%d]: cpu %g, cuda %g", step, cpuParams[i].Name(), j, w[j], g[j])
				}
			}
		}
	}
	return gpuOpt
}

// TestSessionCUDAPlannedPeaksAreMeasured: through the session on CUDA, the
// plan's peaks plus Overhead (the cuBLAS workspace) are the measured ones,
// over three steps, with the budget the device gives (one chunk) and with
// a budget that splits the batch in two.
func TestSessionCUDAPlannedPeaksAreMeasured(t *testing.T) {
	const n = courtesyBatch
	ctx := context.Background()
	probe := cudaSession(t, batchfit.Options{})
	loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(83, 84)), n)
	budgets := testutil.TightBudgets(t, testutil.StepProgram(t, cuda.Workspace, loss, params, 2))
	require.Contains(t, budgets, 2)
	require.NoError(t, probe.Close())
	for _, c := range []struct {
		name   string
		budget int64
		chunks int
	}{{"device", 0, 1}, {"two chunks", budgets[2], 2}} {
		t.Run(c.name, func(t *testing.T) {
			sess := cudaSession(t, batchfit.Options{Budget: withOverhead(c.budget)})
			m, rng, opt := mlpModel(false), rand.New(rand.NewPCG(85, 86)), optim.NewAdam(1e-3)
			for step := range 3 {
				loss, params := m.Build(rng, n)
				_, err := sess.Step(ctx, loss, params, opt)
				require.NoError(t, err, "step %d", step)
				pl, used := sess.LastPlan(), sess.LastUsage()
				require.Len(t, pl.Chunks, c.chunks)
				t.Logf("step %d, %d chunks, budget %d: reserved predicted %d + overhead %d, measured %d; allocated predicted %d + %d, measured %d",
					step, len(pl.Chunks), pl.Budget, pl.PeakReserved, sess.Overhead(), used.PeakReserved,
					pl.PeakAllocated, sess.Overhead(), used.PeakAllocated)
				assert.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "step %d: peak reserved", step)
				assert.Equal(t, pl.PeakAllocated+sess.Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
			}
		})
	}
}

// TestSessionCUDAYieldRestore: a CUDA session yields between Adam steps
// (reserved drops to Overhead, the cuBLAS workspace's segment), and the
// run goes on bit for bit: the same losses and parameters as a session
// that never yielded. (exec/cuda's TestYieldRestoreContinuesTraining
// checks the device-side optimizer state bit for bit too.)
func TestSessionCUDAYieldRestore(t *testing.T) {
	run := func(yield bool) trained {
		sess := cudaSession(t, batchfit.Options{})
		m, rng, opt := mlpModel(false), rand.New(rand.NewPCG(87, 88)), optim.NewAdam(1e-2)
		var out trained
		var params []*lazy.Tensor
		for step := range 5 {
			if yield && step > 0 {
				require.NoError(t, sess.Yield())
				st := sess.Allocator().Stats()
				require.LessOrEqual(t, st.ReservedBytes[alloc.All].Current, sess.Overhead(), "step %d: reserved while yielded", step)
				if step%2 == 0 {
					require.NoError(t, sess.Restore())
				}
			}
			var loss *lazy.Tensor
			loss, params = m.Build(rng, courtesyBatch)
			l, err := sess.Step(context.Background(), loss, params, opt)
			require.NoError(t, err, "step %d", step)
			require.Equal(t, sess.LastPlan().PeakReserved+sess.Overhead(), sess.LastUsage().PeakReserved, "step %d", step)
			out.losses = append(out.losses, math.Float32bits(l))
		}
		require.NoError(t, sess.SyncParams())
		for _, p := range params {
			out.params = append(out.params, testutil.Bits(testutil.Float32s(t, p.Value().(*tensor.Dense))))
		}
		return out
	}
	never := run(false)
	require.Equal(t, never, run(true))
}

// On CUDA a step updates the parameters on the device only; SyncParams
// and Close bring the host tensors up to date, with the values the CPU
// computes (same tolerance as TestSessionCUDAMatchesCPU).
func TestSessionCUDASyncParams(t *testing.T) {
	const steps, n = 3, 64
	ctx := context.Background()
	gpu := cudaSession(t, batchfit.Options{})
	cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	cpuModel, gpuModel := mlpModel(false), mlpModel(false)
	cpuRng, gpuRng := rand.New(rand.NewPCG(91, 92)), rand.New(rand.NewPCG(91, 92))
	cpuOpt, gpuOpt := optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)
	var cpuParams, gpuParams []*lazy.Tensor
	var initial [][]uint32
	for step := range steps {
		var loss *lazy.Tensor
		loss, cpuParams = cpuModel.Build(cpuRng, n)
		_, err := cpu.Step(ctx, loss, cpuParams, cpuOpt)
		require.NoError(t, err)
		loss, gpuParams = gpuModel.Build(gpuRng, n)
		if step == 0 {
			for _, p := range gpuParams {
				initial = append(initial, testutil.Bits(testutil.Float32s(t, p.Value().(*tensor.Dense))))
			}
		}
		_, err = gpu.Step(ctx, loss, gpuParams, gpuOpt)
		require.NoError(t, err)
	}
	for i, p := range gpuParams {
		require.Equal(t, initial[i], testutil.Bits(testutil.Float32s(t, p.Value().(*tensor.Dense))),
			"%s: the host tensor is not written before SyncParams", p.Name())
	}
	compare := func(when string) {
		for i := range cpuParams {
			w, g := testutil.Float32s(t, cpuParams[i].Value().(*tensor.Dense)), testutil.Float32s(t, gpuParams[i].Value().(*tensor.Dense))
			for j := range w {
				if d := math.Abs(float64(g[j]) - float64(w[j])); d > 1e-6+1e-4*math.Abs(float64(w[j])) {
					require.Failf(t, "parameters differ", "%s: %s[%d]: cpu %g, cuda %g", when, cpuParams[i].Name(), j, w[j], g[j])
				}
			}
		}
	}
	require.NoError(t, gpu.SyncParams())
	compare("after SyncParams")

	// One more step, then Close alone syncs.
	loss, ps := cpuModel.Build(cpuRng, n)
	_, err := cpu.Step(ctx, loss, ps, cpuOpt)
	require.NoError(t, err)
	loss, ps = gpuModel.Build(gpuRng, n)
	_, err = gpu.Step(ctx, loss, ps, gpuOpt)
	require.NoError(t, err)
	require.NoError(t, gpu.Close())
	compare("after Close")
	require.NoError(t, gpu.Close(), "Close twice")
}

// TestSessionCUDANoLeakOver200Steps trains an MLP (784 → 64 → 64 → 10,
// 2048 samples) for 200 Adam steps on CUDA, whole and under the smallest
// budget at which the planner splits the batch in at least three chunks
// (testutil.TightBudgets over the step's program compiled with CUDA's workspaces,
// as the session compiles it). After every step:
//   - the allocator's allocated bytes equal those after the first step,
//     which are the resident parameters and Adam's two state tensors per
//     parameter (each rounded to the allocator's 512 B) plus the cuBLAS
//     workspace (Overhead): nothing a step allocates outlives it;
//   - the allocator's reserved bytes, and the device's used bytes (total −
//     free from cuMemGetInfo), are no more than after the second step, by
//     which the cache holds what the steady state needs;
//   - the plan's peak reserved plus Overhead is the measured peak.
func TestSessionCUDANoLeakOver200Steps(t *testing.T) {
	const steps, n = 200, 2048
	const in, hidden, labels = 784, 64, 10
	newModel := func() *nn.Sequential {
		return nn.MLP(nn.Seed(31), []int{in, hidden, hidden, labels}, nn.ReLU{})
	}
	// Four batches drawn once and cycled, so the loop's host time goes to
	// the steps, not to drawing data.
	rng := rand.New(rand.NewPCG(93, 94))
	xs, ys := make([]*tensor.Dense, 4), make([]*tensor.Dense, 4)
	for i := range xs {
		xs[i], ys[i] = testutil.UniformF32(rng, n, in), testutil.Classes(rng, labels, n)
	}
	build := func(m *nn.Sequential, step int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Wrap(xs[step%len(xs)], 0)
		y := x.Graph().Wrap(ys[step%len(ys)], 0)
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}
	loss, params := build(newModel(), 0)
	budgets := testutil.TightBudgets(t, testutil.StepProgram(t, cuda.Workspace, loss, params, 2))
	chunks := 0
	for _, k := range testutil.Counts(budgets) {
		if k >= 3 {
			chunks = k
			break
		}
	}
	require.NotZero(t, chunks, "some budget splits the batch in three chunks or more: %v", budgets)
	var resident int64 // parameters and Adam's m and v, as the allocator rounds them
	for _, p := range params {
		resident += 3 * alloc.RoundSize(int64(graph.Numel(p.Shape()))*4)
	}

	for _, c := range []struct {
		name   string
		budget int64
		chunks int
	}{{"whole", 0, 1}, {fmt.Sprintf("%d chunks", chunks), budgets[chunks], chunks}} {
		t.Run(c.name, func(t *testing.T) {
			sess := cudaSession(t, batchfit.Options{Budget: withOverhead(c.budget)})
			m, opt := newModel(), optim.NewAdam(1e-3)
			dev := sess.Allocator().Backend()
			deviceUsed := func() int64 {
				free, total, err := dev.MemInfo()
				require.NoError(t, err)
				return total - free
			}
			var baseline, reserved2, used2, maxReserved, maxUsed int64
			var first, last float32
			for step := range steps { // messages count steps from 1
				loss, params := build(m, step)
				l, err := sess.Step(context.Background(), loss, params, opt)
				require.NoError(t, err, "step %d", step+1)
				if step == 0 {
					first = l
				}
				last = l
				pl, used := sess.LastPlan(), sess.LastUsage()
				require.Len(t, pl.Chunks, c.chunks, "step %d", step+1)
				require.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "step %d: peak reserved", step+1)
				st := sess.Allocator().Stats()
				allocated, reserved, dused := st.AllocatedBytes[alloc.All].Current, st.ReservedBytes[alloc.All].Current, deviceUsed()
				switch step {
				case 0:
					baseline = allocated
					require.Equal(t, sess.Overhead()+resident, baseline, "after the first step: the cuBLAS workspace, parameters and Adam state")
				case 1:
					reserved2, used2 = reserved, dused
				default:
					require.LessOrEqual(t, reserved, reserved2, "step %d: reserved bytes grew after step 2", step+1)
					require.LessOrEqual(t, dused, used2, "step %d: device used bytes grew after step 2", step+1)
				}
				require.Equal(t, baseline, allocated, "step %d: allocated bytes", step+1)
				maxReserved, maxUsed = max(maxReserved, reserved), max(maxUsed, dused)
			}
			st := sess.Allocator().Stats()
			t.Logf("%d steps in %d chunks (budget %d): allocated %d after every step (Overhead %d + resident %d); "+
				"reserved %d after step 2, at most %d after any, %d at the end; device used %d after step 2, at most %d after any; "+
				"%d device allocs, %d frees, %d OOMs; loss %.4f → %.4f",
				steps, c.chunks, c.budget, baseline, sess.Overhead(), resident,
				reserved2, maxReserved, st.ReservedBytes[alloc.All].Current, used2, maxUsed,
				st.NumDeviceAlloc, st.NumDeviceFree, st.NumOOMs, first, last)
			assert.Less(t, last, first, "Adam lowers the loss over %d steps", steps)
		})
	}
}

// withOverhead turns a plan's budget into the Options.Budget that gives it:
// the session's budget holds the cuBLAS workspace (Overhead) too. Zero
// stays zero (the device's free memory).
func withOverhead(planBudget int64) int64 {
	if planBudget == 0 {
		return 0
	}
	return planBudget + cuda.DefaultWorkspace
}

// TestSessionCUDAGPTFusedAttention: a GPT step through fused attention
// (float32: cuBLAS over query blocks, attention_rows_{fwd,bwd}_f32)
// trains like the CPU's (losses and parameters over 5 SGD steps), and its
// plan's peaks plus Overhead are the measured ones, in one chunk and in
// two.
func TestSessionCUDAGPTFusedAttention(t *testing.T) {
	const steps, n = 5, 64
	ctx := context.Background()
	t.Run("matches the CPU", func(t *testing.T) {
		trainsLikeCPU(t, func() testutil.TrainModel { return testutil.FusedGPTModel(64, false) }, steps, 91, 1e-5)
	})
	probe := cudaSession(t, batchfit.Options{})
	loss, params := testutil.FusedGPTModel(64, false).Build(rand.New(rand.NewPCG(93, 94)), n)
	budgets := testutil.TightBudgets(t, testutil.StepProgram(t, cuda.Workspace, loss, params, 2))
	require.Contains(t, budgets, 2)
	require.NoError(t, probe.Close())
	for _, c := range []struct {
		name   string
		budget int64
		chunks int
	}{{"device", 0, 1}, {"two chunks", budgets[2], 2}} {
		t.Run("predicted = measured/"+c.name, func(t *testing.T) {
			sess := cudaSession(t, batchfit.Options{Budget: withOverhead(c.budget)})
			m, rng, opt := gptModel(64)(false), rand.New(rand.NewPCG(95, 96)), optim.NewAdam(1e-3)
			for step := range 3 {
				loss, params := m.Build(rng, n)
				_, err := sess.Step(ctx, loss, params, opt)
				require.NoError(t, err, "step %d", step)
				pl, used := sess.LastPlan(), sess.LastUsage()
				require.Len(t, pl.Chunks, c.chunks)
				assert.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "step %d: peak reserved", step)
				assert.Equal(t, pl.PeakAllocated+sess.Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
			}
		})
	}
}

// Mixed precision on CUDA: for each policy and model, a CUDA session and a
// CPU session (which emulates the 16-bit rounding at the same points) train
// from the same data with SGD, whole and in chunks. The plan's peaks plus
// Overhead are the measured ones at every step, and the losses agree
// within the policy's tolerance: both round every 16-bit result once, but
// cuBLAS and the CPU sum products in different orders, so a value may land
// one 16-bit ulp apart (2⁻⁸ relative for bfloat16, 2⁻¹¹ for float16) and
// carry that into the loss: rtol 2e-2 for bf16-mixed, 5e-3 for fp16-mixed.
// The padded-head GPT's loss reads its head's padded logits (precision's
// fused loss: cross_entropy with Attrs.End, no slice). The fused loss's
// logits chunk is pinned at graph.MaxLossChunk tokens (Options.LossChunk):
// under a budget the session would otherwise choose a smaller one, which
// fits the whole batch in half its peak without chunks.
func TestSessionCUDAMixedPrecision(t *testing.T) {
	const steps = 3
	ctx := context.Background()
	for _, pc := range []struct {
		precision string
		rtol      float64
	}{{"bf16-mixed", 2e-2}, {"fp16-mixed", 5e-3}} {
		for _, mc := range []struct {
			newModel func() testutil.TrainModel
			n        int
		}{
			{func() testutil.TrainModel { return testutil.MLPModel(784, 64, true) }, 512},
			{func() testutil.TrainModel { return testutil.GPTModel(64, true) }, 512},
			{func() testutil.TrainModel { return testutil.FusedGPTModel(64, false) }, 512},
			{testutil.PaddedHeadGPTModel, 256},
			// Head dim 64: attention_qkv on cuDNN, whose 1 MiB plan
			// workspaces put a 20 MiB segment in the large pool; 512
			// sequences make half the whole step's peak hold a chunk.
			{testutil.HeadDim64GPTModel, 512},
			// The convolutions' patch workspace is sized from the full batch
			// (up to 64 MiB, conv.go), so only a batch past that cap leaves
			// chunks anything to save.
			{func() testutil.TrainModel { return testutil.ConvModel(12, true) }, 8192},
		} {
			newModel, n := mc.newModel, mc.n
			name := newModel().Name
			t.Run(pc.precision+"/"+name, func(t *testing.T) {
				var wholePeak, overhead int64
				for _, chunked := range []bool{false, true} {
					var budget int64
					if chunked { // the overhead (cuBLAS's workspace) and half the step
						budget = overhead + wholePeak/2
					}
					gpu := cudaSession(t, batchfit.Options{Precision: pc.precision, Budget: budget, LossChunk: graph.MaxLossChunk})
					cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: pc.precision})
					ts := newTwinSteps(cpu, gpu, newModel, 91)
					for step := range steps {
						pl := ts.step(t, ctx, step, n, pc.rtol, fmt.Sprintf("chunked %t", chunked))
						if !chunked {
							wholePeak, overhead = pl.PeakReserved, gpu.Overhead()
							assert.Len(t, pl.Chunks, 1)
						} else {
							assert.Greater(t, len(pl.Chunks), 1, "a budget of half the whole step's peak splits the batch")
						}
					}
					require.NoError(t, cpu.Close())
				}
			})
		}
	}
}

// TestSessionCUDAMixedResNet: a ResNet (Bottleneck blocks, training-mode
// batch norm, the running statistics updated) under bf16-mixed and
// fp16-mixed on CUDA, where its batch norms read 16-bit activations with
// float32 weights (on cuDNN), against the CPU session for three SGD steps:
// losses within the policy's tolerance (as TestSessionCUDAMixedPrecision),
// and predicted = measured at every step.
func TestSessionCUDAMixedResNet(t *testing.T) {
	ctx := context.Background()
	for _, pc := range []struct {
		precision string
		rtol      float64
	}{{"bf16-mixed", 2e-2}, {"fp16-mixed", 5e-3}} {
		t.Run(pc.precision, func(t *testing.T) {
			gpu := cudaSession(t, batchfit.Options{Precision: pc.precision})
			t.Log(gpu.Device())
			cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: pc.precision})
			defer cpu.Close()
			ts := newTwinSteps(cpu, gpu, func() testutil.TrainModel { return resnetModel(false) }, 93)
			for step := range 3 {
				ts.step(t, ctx, step, 64, pc.rtol, "whole")
			}
		})
	}
}

// TestSessionCUDALossScale: fp16-mixed on CUDA scales its loss as on the
// CPU: from 2⁴⁰ the first steps overflow and are skipped (parameters and
// the device's Adam untouched, the scale halving) until the scale fits,
// as many as on the CPU give or take one (rounding differs at the
// threshold); then steps update, with losses near the CPU's and peaks as
// planned (the flag included).
func TestSessionCUDALossScale(t *testing.T) {
	ctx := context.Background()
	const n, steps = 64, 30
	o := batchfit.Options{Precision: "fp16-mixed", LossScale: precision.LossScale{Init: 1 << 40}}
	sess := cudaSession(t, o)
	o.Device = batchfit.DeviceCPU
	host := batchfit.NewSession(o)
	devNet, hostNet := mlpModel(false), mlpModel(false)
	devOpt, hostOpt := optim.NewAdam(1e-3), optim.NewAdam(1e-3)
	rng := rand.New(rand.NewPCG(12, 13))
	good := 0
	for step := range steps {
		seed := rng.Uint64()
		loss, params := devNet.Build(rand.New(rand.NewPCG(seed, 1)), n)
		require.NoError(t, sess.SyncParams())
		before := make([][]float32, len(params))
		for i, p := range params {
			before[i] = slices.Clone(p.Value().(*tensor.Dense).Float32s())
		}
		l, err := sess.Step(ctx, loss, params, devOpt)
		require.NoError(t, err, "step %d", step)
		hLoss, hParams := hostNet.Build(rand.New(rand.NewPCG(seed, 1)), n)
		hl, err := host.Step(ctx, hLoss, hParams, hostOpt)
		require.NoError(t, err, "step %d on the CPU", step)
		require.InEpsilon(t, hl, l, 1e-2, "step %d: the unscaled loss, on CUDA and on the CPU", step)
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "step %d: peak reserved", step)
		require.Equal(t, pl.PeakAllocated+sess.Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
		require.NoError(t, sess.SyncParams())
		st := sess.LossScale()
		for i, p := range params {
			for _, v := range p.Value().(*tensor.Dense).Float32s() {
				require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 0), "step %d: %s", step, p.Name())
			}
			if st.LastSkipped {
				require.Equal(t, before[i], p.Value().(*tensor.Dense).Float32s(), "step %d: a skipped step updates nothing", step)
			}
		}
		if !st.LastSkipped {
			good++
		}
		require.Equal(t, good, devOpt.Steps(), "step %d: Adam counts the steps that ran", step)
		require.False(t, math.IsNaN(float64(l)), "step %d: loss", step)
	}
	ds, hs := sess.LossScale(), host.LossScale()
	t.Logf("CUDA: %+v; CPU: %+v", ds, hs)
	require.Positive(t, ds.Skipped)
	require.Positive(t, good)
	require.InDelta(t, hs.Skipped, ds.Skipped, 1, "skipped steps on CUDA and on the CPU")
}
