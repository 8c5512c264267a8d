package planner_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// finishHooks runs nothing and records what Finish receives.
type finishHooks struct {
	a                 *alloc.Allocator
	kept              int
	ws                *alloc.Block
	wsBytes           int64 // ws's requested bytes, during Finish
	allocated         int64 // bytes allocated during Finish
	freedWS, finishes int
}

func (*finishHooks) Resident(planner.Buffer) *alloc.Block    { return nil }
func (*finishHooks) Fill(planner.Buffer, *alloc.Block) error { return nil }
func (*finishHooks) Run(*graph.Node, planner.Chunk, *alloc.Block, []*alloc.Block, *alloc.Block) error {
	return nil
}
func (h *finishHooks) Freed(b planner.Buffer, blk *alloc.Block) {
	if blk == h.ws && b.Tag.Op == planner.FinishOp {
		h.freedWS++
	}
}
func (*finishHooks) ChunkDone(planner.Chunk, []*alloc.Block, []*alloc.Block) error { return nil }
func (h *finishHooks) Finish(kept []*alloc.Block, ws *alloc.Block) error {
	h.finishes++
	h.kept, h.ws = len(kept), ws
	if ws != nil {
		h.wsBytes = ws.Requested()
	}
	h.allocated = h.a.Stats().AllocatedBytes[alloc.All].Current
	return nil
}
func (*finishHooks) EveryChunk() bool { return true }

// finishStep is a small training step of two parameters, compiled with a
// finish workspace of ws bytes.
func finishStep(t *testing.T, ws int64) *planner.Program {
	x := lazy.Placeholder([]int{8, 16}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{16, 4}, graph.Float32, "w")
	b := lazy.ParamSpec([]int{4}, graph.Float32, "b")
	g, outs, co := testutil.Step(t, x.MatMul(w).Add(b).Tanh().Sum(), []*lazy.Tensor{w, b}, 2)
	co.FinishWorkspace = ws
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, co)
	require.NoError(t, err)
	return p
}

// CompileOptions.FinishWorkspace: Replay allocates it after the last chunk,
// beside the kept outputs, hands it to Finish and frees it; plans count it,
// and the program's signature tells it apart. Without it Finish gets nil.
func TestFinishWorkspace(t *testing.T) {
	p := finishStep(t, 4)
	assert.Equal(t, int64(4), p.FinishWorkspace.Fixed)
	assert.Equal(t, planner.BufWorkspace, p.FinishWorkspace.Kind)
	assert.Equal(t, p.Kept[len(p.Kept)-1], p.FinishWorkspace.Node)
	assert.Equal(t, planner.FinishOp, p.FinishWorkspace.Tag.Op)
	plain := finishStep(t, 0)
	assert.Zero(t, plain.FinishWorkspace)
	assert.NotEqual(t, plain.Signature(), p.Signature())

	for _, chunks := range [][]planner.Chunk{planner.Chunks(8, 1), planner.Chunks(8, 3)} {
		var at [2]int64
		var points [2]int
		for i, prog := range []*planner.Program{plain, p} {
			a := alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{})
			h := &finishHooks{a: a}
			u, err := planner.Replay(prog, chunks, a, h, true)
			require.NoError(t, err)
			assert.Equal(t, 1, h.finishes)
			assert.Equal(t, 2, h.kept)
			at[i], points[i] = h.allocated, len(u.Timeline)
			// A replay without hooks (the planner's) counts it as the
			// executors' replay does.
			bare := peak(t, prog, chunks)
			assert.Equal(t, bare.PeakReserved, u.PeakReserved)
			assert.Equal(t, bare.PeakAllocated, u.PeakAllocated)
			if prog == plain {
				assert.Nil(t, h.ws)
				continue
			}
			require.NotNil(t, h.ws)
			assert.Equal(t, int64(4), h.wsBytes)
			assert.Equal(t, 1, h.freedWS, "freed after Finish")
		}
		assert.Equal(t, at[0]+512, at[1], "%d chunks: the flag is one 512-byte block more during Finish", len(chunks))
		assert.Equal(t, points[0], points[1], "no timeline point marks it (memviz's walk knows every point)")
	}

	// No kept outputs, nothing to finish: no workspace.
	x := lazy.Placeholder([]int{8, 16}, graph.Float32, 0)
	out := x.Tanh().Sum()
	info, err := shapeinfer.Analyze(out.Graph().IR(), out.ID())
	require.NoError(t, err)
	q, err := planner.Compile(out.Graph().IR(), info, []int{out.ID()}, planner.CompileOptions{FinishWorkspace: 4})
	require.NoError(t, err)
	assert.Zero(t, q.FinishWorkspace)
	_, err = planner.Compile(out.Graph().IR(), info, []int{out.ID()}, planner.CompileOptions{FinishWorkspace: -1})
	require.ErrorIs(t, err, graph.ErrAttr)
}

// CompileOptions.OptimizerScalars puts the optimizer's device scalars
// (OptimizerScalarBytes of the trained parameters) in the finish
// workspace after the caller's bytes rounded up to 8, so plans count
// them; without trained parameters there are none.
func TestOptimizerScalarsInFinishWorkspace(t *testing.T) {
	scalars := planner.OptimizerScalarBytes(2)
	require.Equal(t, int64(8*(4+8*2+2*2+256)), scalars)
	for _, ws := range []int64{0, 4} {
		x := lazy.Placeholder([]int{8, 16}, graph.Float32, 0)
		w := lazy.ParamSpec([]int{16, 4}, graph.Float32, "w")
		b := lazy.ParamSpec([]int{4}, graph.Float32, "b")
		g, outs, co := testutil.Step(t, x.MatMul(w).Add(b).Tanh().Sum(), []*lazy.Tensor{w, b}, 2)
		co.FinishWorkspace, co.OptimizerScalars = ws, true
		info, err := shapeinfer.Analyze(g, outs...)
		require.NoError(t, err)
		p, err := planner.Compile(g, info, outs, co)
		require.NoError(t, err)
		require.True(t, p.HasOptimizerScalars())
		at := (ws + 7) &^ 7
		assert.Equal(t, at, p.OptimizerScalars)
		assert.Equal(t, at, p.CallerFinish())
		assert.Equal(t, at+scalars, p.FinishWorkspace.Fixed)
		plain := finishStep(t, ws)
		assert.False(t, plain.HasOptimizerScalars())
		assert.Equal(t, ws, plain.CallerFinish())
		assert.NotEqual(t, plain.Signature(), p.Signature())
		for _, chunks := range [][]planner.Chunk{planner.Chunks(8, 1), planner.Chunks(8, 3)} {
			a := alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{})
			h := &finishHooks{a: a}
			u, err := planner.Replay(p, chunks, a, h, false)
			require.NoError(t, err)
			assert.Equal(t, at+scalars, h.wsBytes)
			assert.Equal(t, peak(t, p, chunks).PeakReserved, u.PeakReserved, "the planner's replay counts them")
		}
	}
	assert.Zero(t, planner.OptimizerScalarBytes(0))
}
