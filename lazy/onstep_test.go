package lazy_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// OnStep keeps what it is given, in order, for the graph's training steps;
// it refuses a value of another graph, an erroneous one and a nil apply,
// and StepUpdates returns a copy.
func TestOnStep(t *testing.T) {
	x := lazy.Placeholder([]int{4, 3, 2, 2}, graph.Float32, 0)
	g := x.Graph()
	assert.Empty(t, g.StepUpdates())
	var calls []int
	a, b := x.BatchStats(), x.Relu().BatchStats()
	require.NoError(t, g.OnStep(a, func(*tensor.Dense) error { calls = append(calls, 1); return nil }))
	require.NoError(t, g.OnStep(b, func(*tensor.Dense) error { calls = append(calls, 2); return nil }))
	ups := g.StepUpdates()
	require.Len(t, ups, 2)
	assert.Same(t, a, ups[0].Value)
	assert.Same(t, b, ups[1].Value)
	for _, u := range ups {
		require.NoError(t, u.Apply(nil))
	}
	assert.Equal(t, []int{1, 2}, calls)
	ups[0] = lazy.StepUpdate{}
	assert.Same(t, a, g.StepUpdates()[0].Value, "StepUpdates returns a copy")

	other := lazy.Placeholder([]int{4, 3}, graph.Float32, 0).BatchStats()
	assert.ErrorIs(t, g.OnStep(other, func(*tensor.Dense) error { return nil }), graph.ErrMixedGraphs)
	assert.ErrorIs(t, g.OnStep(a, nil), graph.ErrNilTensor)
	bad := lazy.Placeholder([]int{1, 3}, graph.Float32, 0).BatchStats() // one value per channel
	assert.ErrorIs(t, g.OnStep(bad, func(*tensor.Dense) error { return nil }), graph.ErrShape)
	assert.Len(t, g.StepUpdates(), 2, "refused registrations add nothing")
	var none *lazy.Graph
	assert.Empty(t, none.StepUpdates())
}
