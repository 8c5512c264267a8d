package cuda_test

import (
	"context"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// searchExecutor is an executor with the timed search on a device of its
// own whose algorithm cache is dir.
func searchExecutor(t *testing.T, dir string) *cuda.Executor {
	t.Helper()
	device(t)
	d, err := cuda.Open(cuda.Options{AlgoCacheDir: dir})
	require.NoError(t, err)
	e, err := cuda.NewExecutor(d, cuda.ExecutorOptions{ConvHeuristics: false})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, e.Close())
		require.NoError(t, d.Close())
	})
	if e.DNN() == nil {
		if os.Getenv("BATCHFIT_REQUIRE_GPU") != "" {
			t.Fatalf("convolutions: %s", e.Convolutions())
		}
		t.Skipf("convolutions: %s", e.Convolutions())
	}
	if os.Getenv("BATCHFIT_CUDNN_FIND") != "0" {
		require.Contains(t, e.Convolutions(), "timed search")
	} else {
		t.Skip("BATCHFIT_CUDNN_FIND=0 turns the search off")
	}
	return e
}

// convWorkspaces is every convolution node's declared workspace in p at
// one sample and at the whole batch, under rule ws.
func convWorkspaces(p *planner.Program, ws planner.WorkspaceFunc) map[int][2]int64 {
	out := map[int][2]int64{}
	for _, nd := range p.Graph.Nodes() {
		switch nd.Op {
		case graph.OpConv2d, graph.OpConv2dGradInput, graph.OpConv2dGradWeight:
			out[nd.ID] = [2]int64{ws(p.Graph, &nd, 1), ws(p.Graph, &nd, p.Graph.Batch())}
		}
	}
	return out
}

// TestConvTimedSearch: a float32 ConvNet's Adam step compiled with the
// executor's Workspace times its convolutions' algorithms at compile time
// (none during the steps), outside the executor's allocator (its reserved
// bytes do not move), and its plans' peaks, whole and in three chunks (a
// second executor, from this process's timings), are the measured ones to
// the byte. Its loss is the heuristics executor's
// within 1e-5 relative (other algorithms: other summation orders). The
// timings go to the disk cache: after ForgetSearches a second executor
// reads every shape from it and declares the same workspaces; a garbled
// entry is searched again (SearchStats.CacheErrors) and rewritten.
func TestConvTimedSearch(t *testing.T) {
	const n = 96
	ctx := context.Background()
	dir := t.TempDir()
	cuda.ForgetSearches()
	e := searchExecutor(t, dir)
	model := testutil.ConvModel(16, false)
	// The same step (parameters and data) for each compile.
	step := func(ws planner.WorkspaceFunc) *planner.Program {
		loss, params := model.Build(rand.New(rand.NewPCG(61, 62)), n)
		return testutil.TrainProgram(t, ws, loss, params, 2)
	}
	before := e.Allocator().Stats().ReservedBytes[alloc.All].Current
	p := step(e.Workspace())
	st := e.DNN().SearchStats()
	t.Logf("search: %+v; choices %+v", st, e.DNN().Choices())
	require.Positive(t, st.Searched, "the compile timed the convolutions")
	require.Empty(t, st.Heuristics)
	assert.Equal(t, before, e.Allocator().Stats().ReservedBytes[alloc.All].Current, "the search used an allocator of its own")
	assert.Positive(t, st.MaxBytes)
	assert.LessOrEqual(t, st.MaxBytes, int64(1<<30))
	entries, err := filepath.Glob(filepath.Join(dir, "*.json"))
	require.NoError(t, err)
	require.Len(t, entries, st.Searched, "one cache entry per searched shape")

	// Whole, and in three chunks (on a second executor, whose allocator
	// holds none of the first's segments, and which takes the timings from
	// this process's searches): predicted = measured, two steps each.
	var first float32
	for _, maxChunk := range []int{0, n / 3} {
		ex, px := e, p
		if maxChunk > 0 {
			ex = searchExecutor(t, dir)
			px = step(ex.Workspace())
			st := ex.DNN().SearchStats()
			require.Zero(t, st.Searched)
			require.Positive(t, st.FromProcess)
		}
		opt := optim.NewAdam(1e-3)
		pl, err := planner.Make(px, planner.Options{Budget: 8 << 30, MaxChunk: maxChunk})
		require.NoError(t, err)
		for i := range 2 {
			res, err := ex.Execute(ctx, px, pl.Chunks, cuda.ExecOptions{Resident: true, Optimizer: opt})
			require.NoError(t, err)
			if maxChunk == 0 && i == 0 {
				first = scalarOf(t, res.Outputs[0])
			}
			t.Logf("%d chunks, step %d: reserved predicted %d + %d, measured %d; allocated predicted %d + %d, measured %d",
				len(pl.Chunks), i, pl.PeakReserved, ex.Overhead(), res.Usage.PeakReserved, pl.PeakAllocated, ex.Overhead(), res.Usage.PeakAllocated)
			assert.Equal(t, pl.PeakReserved+ex.Overhead(), res.Usage.PeakReserved, "%d chunks, step %d: peak reserved", len(pl.Chunks), i)
			assert.Equal(t, pl.PeakAllocated+ex.Overhead(), res.Usage.PeakAllocated, "%d chunks, step %d: peak allocated", len(pl.Chunks), i)
		}
		if maxChunk > 0 {
			require.Len(t, pl.Chunks, 3)
		}
	}
	assert.Equal(t, st.Searched, e.DNN().SearchStats().Searched, "no search during the steps")

	// The heuristics executor's loss on the same step.
	h := freshExecutor(t, cuda.ExecutorOptions{ConvHeuristics: true})
	require.Contains(t, h.Convolutions(), "heuristics")
	hp := step(h.Workspace())
	res, err := h.Execute(ctx, hp, planner.Chunks(n, 1), cuda.ExecOptions{})
	require.NoError(t, err)
	want := scalarOf(t, res.Outputs[0])
	assert.InEpsilon(t, want, first, 1e-5, "loss: timed %g, heuristics %g", first, want)
	assert.Zero(t, h.DNN().SearchStats().Searched)

	// From the disk cache: the same declarations, no search.
	cuda.ForgetSearches()
	e2 := searchExecutor(t, dir)
	p2 := step(e2.Workspace())
	st2 := e2.DNN().SearchStats()
	assert.Zero(t, st2.Searched)
	assert.Equal(t, st.Searched, st2.FromDisk)
	assert.Equal(t, convWorkspaces(p, e.Workspace()), convWorkspaces(p2, e2.Workspace()))

	// A garbled entry: searched again and rewritten; the rest from disk.
	require.NoError(t, os.WriteFile(entries[0], []byte(`{"format":"batchfit-cudnn-find/1","key":"forged"}`), 0o600))
	cuda.ForgetSearches()
	e3 := searchExecutor(t, dir)
	step(e3.Workspace())
	st3 := e3.DNN().SearchStats()
	assert.Equal(t, 1, st3.CacheErrors)
	assert.Equal(t, 1, st3.Searched)
	assert.Equal(t, st.Searched-1, st3.FromDisk)
	b, err := os.ReadFile(entries[0])
	require.NoError(t, err)
	assert.Contains(t, string(b), `"results"`, "rewritten")
	assert.False(t, math.IsNaN(float64(first)))
}
