package memviz_test

import (
	"bytes"
	"encoding/csv"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/planner"
)

// After the step a simulation holds what a training loop holds between
// steps: the parameters and Adam's state, each rounded to 512 bytes, in
// segments that cache the rest.
func TestSimulationEnd(t *testing.T) {
	rng := rand.New(rand.NewPCG(51, 52))
	x, y := batch(rng, 64, nIn, nOut)
	s := compileStep(t, newMLP(5), x, y, 2)
	sim, err := memviz.Simulate(s.prog, planner.Chunks(64, 2), memviz.SimOptions{})
	require.NoError(t, err)
	end := memviz.NewSnapshot(0, sim.End)
	var want int64
	for _, p := range mlpParams {
		want += 3 * roundUp(4*numel(p.shape)) // the parameter and two state slots
	}
	assert.Equal(t, want, end.Allocated())
	assert.Equal(t, sim.Usage.PeakReserved, end.Reserved(), "freed blocks stay cached")
	peak := memviz.NewSnapshot(0, sim.Snapshot)
	assert.Equal(t, sim.Usage.PeakAllocated, peak.Allocated())

	rep, err := memviz.NewReport(s.prog, end, memviz.Options{})
	require.NoError(t, err)
	for _, x := range rep.Devices[0].Tensors {
		assert.Contains(t, []memviz.Kind{memviz.KindParam, memviz.KindState}, x.Kind, x.Name)
	}
}

// The report's CSV has a header and one row per tensor whose sizes add
// up to the allocated bytes.
func TestReportCSV(t *testing.T) {
	rng := rand.New(rand.NewPCG(53, 54))
	x, y := batch(rng, 64, nIn, nOut)
	s := compileStep(t, newMLP(6), x, y, 2)
	sim, err := memviz.Simulate(s.prog, planner.Chunks(64, 2), memviz.SimOptions{})
	require.NoError(t, err)
	rep, err := memviz.NewReport(s.prog, memviz.NewSnapshot(0, sim.Snapshot), memviz.Options{})
	require.NoError(t, err)
	var b bytes.Buffer
	require.NoError(t, rep.WriteCSV(&b))
	rows, err := csv.NewReader(&b).ReadAll()
	require.NoError(t, err)
	require.Len(t, rows, 1+len(rep.Devices[0].Tensors))
	require.Equal(t, "size", rows[0][6])
	var sum int64
	names := map[string]bool{}
	for _, r := range rows[1:] {
		n, err := strconv.ParseInt(r[6], 10, 64)
		require.NoError(t, err)
		sum += n
		names[r[2]] = true
	}
	assert.Equal(t, rep.Devices[0].Totals.Allocated, sum)
	assert.True(t, names["fc1.weight.exp_avg_sq"], "%v", names)
}

// TraceEntries outside 0…alloc.MaxTraceEntries fails with alloc.ErrInvalid
// rather than tracing nothing or panicking.
func TestSimulateTraceEntriesOutOfRange(t *testing.T) {
	x, y := batch(rand.New(rand.NewPCG(1, 2)), 64, nIn, nOut)
	s := compileStep(t, newMLP(5), x, y, 2)
	for _, n := range []int{-1, alloc.MaxTraceEntries + 1} {
		_, err := memviz.Simulate(s.prog, planner.Chunks(64, 1), memviz.SimOptions{TraceEntries: n})
		assert.ErrorIs(t, err, alloc.ErrInvalid, n)
	}
}
