package memviz_test

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// checkRows checks what holds for every profile: rows follow each other
// (live bytes change by what a row allocates and frees), and a node's row
// allocates its output at the chunk's size, rounded, and its companion's
// with it (planner.Program.Companions: cross_entropy's row holds its
// gradient's), which then allocates nothing in its own row.
func checkRows(t *testing.T, s trainStep, chunks []planner.Chunk, pr *memviz.Profile) {
	t.Helper()
	g := s.prog.Graph
	for i, r := range pr.Rows {
		if i > 0 {
			assert.Equal(t, pr.Rows[i-1].Predicted.LiveAfter+r.Allocated-r.Freed, r.Predicted.LiveAfter, "row %d (%s)", i, r.Name)
		}
		assert.GreaterOrEqual(t, r.Predicted.PeakActive, r.Predicted.LiveAfter)
		assert.GreaterOrEqual(t, r.Predicted.PeakReserved, r.Predicted.PeakActive)
		if r.Chunk < 0 || r.Node < 0 {
			continue
		}
		nd := g.Node(r.Node)
		bytes := func(id int) int64 {
			t := g.Node(id).Type
			n := int64(t.DType.Size())
			for _, d := range t.AtBatch(chunks[r.Chunk].Size) {
				n *= int64(d)
			}
			return n
		}
		n := bytes(r.Node)
		allocated := roundUp(n)
		for m := range s.prog.Companions(r.Node) {
			n += bytes(m)
			allocated += roundUp(bytes(m))
		}
		if slices.Contains(s.prog.Companion, r.Node) || slices.Contains(s.prog.NextCompanion, r.Node) {
			n, allocated = 0, 0
		}
		assert.Equal(t, n, r.Requested, "row %d (%s)", i, r.Name)
		assert.Equal(t, allocated, r.Allocated, "row %d (%s)", i, r.Name)
		assert.Equal(t, nd.Scope, r.Scope)
		assert.Equal(t, nd.Op.String(), r.Op)
	}
}

func TestProfilePredictedMatchesMeasured(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	x, y := batch(rng, 6, nIn, nOut)
	s := compileStep(t, newMLP(4), x, y, 2)
	for _, k := range []int{1, 2} { // whole batch, then two chunks with accumulators
		chunks := planner.Chunks(6, k)
		sim, err := memviz.Simulate(s.prog, chunks, memviz.SimOptions{})
		require.NoError(t, err)
		e, a := tracedExecutor()
		r := execute(t, e, a, s, chunks, optim.NewAdam(1e-3))
		pr, err := memviz.NewProfile(s.prog, chunks, sim.Usage.Timeline, r.res.Usage.Timeline, memviz.Options{})
		require.NoError(t, err)
		checkRows(t, s, chunks, pr)
		// A first step on a fresh device is exactly the simulated one.
		for i, row := range pr.Rows {
			if assert.NotNil(t, row.Measured, "row %d", i) {
				assert.Equal(t, row.Predicted, *row.Measured, "row %d (%s)", i, row.Name)
			}
		}
		assert.Equal(t, sim.Usage.PeakAllocated, pr.PredictedPeakActive)
		assert.Equal(t, sim.Usage.PeakReserved, pr.PredictedPeakReserved)
		assert.Equal(t, r.res.Usage.PeakAllocated, pr.MeasuredPeakActive)
		assert.Equal(t, r.res.Usage.PeakReserved, pr.MeasuredPeakReserved)
		assert.Equal(t, pr.PredictedPeakRow, pr.MeasuredPeakRow)

		names := map[string]int{}
		for _, row := range pr.Rows {
			names[row.Name]++
		}
		assert.Equal(t, 1, names["fc1.weight.exp_avg_sq"], "persistent rows name their buffers")
		assert.Equal(t, k, names["chunk outputs read back"], "the loss, read back after each chunk")
		if k > 1 {
			assert.Equal(t, 1+k, names["fc2.bias.grad"], "the persistent accumulator, then the gradient of each chunk")
		}

		// The snapshot at the predicted peak holds exactly the peak bytes.
		snap := memviz.NewSnapshot(0, sim.Snapshot)
		assert.Equal(t, sim.Usage.PeakAllocated, snap.Allocated())
		assert.Equal(t, sim.Peak.Allocated, snap.Allocated())
	}
}

func TestProfileSecondStepHasNoPersistentMeasurements(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	x, y := batch(rng, 5, nIn, nOut)
	s := compileStep(t, newMLP(5), x, y, 1)
	chunks := planner.Chunks(5, 1)
	e, a := tracedExecutor()
	opt := optim.NewSGD(0.1, 0.9)
	execute(t, e, a, s, chunks, opt)
	r := execute(t, e, a, s, chunks, opt) // parameters and momentum already resident
	sim, err := memviz.Simulate(s.prog, chunks, memviz.SimOptions{})
	require.NoError(t, err)
	pr, err := memviz.NewProfile(s.prog, chunks, sim.Usage.Timeline, r.res.Usage.Timeline, memviz.Options{})
	require.NoError(t, err)
	for i, row := range pr.Rows {
		if row.Chunk < 0 {
			assert.Nil(t, row.Measured, "row %d (%s) was resident", i, row.Name)
			continue
		}
		require.NotNil(t, row.Measured, "row %d", i)
		// Resident or replayed, the same bytes are allocated.
		assert.Equal(t, row.Predicted.LiveAfter, row.Measured.LiveAfter, "row %d (%s)", i, row.Name)
		assert.Equal(t, row.Predicted.PeakActive, row.Measured.PeakActive, "row %d (%s)", i, row.Name)
	}
}

func TestProfileWriters(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	x, y := batch(rng, 4, nIn, nOut)
	s := compileStep(t, newMLP(6), x, y, 2)
	chunks := planner.Chunks(4, 2)
	sim, err := memviz.Simulate(s.prog, chunks, memviz.SimOptions{})
	require.NoError(t, err)
	pr, err := memviz.NewProfile(s.prog, chunks, sim.Usage.Timeline, nil, memviz.Options{})
	require.NoError(t, err)
	assert.Equal(t, -1, pr.MeasuredPeakRow)

	var c bytes.Buffer
	require.NoError(t, pr.WriteCSV(&c))
	recs, err := csv.NewReader(&c).ReadAll()
	require.NoError(t, err)
	require.Len(t, recs, len(pr.Rows)+1)
	assert.Equal(t, "chunk", recs[0][0])
	for i, r := range pr.Rows {
		assert.Equal(t, r.Name, recs[i+1][5])
		assert.Equal(t, strconv.FormatInt(r.Predicted.PeakActive, 10), recs[i+1][10])
		assert.Equal(t, "", recs[i+1][12], "not measured")
	}

	var j bytes.Buffer
	require.NoError(t, pr.WriteJSON(&j))
	var back memviz.Profile
	require.NoError(t, json.Unmarshal(j.Bytes(), &back))
	assert.Equal(t, *pr, back)

	var txt bytes.Buffer
	require.NoError(t, pr.WriteText(&txt))
	assert.Contains(t, txt.String(), "predicted peak: "+alloc.FormatBytes(pr.PredictedPeakActive))
	assert.Contains(t, txt.String(), "fc1.weight.exp_avg")
}

func TestProfileRejectsForeignTimelines(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 18))
	x, y := batch(rng, 4, nIn, nOut)
	s := compileStep(t, newMLP(7), x, y, 0)
	chunks := planner.Chunks(4, 1)
	sim, err := memviz.Simulate(s.prog, chunks, memviz.SimOptions{})
	require.NoError(t, err)
	tl := sim.Usage.Timeline

	shifted := append([]planner.Point(nil), tl...)
	for i := range shifted {
		if shifted[i].Step >= 0 {
			shifted[i].Step++
		}
	}
	wrongChunk := append([]planner.Point(nil), tl...)
	wrongChunk[len(wrongChunk)-1].Chunk = 3
	unknownParam := append([]planner.Point{{Chunk: -1, Step: -1, Node: len(s.prog.OutputBuf) - 1, Kind: planner.StepAlloc}}, tl...)
	for name, c := range map[string]struct {
		p         *planner.Program
		predicted []planner.Point
		measured  []planner.Point
	}{
		"no program":              {nil, tl, nil},
		"empty timeline":          {s.prog, nil, nil},
		"steps shifted":           {s.prog, shifted, nil},
		"chunk out of range":      {s.prog, wrongChunk, nil},
		"measured steps shifted":  {s.prog, tl, shifted},
		"unknown persistent node": {s.prog, unknownParam, nil},
	} {
		_, err := memviz.NewProfile(c.p, chunks, c.predicted, c.measured, memviz.Options{})
		assert.True(t, errors.Is(err, memviz.ErrTimeline), "%s: %v", name, err)
	}
}
