package memviz_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// TestSessionStep wires memviz to a batchfit.Session the way a command
// line tool does: report after the step, profile predicted against
// measured, export the snapshot.
func TestSessionStep(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, TraceEntries: traceEntries, Timeline: true})
	m := newMLP(10)
	rng := rand.New(rand.NewPCG(41, 42))
	x, y := batch(rng, 12, nIn, nOut)
	in := lazy.Wrap(x, 0)
	loss := m.Forward(in).CrossEntropy(in.Graph().Wrap(y, 0), graph.ReduceMean)
	_, err := sess.Step(context.Background(), loss, nn.ParamTensors(m), optim.NewAdam(1e-3))
	require.NoError(t, err)

	prog, plan := sess.LastProgram(), sess.LastPlan()
	require.NotNil(t, prog)
	snap := memviz.NewSnapshot(0, sess.Allocator().Snapshot())
	rep, err := memviz.NewReport(prog, snap, memviz.Options{})
	require.NoError(t, err)
	checkTotals(t, rep.Devices[0], sess.Allocator().Stats())
	got := byName(t, rep.Devices[0])
	for _, p := range mlpParams {
		assert.Equal(t, p.shape, got[p.name+".exp_avg_sq"].Shape)
	}
	assert.NotEmpty(t, snap.Devices[0].Trace, "the session's allocator keeps a trace")

	sim, err := memviz.Simulate(prog, plan.Chunks, memviz.SimOptions{})
	require.NoError(t, err)
	pr, err := memviz.NewProfile(prog, plan.Chunks, sim.Usage.Timeline, sess.LastUsage().Timeline, memviz.Options{})
	require.NoError(t, err)
	assert.Equal(t, plan.PeakAllocated, pr.PredictedPeakActive)
	assert.Equal(t, plan.PeakReserved, pr.PredictedPeakReserved)
	assert.Equal(t, pr.PredictedPeakActive, pr.MeasuredPeakActive, "a first step measures what the planner predicted")
}
