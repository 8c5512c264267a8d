package batchfit_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// samePlan requires two plans to pick the same chunks with the same
// predicted peaks within the same budget.
func samePlan(t *testing.T, want, got *planner.Plan, msg string) {
	t.Helper()
	require.NotNil(t, want, msg)
	require.NotNil(t, got, msg)
	assert.Equal(t, want.Batch, got.Batch, msg)
	assert.Equal(t, want.Split, got.Split, msg)
	assert.Equal(t, want.PeakReserved, got.PeakReserved, msg)
	assert.Equal(t, want.PeakAllocated, got.PeakAllocated, msg)
	assert.Equal(t, want.Budget, got.Budget, msg)
	assert.Equal(t, want.Persistent, got.Persistent, msg)
}

// Plan is the plan Step runs: for each model and session configuration,
// the plan of a step built over the same data is the plan the next Step
// of that graph takes (chunks, peaks, budget), the recompute choice is the
// step's, and the CPU executor measures the planned peaks to the byte. It
// holds for a first step (nothing resident) and for a step after others
// (parameters and optimizer state resident).
func TestPlanIsStepsPlan(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name  string
		model testutil.TrainModel
		batch int
		opts  batchfit.Options
		opt   func() optim.Optimizer
	}{
		{"mlp chunked", mlpModel(false), 1000, batchfit.Options{Budget: 6 << 20}, func() optim.Optimizer { return optim.NewAdam(1e-3) }},
		{"mlp whole", mlpModel(false), 64, batchfit.Options{}, func() optim.Optimizer { return optim.NewSGD(0.1, 0.9) }},
		{"mlp micro-batch", mlpModel(true), 200, batchfit.Options{MaxChunk: 48}, func() optim.Optimizer { return optim.NewSGD(0.1, 0) }},
		{"gpt bf16-mixed", gptModel(512)(false), 40, batchfit.Options{Budget: 8 << 20, Precision: "bf16-mixed"}, func() optim.Optimizer { return optim.NewAdamW(1e-3) }},
		{"gpt fp16-mixed", fusedGPTModel(512)(false), 40, batchfit.Options{Budget: 8 << 20, Precision: "fp16-mixed"}, func() optim.Optimizer { return optim.NewAdam(1e-3) }},
		{"gpt recompute auto", fusedGPTModel(512)(false), 64, batchfit.Options{Budget: 6 << 20, Recompute: recompute.Auto}, func() optim.Optimizer { return optim.NewAdam(1e-3) }},
		{"gpt full checkpoint", gptModel(512)(false), 64, batchfit.Options{Budget: 6 << 20, Recompute: recompute.FullCheckpoint}, func() optim.Optimizer { return optim.NewAdam(1e-3) }},
		{"convnet chunked", convModel(32)(false), 40, batchfit.Options{Budget: 4 << 20}, func() optim.Optimizer { return optim.NewAdam(1e-3) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := c.opts
			opts.Device = batchfit.DeviceCPU
			sess := batchfit.NewSession(opts)
			require.NoError(t, sess.Err())
			defer sess.Close()
			opt := c.opt()
			for step := range 3 {
				seed := uint64(10 + step)
				loss, params := c.model.Build(rand.New(rand.NewPCG(seed, 1)), c.batch)
				sp, err := sess.Plan(loss, params, opt)
				require.NoError(t, err, "step %d", step)
				require.NotNil(t, sp.Plan)
				assert.Nil(t, sp.Plan.Chunks, "a plan lists no chunks")
				assert.NotEmpty(t, sp.Plan.Timeline, "the timeline of the first chunk")
				for _, nd := range sp.Program.Graph.Nodes() {
					require.Nil(t, nd.Value, "the plan's graph holds no data (node %d)", nd.ID)
				}

				loss, params = c.model.Build(rand.New(rand.NewPCG(seed, 1)), c.batch)
				_, err = sess.Step(ctx, loss, params, opt)
				require.NoError(t, err, "step %d", step)
				samePlan(t, sess.LastPlan(), sp.Plan, c.name)
				assert.Equal(t, sess.LastRecompute(), sp.Recompute)
				assert.Equal(t, sess.LastProgram().Signature(), sp.Program.Signature())
				u := sess.LastUsage()
				assert.Equal(t, sp.Plan.PeakReserved, u.PeakReserved, "predicted = measured, step %d", step)
				assert.Equal(t, sp.Plan.PeakAllocated, u.PeakAllocated, "predicted = measured, step %d", step)
			}
			if c.opts.Recompute == recompute.FullCheckpoint {
				assert.NotEqual(t, "none", sess.LastRecompute().Strategy, "a recompute transform ran")
			}
		})
	}
}

// Plan runs nothing: parameters, optimizer state and the allocator are as
// they were, on a fresh session and after a step.
func TestPlanRunsNothing(t *testing.T) {
	model := mlpModel(false)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 6 << 20})
	defer sess.Close()
	opt := optim.NewAdam(1e-3)
	rng := rand.New(rand.NewPCG(1, 2))

	snapshot := func(params []*lazy.Tensor) [][]float32 {
		var s [][]float32
		for _, p := range params {
			s = append(s, slices.Clone(testutil.Float32s(t, p.Value().(*tensor.Dense))))
		}
		return s
	}
	loss, params := model.Build(rng, 1000)
	before := snapshot(params)
	_, err := sess.Plan(loss, params, opt)
	require.NoError(t, err)
	assert.Equal(t, before, snapshot(params))
	assert.Zero(t, sess.Allocator().Stats().ReservedBytes[alloc.All].Peak, "nothing was allocated")
	assert.Zero(t, opt.Steps(), "the optimizer did not step")
	assert.Nil(t, sess.LastPlan(), "LastPlan is a run's")

	loss, params = model.Build(rng, 1000)
	_, err = sess.Step(context.Background(), loss, params, opt)
	require.NoError(t, err)
	after := snapshot(params)
	st := sess.Allocator().Stats()
	last := sess.LastPlan()
	loss, params = model.Build(rng, 1000)
	_, err = sess.Plan(loss, params, opt)
	require.NoError(t, err)
	assert.Equal(t, after, snapshot(params))
	assert.Equal(t, st.ReservedBytes, sess.Allocator().Stats().ReservedBytes)
	assert.Equal(t, st.AllocatedBytes, sess.Allocator().Stats().AllocatedBytes)
	assert.Equal(t, 1, opt.Steps())
	assert.Same(t, last, sess.LastPlan())
}

// A constant the planned graph does not read is planned as released (the
// run would free it first) but stays resident: Plan frees nothing.
func TestPlanCountsReleaseWithoutReleasing(t *testing.T) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	w := lazy.Param(testutil.UniformF32(rng, 64, 64), "w")
	build := func(k *lazy.Tensor) *lazy.Tensor {
		x := lazy.Wrap(testutil.UniformF32(rng, 32, 64), 0)
		h := x.MatMul(w)
		if k != nil {
			h = h.Mul(k)
		}
		return h.Mul(h).Mean()
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	opt := optim.NewSGD(0.1, 0)
	// A step with a large constant leaves it resident.
	_, err := sess.Step(ctx, build(lazy.Const(testutil.UniformF32(rng, 32, 64))), []*lazy.Tensor{w}, opt)
	require.NoError(t, err)
	held := sess.Allocator().Stats().AllocatedBytes[alloc.All].Current

	sp, err := sess.Plan(build(nil), []*lazy.Tensor{w}, opt)
	require.NoError(t, err)
	assert.Equal(t, held, sess.Allocator().Stats().AllocatedBytes[alloc.All].Current, "the constant stays resident")
	_, err = sess.Step(ctx, build(nil), []*lazy.Tensor{w}, opt)
	require.NoError(t, err)
	samePlan(t, sess.LastPlan(), sp.Plan, "planned as the run that released the constant")
	assert.Less(t, sess.Allocator().Stats().AllocatedBytes[alloc.All].Current, held, "the run released it")
}

// Plan needs no data: a shape-only model plans as the model with data
// does, and Step refuses it.
func TestPlanShapeOnly(t *testing.T) {
	cfg := []int{784, 64, 64, 10}
	build := func(opt nn.Options, n int, data bool) (*lazy.Tensor, []*lazy.Tensor) {
		m := nn.MLP(opt, cfg, nn.ReLU{})
		var x, y *lazy.Tensor
		if data {
			rng := rand.New(rand.NewPCG(5, 6))
			x = lazy.Wrap(testutil.UniformF32(rng, n, 784), 0)
			y = x.Graph().Wrap(testutil.Classes(rng, 10, n), 0)
		} else {
			x = lazy.Placeholder([]int{n, 784}, graph.Float32, 0)
			y = x.Graph().Placeholder([]int{n}, graph.Int64, 0)
		}
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}
	plan := func(opt nn.Options, data bool) *batchfit.StepPlan {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 6 << 20})
		defer sess.Close()
		loss, params := build(opt, 1000, data)
		sp, err := sess.Plan(loss, params, optim.NewAdam(1e-3))
		require.NoError(t, err)
		return sp
	}
	real, shape := plan(nn.Seed(1), true), plan(nn.Options{ShapeOnly: true}, false)
	samePlan(t, real.Plan, shape.Plan, "shape-only")
	assert.Greater(t, shape.Plan.Split.Len(), 1, "the budget makes chunks")

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	loss, params := build(nn.Options{ShapeOnly: true}, 8, false)
	_, err := sess.Step(context.Background(), loss, params, optim.NewAdam(1e-3))
	require.ErrorIs(t, err, graph.ErrNoData)
}

// A step that does not fit: Plan returns the compiled step and the
// planner's typed error.
func TestPlanDoesNotFit(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 512 << 10})
	defer sess.Close()
	loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(1, 1)), 100)
	sp, err := sess.Plan(loss, params, optim.NewAdam(1e-3))
	require.ErrorIs(t, err, planner.ErrDoesNotFit)
	var dnf *planner.DoesNotFitError
	require.ErrorAs(t, err, &dnf)
	assert.Greater(t, dnf.Fixed, dnf.Available, "the parameters and Adam's state alone are more than 512 KiB")
	require.NotNil(t, sp)
	assert.Nil(t, sp.Plan)
	assert.NotNil(t, sp.Program)
	assert.NotNil(t, sp.Search.Graph)
}

// Plan's errors: a session without an executor, a closed one, a graph
// with an error, a nil optimizer.
func TestPlanErrors(t *testing.T) {
	loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(1, 1)), 8)

	bad := batchfit.NewSession(batchfit.Options{Device: "tpu"})
	_, err := bad.Plan(loss, params, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, graph.ErrAttr)
	_, err = bad.PlanEval(loss)
	require.ErrorIs(t, err, graph.ErrAttr)

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	_, err = sess.Plan(loss, params, nil)
	require.ErrorIs(t, err, graph.ErrNilTensor)
	_, err = sess.Plan(lazy.ErrorTensor("model", graph.ErrShape), params, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, graph.ErrShape)
	_, err = sess.Plan(loss, append(params, params[0]), optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, batchfit.ErrDuplicateParam)
	require.NoError(t, sess.Close())
	_, err = sess.Plan(loss, params, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, batchfit.ErrClosed)
}

// PlanEval is the plan Eval runs.
func TestPlanEvalIsEvalsPlan(t *testing.T) {
	for _, pol := range []string{"fp32", "bf16-mixed"} {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 3 << 20, Precision: pol})
		rng := rand.New(rand.NewPCG(7, 8))
		m := nn.MLP(nn.Seed(1), []int{784, 256, 10}, nn.ReLU{})
		data := testutil.UniformF32(rng, 2000, 784)
		sp, err := sess.PlanEval(m.Forward(lazy.Wrap(data, 0)))
		require.NoError(t, err, pol)
		_, err = sess.Eval(context.Background(), m.Forward(lazy.Wrap(data, 0)))
		require.NoError(t, err, pol)
		samePlan(t, sess.LastPlan(), sp.Plan, pol)
		assert.Greater(t, sp.Plan.Split.Len(), 1, "%s: the budget makes chunks", pol)
		assert.Equal(t, sess.LastUsage().PeakReserved, sp.Plan.PeakReserved, pol)
		require.NoError(t, sess.Close())
	}
}

// A dry-run session plans as a session on the device it describes: with
// the CPU's workspaces and a budget, as a CPU session of that budget;
// with Overhead, within Budget − Overhead. It runs nothing.
func TestDryRun(t *testing.T) {
	model := fusedGPTModel(512)(false)
	plan := func(o batchfit.Options) *planner.Plan {
		sess := batchfit.NewSession(o)
		require.NoError(t, sess.Err())
		defer sess.Close()
		loss, params := model.Build(rand.New(rand.NewPCG(9, 9)), 48)
		sp, err := sess.Plan(loss, params, optim.NewAdam(1e-3))
		require.NoError(t, err)
		return sp.Plan
	}
	// The head and loss unfused: the small GPT's logits make the budget chunk it.
	cpuPlan := plan(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 8 << 20, NoFusedLoss: true})
	require.Greater(t, cpuPlan.Split.Len(), 1)
	samePlan(t, cpuPlan, plan(batchfit.Options{Budget: 8 << 20, DryRun: &batchfit.DryRun{}, NoFusedLoss: true}), "dry run")
	samePlan(t, cpuPlan, plan(batchfit.Options{Budget: 9 << 20, DryRun: &batchfit.DryRun{Workspace: cpu.Workspace, Overhead: 1 << 20}, NoFusedLoss: true}),
		"dry run with overhead")

	sess := batchfit.NewSession(batchfit.Options{DryRun: &batchfit.DryRun{}})
	require.NoError(t, sess.Err())
	assert.Contains(t, sess.Device(), "dry run")
	loss, params := model.Build(rand.New(rand.NewPCG(9, 9)), 8)
	_, err := sess.Step(context.Background(), loss, params, optim.NewAdam(1e-3))
	require.ErrorIs(t, err, batchfit.ErrDryRun)
	loss, _ = model.Build(rand.New(rand.NewPCG(9, 9)), 8)
	_, err = sess.Eval(context.Background(), loss)
	require.ErrorIs(t, err, batchfit.ErrDryRun)

	for _, d := range []batchfit.Options{
		{Budget: 1 << 20, DryRun: &batchfit.DryRun{Overhead: 1 << 20}},
		{DryRun: &batchfit.DryRun{Overhead: -1}},
	} {
		require.ErrorIs(t, batchfit.NewSession(d).Err(), planner.ErrBudget)
	}
}

// MaxBatch's answer is exact: a real step at the batch it found runs in
// one chunk, and one sample more runs in chunks; the target's plan is the
// plan Step runs it in.
func TestMaxBatchIsExact(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name  string
		model testutil.TrainModel
		opts  batchfit.Options
	}{
		{"mlp", mlpModel(false), batchfit.Options{Budget: 6 << 20}},
		{"gpt bf16-mixed", fusedGPTModel(512)(false), batchfit.Options{Budget: 8 << 20, Precision: "bf16-mixed"}},
		{"convnet", convModel(32)(false), batchfit.Options{Budget: 4 << 20}},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := c.opts
			opts.Device = batchfit.DeviceCPU
			rng := rand.New(rand.NewPCG(11, 12))
			build := func(n int) (*lazy.Tensor, []*lazy.Tensor) { return c.model.Build(rng, n) }
			search := batchfit.NewSession(opts)
			defer search.Close()
			const target = 500
			fit, err := search.MaxBatch(build, optim.NewAdam(1e-3), batchfit.MaxBatchOptions{Limit: 4096, Target: target})
			require.NoError(t, err)
			t.Logf("%s: largest one-chunk batch %d (%d plans); %d runs as %s", c.name, fit.Batch, fit.Plans, target, fit.Target.Plan.Split)
			require.Greater(t, fit.Batch, 1)
			require.Less(t, fit.Batch, target, "the target needs chunks")
			assert.False(t, fit.AtLimit)
			assert.Equal(t, fit.Batch, fit.Plan.Plan.Batch)
			assert.Equal(t, 1, fit.Plan.Plan.Split.Len())
			assert.LessOrEqual(t, fit.Plans, 2*bitsLen(fit.Batch)+3)

			run := func(n int) *planner.Plan {
				sess := batchfit.NewSession(opts)
				defer sess.Close()
				loss, params := c.model.Build(rng, n)
				_, err := sess.Step(ctx, loss, params, optim.NewAdam(1e-3))
				require.NoError(t, err, "batch %d", n)
				require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved)
				return sess.LastPlan()
			}
			samePlan(t, run(fit.Batch), fit.Plan.Plan, "the found batch")
			assert.Greater(t, run(fit.Batch+1).Split.Len(), 1, "one sample more needs chunks")
			samePlan(t, run(target), fit.Target.Plan, "the target")
		})
	}
}

// bitsLen is the number of bits of n.
func bitsLen(n int) int {
	k := 0
	for ; n > 0; n >>= 1 {
		k++
	}
	return k
}

// MaxBatch at its limit, with nothing fitting, and its errors.
func TestMaxBatchEdges(t *testing.T) {
	m := nn.MLP(nn.Options{ShapeOnly: true}, []int{16, 16, 4}, nn.ReLU{})
	params := nn.ParamTensors(m)
	build := func(n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Placeholder([]int{n, 16}, graph.Float32, 0)
		y := x.Graph().Placeholder([]int{n}, graph.Int64, 0)
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), params
	}
	opt := optim.NewSGD(0.1, 0)
	sess := batchfit.NewSession(batchfit.Options{DryRun: &batchfit.DryRun{}})
	defer sess.Close()
	fit, err := sess.MaxBatch(build, opt, batchfit.MaxBatchOptions{Limit: 100, Target: 100})
	require.NoError(t, err)
	assert.Equal(t, 100, fit.Batch, "everything fits an unlimited device")
	assert.True(t, fit.AtLimit)
	assert.Same(t, fit.Plan, fit.Target)
	assert.Equal(t, 8, fit.Plans, "1, 2, 4, …, 64, then the limit")

	tiny := batchfit.NewSession(batchfit.Options{DryRun: &batchfit.DryRun{}, Budget: 1 << 10})
	defer tiny.Close()
	fit, err = tiny.MaxBatch(build, opt, batchfit.MaxBatchOptions{Limit: 100})
	require.NoError(t, err)
	assert.Zero(t, fit.Batch, "not even one sample fits 1 KiB")
	assert.Nil(t, fit.Plan)
	fit, err = tiny.MaxBatch(build, opt, batchfit.MaxBatchOptions{Limit: 100, Target: 10})
	require.ErrorIs(t, err, planner.ErrDoesNotFit)
	require.NotNil(t, fit)
	assert.Nil(t, fit.Target)

	_, err = sess.MaxBatch(nil, opt, batchfit.MaxBatchOptions{})
	require.ErrorIs(t, err, graph.ErrNilTensor)
	_, err = sess.MaxBatch(build, opt, batchfit.MaxBatchOptions{Limit: -1})
	require.ErrorIs(t, err, graph.ErrShape)
	_, err = sess.MaxBatch(func(int) (*lazy.Tensor, []*lazy.Tensor) { return lazy.ErrorTensor("build", graph.ErrAttr), nil }, opt, batchfit.MaxBatchOptions{})
	require.ErrorIs(t, err, graph.ErrAttr)
	_, err = sess.MaxBatch(func(int) (*lazy.Tensor, []*lazy.Tensor) { return build(7) }, opt, batchfit.MaxBatchOptions{Limit: 16})
	require.ErrorIs(t, err, graph.ErrShape, "a builder that ignores the batch")
}
