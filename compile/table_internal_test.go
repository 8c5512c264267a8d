package compile

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/precision"
)

// A pass added as one entry runs in table order in every step its Modes
// name: a backward-stage rewrite of mode TrainStep | EvalStep sees the
// training step's outputs (the gradients among them) in a training step,
// and the evaluation's outputs on the forward graph in an evaluation;
// Check knows its name, and the ids it returns are composed into the
// step's.
func TestOneLineEntry(t *testing.T) {
	saved := table
	defer func() { table = saved }()
	var seen [][]int // the outputs each run of the probe was given
	probe := func(g *graph.Graph, outs []int) (*graph.Graph, []int, error) {
		seen = append(seen, slices.Clone(outs))
		ids := make([]int, g.Len())
		for i := range ids {
			ids[i] = i
		}
		return g.Clone(), ids, nil
	}
	entry := Pass{Name: "probe", Stage: Backward, Modes: TrainStep | EvalStep, When: always, run: backward(probe), Doc: "a test's"}
	table = append(slices.Clone(saved[:len(saved)-1]), entry, saved[len(saved)-1])
	require.NoError(t, Check([]string{"probe"}))

	x := lazy.Placeholder([]int{4, 16}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{8, 16}, graph.Float32, "w")
	y := x.Graph().Placeholder([]int{4}, graph.Int64, 0)
	loss := x.Linear(w, nil).CrossEntropy(y, graph.ReduceMean)
	wrt, err := lazy.ParamIDs(loss, w)
	require.NoError(t, err)
	g := loss.Graph().IR()

	st, err := Train(g, loss.ID(), wrt, Options{Policy: precision.BF16Mixed})
	require.NoError(t, err)
	require.Len(t, seen, 1)
	assert.Equal(t, st.Outputs(), seen[0], "the scale is −1 without loss scaling")
	assert.Contains(t, seen[0], st.Grads[0])
	assert.Equal(t, "probe", st.Passes[len(st.Passes)-1].Name)
	assert.True(t, st.Passes[len(st.Passes)-1].Ran)

	ev, err := Eval(g, []int{loss.ID()}, Options{Policy: precision.BF16Mixed})
	require.NoError(t, err)
	require.Len(t, seen, 2)
	assert.Equal(t, ev.Outputs, seen[1])
	assert.True(t, ev.Passes[len(ev.Passes)-1].Ran)

	_, err = Eval(g, []int{loss.ID()}, Options{Disable: []string{"probe"}})
	require.NoError(t, err)
	assert.Len(t, seen, 2, "disabled")
}
