package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// TestAddRMSNormProducer: an rms_norm pairs with the float32 residual add
// it reads, as a layer norm does, 16-bit output included (the norm a
// mixed policy gives the GEMMs); a layer norm is not taken for it.
func TestAddRMSNormProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	rms := graph.Attrs{NormDims: 1, Eps: 1e-6}
	w := b.in(graph.Float32, false, 8)
	x, h := b.in(graph.Float32, true, 2, 4, 8), b.in(graph.BFloat16, true, 2, 4, 8)
	res := b.node(graph.OpAdd, graph.Attrs{}, x, h)
	norm := b.node(graph.OpRMSNorm, rms, res, w)
	assert.Equal(t, res, graph.AddRMSNormProducer(b.g, norm))
	assert.Equal(t, res, graph.CompanionProducer(b.g, norm))
	half := b.node(graph.OpRMSNorm, graph.Attrs{NormDims: 1, Eps: 1e-6, Target: graph.Type{DType: graph.BFloat16}}, res, w)
	assert.Equal(t, res, graph.CompanionProducer(b.g, half), "16-bit output")
	ln := b.node(graph.OpLayerNorm, graph.Attrs{NormDims: 1, Eps: 1e-5}, res)
	assert.Equal(t, -1, graph.AddRMSNormProducer(b.g, ln), "a layer norm")
	assert.Equal(t, -1, graph.AddLayerNormProducer(b.g, norm), "an rms_norm")
	hh := b.node(graph.OpAdd, graph.Attrs{}, h, h)
	assert.Equal(t, -1, graph.AddRMSNormProducer(b.g, b.node(graph.OpRMSNorm, rms, hh)), "bfloat16 add")
}

// TestRMSNormGradWProducer: rms_norm_grad_w pairs with the rms_norm_grad_x
// (or its fused add) of the same g, x and attributes.
func TestRMSNormGradWProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	rms := graph.Attrs{NormDims: 1, Eps: 1e-6}
	g, x, w, r := b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, false, 6), b.in(graph.Float32, true, 4, 6)
	dx := b.node(graph.OpRMSNormGradX, rms, g, x, w)
	dw := b.node(graph.OpRMSNormGradW, rms, g, x)
	assert.Equal(t, dx, graph.RMSNormGradWProducer(b.g, dw))
	assert.Equal(t, dx, graph.CompanionProducer(b.g, dw))
	fused := b.node(graph.OpRMSNormGradXAdd, rms, g, x, r, w)
	assert.Equal(t, fused, graph.CompanionProducer(b.g, b.node(graph.OpRMSNormGradW, rms, g, x)), "the fused add")
	other := b.node(graph.OpRMSNormGradW, graph.Attrs{NormDims: 1, Eps: 1e-5}, g, x)
	assert.Equal(t, -1, graph.RMSNormGradWProducer(b.g, other), "another eps")
	lnw := b.node(graph.OpLayerNormGradW, graph.Attrs{NormDims: 1, Eps: 1e-6}, g, x)
	assert.Equal(t, -1, graph.CompanionProducer(b.g, lnw), "a layer norm's weight gradient")
	narrow := b.node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.BFloat16}}, fused)
	assert.Equal(t, fused, graph.LayerNormGradCastProducer(b.g, narrow), "the 16-bit cast of the input gradient")
}

// TestSwiGLUGradProducer: swiglu's up gradient pairs with its gate
// gradient of the same g, gate and up; the VJP emits the pair.
func TestSwiGLUGradProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	g, gate, up := b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, true, 4, 6)
	dg := b.node(graph.OpSwiGLUGrad, graph.Attrs{Axis: 0}, g, gate, up)
	du := b.node(graph.OpSwiGLUGrad, graph.Attrs{Axis: 1}, g, gate, up)
	assert.Equal(t, dg, graph.SwiGLUGradProducer(b.g, du))
	assert.Equal(t, dg, graph.CompanionProducer(b.g, du))
	assert.Equal(t, -1, graph.CompanionProducer(b.g, dg), "the gate's gradient is the producer")
	du2 := b.node(graph.OpSwiGLUGrad, graph.Attrs{Axis: 1}, g, up, gate)
	assert.Equal(t, -1, graph.SwiGLUGradProducer(b.g, du2), "other operands")
}

// TestFuseRMSNormGradAdd: FuseLayerNormGradAdd fuses an RMS norm's input
// gradient into the residual add as it does a layer norm's.
func TestFuseRMSNormGradAdd(t *testing.T) {
	b := nodes{t, graph.New()}
	rms := graph.Attrs{NormDims: 1, Eps: 1e-6}
	g, x, w, r := b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, true, 4, 6), b.in(graph.Float32, false, 6), b.in(graph.Float32, true, 4, 6)
	dx := b.node(graph.OpRMSNormGradX, rms, g, x, w)
	sum := b.node(graph.OpAdd, graph.Attrs{}, dx, r)
	ng, ids, err := graph.FuseLayerNormGradAdd(b.g, []int{sum})
	require.NoError(t, err)
	assert.Equal(t, -1, ids[dx])
	f := ng.Node(ids[sum])
	assert.Equal(t, graph.OpRMSNormGradXAdd, f.Op)
	assert.Equal(t, []int{ids[g], ids[x], ids[r], ids[w]}, f.Inputs)
	assert.Equal(t, b.g.Node(sum).Type, f.Type)
}

// TestRotaryVJP: rotary's gradient is rotary_grad of the same table and
// heads; asking for the table's gradient is a typed error.
func TestRotaryVJP(t *testing.T) {
	b := nodes{t, graph.New()}
	x, cs := b.in(graph.Float32, true, 4, 3, 6, 8), b.in(graph.Float32, false, 3, 8)
	y := b.node(graph.OpRotary, graph.Attrs{End: 4}, x, cs)
	assert.Equal(t, 4, b.g.Node(y).Attrs.End)
	_, err := b.g.Append(graph.Node{Op: graph.OpRotaryGrad, Inputs: []int{y, cs}, Attrs: graph.Attrs{End: 4, Axis: 1}})
	assert.ErrorIs(t, err, graph.ErrAttr)
	all := b.node(graph.OpRotary, graph.Attrs{}, x, cs)
	assert.Equal(t, 6, b.g.Node(all).Attrs.End, "End 0 is every head")
}
