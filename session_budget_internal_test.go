package batchfit

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// sineBatch is n samples of in features, sin(i·freq) over the flattened
// index, and labels i mod 10: data no step can fit exactly, never zero.
func sineBatch(n, in int, freq float64) ([]float32, []int64) {
	data := make([]float32, n*in)
	labels := make([]int64, n)
	for i := range data {
		data[i] = float32(math.Sin(float64(i) * freq))
	}
	for i := range labels {
		labels[i] = int64(i % 10)
	}
	return data, labels
}

// withOverhead is a CPU executor holding a library workspace of its own
// outside every plan, as CUDA's cuBLAS workspace is.
type withOverhead struct {
	*cpu.Executor
	ws int64
}

func (w withOverhead) Overhead() int64 { return w.ws }

// Options.Budget is everything the session holds; the
// executor's overhead comes out of it, not on top. With a 32 MiB
// workspace held outside the plans, the allocator's reserved bytes stay
// within the budget at every step, and each step's measured peak is its
// plan's plus the workspace.
func TestBudgetIncludesOverhead(t *testing.T) {
	const budget, ws = 64 << 20, 32 << 20
	const n, in = 2048, 256
	data, labels := sineBatch(n, in, 0.29)
	sess := NewSession(Options{Device: DeviceCPU, Budget: budget})
	// A device larger than the budget, as a GPU is.
	e := cpu.NewOn(alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{}))
	blk, err := e.Allocator().Malloc(ws, alloc.Tag{Op: "library.workspace"})
	require.NoError(t, err)
	require.Equal(t, int64(ws), blk.Size(), "the workspace fills a segment of its own")
	sess.be = withOverhead{e, ws}
	require.Equal(t, int64(ws), sess.Overhead())
	model := nn.MLP(nn.Seed(4), []int{in, 1024, 10}, nn.ReLU{})
	opt := optim.NewAdam(1e-3)
	for step := range 3 {
		x := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(data)), 0)
		y := x.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(labels)), 0)
		_, err := sess.Step(context.Background(), model.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(model), opt)
		require.NoError(t, err, "step %d", step)
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, int64(budget-ws), pl.Budget, "step %d: the plan's budget is the rest", step)
		require.Greater(t, len(pl.Chunks), 1, "step %d: the budget makes it chunk", step)
		require.Equal(t, pl.PeakReserved+ws, used.PeakReserved, "step %d: measured = planned + overhead", step)
		require.LessOrEqual(t, sess.Allocator().Stats().ReservedBytes[alloc.All].Peak, int64(budget), "step %d: reserved within the budget", step)
	}
}

// A negative budget is a typed error, not "no limit".
func TestNegativeBudget(t *testing.T) {
	sess := NewSession(Options{Device: DeviceCPU, Budget: -1})
	require.ErrorIs(t, sess.Err(), planner.ErrBudget)
	_, err := sess.Eval(context.Background(), lazy.Wrap(tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]float32{1, 2, 3, 4})), 0).Tanh())
	require.ErrorIs(t, err, planner.ErrBudget)
}

// A budget that moves between steps, as the device's free memory does
// when the CUDA driver takes a few MiB for a captured graph, keeps the
// last plan while it provably gives the same one (Session.keptPlan): the
// same plan, no segment taken from or given back to the device, and the
// measured peak still the planned one. Growing keeps a one-chunk plan too.
// A budget that no longer holds twice the peak is planned again, and
// steps that chunk are not kept when the budget grows.
func TestMovingBudgetKeepsPlan(t *testing.T) {
	const n, in = 512, 256
	data, labels := sineBatch(n, in, 0.37)
	sim := alloc.NewSimBackend(1 << 30)
	e := cpu.NewOn(alloc.New(sim, alloc.Options{}))
	sess := NewSession(Options{Device: DeviceCPU})
	sess.be = e
	model := nn.MLP(nn.Seed(5), []int{in, 1024, 10}, nn.ReLU{})
	opt := optim.NewAdam(1e-3)
	step := func(what string) (*planner.Plan, alloc.Stats) {
		t.Helper()
		x := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(data)), 0)
		y := x.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(labels)), 0)
		_, err := sess.Step(context.Background(), model.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(model), opt)
		require.NoError(t, err, what)
		pl := sess.LastPlan()
		require.Equal(t, pl.PeakReserved, sess.LastUsage().PeakReserved, "%s: measured = planned", what)
		return pl, sess.Allocator().Stats()
	}
	step("first")
	pl, st := step("steady")
	require.Len(t, pl.Chunks, 1)

	// The driver takes 4 MiB outside the allocator: kept.
	drv, err := sim.Malloc(4 << 20)
	require.NoError(t, err)
	kept, st2 := step("4 MiB less")
	require.Same(t, pl, kept, "the plan is kept")
	require.Equal(t, st.NumDeviceAlloc, st2.NumDeviceAlloc, "no segment taken again")
	require.Equal(t, st.NumDeviceFree, st2.NumDeviceFree, "no segment given back")
	// And gives them back: one chunk, kept as the budget grows.
	require.NoError(t, sim.Free(drv))
	kept, st3 := step("4 MiB more")
	require.Same(t, pl, kept)
	require.Equal(t, st.NumDeviceAlloc, st3.NumDeviceAlloc)

	// Leave less than twice the peak: planned again at the new budget.
	free, _, err := sim.MemInfo()
	require.NoError(t, err)
	hog, err := sim.Malloc(free - pl.PeakReserved/2) // the budget counts the allocator's cache back in
	require.NoError(t, err)
	again, _ := step("tight")
	require.NotSame(t, pl, again, "planned again")
	budget, err := sess.budget()
	require.NoError(t, err)
	require.Equal(t, budget, again.Budget)
	require.NoError(t, sim.Free(hog))

	// The rule alone: a chunked plan is not kept when the budget grows, a
	// one-chunk plan is; neither below twice the peak.
	chunked := &planner.Plan{Batch: 8, Chunk: 4, PeakReserved: 10, Budget: 100}
	whole := &planner.Plan{Batch: 8, Chunk: 8, PeakReserved: 10, Budget: 100}
	require.False(t, samePlanAt(chunked, 100, 120))
	require.True(t, samePlanAt(chunked, 100, 90))
	require.True(t, samePlanAt(whole, 100, 120))
	require.True(t, samePlanAt(whole, 100, 20))
	require.False(t, samePlanAt(whole, 100, 19))
	require.False(t, samePlanAt(&planner.Plan{Batch: 8, Chunk: 8, PeakReserved: 60, Budget: 100}, 100, 130), "the plan's own budget held less than twice its peak")

}
