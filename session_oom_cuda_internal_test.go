package batchfit

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// newCUDASessionOrSkip returns a CUDA session, closed when the test ends,
// or skips without a GPU (fails when testutil.RequireGPUEnv is set).
func newCUDASessionOrSkip(t *testing.T) *Session {
	t.Helper()
	sess := NewSession(Options{Device: DeviceCUDA})
	testutil.SkipWithoutGPU(t, sess.Err(), cuda.ErrNoGPU)
	t.Cleanup(func() { require.NoError(t, sess.Close()) })
	return sess
}

// TestStepReplansWhenMemoryIsTakenCUDA is TestStepReplansWhenMemoryIsTaken
// on CUDA, with the memory taken by a cuMemAlloc outside the session's
// caching allocator, as another process would take it. Step 0 runs whole;
// the session then empties its cache, step 1 is planned whole within what
// the device gives, and between that plan and the run enough device memory
// is taken that the session's budget (free + reserved − Overhead) falls
// midway between the chunked step's need and the whole step's. The whole
// run hits OOM, the step is re-planned in at least two chunks and
// completes, and its parameters are those of an undisturbed session. The
// "cpu" subtest runs the same steps on the simulated device of the CPU
// executor, so the harness itself is checked without a GPU.
func TestStepReplansWhenMemoryIsTakenCUDA(t *testing.T) {
	t.Run("cuda", func(t *testing.T) {
		// 16384 samples through 256 → 1024 → 10: the activations (64 MiB per
		// hidden tensor) dwarf the parameters, so the chunked step needs far
		// less than the whole one and the taken memory leaves slack of tens
		// of MiB on either side of the budget.
		replanAfterTaking(t, func(t *testing.T) *Session { return newCUDASessionOrSkip(t) }, 16384)
	})
	t.Run("cpu", func(t *testing.T) {
		replanAfterTaking(t, func(*testing.T) *Session { return NewSession(Options{Device: DeviceCPU}) }, 2048)
	})
}

// replanAfterTaking trains two SGD steps of an MLP over n samples in a
// session from newSess, undisturbed and disturbed as the test above says,
// and compares them.
//
// Parameters are compared with rtol 1e-4 plus atol 1e-6: on CUDA the
// chunked step adds two partial gradient sums where the whole step sums
// once (different float32 rounding, about 1e-6 relative; momentum SGD
// carries it linearly), as TestSessionCUDAMatchesCPU holds CUDA to the CPU.
func replanAfterTaking(t *testing.T, newSess func(*testing.T) *Session, n int) {
	const in, hidden, classes = 256, 1024, 10
	rng := rand.New(rand.NewPCG(101, 102))
	data := make([]float32, n*in)
	for i := range data {
		data[i] = float32(rng.Float64()*2 - 1)
	}
	labels := make([]int64, n)
	for i := range labels {
		labels[i] = int64(rng.IntN(classes))
	}
	train := func(disturb bool) []*lazy.Tensor {
		sess := newSess(t)
		model := nn.MLP(nn.Seed(3), []int{in, hidden, classes}, nn.ReLU{})
		opt := optim.NewSGD(0.1, 0.9)
		for step := range 2 {
			var oomsBefore int64
			if step == 1 && disturb {
				oomsBefore = disturbBeforeRun(t, sess)
			}
			x := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(data)), 0)
			y := x.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(labels)), 0)
			loss := model.Forward(x).CrossEntropy(y, graph.ReduceMean)
			_, err := sess.Step(context.Background(), loss, nn.ParamTensors(model), opt)
			require.NoError(t, err, "step %d", step)
			pl, used := sess.LastPlan(), sess.LastUsage()
			t.Logf("disturbed %v, step %d: %d chunks of %d, budget %s, predicted peak reserved %s + overhead %s, measured %s",
				disturb, step, len(pl.Chunks), pl.Chunk, alloc.FormatBytes(pl.Budget), alloc.FormatBytes(pl.PeakReserved),
				alloc.FormatBytes(sess.Overhead()), alloc.FormatBytes(used.PeakReserved))
			if step == 1 && disturb {
				require.Nil(t, sess.beforeRun, "the hook ran")
				require.Equal(t, oomsBefore+1, sess.Allocator().Stats().NumOOMs, "the whole-batch run hit one OOM")
				require.GreaterOrEqual(t, len(pl.Chunks), 2, "after the memory was taken the step re-planned in chunks")
				// The session gives the failed run's cache back before it
				// re-plans, so the retry starts from the resident buffers
				// alone, as the plan's first simulated step does (for this
				// MLP both simulated steps peak alike): measured equals
				// predicted, and is within what the device had.
				require.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "the retried step's peak reserved, against the plan")
				require.LessOrEqual(t, used.PeakReserved, pl.Budget+sess.Overhead(), "the retried step's peak reserved, against the budget")
			} else {
				require.Len(t, pl.Chunks, 1, "disturbed %v, step %d runs whole", disturb, step)
			}
		}
		require.NoError(t, sess.SyncParams())
		return nn.ParamTensors(model)
	}
	calm := train(false)
	disturbed := train(true)
	require.Len(t, disturbed, len(calm))
	for i, p := range calm {
		want := p.Value().(*tensor.Dense).Float32s()
		got := disturbed[i].Value().(*tensor.Dense).Float32s()
		require.Len(t, got, len(want))
		for j := range want {
			if d := math.Abs(float64(got[j]) - float64(want[j])); d > 1e-6+1e-4*math.Abs(float64(want[j])) {
				require.Failf(t, "parameters differ", "%s[%d]: undisturbed %g, disturbed %g", p.Name(), j, want[j], got[j])
			}
		}
	}
}

// disturbBeforeRun prepares step 1 of a session whose step 0 ran whole:
// the session empties its cache (as empty_cache would), and a hook takes
// device memory through the allocator's Backend, outside the caching
// allocator, after the step is planned and before it runs. It returns the
// allocator's OOM count before the step; the taken memory is freed when
// the test ends, before the session closes.
//
// The session's retry budget is the device's free bytes less the driver
// reserve, plus what the allocator reserves, less Overhead; what the
// failed run leaves cached counts in both and cancels. So taking free −
// Reserve + reserved − Overhead − target leaves a retry budget of target (the device rounds the
// allocation to its pages, so a few MiB less), with target midway between
// what the step needs in chunks (planned within one byte less than the
// whole step's peak) and what it needs whole.
func disturbBeforeRun(t *testing.T, sess *Session) int64 {
	t.Helper()
	whole := sess.LastPlan()
	require.Len(t, whole.Chunks, 1)
	chunked, err := planner.Make(sess.LastProgram(), planner.Options{Budget: whole.PeakReserved - 1})
	require.NoError(t, err, "the step fits in chunks")
	require.GreaterOrEqual(t, len(chunked.Chunks), 2)
	slack := (whole.PeakReserved - chunked.PeakReserved) / 2
	require.GreaterOrEqual(t, slack, int64(8<<20), "the chunked step needs %s, the whole step %s: too close for a device's page rounding",
		alloc.FormatBytes(chunked.PeakReserved), alloc.FormatBytes(whole.PeakReserved))
	target := chunked.PeakReserved + slack
	t.Logf("whole step %s, %d chunks of %d %s: the retry budget is to be %s",
		alloc.FormatBytes(whole.PeakReserved), len(chunked.Chunks), chunked.Chunk,
		alloc.FormatBytes(chunked.PeakReserved), alloc.FormatBytes(target))

	a := sess.Allocator()
	require.NoError(t, a.EmptyCache())
	oomsBefore := a.Stats().NumOOMs
	be := a.Backend()
	sess.beforeRun = func() {
		sess.beforeRun = nil
		free, _, err := be.MemInfo()
		require.NoError(t, err)
		reserved := a.Stats().ReservedBytes[alloc.All].Current
		avail := free - sess.be.Reserve() + reserved - sess.Overhead()
		take := (avail - target) / alloc.RoundLarge * alloc.RoundLarge
		require.Positive(t, take, "the device gives %s, less than the whole step needs", alloc.FormatBytes(avail))
		p, err := be.Malloc(take)
		require.NoError(t, err, "take %s outside the caching allocator", alloc.FormatBytes(take))
		// Cleanups run last in first out: this one before the session's Close.
		t.Cleanup(func() { assert.NoError(t, be.Free(p), "give back the taken memory") })
		after, _, err := be.MemInfo()
		require.NoError(t, err)
		t.Logf("took %s: device free %s → %s, budget now %s", alloc.FormatBytes(take), alloc.FormatBytes(free),
			alloc.FormatBytes(after), alloc.FormatBytes(after-sess.be.Reserve()+reserved-sess.Overhead()))
	}
	return oomsBefore
}
