package batchfit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"weak"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// wideModel is 784 → 512 → 10: the first weight (1.6 MB) and each of
// Adam's two state tensors for it take a large block of their own.
func wideModel() testutil.TrainModel {
	opt := nn.Seed(31)
	m := nn.NewSequential(nn.NewLinear(opt, 784, 512, true), nn.ReLU{}, nn.NewLinear(opt, 512, 10, true))
	return testutil.TrainModel{Name: "wide", Build: func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Wrap(testutil.UniformF32(rng, n, 784), 0)
		y := x.Graph().Wrap(testutil.Classes(rng, 10, n), 0)
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}}
}

// evalProgram compiles the graph of out alone, as Session.Eval does.
func evalProgram(t *testing.T, out *lazy.Tensor) *planner.Program {
	t.Helper()
	g := out.Graph().IR()
	info, err := shapeinfer.Analyze(g, out.ID())
	require.NoError(t, err)
	p, err := planner.Compile(g, info, []int{out.ID()}, planner.CompileOptions{Workspace: cpu.Workspace})
	require.NoError(t, err)
	return p
}

// After training steps, an evaluation in the same session
// is planned on a device that holds the optimizer state Step left
// resident, so it fits wherever a fresh session's does (in more chunks if
// need be) and its peaks are measured as predicted, to the byte.
func TestEvalAfterStepCountsResidentState(t *testing.T) {
	const n = 512
	m := wideModel()
	rng := rand.New(rand.NewPCG(81, 82))
	loss, _ := m.Build(rng, n)
	budgets := testutil.TightBudgets(t, evalProgram(t, loss))
	for _, chunks := range []int{1, 2} {
		budget, ok := budgets[chunks]
		require.True(t, ok, "a fresh Eval runs in %d chunks at some budget", chunks)
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget})
		opt := optim.NewAdam(1e-3)
		for step := range 2 {
			loss, params := m.Build(rng, n)
			_, err := sess.Step(context.Background(), loss, params, opt)
			require.NoError(t, err, "budget %d: step %d", budget, step)
			require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved, "budget %d: step %d", budget, step)
			loss, _ = m.Build(rng, n)
			_, err = sess.Eval(context.Background(), loss)
			require.NoError(t, err, "budget %d: eval after step %d, where a fresh session's runs", budget, step)
			pl, used := sess.LastPlan(), sess.LastUsage()
			require.Equal(t, pl.PeakReserved, used.PeakReserved, "budget %d: eval after step %d: reserved", budget, step)
			require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "budget %d: eval after step %d: allocated", budget, step)
		}
		require.NoError(t, sess.Close())
	}
}

// mixedModel is wideModel after a mixing matrix made anew by every build
// (a 784 × 784 constant, 2.4 MB), as a loop that draws a random projection
// per step makes it.
func mixedModel() testutil.TrainModel {
	opt := nn.Seed(41)
	m := nn.NewSequential(nn.NewLinear(opt, 784, 512, true), nn.ReLU{}, nn.NewLinear(opt, 512, 10, true))
	return testutil.TrainModel{Name: "mixed", Build: func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Wrap(testutil.UniformF32(rng, n, 784), 0)
		y := x.Graph().Wrap(testutil.Classes(rng, 10, n), 0)
		mix := lazy.Const(testutil.UniformF32(rng, 784, 784))
		return m.Forward(x.MatMul(mix)).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}}
}

// A constant made every step is released by the next
// step, which does not read it: allocated bytes after every step are the
// first step's, reserved bytes stay flat, and a loop under a budget keeps
// running with its peaks measured as planned.
func TestConstantPerStepIsReleased(t *testing.T) {
	const n, steps = 256, 12
	m := mixedModel()
	rng := rand.New(rand.NewPCG(83, 84))
	loss, params := m.Build(rng, n)
	budgets := testutil.TightBudgets(t, stepProgram(t, loss, params, 2))
	budget, ok := budgets[2]
	require.True(t, ok, "the step runs in 2 chunks at some budget")
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget})
	opt := optim.NewAdam(1e-3)
	var allocated, reserved int64
	for step := range steps {
		loss, params := m.Build(rng, n)
		_, err := sess.Step(context.Background(), loss, params, opt)
		require.NoError(t, err, "step %d", step)
		require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved, "step %d", step)
		require.Equal(t, sess.LastPlan().PeakAllocated, sess.LastUsage().PeakAllocated, "step %d", step)
		st := sess.Allocator().Stats()
		if step == 0 {
			allocated, reserved = st.AllocatedBytes[alloc.All].Current, st.ReservedBytes[alloc.All].Current
			continue
		}
		require.Equal(t, allocated, st.AllocatedBytes[alloc.All].Current, "step %d: allocated bytes grew", step)
		require.Equal(t, reserved, st.ReservedBytes[alloc.All].Current, "step %d: reserved bytes moved", step)
	}
	require.NoError(t, sess.Close())
}

// With a new batch size every step (a short last batch,
// sequence-length buckets), nothing the session caches keeps a step's
// data: every input of an earlier step is garbage once the step is over,
// and the caches hold at most planner.CacheSize entries.
func TestVariableShapesPinNoData(t *testing.T) {
	const shapes = planner.CacheSize + 6
	opt := nn.Seed(43)
	m := nn.NewSequential(nn.NewLinear(opt, 64, 32, true), nn.ReLU{}, nn.NewLinear(opt, 32, 4, true))
	rng := rand.New(rand.NewPCG(85, 86))
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 64 << 20})
	sgd := optim.NewSGD(1e-2, 0)
	var inputs []weak.Pointer[tensor.Dense]
	for n := 1; n <= shapes; n++ {
		xd := testutil.UniformF32(rng, n, 64)
		inputs = append(inputs, weak.Make(xd))
		x := lazy.Wrap(xd, 0)
		y := x.Graph().Wrap(testutil.Classes(rng, 4, n), 0)
		loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
		_, err := sess.Step(context.Background(), loss, nn.ParamTensors(m), sgd)
		require.NoError(t, err, "batch %d", n)
		if n%2 == 0 { // and an evaluation of a batch of the same size
			_, err = sess.Eval(context.Background(), m.Forward(lazy.Wrap(testutil.UniformF32(rng, n, 64), 0)))
			require.NoError(t, err, "eval of batch %d", n)
		}
	}
	// The last Eval's graph stays reachable through LastProgram; every
	// Step's input is garbage.
	runtime.GC()
	for i, p := range inputs {
		require.True(t, p.Value() == nil, "the input of batch %d is still reachable", i+1)
	}
	require.Equal(t, planner.CacheSize, batchfit.CachedPrograms(sess), "programs cached")
	require.Equal(t, planner.CacheSize, batchfit.CachedPlans(sess), "plans cached")
	runtime.KeepAlive(sess)
}

// A closed session says so with ErrClosed; a parameter
// listed twice is a typed error; a parameter with no gradient path is left
// alone, as PyTorch skips parameters whose grad is None; an error inside a
// chunk names the samples of the caller's batch it came from.
func TestSessionContract(t *testing.T) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(87, 88))
	t.Run("closed", func(t *testing.T) {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		m := newMLP(rng)
		x, labels := batchOf(rng, batch)
		_, loss := m.loss(x, labels)
		_, err := sess.Step(ctx, loss, m.params, optim.NewSGD(0.1, 0))
		require.NoError(t, err)
		require.NoError(t, sess.Close())
		require.NoError(t, sess.Close(), "closing twice")
		_, loss = m.loss(x, labels)
		_, err = sess.Step(ctx, loss, m.params, optim.NewSGD(0.1, 0))
		require.ErrorIs(t, err, batchfit.ErrClosed)
		_, err = sess.Eval(ctx, loss)
		require.ErrorIs(t, err, batchfit.ErrClosed)
		require.ErrorIs(t, sess.Yield(), batchfit.ErrClosed)
		require.ErrorIs(t, sess.Restore(), batchfit.ErrClosed)
		require.ErrorIs(t, sess.SyncParams(), batchfit.ErrClosed)
	})
	t.Run("duplicate parameter", func(t *testing.T) {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		m := newMLP(rng)
		x, labels := batchOf(rng, batch)
		before := m.snapshot()
		_, loss := m.loss(x, labels)
		_, err := sess.Step(ctx, loss, append(slices.Clone(m.params), m.params[1]), optim.NewSGD(0.1, 0))
		require.ErrorIs(t, err, batchfit.ErrDuplicateParam)
		var oe *graph.OpError
		require.ErrorAs(t, err, &oe)
		// Two lazy tensors over one host tensor are the same parameter too.
		again := lazy.Param(m.params[0].Value(), "again")
		_, loss = m.loss(x, labels)
		_, err = sess.Step(ctx, loss, append(slices.Clone(m.params), again), optim.NewSGD(0.1, 0))
		require.ErrorIs(t, err, batchfit.ErrDuplicateParam)
		require.Equal(t, before, m.snapshot(), "a refused step updates nothing")
	})
	t.Run("no gradient path", func(t *testing.T) {
		for _, opt := range []optim.Optimizer{optim.NewAdamW(0.1), &optim.SGD{LR: 0.1, Momentum: 0.9, WeightDecay: 0.1}} {
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
			m := newMLP(rng)
			x, labels := batchOf(rng, batch)
			// Step 1 trains everything (momentum builds up); step 2's loss
			// does not read the second layer.
			_, loss := m.loss(x, labels)
			_, err := sess.Step(ctx, loss, m.params, opt)
			require.NoError(t, err)
			l2 := m.snapshot()[2:]
			hidden := lazy.Wrap(x, 0).Linear(m.params[0], m.params[1]).Tanh()
			_, err = sess.Step(ctx, hidden.Mul(hidden).Mean(), m.params, opt)
			require.NoError(t, err)
			require.Equal(t, l2, m.snapshot()[2:], "%s moved parameters without a gradient", opt.Name())
			require.NoError(t, sess.Close())
		}
	})
	t.Run("chunk error names the batch's samples", func(t *testing.T) {
		const n, bad = 2048, 1500
		m := nn.NewSequential(nn.NewLinear(nn.Seed(5), 784, 2048, true), nn.ReLU{}, nn.NewLinear(nn.Seed(6), 2048, 10, true))
		x := lazy.Wrap(testutil.UniformF32(rng, n, 784), 0)
		lab := testutil.Classes(rng, 10, n)
		lab.Int64s()[bad] = 10 // out of range
		loss := m.Forward(x).CrossEntropy(x.Graph().Wrap(lab, 0), graph.ReduceMean)
		prog := stepProgram(t, loss, nn.ParamTensors(m), 0)
		budgets := testutil.TightBudgets(t, prog)
		cs := testutil.Counts(budgets)
		require.Greater(t, len(cs), 1, "the step runs in several chunks at some budget")
		k := cs[1] // the fewest chunks but one
		pl, err := planner.Make(prog, planner.Options{Budget: budgets[k]})
		require.NoError(t, err)
		var want planner.Chunk
		for _, c := range pl.Chunks {
			if c.Start <= bad && bad < c.Start+c.Size {
				want = c
			}
		}
		require.NotZero(t, want.Start, "the bad label is past the first chunk")
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[k], NoFusedLoss: true}) // stepProgram's step
		_, err = sess.Step(ctx, loss, nn.ParamTensors(m), optim.NewSGD(0.1, 0))
		require.ErrorIs(t, err, graph.ErrAttr)
		var ce *exec.ChunkError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, want.Start, ce.Start, "the chunk's first sample in the caller's batch")
		require.Equal(t, want.Size, ce.Size)
	})
}

// A constant released from between residents that stay (one Eval and one
// Step shared it, and the Step's optimizer state came after it) is
// released all the same, and the runs after it are measured as planned.
func TestReleasedConstantBetweenResidents(t *testing.T) {
	const n = 256
	ctx := context.Background()
	opt := nn.Seed(45)
	m := nn.NewSequential(nn.NewLinear(opt, 784, 512, true), nn.ReLU{}, nn.NewLinear(opt, 512, 10, true))
	rng := rand.New(rand.NewPCG(89, 90))
	build := func(mix *lazy.Tensor) *lazy.Tensor {
		x := lazy.Wrap(testutil.UniformF32(rng, n, 784), 0)
		y := x.Graph().Wrap(testutil.Classes(rng, 10, n), 0)
		return m.Forward(x.MatMul(mix)).CrossEntropy(y, graph.ReduceMean)
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 256 << 20})
	adam := optim.NewAdam(1e-3)
	shared := lazy.Const(testutil.UniformF32(rng, 784, 784))
	check := func(what string) {
		t.Helper()
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, pl.PeakReserved, used.PeakReserved, "%s: reserved", what)
		require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "%s: allocated", what)
	}
	_, err := sess.Eval(ctx, build(shared)) // residents: parameters, shared
	require.NoError(t, err)
	check("eval")
	_, err = sess.Step(ctx, build(shared), nn.ParamTensors(m), adam) // + Adam's state
	require.NoError(t, err)
	check("step with the shared constant")
	var bytes int64
	for _, p := range nn.ParamTensors(m) {
		bytes += 3 * int64(4*graph.Numel(p.Shape())) // the parameter and Adam's two slots
	}
	for step := range 3 { // shared is released, then each step's own
		_, err = sess.Step(ctx, build(lazy.Const(testutil.UniformF32(rng, 784, 784))), nn.ParamTensors(m), adam)
		require.NoError(t, err)
		check(fmt.Sprint("step ", step))
		got := sess.Allocator().Stats().RequestedBytes[alloc.All].Current
		require.Equal(t, bytes+4*784*784, got, "step %d: parameters, state and one constant stay", step)
	}
}
