package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// TestAddLayerNormProducer: a layer norm pairs with the float32 add it
// reads when the add's other operand covers whole rows (equal shape, or a
// suffix of it spanning the normalised dims) and the weight and bias are
// float32 values made before the add; CompanionProducer dispatches on the
// op.
func TestAddLayerNormProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	w := b.in(graph.Float32, false, 8)
	x, h := b.in(graph.Float32, true, 2, 4, 8), b.in(graph.BFloat16, true, 2, 4, 8)
	res := b.node(graph.OpAdd, graph.Attrs{}, x, h)
	bias := b.in(graph.Float32, false, 8) // a parameter made after the add, as nn.LayerNorm's are
	norm := b.node(graph.OpLayerNorm, ln, res, w, bias)
	assert.Equal(t, res, graph.AddLayerNormProducer(b.g, norm))
	assert.Equal(t, res, graph.CompanionProducer(b.g, norm))
	swapped := b.node(graph.OpAdd, graph.Attrs{}, h, x)
	assert.Equal(t, swapped, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, ln, swapped, w, bias)), "operands swapped")
	pos := b.in(graph.Float32, false, 4, 8)
	emb := b.node(graph.OpAdd, graph.Attrs{}, x, pos)
	assert.Equal(t, emb, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, ln, emb)), "broadcast rows, no affine")

	// Near misses: a 16-bit add; an operand broadcast within a row; a
	// weight made after the add; a layer norm of something else.
	hh := b.node(graph.OpAdd, graph.Attrs{}, h, h)
	assert.Equal(t, -1, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, ln, hh)), "bfloat16 add")
	col := b.in(graph.Float32, true, 2, 4, 1)
	part := b.node(graph.OpAdd, graph.Attrs{}, x, col)
	assert.Equal(t, -1, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, ln, part)), "broadcast within rows")
	late := b.node(graph.OpAdd, graph.Attrs{}, x, x)
	w2 := b.node(graph.OpMulScalar, graph.Attrs{Scalar: 2}, w)
	assert.Equal(t, -1, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, ln, late, w2, bias)), "weight made after the add")
	assert.Equal(t, -1, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, ln, x)), "not an add")
	wide := graph.Attrs{NormDims: 2, Eps: 1e-5}
	short := b.in(graph.Float32, false, 8)
	rows := b.node(graph.OpAdd, graph.Attrs{}, x, short)
	assert.Equal(t, -1, graph.AddLayerNormProducer(b.g, b.node(graph.OpLayerNorm, wide, rows)), "operand shorter than the normalised dims")
}
