package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// TestLSEProducerNeedsTheSameScores: attention_lse only pairs with an
// attention over the same q, k and mask with the same scale and causality.
func TestLSEProducerNeedsTheSameScores(t *testing.T) {
	g := graph.New()
	in := func(shape ...int) int {
		id, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: graph.Float32, BatchAxis: 0, PerSample: 1}})
		require.NoError(t, err)
		return id
	}
	q, k, v := in(2, 2, 4, 8), in(2, 2, 4, 8), in(2, 2, 4, 8)
	node := func(op graph.Op, a graph.Attrs, ins ...int) int {
		id, err := g.Append(graph.Node{Op: op, Attrs: a, Inputs: ins})
		require.NoError(t, err)
		return id
	}
	causal := graph.Attrs{Scalar: 0.5, Causal: true}
	att := node(graph.OpAttention, causal, q, k, v)
	assert.Equal(t, att, graph.LSEProducer(g, node(graph.OpAttentionLSE, causal, q, k)))
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionLSE, graph.Attrs{Scalar: 0.5}, q, k)), "not causal")
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionLSE, graph.Attrs{Scalar: 0.25, Causal: true}, q, k)), "another scale")
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionLSE, causal, k, q)), "q and k swapped")
	assert.Equal(t, -1, graph.LSEProducer(g, att), "an attention node")
	assert.Equal(t, -1, graph.LSEProducer(g, -1))
}
