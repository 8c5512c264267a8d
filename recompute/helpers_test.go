package recompute_test

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

const gib = 1 << 30

// stepOf is the training step Session.Step compiles for loss over params
// with slots optimizer state tensors each.
func stepOf(t testing.TB, loss *lazy.Tensor, params []*lazy.Tensor, slots int, ws planner.WorkspaceFunc) recompute.Step {
	t.Helper()
	require.NoError(t, loss.Err())
	g := loss.Graph()
	boundary := loss.ID() + 1
	outs := []int{loss.ID()}
	trained := make([]int, len(params))
	for i, gr := range lazy.Grad(loss, params...) {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
		trained[i] = g.NodeOf(params[i])
	}
	return recompute.Step{Graph: g.IR(), Boundary: boundary, Outputs: outs,
		Compile: planner.CompileOptions{Kept: slices.Clone(outs[1:]), Trained: trained, StateSlots: slots, Workspace: ws}}
}

// gptStep is a shape-only GPT training step over tokens [batch, seq].
func gptStep(t testing.TB, cfg models.GPTConfig, batch, seq int) recompute.Step {
	model := models.NewGPT(nn.Options{ShapeOnly: true}, cfg)
	tokens := lazy.Placeholder([]int{batch, seq}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{batch, seq}, graph.Int64, 0)
	return stepOf(t, models.Loss(model.Forward(tokens), targets), nn.ParamTensors(model), 2, nil)
}
