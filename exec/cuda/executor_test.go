package cuda_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// FP32 tolerance: exec/cpu's (rtol 1e-4, atol 1e-5 against the float64
// reference over values in [−1, 2)). The GPU computes exp, log, tanh,
// sigmoid, gelu and softmax's exp with CUDA's float functions, a few ulp
// (a few 1e-7 relative) from the CPU's float64 ones, and cuBLAS sums
// GEMMs in float32 in its own order: both far inside it.
var fp32Tolerance = conformance.Tolerance{RTol: 1e-4, ATol: 1e-5}

// TF32 tolerance: TF32 tensor cores round GEMM operands to a 10-bit
// mantissa (unit roundoff 2⁻¹¹ ≈ 5e-4, so a product of two values in
// [−1, 1) is off by about 1e-4). The cases' losses sum a hundred or more
// GEMM outputs of a dozen products each, which puts their error at a few
// 1e-3 while the loss itself may be near 0: rtol 1e-2, atol 1e-2.
var tf32Tolerance = conformance.Tolerance{RTol: 1e-2, ATol: 1e-2}

func TestConformanceFP32(t *testing.T) {
	conformance.RunAll(t, runOn(executor(t)), fp32Tolerance)
}

func TestConformanceTF32(t *testing.T) {
	conformance.RunAll(t, runOn(freshExecutor(t, cuda.ExecutorOptions{TF32: true})), tf32Tolerance)
}

// 16-bit conformance: every op with bfloat16 (float16) values, against the
// float64 reference rounded where the kernels round. The tolerances are the
// CPU executor's (conformance.BFloat16Tol, Float16Tol): CUDA computes in
// float32 like the CPU, in another order (cuBLAS, tree reductions), which
// moves a result across a 16-bit rounding boundary now and then, one unit
// in the last place, well inside them.
func TestConformanceBFloat16(t *testing.T) {
	conformance.RunAllAs(t, runOn(executor(t)), graph.BFloat16, conformance.BFloat16Tol)
}

func TestConformanceFloat16(t *testing.T) {
	conformance.RunAllAs(t, runOn(executor(t)), graph.Float16, conformance.Float16Tol)
}

// runOn adapts an executor to the conformance suite, as exec/cpu's runCPU.
func runOn(e *cuda.Executor) conformance.Runner { return conformance.RunnerOf(e.RunBatch) }

// stepProgram compiles a training step as batchfit.Session.Step does on
// CUDA: testutil.StepProgram with the CUDA kernels' workspaces.
func stepProgram(t testing.TB, loss *lazy.Tensor, params []*lazy.Tensor, slots int) *planner.Program {
	t.Helper()
	return testutil.TrainProgram(t, cuda.Workspace, loss, params, slots)
}

func scalarOf(t *testing.T, d *tensor.Dense) float32 {
	t.Helper()
	switch v := d.Data().(type) {
	case float32:
		return v
	case []float32:
		require.Len(t, v, 1)
		return v[0]
	}
	t.Fatalf("loss holds %T", d.Data())
	return 0
}

// hostParams copies the parameters' host data.
func hostParams(t *testing.T, params []*lazy.Tensor) [][]float32 {
	t.Helper()
	out := make([][]float32, len(params))
	for i, p := range params {
		d, ok := p.Value().(*tensor.Dense)
		require.True(t, ok)
		out[i] = slices.Clone(d.Float32s())
	}
	return out
}

// TestTrainingMatchesCPU trains an MLP, a small GPT and a small ConvNet
// for a few SGD steps with momentum on both executors from the same
// parameters and data: the CPU runs each batch whole, CUDA in three
// balanced chunks, with the update on the device. Every step's loss and
// the final parameters agree.
//
// Tolerance: both compute in float32 and sum in different orders (cuBLAS,
// double-accumulating reductions, chunk partials), which moves results by
// about 1e-6 relative; SGD carries the differences linearly. Losses are
// held to rtol 1e-4, parameters to rtol 1e-4 plus atol 1e-6.
func TestTrainingMatchesCPU(t *testing.T) {
	const steps, n, chunks = 4, 30, 3
	ctx := context.Background()
	for _, mk := range []func() testutil.TrainModel{
		func() testutil.TrainModel { return testutil.MLPModel(64, 32, false) },
		func() testutil.TrainModel { return testutil.GPTModel(64, false) },
		func() testutil.TrainModel { return testutil.ConvModel(16, false) },
	} {
		name := mk().Name
		t.Run(name, func(t *testing.T) {
			e := freshExecutor(t, cuda.ExecutorOptions{})
			cpuModel, gpuModel := mk(), mk()
			cpuRng, gpuRng := rand.New(rand.NewPCG(41, 42)), rand.New(rand.NewPCG(41, 42))
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
			cpuOpt, gpuOpt := optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)
			var cpuParams, gpuParams []*lazy.Tensor
			for step := range steps {
				loss, params := cpuModel.Build(cpuRng, n)
				want, err := sess.Step(ctx, loss, params, cpuOpt)
				require.NoError(t, err, "cpu step %d", step)
				cpuParams = params

				loss, params = gpuModel.Build(gpuRng, n)
				p := stepProgram(t, loss, params, cpuOpt.StateSlots())
				res, err := e.Execute(ctx, p, planner.Chunks(n, chunks), cuda.ExecOptions{Resident: true, Optimizer: gpuOpt,
					SyncParams: step == steps-1})
				require.NoError(t, err, "cuda step %d", step)
				got := scalarOf(t, res.Outputs[0])
				assert.InEpsilon(t, want, got, 1e-4, "step %d loss", step)
				t.Logf("step %d: loss cpu %.7f, cuda %.7f", step, want, got)
				gpuParams = params
			}
			assert.Equal(t, steps, gpuOpt.Steps())
			want, got := hostParams(t, cpuParams), hostParams(t, gpuParams)
			var worst float64
			for i := range want {
				require.Len(t, got[i], len(want[i]))
				for j, w := range want[i] {
					d := math.Abs(float64(got[i][j]) - float64(w))
					worst = max(worst, d)
					if d > 1e-6+1e-4*math.Abs(float64(w)) {
						require.Failf(t, "parameters differ", "%s[%d]: cpu %g, cuda %g", cpuParams[i].Name(), j, w, got[i][j])
					}
				}
			}
			t.Logf("largest parameter difference after %d steps: %.3g", steps, worst)
		})
	}
}

// TestDeviceOptimizerMatchesHost: the sgd_multi_f32 and adam_multi_f32
// updates equal optim.go's bit for bit (kernels/README.md). Two identical
// MLPs train on one executor, one with the optimizer on the device, one
// with it on the host through ExecOptions.Update (gradients downloaded,
// host parameters updated and uploaded). The kernels that compute the gradients are
// deterministic, so the parameters stay bitwise equal step after step.
func TestDeviceOptimizerMatchesHost(t *testing.T) {
	const steps, n = 4, 24
	ctx := context.Background()
	for _, c := range []struct {
		name string
		opt  func() optim.Optimizer
	}{
		{"sgd", func() optim.Optimizer {
			o := optim.NewSGD(0.05, 0.9)
			o.Nesterov, o.WeightDecay, o.Dampening = true, 1e-2, 0.1
			return o
		}},
		{"adam", func() optim.Optimizer { o := optim.NewAdam(1e-2); o.WeightDecay = 1e-2; return o }},
		{"adamw", func() optim.Optimizer { return optim.NewAdamW(1e-2) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := freshExecutor(t, cuda.ExecutorOptions{})
			devModel, hostModel := testutil.MLPModel(32, 16, false), testutil.MLPModel(32, 16, false)
			devRng, hostRng := rand.New(rand.NewPCG(43, 44)), rand.New(rand.NewPCG(43, 44))
			devOpt, hostOpt := c.opt(), c.opt()
			var devParams, hostParamsT []*lazy.Tensor
			for step := range steps {
				loss, params := devModel.Build(devRng, n)
				p := stepProgram(t, loss, params, devOpt.StateSlots())
				dres, err := e.Execute(ctx, p, planner.Chunks(n, 2), cuda.ExecOptions{Resident: true, Optimizer: devOpt, SyncParams: true})
				require.NoError(t, err, "device step %d", step)
				devParams = params

				loss, params = hostModel.Build(hostRng, n)
				p = stepProgram(t, loss, params, hostOpt.StateSlots())
				update := func(kept [][]float32) error { // as batchfit.Session.Step's
					ps := make([]optim.Param, len(params))
					for i, pt := range params {
						ps[i] = optim.Param{Key: pt.Value(), Name: pt.Name(), Data: pt.Value().(*tensor.Dense).Float32s(), Grad: kept[i]}
					}
					return hostOpt.Step(ps)
				}
				hres, err := e.Execute(ctx, p, planner.Chunks(n, 2), cuda.ExecOptions{Resident: true, Update: update})
				require.NoError(t, err, "host step %d", step)
				hostParamsT = params
				require.Equal(t, scalarOf(t, hres.Outputs[0]), scalarOf(t, dres.Outputs[0]), "step %d loss", step)
			}
			assert.Equal(t, steps, devOpt.Steps())
			assert.Empty(t, devOpt.State(devParams[0].Value()), "the device optimizer keeps no host state")
			want, got := hostParams(t, hostParamsT), hostParams(t, devParams)
			for i := range want {
				require.Equal(t, want[i], got[i], "parameter %s", devParams[i].Name())
			}
		})
	}
}

// TestKeptOnDeviceAndSyncParams: a training loop's options leave the
// gradients on the device (their outputs are nil) and the host tensors
// untouched until SyncParams, yet train bit for bit as steps that download
// everything and sync every step. OpTime reports every node of every chunk
// that runs a pass of its own, UpdateTime the optimizer's update once.
func TestKeptOnDeviceAndSyncParams(t *testing.T) {
	const steps, n, chunks = 3, 24, 2
	ctx := context.Background()
	e := freshExecutor(t, cuda.ExecutorOptions{})
	lazyModel, eagerModel := testutil.MLPModel(32, 16, false), testutil.MLPModel(32, 16, false)
	lazyRng, eagerRng := rand.New(rand.NewPCG(45, 46)), rand.New(rand.NewPCG(45, 46))
	lazyOpt, eagerOpt := optim.NewAdam(1e-2), optim.NewAdam(1e-2)
	var lazyParams, eagerParams []*lazy.Tensor
	var initial [][]float32
	for step := range steps {
		loss, params := lazyModel.Build(lazyRng, n)
		if step == 0 {
			initial = hostParams(t, params)
		}
		p := stepProgram(t, loss, params, lazyOpt.StateSlots())
		timed, total, updates := 0, time.Duration(0), []time.Duration{}
		fused := cuda.FusedCrossEntropies()
		lres, err := e.Execute(ctx, p, planner.Chunks(n, chunks), cuda.ExecOptions{Resident: true, Optimizer: lazyOpt, KeptOnDevice: true,
			OpTime: func(nd *graph.Node, c planner.Chunk, d time.Duration) {
				require.GreaterOrEqual(t, d, time.Duration(0), "node %d", nd.ID)
				timed++
				total += d
			},
			UpdateTime: func(d time.Duration) { updates = append(updates, d) }})
		require.NoError(t, err, "step %d", step)
		runs := 0
		for _, st := range p.Steps {
			if st.Kind == planner.StepRun {
				runs++
			}
		}
		// A cross_entropy_grad computed in its cross_entropy's pass has no
		// run of its own to time.
		inPass := int(cuda.FusedCrossEntropies() - fused)
		require.Equal(t, chunks, inPass, "each chunk's loss gradient comes with its loss")
		require.Equal(t, chunks*runs-inPass, timed, "OpTime sees every other node of every chunk")
		require.Positive(t, total, "the step's kernels take device time")
		require.Len(t, updates, 1, "one update a step")
		require.Positive(t, updates[0], "the optimizer's kernels take device time")
		require.NotNil(t, lres.Outputs[0], "the loss is downloaded")
		for i := 1; i < len(lres.Outputs); i++ {
			require.Nil(t, lres.Outputs[i], "gradient %d stays on the device", i)
		}
		lazyParams = params

		loss, params = eagerModel.Build(eagerRng, n)
		p = stepProgram(t, loss, params, eagerOpt.StateSlots())
		eres, err := e.Execute(ctx, p, planner.Chunks(n, chunks), cuda.ExecOptions{Resident: true, Optimizer: eagerOpt, SyncParams: true})
		require.NoError(t, err, "step %d", step)
		require.Len(t, eres.Outputs[1].Float32s(), graph.Numel(eres.Outputs[1].Shape()), "gradients are downloaded by default")
		eagerParams = params
		require.Equal(t, scalarOf(t, eres.Outputs[0]), scalarOf(t, lres.Outputs[0]), "step %d loss", step)
	}
	require.Equal(t, initial, hostParams(t, lazyParams), "host tensors are not written before SyncParams")
	require.NoError(t, e.SyncParams())
	want, got := hostParams(t, eagerParams), hostParams(t, lazyParams)
	for i := range want {
		require.Equal(t, want[i], got[i], "parameter %s after SyncParams", lazyParams[i].Name())
	}
	// While yielded, SyncParams reads the executor's host copies.
	loss, params := lazyModel.Build(lazyRng, n)
	_, err := e.Execute(ctx, stepProgram(t, loss, params, 2), planner.Chunks(n, 1), cuda.ExecOptions{Resident: true, Optimizer: lazyOpt, KeptOnDevice: true})
	require.NoError(t, err)
	loss, params = eagerModel.Build(eagerRng, n)
	_, err = e.Execute(ctx, stepProgram(t, loss, params, 2), planner.Chunks(n, 1), cuda.ExecOptions{Resident: true, Optimizer: eagerOpt, SyncParams: true})
	require.NoError(t, err)
	require.NoError(t, e.Yield())
	require.NoError(t, e.SyncParams())
	want, got = hostParams(t, eagerParams), hostParams(t, lazyParams)
	for i := range want {
		require.Equal(t, want[i], got[i], "parameter %s after SyncParams while yielded", lazyParams[i].Name())
	}
	require.NoError(t, e.Restore())
}

// persistentBytes is what the persistent buffers of p occupy in the
// allocator: each rounded to the 512-byte block size.
func persistentBytes(p *planner.Program) int64 {
	var n int64
	for _, bi := range p.Persistent {
		if b := p.Buffers[bi].Bytes(0); b > 0 {
			n += alloc.RoundSize(b)
		}
	}
	return n
}

// TestPlannedPeaksAreMeasured: for an MLP's Adam training step at every
// chunk count the planner chooses under some budget (1, 2 and 5 here), the plan's
// peaks (planner.Make over the program compiled with cuda.Workspace) are
// what the executor's allocator measures on the device, over three
// consecutive steps (the first allocates parameters and optimizer state,
// later ones find them resident), plus the executor's Overhead, the cuBLAS
// workspace's own segment. After every step the allocated bytes are back
// at the resident baseline: parameters, optimizer state and the workspace.
func TestPlannedPeaksAreMeasured(t *testing.T) {
	const steps, n = 3, 512
	ctx := context.Background()
	model := testutil.MLPModel(784, 256, false)
	loss, params := model.Build(rand.New(rand.NewPCG(45, 46)), n)
	budgets := testutil.TightBudgets(t, stepProgram(t, loss, params, 2))
	require.GreaterOrEqual(t, len(budgets), 2, "budgets gave chunk counts %v", budgets)
	for _, k := range slices.Sorted(maps.Keys(budgets)) {
		budget := budgets[k]
		t.Run(fmt.Sprintf("chunks=%d", k), func(t *testing.T) {
			e := freshExecutor(t, cuda.ExecutorOptions{})
			m, rng := testutil.MLPModel(784, 256, false), rand.New(rand.NewPCG(47, uint64(k)))
			opt := optim.NewAdam(1e-3)
			for step := range steps {
				loss, params := m.Build(rng, n)
				p := stepProgram(t, loss, params, 2)
				pl, err := planner.Make(p, planner.Options{Budget: budget})
				require.NoError(t, err)
				require.Len(t, pl.Chunks, k)
				res, err := e.Execute(ctx, p, pl.Chunks, cuda.ExecOptions{Resident: true, Optimizer: opt})
				require.NoError(t, err, "step %d", step)
				st := e.Allocator().Stats()
				t.Logf("step %d, %d chunks: reserved predicted %d + overhead %d, measured %d (error %d B); allocated predicted %d + %d, measured %d (error %d B)",
					step, k, pl.PeakReserved, e.Overhead(), res.Usage.PeakReserved, res.Usage.PeakReserved-pl.PeakReserved-e.Overhead(),
					pl.PeakAllocated, e.Overhead(), res.Usage.PeakAllocated, res.Usage.PeakAllocated-pl.PeakAllocated-e.Overhead())
				assert.Equal(t, pl.PeakReserved+e.Overhead(), res.Usage.PeakReserved, "step %d: peak reserved", step)
				assert.Equal(t, pl.PeakAllocated+e.Overhead(), res.Usage.PeakAllocated, "step %d: peak allocated", step)
				assert.Equal(t, res.Usage.PeakReserved, st.ReservedBytes[alloc.All].Peak, "step %d: stats", step)
				assert.Equal(t, persistentBytes(p)+e.Overhead(), st.AllocatedBytes[alloc.All].Current,
					"step %d: allocated bytes after the step are the resident baseline", step)
				assert.Zero(t, st.NumOOMs)
			}
		})
	}
}

// TestNoLeakAfterNonResidentRuns: runs that keep nothing resident, a
// failing one included, leave only the cuBLAS workspace allocated.
func TestNoLeakAfterNonResidentRuns(t *testing.T) {
	e := freshExecutor(t, cuda.ExecutorOptions{})
	ctx := context.Background()
	for step := range 3 {
		loss, params := testutil.MLPModel(16, 8, false).Build(rand.New(rand.NewPCG(48, uint64(step))), 10)
		p := stepProgram(t, loss, params, 0)
		_, err := e.Execute(ctx, p, planner.Chunks(10, 1+step), cuda.ExecOptions{})
		require.NoError(t, err)
		assert.Equal(t, e.Overhead(), e.Allocator().Stats().AllocatedBytes[alloc.All].Current, "step %d", step)
	}
	g, id := badEmbedding(t)
	_, err := e.Run(ctx, g, id)
	require.ErrorIs(t, err, graph.ErrAttr)
	assert.Equal(t, e.Overhead(), e.Allocator().Stats().AllocatedBytes[alloc.All].Current, "after a failed run")
}

// badEmbedding is a graph whose embedding index 7 is out of range for 5
// rows; its output node is the last.
func badEmbedding(t *testing.T) (*graph.Graph, int) {
	t.Helper()
	w := lazy.Param(tensor.New(tensor.WithShape(5, 3), tensor.WithBacking(make([]float32, 15))), "w")
	idx := lazy.Const(tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]int64{0, 4, 7, 1})))
	out := idx.Embedding(w)
	require.NoError(t, out.Err())
	return out.Graph().IR(), out.ID()
}

// TestIndexErrorsAreTyped: an index or label out of range is found by the
// kernel and returned as the CPU returns it, an *graph.OpError wrapping
// graph.ErrAttr.
func TestIndexErrorsAreTyped(t *testing.T) {
	e := executor(t)
	ctx := context.Background()
	g, id := badEmbedding(t)
	_, err := e.Run(ctx, g, id)
	require.ErrorIs(t, err, graph.ErrAttr)
	var oe *graph.OpError
	require.True(t, errors.As(err, &oe), "got %v", err)
	assert.Equal(t, "embedding", oe.Op)
	t.Log(err)

	logits := lazy.Wrap(testutil.UniformF32(rand.New(rand.NewPCG(49, 50)), 3, 4), 0)
	labels := logits.Graph().Wrap(tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{1, 4, 0})), 0)
	loss := logits.CrossEntropy(labels, graph.ReduceMean)
	require.NoError(t, loss.Err())
	_, err = e.Run(ctx, loss.Graph().IR(), loss.ID())
	require.ErrorIs(t, err, graph.ErrAttr)
	require.True(t, errors.As(err, &oe), "got %v", err)
	assert.Equal(t, "cross_entropy", oe.Op)

	// With 3 classes of 4 columns (Attrs.End), label 3 is out of range.
	labels = logits.Graph().Wrap(tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{1, 3, 0})), 0)
	loss = logits.CrossEntropyClasses(labels, 3, graph.ReduceMean)
	require.NoError(t, loss.Err())
	_, err = e.Run(ctx, loss.Graph().IR(), loss.ID())
	require.ErrorIs(t, err, graph.ErrAttr)
	var re *exec.RowError
	require.True(t, errors.As(err, &re), "got %v", err)
	assert.Equal(t, int64(3), re.Value)
	assert.Equal(t, 3, re.Limit, "labels must be below the class count")
}

// TestWorkspaceMissing: a program compiled without cuda.Workspace is
// refused where a kernel needs scratch memory, with ErrWorkspace.
func TestWorkspaceMissing(t *testing.T) {
	e := executor(t)
	logits := lazy.Wrap(testutil.UniformF32(rand.New(rand.NewPCG(51, 52)), 3, 4), 0)
	labels := logits.Graph().Wrap(tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{1, 2, 0})), 0)
	loss := logits.CrossEntropy(labels, graph.ReduceMean)
	require.NoError(t, loss.Err())
	g := loss.Graph().IR()
	info, err := shapeinfer.Analyze(g, loss.ID())
	require.NoError(t, err)
	p, err := planner.Compile(g, info, []int{loss.ID()}, planner.CompileOptions{})
	require.NoError(t, err)
	_, err = e.Execute(context.Background(), p, planner.Chunks(3, 1), cuda.ExecOptions{})
	require.ErrorIs(t, err, cuda.ErrWorkspace)
}

// TestExecutorClosed: Execute after Close fails with ErrClosed, and Close
// gives every byte back.
func TestExecutorClosed(t *testing.T) {
	e, err := cuda.NewExecutor(device(t), cuda.ExecutorOptions{})
	require.NoError(t, err)
	loss, params := testutil.MLPModel(8, 4, false).Build(rand.New(rand.NewPCG(53, 54)), 6)
	p := stepProgram(t, loss, params, 2)
	_, err = e.Execute(context.Background(), p, planner.Chunks(6, 2), cuda.ExecOptions{Resident: true, Optimizer: optim.NewAdam(1e-3)})
	require.NoError(t, err)
	require.NoError(t, e.Close())
	require.NoError(t, e.Close())
	st := e.Allocator().Stats()
	assert.Zero(t, st.AllocatedBytes[alloc.All].Current)
	assert.Zero(t, st.ReservedBytes[alloc.All].Current)
	_, err = e.Execute(context.Background(), p, planner.Chunks(6, 1), cuda.ExecOptions{})
	assert.ErrorIs(t, err, cuda.ErrClosed)
}

// TestSplitReductions: reductions with few outputs over a long batch run as
// split partial reductions and a second pass (sum, mean and max over
// 16384 rows into 4 outputs, the bias-like gradient of layer_norm, and
// layer_norm_grad_w's column sums), checked against the float64 reference
// interpreter.
//
// Tolerance: the partials are rounded to float32 before the second pass,
// about 6e-8 of each partial (sums of up to 4096 values in [−1, 1), so
// |partial| ≲ 100): rtol 1e-5 and atol 1e-4 bound it with room.
func TestSplitReductions(t *testing.T) {
	const rows = 16384
	x := lazy.Placeholder([]int{rows, 4}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{4}, graph.Float32, "w")
	b := lazy.ParamSpec([]int{4}, graph.Float32, "b")
	ln := x.LayerNorm(w, b, 1, 1e-5)
	loss := ln.Mul(ln).Sum()
	grads := lazy.Grad(loss, w, b)
	outs := []*lazy.Tensor{x.Sum(0), x.Mean(0), x.Max(0), grads[0], grads[1]}
	ids := make([]int, len(outs))
	for i, o := range outs {
		require.NoError(t, o.Err())
		ids[i] = o.ID()
	}
	g := x.Graph().IR()
	rng := rand.New(rand.NewPCG(55, 56))
	feeds := map[int]ref.Value{}
	for _, s := range []struct {
		id    int
		shape []int
	}{{x.ID(), []int{rows, 4}}, {g.NodeNamed("w"), []int{4}}, {g.NodeNamed("b"), []int{4}}} {
		v := ref.Zeros(s.shape...)
		for i := range v.Data {
			v.Data[i] = rng.Float64()*2 - 1
		}
		feeds[s.id] = v
	}
	want, err := ref.Eval(g, feeds, ids...)
	require.NoError(t, err)
	got, err := runOn(executor(t))(g, feeds, ids...)
	require.NoError(t, err)
	for k := range ids {
		for i, wv := range want[k].Data {
			assert.InDelta(t, wv, got[k].Data[i], 1e-4+1e-5*math.Abs(wv), "output %d (%s) element %d", k, g.Node(ids[k]).Op, i)
		}
	}
}

// doubler is an exec.Reducer for one rank that "sums" by doubling: it
// records what Add hands over, and Wait doubles every buffer in place, as
// an all-reduce over two identical ranks would.
type doubler struct {
	d      *cuda.Device
	bufs   []alloc.Ptr
	counts []int64
	waits  int
}

func (r *doubler) Add(buf alloc.Ptr, count int64) error {
	r.bufs, r.counts = append(r.bufs, buf), append(r.counts, count)
	return nil
}

func (r *doubler) Wait() error {
	r.waits++
	for i, p := range r.bufs {
		v := make([]float32, r.counts[i])
		if err := cuda.CopyDtoH(r.d, v, p); err != nil {
			return err
		}
		for j := range v {
			v[j] *= 2
		}
		if err := cuda.CopyHtoD(r.d, p, v); err != nil {
			return err
		}
	}
	return nil
}

// TestReduceSeesFinalGradients: ExecOptions.Reduce gets every kept
// gradient once, whole (its element count), in one chunk or several, and
// what Wait leaves in them is what the optimizer and the returned outputs
// see: with a reducer that doubles them, the gradients are exactly twice
// a plain run's and SGD (no momentum) at lr moves the parameters exactly
// as the plain run at 2·lr.
func TestReduceSeesFinalGradients(t *testing.T) {
	const n = 24
	ctx := context.Background()
	for _, chunks := range []int{1, 3} {
		t.Run(fmt.Sprintf("chunks=%d", chunks), func(t *testing.T) {
			e := freshExecutor(t, cuda.ExecutorOptions{})
			redModel, refModel := testutil.MLPModel(32, 16, false), testutil.MLPModel(32, 16, false)
			redRng, refRng := rand.New(rand.NewPCG(47, 48)), rand.New(rand.NewPCG(47, 48))

			loss, redParams := redModel.Build(redRng, n)
			p := stepProgram(t, loss, redParams, 0)
			r := &doubler{d: e.Device()}
			red, err := e.Execute(ctx, p, planner.Chunks(n, chunks), cuda.ExecOptions{Resident: true, Optimizer: optim.NewSGD(0.05, 0),
				SyncParams: true, Reduce: r})
			require.NoError(t, err)
			require.Equal(t, 1, r.waits)
			require.Len(t, r.bufs, len(p.Kept), "every gradient once")
			// In one chunk they come in the order backward makes them.
			var sizes []int64
			for _, id := range p.Kept {
				sizes = append(sizes, int64(p.Graph.Node(id).Type.Numel()))
			}
			require.ElementsMatch(t, sizes, r.counts, "the gradients' elements")

			loss, refParams := refModel.Build(refRng, n)
			ref, err := e.Execute(ctx, stepProgram(t, loss, refParams, 0), planner.Chunks(n, chunks),
				cuda.ExecOptions{Resident: true, Optimizer: optim.NewSGD(0.1, 0), SyncParams: true})
			require.NoError(t, err)
			require.Equal(t, scalarOf(t, ref.Outputs[0]), scalarOf(t, red.Outputs[0]), "loss")
			for i := 1; i < len(ref.Outputs); i++ {
				want := ref.Outputs[i].Float32s()
				got := red.Outputs[i].Float32s()
				for k := range want {
					require.Equal(t, 2*want[k], got[k], "gradient %d [%d]", i, k)
				}
			}
			want, got := hostParams(t, refParams), hostParams(t, redParams)
			for i := range want {
				require.Equal(t, want[i], got[i], "parameter %d", i)
			}
		})
	}
}

// TestResidentStepLeavesItsTailRunning: a resident step copies its loss
// to the host as soon as each chunk's forward pass has made it and
// returns with the rest of its kernels still queued; all that follows
// waits for them: the next step, the allocator giving its cache back to
// the driver, SyncParams. It trains bit for bit as steps that wait for
// every kernel (OpTime set), in two chunks and in one.
func TestResidentStepLeavesItsTailRunning(t *testing.T) {
	const steps, n = 4, 48
	ctx := context.Background()
	d := device(t)
	e := freshExecutor(t, cuda.ExecutorOptions{})
	leftModel, waitModel := testutil.MLPModel(256, 128, false), testutil.MLPModel(256, 128, false)
	leftRng, waitRng := rand.New(rand.NewPCG(47, 48)), rand.New(rand.NewPCG(47, 48))
	leftOpt, waitOpt := optim.NewAdam(1e-2), optim.NewAdam(1e-2)
	var leftParams, waitParams []*lazy.Tensor
	for step := range steps {
		chunks := 1 + step%2
		loss, params := leftModel.Build(leftRng, n)
		p := stepProgram(t, loss, params, leftOpt.StateSlots())
		reads := e.EarlyReads()
		lres, err := e.Execute(ctx, p, planner.Chunks(n, chunks), cuda.ExecOptions{Resident: true, Optimizer: leftOpt, KeptOnDevice: true})
		require.NoError(t, err, "step %d", step)
		require.True(t, d.TailPending(), "step %d returned without waiting for its last kernels", step)
		require.Equal(t, reads+int64(chunks), e.EarlyReads(), "step %d: each chunk's loss is read early", step)
		leftParams = params
		if step == 1 {
			before := e.Allocator().Stats().NumDeviceFree
			require.NoError(t, e.Allocator().EmptyCache())
			if e.Allocator().Stats().NumDeviceFree > before {
				require.False(t, d.TailPending(), "a segment given back waited for the kernels")
			}
		}

		loss, params = waitModel.Build(waitRng, n)
		p = stepProgram(t, loss, params, waitOpt.StateSlots())
		wres, err := e.Execute(ctx, p, planner.Chunks(n, chunks), cuda.ExecOptions{Resident: true, Optimizer: waitOpt, KeptOnDevice: true,
			OpTime: func(*graph.Node, planner.Chunk, time.Duration) {}})
		require.NoError(t, err, "step %d", step)
		require.False(t, d.TailPending(), "step %d with OpTime waited for its kernels", step)
		waitParams = params
		require.Equal(t, scalarOf(t, wres.Outputs[0]), scalarOf(t, lres.Outputs[0]), "step %d loss", step)
	}
	require.NoError(t, e.SyncParams())
	want, got := hostParams(t, waitParams), hostParams(t, leftParams)
	for i := range want {
		require.Equal(t, want[i], got[i], "parameter %s", leftParams[i].Name())
	}
}

// TestExecuteOnCallersThreads: Execute runs on its caller's thread with
// the context made current there, the device goroutine waiting. Two
// executors of one device trained from two goroutines at once, while a
// third keeps calling the device goroutine (MemInfo, Synchronize), train
// as they do one after the other, bit for bit.
func TestExecuteOnCallersThreads(t *testing.T) {
	const steps, n = 3, 32
	ctx := context.Background()
	d := device(t)
	train := func(e *cuda.Executor, seed uint64) ([]float32, error) {
		model := testutil.MLPModel(64, 32, false)
		rng := rand.New(rand.NewPCG(seed, seed+1))
		opt := optim.NewAdam(1e-2)
		var losses []float32
		for step := range steps {
			loss, params := model.Build(rng, n)
			p := stepProgram(t, loss, params, opt.StateSlots())
			res, err := e.Execute(ctx, p, planner.Chunks(n, 1+step%2), cuda.ExecOptions{Resident: true, Optimizer: opt, KeptOnDevice: true})
			if err != nil {
				return nil, err
			}
			losses = append(losses, res.Outputs[0].Float32s()...)
		}
		return losses, e.SyncParams()
	}
	ea, eb := freshExecutor(t, cuda.ExecutorOptions{}), freshExecutor(t, cuda.ExecutorOptions{})
	wantA, err := train(ea, 51)
	require.NoError(t, err)
	wantB, err := train(eb, 53)
	require.NoError(t, err)

	ea, eb = freshExecutor(t, cuda.ExecutorOptions{}), freshExecutor(t, cuda.ExecutorOptions{})
	var gotA, gotB []float32
	var errA, errB, errC error
	stop, caller := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(caller)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, _, err := d.Backend().MemInfo(); err != nil {
				errC = err
				return
			}
			if err := d.Synchronize(); err != nil {
				errC = err
				return
			}
		}
	}()
	var trainers sync.WaitGroup
	trainers.Add(2)
	go func() { defer trainers.Done(); gotA, errA = train(ea, 51) }()
	go func() { defer trainers.Done(); gotB, errB = train(eb, 53) }()
	trainers.Wait()
	close(stop)
	<-caller
	require.NoError(t, errA)
	require.NoError(t, errB)
	require.NoError(t, errC)
	assert.Equal(t, wantA, gotA)
	assert.Equal(t, wantB, gotB)
}
