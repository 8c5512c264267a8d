package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// TestFuseLayerNormGradAdd: an add of another gradient and a
// layer_norm_grad_x nothing else reads becomes one layer_norm_grad_x_add
// in the add's place, in either operand order, with or without the
// weight; the near misses stay as they were, and a graph without the
// pattern comes back as a copy of itself.
func TestFuseLayerNormGradAdd(t *testing.T) {
	b := nodes{t, graph.New()}
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	g, x, w, r := b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, false, 6), b.in(graph.Float32, true, 4, 6)
	dx := b.node(graph.OpLayerNormGradX, ln, g, x, w)
	sum := b.node(graph.OpAdd, graph.Attrs{}, r, dx)
	dx2 := b.node(graph.OpLayerNormGradX, ln, sum, x) // no weight; the add's operands swapped
	sum2 := b.node(graph.OpAdd, graph.Attrs{}, dx2, sum)
	// Near misses: a gradient read twice; one that is an output; an add
	// broadcasting a smaller r; a bfloat16 r (the add promotes).
	dx3 := b.node(graph.OpLayerNormGradX, ln, sum2, x, w)
	twice := b.node(graph.OpAdd, graph.Attrs{}, dx3, dx3)
	dx4 := b.node(graph.OpLayerNormGradX, ln, twice, x, w)
	kept := b.node(graph.OpAdd, graph.Attrs{}, r, dx4)
	dx5 := b.node(graph.OpLayerNormGradX, ln, kept, x, w)
	bcast := b.node(graph.OpAdd, graph.Attrs{}, dx5, w)
	hr := b.in(graph.BFloat16, true, 4, 6)
	dx6 := b.node(graph.OpLayerNormGradX, ln, kept, x, w)
	mixed := b.node(graph.OpAdd, graph.Attrs{}, dx6, hr)

	outs := []int{sum2, kept, dx4, bcast, mixed}
	ng, ids, err := graph.FuseLayerNormGradAdd(b.g, outs)
	require.NoError(t, err)
	require.Equal(t, b.g.Len()-2, ng.Len(), "two layer_norm_grad_x go")
	assert.Equal(t, -1, ids[dx])
	assert.Equal(t, -1, ids[dx2])
	f := ng.Node(ids[sum])
	assert.Equal(t, graph.OpLayerNormGradXAdd, f.Op)
	assert.Equal(t, []int{ids[g], ids[x], ids[r], ids[w]}, f.Inputs)
	assert.Equal(t, ln, f.Attrs)
	assert.Equal(t, b.g.Node(sum).Type, f.Type)
	f2 := ng.Node(ids[sum2])
	assert.Equal(t, graph.OpLayerNormGradXAdd, f2.Op)
	assert.Equal(t, []int{ids[sum], ids[x], ids[sum]}, f2.Inputs, "no weight: g, x, r")
	for _, id := range []int{dx3, dx4, dx5, dx6} {
		assert.Equal(t, graph.OpLayerNormGradX, ng.Node(ids[id]).Op, "node %d", id)
	}
	for _, id := range []int{twice, kept, bcast, mixed} {
		assert.Equal(t, graph.OpAdd, ng.Node(ids[id]).Op, "node %d", id)
	}

	ng2, ids2, err := graph.FuseLayerNormGradAdd(ng, []int{ids[sum2], ids[kept], ids[dx4], ids[bcast], ids[mixed]})
	require.NoError(t, err)
	require.Equal(t, ng.Len(), ng2.Len())
	for i := range ng.Len() {
		assert.Equal(t, i, ids2[i])
		assert.Equal(t, ng.Node(i).Op, ng2.Node(i).Op)
		assert.Equal(t, ng.Node(i).Inputs, ng2.Node(i).Inputs)
	}

	// The fused node's rule checks r like the add did.
	_, err = ng.Append(graph.Node{Op: graph.OpLayerNormGradXAdd, Attrs: ln, Inputs: []int{ids[g], ids[x], ids[hr], ids[w]}})
	require.ErrorIs(t, err, graph.ErrShape, "a bfloat16 r")
}

// TestLayerNormGradCastCompanion: a 16-bit cast of a float32 layer norm
// input gradient (plain or with an added gradient) pairs with it; a
// widening cast, a cast of another op and a float32 gradient's float32
// "cast" do not.
func TestLayerNormGradCastCompanion(t *testing.T) {
	b := nodes{t, graph.New()}
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	g, x, w := b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, false, 6)
	dx := b.node(graph.OpLayerNormGradX, ln, g, x, w)
	dxa := b.node(graph.OpLayerNormGradXAdd, ln, g, x, dx, w)
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, p := range []int{dx, dxa} {
			c := b.node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: dt}}, p)
			assert.Equal(t, p, graph.LayerNormGradCastProducer(b.g, c))
			assert.Equal(t, p, graph.CompanionProducer(b.g, c))
		}
	}
	h := b.node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.BFloat16}}, dx)
	assert.Equal(t, -1, graph.CompanionProducer(b.g, b.node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.Float32}}, h)), "widening")
	assert.Equal(t, -1, graph.CompanionProducer(b.g, b.node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.BFloat16}}, g)), "not a layer norm gradient")
	assert.Equal(t, -1, graph.CompanionProducer(b.g, b.node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.Float32}}, dx)), "no narrowing")
}
