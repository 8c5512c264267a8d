package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// Courtesy: a session yields its device memory between steps
// and takes it back, and training goes on as if it never had.

// trained is what a training run leaves: every parameter's values and
// Adam's two state tensors per parameter, as bits, and the losses.
type trained struct {
	params [][]uint32
	state  [][][]uint32
	losses []uint32
}

// requireEmptyDevice checks that a yielded session holds nothing, and that
// the simulated device has other bytes in use.
func requireEmptyDevice(t *testing.T, sess *batchfit.Session, other int64) {
	t.Helper()
	require.True(t, sess.Yielded())
	st := sess.Allocator().Stats()
	require.Zero(t, st.ReservedBytes[alloc.All].Current, "reserved while yielded")
	require.Zero(t, st.AllocatedBytes[alloc.All].Current, "allocated while yielded")
	require.Equal(t, other, sess.Allocator().Backend().(*alloc.SimBackend).Used(), "device bytes while yielded")
}

// courtesyBatch is large enough that a budget can split it.
const courtesyBatch = 500

// trainMLP runs steps Adam steps of the MLP on the same data every call,
// under a budget that splits the batch in chunks; before step yieldAt
// (every step but the first when yieldAt < 0) it calls between (nil:
// nothing). After every step the plan's peaks must be the measured ones.
func trainMLP(t *testing.T, budget int64, chunks, steps, yieldAt int, between func(*batchfit.Session)) trained {
	t.Helper()
	const n = courtesyBatch
	m, rng := mlpModel(false), rand.New(rand.NewPCG(73, 74))
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget})
	opt := optim.NewAdam(1e-2)
	var out trained
	var params []*lazy.Tensor
	for step := range steps {
		if between != nil && (step == yieldAt || (yieldAt < 0 && step > 0)) {
			between(sess)
		}
		var loss *lazy.Tensor
		loss, params = m.Build(rng, n)
		l, err := sess.Step(context.Background(), loss, params, opt)
		require.NoError(t, err, "step %d", step)
		require.False(t, sess.Yielded(), "step %d restored the memory", step)
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Len(t, pl.Chunks, chunks)
		require.Equal(t, pl.PeakReserved, used.PeakReserved, "step %d: reserved", step)
		require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "step %d: allocated", step)
		out.losses = append(out.losses, math.Float32bits(l))
	}
	for _, p := range params {
		d := p.Value().(*tensor.Dense).Float32s()
		out.params = append(out.params, testutil.Bits(d))
		st := opt.State(p.Value())
		require.Len(t, st, 2, "Adam keeps exp_avg and exp_avg_sq")
		out.state = append(out.state, [][]uint32{testutil.Bits(st[0]), testutil.Bits(st[1])})
	}
	return out
}

func TestYieldRestoreContinuesTraining(t *testing.T) {
	const steps, yieldAt = 5, 2
	loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(71, 72)), courtesyBatch)
	budgets := testutil.TightBudgets(t, stepProgram(t, loss, params, 2))
	require.Contains(t, budgets, 2)
	budget := budgets[2]

	never := trainMLP(t, budget, 2, steps, yieldAt, nil)
	explicit := trainMLP(t, budget, 2, steps, yieldAt, func(sess *batchfit.Session) {
		require.NoError(t, sess.Yield())
		requireEmptyDevice(t, sess, 0)
		require.NoError(t, sess.Yield(), "yielding twice is a no-op")
		requireEmptyDevice(t, sess, 0)
		require.NoError(t, sess.Restore())
		require.False(t, sess.Yielded())
		st := sess.Allocator().Stats()
		require.Equal(t, sess.LastPlan().Persistent, st.RequestedBytes[alloc.All].Current,
			"restored: parameters and optimizer state, nothing else")
		require.NoError(t, sess.Restore(), "restoring twice is a no-op")
	})
	yield := func(sess *batchfit.Session) {
		require.NoError(t, sess.Yield())
		requireEmptyDevice(t, sess, 0)
	}
	automatic := trainMLP(t, budget, 2, steps, yieldAt, yield)
	require.Equal(t, never, explicit, "yield + Restore changed the training run")
	require.Equal(t, never, automatic, "yield + the next step's restore changed the training run")

	// Yielding every step changes nothing either.
	every := trainMLP(t, budget, 2, steps, -1, yield)
	require.Equal(t, never, every)
}

// A Restore that finds the device taken fails with the allocator's typed
// error, holds nothing, and succeeds once the memory is free again.
func TestRestoreWhenTheDeviceIsTaken(t *testing.T) {
	loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(75, 76)), courtesyBatch)
	budgets := testutil.TightBudgets(t, stepProgram(t, loss, params, 2))
	budget := budgets[1]
	never := trainMLP(t, budget, 1, 3, 1, nil)
	got := trainMLP(t, budget, 1, 3, 1, func(sess *batchfit.Session) {
		require.NoError(t, sess.Yield())
		requireEmptyDevice(t, sess, 0)
		dev := sess.Allocator().Backend().(*alloc.SimBackend)
		free, _, err := dev.MemInfo()
		require.NoError(t, err)
		other, err := dev.Malloc(free) // another process takes the whole device
		require.NoError(t, err)
		err = sess.Restore()
		require.ErrorIs(t, err, alloc.ErrOutOfMemory)
		var oom *alloc.OOMError
		require.ErrorAs(t, err, &oom)
		requireEmptyDevice(t, sess, free)
		require.NoError(t, dev.Free(other))
		// The next step restores by itself.
	})
	require.Equal(t, never, got)
}

// Yield before any step, and Eval after a Yield.
func TestYieldBeforeStepsAndEval(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Yield())
	requireEmptyDevice(t, sess, 0)
	rng := rand.New(rand.NewPCG(77, 78))
	m := mlpModel(false)
	loss, params := m.Build(rng, 8)
	_, err := sess.Step(context.Background(), loss, params, optim.NewAdam(1e-3))
	require.NoError(t, err)
	require.False(t, sess.Yielded())

	loss, _ = m.Build(rng, 8)
	want, err := sess.Eval(context.Background(), loss)
	require.NoError(t, err)
	require.NoError(t, sess.Yield())
	requireEmptyDevice(t, sess, 0)
	got, err := sess.Eval(context.Background(), loss)
	require.NoError(t, err)
	require.False(t, sess.Yielded(), "Eval restored the memory")
	require.Equal(t, math.Float32bits(want[0].Data().(float32)), math.Float32bits(got[0].Data().(float32)))
	require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved)
}
