package cuda

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// The CUDA executor refuses per-chunk batch statistics before it runs
// anything (no GPU needed to check): a training step with per-chunk batch
// norm is refused at its batch_norm node, a step whose only per-chunk
// piece is batch_norm_stats at that node, with errors wrapping
// graph.ErrAttr and ErrUnverified; the default step and evaluation mode
// pass the check.
func TestCheckPerChunk(t *testing.T) {
	compile := func(perChunk, stats, training bool) (*planner.Program, map[string]int) {
		t.Helper()
		x := lazy.Placeholder([]int{4, 3, 5, 5}, graph.Float32, 0)
		w, b := lazy.ParamSpec([]int{3}, graph.Float32, "w"), lazy.ParamSpec([]int{3}, graph.Float32, "b")
		rm, rv := lazy.ParamSpec([]int{3}, graph.Float32, "rm"), lazy.ParamSpec([]int{3}, graph.Float32, "rv")
		var y *lazy.Tensor
		switch {
		case perChunk:
			y = x.BatchNorm2dPerChunk(w, b, 1e-5)
		default:
			y = x.BatchNorm2d(w, b, rm, rv, training, 1e-5)
		}
		loss := y.Relu().Mean()
		outs := []int{loss.ID()}
		for _, gr := range lazy.Grad(loss, w, b) {
			require.NoError(t, gr.Err())
			outs = append(outs, gr.ID())
		}
		ids := map[string]int{"batch_norm": y.ID()}
		if stats {
			s := x.BatchStats()
			outs = append(outs, s.ID())
			ids["batch_norm_stats"] = s.ID()
		}
		g := x.Graph().IR()
		info, err := shapeinfer.Analyze(g, outs...)
		require.NoError(t, err)
		p, err := planner.Compile(g, info, outs, planner.CompileOptions{Kept: outs[1:3], Workspace: Workspace})
		require.NoError(t, err)
		return p, ids
	}
	refused := func(p *planner.Program, node int, op string) {
		t.Helper()
		err := checkPerChunk(p)
		require.Error(t, err)
		assert.ErrorIs(t, err, graph.ErrAttr)
		assert.ErrorIs(t, err, ErrUnverified)
		assert.Contains(t, err.Error(), fmt.Sprintf("node %d (%s)", node, op))
	}
	p, ids := compile(true, true, true)
	refused(p, ids["batch_norm"], "batch_norm")
	p, ids = compile(false, true, true)
	refused(p, ids["batch_norm_stats"], "batch_norm_stats")
	p, _ = compile(false, false, true)
	assert.NoError(t, checkPerChunk(p), "the default (whole-batch statistics)")
	p, _ = compile(false, false, false)
	assert.NoError(t, checkPerChunk(p), "evaluation mode")

	// The kernel table's entry refuses too, should anything reach it.
	nd := &graph.Node{ID: 7, Op: graph.OpBatchNormStats, Scope: "layer1.bn"}
	err := kernelTable[graph.OpBatchNormStats].run(&kctx{nd: nd}, nil, operand{})
	assert.True(t, errors.Is(err, ErrUnverified) && errors.Is(err, graph.ErrAttr), "%v", err)
	assert.Contains(t, err.Error(), "node 7 (batch_norm_stats in layer1.bn)")
}
