package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// TestFuseEmbeddingGradAdd: an add of a gradient and an embedding_grad
// nothing else reads becomes one embedding_grad onto it, in either
// operand order; an embedding_grad that is an output, or an addend of
// another type or with a batch axis, stays as it was.
func TestFuseEmbeddingGradAdd(t *testing.T) {
	b := nodes{t, graph.New()}
	g, idx := b.in(graph.Float32, true, 4, 3), b.in(graph.Int64, true, 4)
	w := graph.Type{Shape: []int{6, 3}, DType: graph.Float32, BatchAxis: -1}
	r := b.in(graph.Float32, false, 6, 3)
	eg := b.node(graph.OpEmbeddingGrad, graph.Attrs{Target: w}, g, idx)
	sum := b.node(graph.OpAdd, graph.Attrs{}, eg, r)
	eg2 := b.node(graph.OpEmbeddingGrad, graph.Attrs{Target: w}, g, idx)
	sum2 := b.node(graph.OpAdd, graph.Attrs{}, sum, eg2)
	kept := b.node(graph.OpEmbeddingGrad, graph.Attrs{Target: w}, g, idx)
	sum3 := b.node(graph.OpAdd, graph.Attrs{}, kept, sum2)
	eg4 := b.node(graph.OpEmbeddingGrad, graph.Attrs{Target: w}, g, idx)
	bcast := b.node(graph.OpAdd, graph.Attrs{}, eg4, b.in(graph.Float32, false, 3))
	outs := []int{sum3, kept, bcast}
	ng, ids, err := graph.FuseEmbeddingGradAdd(b.g, outs)
	require.NoError(t, err)
	require.Equal(t, b.g.Len()-2, ng.Len())
	assert.Equal(t, -1, ids[eg])
	assert.Equal(t, -1, ids[eg2])
	f := ng.Node(ids[sum])
	assert.Equal(t, graph.OpEmbeddingGrad, f.Op)
	assert.Equal(t, []int{ids[g], ids[idx], ids[r]}, f.Inputs)
	assert.Equal(t, b.g.Node(sum).Type, f.Type)
	assert.Equal(t, []int{ids[g], ids[idx], ids[sum]}, ng.Node(ids[sum2]).Inputs, "the operands swapped")
	assert.Equal(t, graph.OpAdd, ng.Node(ids[sum3]).Op, "an output's embedding_grad stays")
	assert.Equal(t, graph.OpAdd, ng.Node(ids[bcast]).Op, "a broadcast addend stays")

	_, err = b.g.Append(graph.Node{Op: graph.OpEmbeddingGrad, Attrs: graph.Attrs{Target: w}, Inputs: []int{g, idx, g}})
	require.ErrorIs(t, err, graph.ErrShape, "an addend of another shape")
}
