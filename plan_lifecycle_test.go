package batchfit_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// Plan, like Step, builds the backward pass on a copy of the caller's
// graph: under every policy, planning a loss leaves its graph's nodes as
// built, planning it again finds the first plan's step graph and program
// (the caches hit), and a Step of that same loss tensor after the plans
// runs the plan Plan made, its peaks measured to the byte, the graph
// still as built. A dry-run session's Plan leaves the graph alone too.
func TestPlanLeavesTheCallersGraphAlone(t *testing.T) {
	ctx := context.Background()
	for _, policy := range []string{"fp32", "tf32", "bf16-mixed", "fp16-mixed"} {
		t.Run(policy, func(t *testing.T) {
			sess := sessionOn(t, batchfit.DeviceCPU, batchfit.Options{Precision: policy})
			rng := rand.New(rand.NewPCG(41, 42))
			m := newMLP(rng)
			_, loss := m.loss(batchOf(rng, batch))
			nodes := loss.Graph().IR().Len()
			opt := optim.NewSGD(0.1, 0)

			sp, err := sess.Plan(loss, m.params, opt)
			require.NoError(t, err)
			require.Equal(t, nodes, loss.Graph().IR().Len(), "nodes of the caller's graph after Plan")
			hits, progs := sess.StepGraphHits(), sess.CacheHits()
			again, err := sess.Plan(loss, m.params, opt)
			require.NoError(t, err)
			require.Equal(t, nodes, loss.Graph().IR().Len(), "nodes of the caller's graph after a second Plan")
			assert.Equal(t, hits+1, sess.StepGraphHits(), "the second plan's step graph is the first's")
			assert.Equal(t, progs+1, sess.CacheHits(), "the second plan's program is the first's")
			samePlan(t, sp.Plan, again.Plan, "plans of one graph")

			_, err = sess.Step(ctx, loss, m.params, opt)
			require.NoError(t, err)
			require.Equal(t, nodes, loss.Graph().IR().Len(), "nodes of the caller's graph after Step")
			samePlan(t, sp.Plan, sess.LastPlan(), "the step runs the plan")
			assert.Equal(t, sp.Plan.PeakReserved, sess.LastUsage().PeakReserved, "predicted = measured")
			assert.Equal(t, sp.Plan.PeakAllocated, sess.LastUsage().PeakAllocated, "predicted = measured")

			dry := batchfit.NewSession(batchfit.Options{Precision: policy, DryRun: &batchfit.DryRun{}})
			require.NoError(t, dry.Err())
			defer dry.Close()
			_, loss = m.loss(batchOf(rng, batch))
			nodes = loss.Graph().IR().Len()
			_, err = dry.Plan(loss, m.params, optim.NewSGD(0.1, 0))
			require.NoError(t, err)
			require.Equal(t, nodes, loss.Graph().IR().Len(), "nodes of the caller's graph after a dry run's Plan")
		})
	}
}

// After Close every call that reaches the executor is ErrClosed, the
// plans and SyncState included, and the parameters the session trained
// are free for another session, which trains them from where the closed
// one left them (Close synced them); while the first is open they are
// ErrParamOwned.
func TestCloseRefusesCallsAndFreesParameters(t *testing.T) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(43, 44))
	m := newMLP(rng)
	x, y := batchOf(rng, batch)
	first := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, first.Err())
	_, loss := m.loss(x, y)
	_, err := first.Step(ctx, loss, m.params, optim.NewAdam(1e-2))
	require.NoError(t, err)

	second := sessionOn(t, batchfit.DeviceCPU, batchfit.Options{})
	_, loss = m.loss(x, y)
	_, err = second.Step(ctx, loss, m.params, optim.NewAdam(1e-2))
	require.ErrorIs(t, err, batchfit.ErrParamOwned, "trained by the open session that stepped them")

	require.NoError(t, first.Close())
	logits, loss := m.loss(x, y)
	calls := map[string]error{}
	_, calls["Step"] = first.Step(ctx, loss, m.params, optim.NewSGD(0.1, 0))
	_, calls["Eval"] = first.Eval(ctx, logits)
	_, calls["Plan"] = first.Plan(loss, m.params, optim.NewSGD(0.1, 0))
	_, calls["PlanEval"] = first.PlanEval(logits)
	_, calls["MaxBatch"] = first.MaxBatch(func(n int) (*lazy.Tensor, []*lazy.Tensor) {
		_, l := m.loss(batchOf(rng, n))
		return l, m.params
	}, optim.NewSGD(0.1, 0), batchfit.MaxBatchOptions{Limit: 8})
	calls["SyncParams"] = first.SyncParams()
	calls["SyncState"] = first.SyncState()
	calls["Yield"] = first.Yield()
	calls["Restore"] = first.Restore()
	for name, err := range calls {
		assert.ErrorIs(t, err, batchfit.ErrClosed, name)
	}
	require.NoError(t, first.Close(), "closing again does nothing")

	before := m.snapshot()
	_, err = second.Step(ctx, loss, m.params, optim.NewAdam(1e-2))
	require.NoError(t, err, "the closed session's parameters are free")
	assert.NotEqual(t, before, m.snapshot(), "the other session trained them")
}

// Plans from several goroutines while Close runs: each Plan either
// finishes (Close waits for it) or returns ErrClosed, never another error
// or a plan of a released executor; Close then leaves the allocator
// empty. go test -race checks the hand-over.
func TestCloseWhilePlanning(t *testing.T) {
	rng := rand.New(rand.NewPCG(45, 46))
	m := newMLP(rng)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	losses := make([]*lazy.Tensor, 4)
	for i := range losses {
		_, losses[i] = m.loss(batchOf(rng, batch+i))
	}
	_, err := sess.Step(context.Background(), losses[0], m.params, optim.NewSGD(0.1, 0))
	require.NoError(t, err)

	var wg sync.WaitGroup
	errs := make([]error, len(losses))
	plans := make([]int, len(losses))
	started := make(chan struct{}, len(losses))
	for g := range losses {
		wg.Go(func() {
			for i := 0; ; i++ {
				sp, err := sess.Plan(losses[g], m.params, optim.NewSGD(0.1, 0))
				if i == 0 {
					started <- struct{}{}
				}
				if err != nil {
					if !errors.Is(err, batchfit.ErrClosed) {
						errs[g] = err
					}
					return
				}
				if sp.Plan == nil || sp.Plan.Batch != batch+g {
					errs[g] = &graph.OpError{Op: "plan", Err: graph.Errorf(graph.ErrShape, "goroutine %d: a plan of the wrong batch", g)}
					return
				}
				plans[g]++
			}
		})
	}
	for range losses {
		<-started
	}
	require.NoError(t, sess.Close())
	wg.Wait()
	for g, err := range errs {
		require.NoError(t, err, "goroutine %d", g)
		assert.Positive(t, plans[g], "goroutine %d planned before Close", g)
	}
	st := sess.Allocator().Stats()
	assert.Zero(t, st.AllocatedBytes[alloc.All].Current, "allocated bytes after Close")
	assert.Zero(t, st.ReservedBytes[alloc.All].Current, "reserved bytes after Close")
}

// Frozen parameters are left out of a step, and every entry of the list
// must still be a parameter: an input after a frozen parameter is
// graph.ErrNotParam named by its index in the caller's list, from Step and
// Plan alike; without it the step trains the unfrozen parameters only.
func TestFrozenAndNonParameters(t *testing.T) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(47, 48))
	m := newMLP(rng)
	sess := sessionOn(t, batchfit.DeviceCPU, batchfit.Options{})
	x, y := batchOf(rng, batch)
	in := lazy.Wrap(x, 0)
	labels := in.Graph().Wrap(y, 0)
	loss := in.Linear(m.params[0], m.params[1]).Tanh().Linear(m.params[2], m.params[3]).CrossEntropy(labels, graph.ReduceMean)
	m.params[0].SetFrozen(true)
	defer m.params[0].SetFrozen(false)
	before := m.snapshot()

	bad := append(append([]*lazy.Tensor{}, m.params...), in)
	_, err := sess.Step(ctx, loss, bad, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, graph.ErrNotParam)
	assert.Contains(t, err.Error(), "params[4]: the input", "the caller's index, the frozen entry counted")
	_, err = sess.Plan(loss, bad, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, graph.ErrNotParam)
	assert.Equal(t, before, m.snapshot())

	_, err = sess.Step(ctx, loss, m.params, optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	after := m.snapshot()
	assert.Equal(t, before[0], after[0], "the frozen weight is not trained")
	for i := 1; i < len(after); i++ {
		assert.NotEqual(t, before[i], after[i], "parameter %d is trained", i)
	}
}
