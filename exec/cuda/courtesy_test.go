package cuda_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// courtesyRun is what a training run leaves: the losses, the parameters'
// host tensors and every resident device buffer (parameters and Adam's
// state), as bits.
type courtesyRun struct {
	losses   []uint32
	params   [][]uint32
	resident [][]uint32
}

// trainYielding runs steps resident Adam steps of an MLP in the two chunks
// the planner picks at the tightest budget for them, on
// a fresh executor, the same data every call; before step yieldAt it calls
// between (nil: nothing). Every step's planned peak is the measured one.
func trainYielding(t *testing.T, steps, yieldAt int, between func(*cuda.Executor)) courtesyRun {
	t.Helper()
	const n = 512
	e := freshExecutor(t, cuda.ExecutorOptions{})
	m, rng := testutil.MLPModel(784, 256, false), rand.New(rand.NewPCG(91, 92))
	opt := optim.NewAdam(1e-2)
	var out courtesyRun
	var budget int64
	for step := range steps {
		if step == yieldAt && between != nil {
			between(e)
		}
		loss, params := m.Build(rng, n)
		p := stepProgram(t, loss, params, 2)
		if budget == 0 {
			budgets := testutil.TightBudgets(t, p)
			require.Contains(t, budgets, 2)
			budget = budgets[2]
		}
		pl, err := planner.Make(p, planner.Options{Budget: budget})
		require.NoError(t, err)
		require.Len(t, pl.Chunks, 2)
		res, err := e.Execute(context.Background(), p, pl.Chunks, cuda.ExecOptions{Resident: true, Optimizer: opt, SyncParams: true})
		require.NoError(t, err, "step %d", step)
		require.False(t, e.Yielded())
		require.Equal(t, pl.PeakReserved+e.Overhead(), res.Usage.PeakReserved, "step %d: planned peak reserved, measured", step)
		out.losses = append(out.losses, math.Float32bits(scalarOf(t, res.Outputs[0])))
		if step == steps-1 {
			for _, hp := range hostParams(t, params) {
				out.params = append(out.params, testutil.Bits(hp))
			}
		}
	}
	var err error
	out.resident, err = e.ResidentData()
	require.NoError(t, err)
	return out
}

// TestYieldRestoreContinuesTraining: an executor yields between Adam steps
// (its reserved bytes drop to the cuBLAS workspace's segment, Overhead),
// restores, and training goes on bit for bit as in a run that never
// yielded: losses, parameters and optimizer state.
func TestYieldRestoreContinuesTraining(t *testing.T) {
	const steps, yieldAt = 5, 2
	never := trainYielding(t, steps, yieldAt, nil)
	require.NotEmpty(t, never.resident)
	explicit := trainYielding(t, steps, yieldAt, func(e *cuda.Executor) {
		before := e.Allocator().Stats().ReservedBytes[alloc.All].Current
		require.NoError(t, e.Yield())
		require.True(t, e.Yielded())
		st := e.Allocator().Stats()
		t.Logf("reserved %d B before Yield, %d B after (Overhead %d B)", before, st.ReservedBytes[alloc.All].Current, e.Overhead())
		require.LessOrEqual(t, st.ReservedBytes[alloc.All].Current, e.Overhead(), "reserved while yielded")
		require.Equal(t, e.Overhead(), st.AllocatedBytes[alloc.All].Current, "allocated while yielded: the cuBLAS workspace")
		require.NoError(t, e.Yield(), "yielding twice is a no-op")
		require.NoError(t, e.Restore())
		require.False(t, e.Yielded())
		require.NoError(t, e.Restore(), "restoring twice is a no-op")
	})
	automatic := trainYielding(t, steps, yieldAt, func(e *cuda.Executor) {
		require.NoError(t, e.Yield()) // the next resident Execute restores
	})
	require.Equal(t, never, explicit, "Yield + Restore changed the training run")
	require.Equal(t, never, automatic, "Yield + the next step's restore changed the training run")
}
