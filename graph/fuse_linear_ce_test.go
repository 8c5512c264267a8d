package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// head is a language model's head over batched h [2, 4, 6] and labels
// [2, 4] with W [10, 6]: the logits [2, 4, 10] reshaped to [8, 10] and
// the labels to [8], as models.Loss and models.CausalLMLoss build them.
type head struct {
	b                 nodes
	h, w, labels, lab int // lab: the labels reshaped to [8]
}

func newHead(t *testing.T) head {
	b := nodes{t, graph.New()}
	hd := head{b: b, h: b.in(graph.Float32, true, 2, 4, 6), w: b.in(graph.Float32, false, 10, 6)}
	hd.labels = b.in(graph.Int64, true, 2, 4)
	hd.lab = b.node(graph.OpReshape, graph.Attrs{Shape: []int{8}}, hd.labels)
	return hd
}

func (hd head) logits(prod int) int {
	return hd.b.node(graph.OpReshape, graph.Attrs{Shape: []int{8, 10}}, prod)
}

// TestFuseLinearCrossEntropy: a cross_entropy of a linear's logits at
// the loss becomes one linear_cross_entropy in the loss's place, reading
// h reshaped to [N, C], W and the labels, with the loss's reduction and
// classes; a mean scaled by a float32 constant (models.CausalLMLoss) takes
// the constant as its scale; a tied embedding read through a transpose
// fuses too. The matched nodes stay, read by nothing.
func TestFuseLinearCrossEntropy(t *testing.T) {
	t.Run("linear", func(t *testing.T) {
		hd := newHead(t)
		b := hd.b
		lin := b.node(graph.OpLinear, graph.Attrs{}, hd.h, hd.w)
		ce := b.node(graph.OpCrossEntropy, graph.Attrs{Reduction: graph.ReduceMean, End: 9}, hd.logits(lin), hd.lab)
		ng, ids, err := graph.FuseLinearCrossEntropy(b.g, []int{ce})
		require.NoError(t, err)
		require.Equal(t, b.g.Len()+1, ng.Len(), "a reshape of h added, the fused op in the loss's place")
		f := ng.Node(ids[ce])
		require.Equal(t, graph.OpLinearCrossEntropy, f.Op)
		assert.Equal(t, []int{ids[ce] - 1, ids[hd.w], ids[hd.lab]}, f.Inputs)
		r := ng.Node(f.Inputs[0])
		assert.Equal(t, graph.OpReshape, r.Op)
		assert.Equal(t, []int{ids[hd.h]}, r.Inputs)
		assert.Equal(t, []int{8, 6}, r.Type.Shape)
		assert.Equal(t, graph.ReduceMean, f.Attrs.Reduction)
		assert.Equal(t, 9, f.Attrs.End)
		assert.Equal(t, 1.0/8, f.Attrs.Scalar)
		assert.Equal(t, graph.DefaultLossChunk, f.Attrs.LossChunk)
		assert.Equal(t, b.g.Node(ce).Type, f.Type)
		assert.Equal(t, graph.OpLinear, ng.Node(ids[lin]).Op, "the product stays, read by nothing")
	})
	t.Run("scaled sum", func(t *testing.T) {
		hd := newHead(t)
		b := hd.b
		lin := b.node(graph.OpLinear, graph.Attrs{}, hd.h, hd.w)
		ce := b.node(graph.OpCrossEntropy, graph.Attrs{Reduction: graph.ReduceSum}, hd.logits(lin), hd.lab)
		inv, err := b.g.Append(graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: []int{}, DType: graph.Float32, BatchAxis: -1}})
		require.NoError(t, err)
		loss := b.node(graph.OpMul, graph.Attrs{}, ce, inv)
		ng, ids, err := graph.FuseLinearCrossEntropy(b.g, []int{loss})
		require.NoError(t, err)
		f := ng.Node(ids[loss])
		require.Equal(t, graph.OpLinearCrossEntropy, f.Op)
		assert.Equal(t, []int{ids[loss] - 1, ids[hd.w], ids[hd.lab], ids[inv]}, f.Inputs, "the constant is the scale")
		assert.Equal(t, graph.ReduceSum, f.Attrs.Reduction)
		assert.Equal(t, 1.0, f.Attrs.Scalar)
	})
	t.Run("tied transpose", func(t *testing.T) {
		b := nodes{t, graph.New()}
		h, w, labels := b.in(graph.Float32, true, 8, 6), b.in(graph.Float32, false, 10, 6), b.in(graph.Int64, true, 8)
		wt := b.node(graph.OpPermute, graph.Attrs{Perm: []int{1, 0}}, w)
		mm := b.node(graph.OpMatMul, graph.Attrs{}, h, wt)
		ce := b.node(graph.OpCrossEntropy, graph.Attrs{}, mm, labels)
		mt := b.node(graph.OpMatMul, graph.Attrs{TransB: true}, h, w)
		ce2 := b.node(graph.OpCrossEntropy, graph.Attrs{}, mt, labels)
		for _, loss := range []int{ce, ce2} {
			ng, ids, err := graph.FuseLinearCrossEntropy(b.g, []int{loss})
			require.NoError(t, err)
			f := ng.Node(ids[loss])
			require.Equal(t, graph.OpLinearCrossEntropy, f.Op, "loss %d", loss)
			assert.Equal(t, []int{ids[h], ids[w], ids[labels]}, f.Inputs, "2-D h needs no reshape; W read as stored")
		}
	})
}

// TestFuseLinearCrossEntropyRefuses: logits another output or node reads,
// a linear with a bias, a loss that is not the graph's end and a scale
// with a batch axis are left as they are; gradient ops already in the
// graph that no output needs do not count as readers.
func TestFuseLinearCrossEntropyRefuses(t *testing.T) {
	unchanged := func(t *testing.T, g *graph.Graph, outputs []int) {
		t.Helper()
		ng, _, err := graph.FuseLinearCrossEntropy(g, outputs)
		require.NoError(t, err)
		require.Equal(t, g.Len(), ng.Len())
		for _, nd := range ng.Nodes() {
			require.NotEqual(t, graph.OpLinearCrossEntropy, nd.Op)
		}
	}
	t.Run("logits read", func(t *testing.T) {
		hd := newHead(t)
		lin := hd.b.node(graph.OpLinear, graph.Attrs{}, hd.h, hd.w)
		lg := hd.logits(lin)
		ce := hd.b.node(graph.OpCrossEntropy, graph.Attrs{}, lg, hd.lab)
		unchanged(t, hd.b.g, []int{ce, lin})
		unchanged(t, hd.b.g, []int{ce, lg})
		sm := hd.b.node(graph.OpSoftmax, graph.Attrs{Axis: 1}, lg)
		unchanged(t, hd.b.g, []int{ce, sm})
	})
	t.Run("bias", func(t *testing.T) {
		hd := newHead(t)
		bias := hd.b.in(graph.Float32, false, 10)
		lin := hd.b.node(graph.OpLinear, graph.Attrs{}, hd.h, hd.w, bias)
		ce := hd.b.node(graph.OpCrossEntropy, graph.Attrs{}, hd.logits(lin), hd.lab)
		unchanged(t, hd.b.g, []int{ce})
	})
	t.Run("not the end", func(t *testing.T) {
		hd := newHead(t)
		lin := hd.b.node(graph.OpLinear, graph.Attrs{}, hd.h, hd.w)
		ce := hd.b.node(graph.OpCrossEntropy, graph.Attrs{}, hd.logits(lin), hd.lab)
		sq := hd.b.node(graph.OpMul, graph.Attrs{}, ce, ce)
		unchanged(t, hd.b.g, []int{sq})
		unchanged(t, hd.b.g, []int{ce, sq})
	})
	t.Run("batched scale", func(t *testing.T) {
		b := nodes{t, graph.New()}
		h, w, labels := b.in(graph.Float32, true, 8, 6), b.in(graph.Float32, false, 10, 6), b.in(graph.Int64, true, 8)
		s := b.in(graph.Float32, false, 1)
		lin := b.node(graph.OpLinear, graph.Attrs{}, h, w)
		ce := b.node(graph.OpCrossEntropy, graph.Attrs{}, lin, labels)
		loss := b.node(graph.OpMul, graph.Attrs{}, ce, s)
		unchanged(t, b.g, []int{loss})
	})
	t.Run("gradient ops", func(t *testing.T) {
		hd := newHead(t)
		lin := hd.b.node(graph.OpLinear, graph.Attrs{}, hd.h, hd.w)
		lg := hd.logits(lin)
		ce := hd.b.node(graph.OpCrossEntropy, graph.Attrs{}, lg, hd.lab)
		seed := hd.b.node(graph.OpFill, graph.Attrs{Scalar: 1, Target: graph.Type{Shape: []int{}, DType: graph.Float32}})
		grad := hd.b.node(graph.OpCrossEntropyGrad, hd.b.g.Node(ce).Attrs, seed, lg, hd.lab)
		ng, ids, err := graph.FuseLinearCrossEntropy(hd.b.g, []int{ce})
		require.NoError(t, err)
		assert.Equal(t, graph.OpLinearCrossEntropy, ng.Node(ids[ce]).Op, "a gradient no output needs reads nothing")
		unchanged(t, hd.b.g, []int{ce, grad})
	})
}

// TestLinearCrossEntropyGradProducer: with a fill seed both gradients pair
// with the forward node; with another seed _grad_w pairs with _grad_h;
// other inputs or attributes pair with nothing.
func TestLinearCrossEntropyGradProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	h, w, labels := b.in(graph.Float32, true, 8, 6), b.in(graph.Float32, false, 10, 6), b.in(graph.Int64, true, 8)
	a := graph.Attrs{LossChunk: 4}
	loss := b.node(graph.OpLinearCrossEntropy, a, h, w, labels)
	seed := b.node(graph.OpFill, graph.Attrs{Scalar: 1, Target: graph.Type{Shape: []int{}, DType: graph.Float32}})
	a.Scalar = b.g.Node(loss).Attrs.Scalar
	gh := b.node(graph.OpLinearCrossEntropyGradH, a, seed, h, w, labels)
	gw := b.node(graph.OpLinearCrossEntropyGradW, a, seed, h, w, labels)
	assert.Equal(t, loss, graph.CompanionProducer(b.g, gh))
	assert.Equal(t, loss, graph.CompanionProducer(b.g, gw))
	g2 := b.in(graph.Float32, false)
	gh2 := b.node(graph.OpLinearCrossEntropyGradH, a, g2, h, w, labels)
	gw2 := b.node(graph.OpLinearCrossEntropyGradW, a, g2, h, w, labels)
	assert.Equal(t, -1, graph.CompanionProducer(b.g, gh2), "a computed seed: backward")
	assert.Equal(t, gh2, graph.CompanionProducer(b.g, gw2))
	other := a
	other.LossChunk = 8
	gw3 := b.node(graph.OpLinearCrossEntropyGradW, other, seed, h, w, labels)
	assert.Equal(t, -1, graph.CompanionProducer(b.g, gw3), "another chunk")
	assert.Equal(t, -1, graph.CompanionProducer(b.g, loss))
}

// TestLinearCrossEntropyRule: shapes, dtypes and attributes are checked
// with the op named.
func TestLinearCrossEntropyRule(t *testing.T) {
	b := nodes{t, graph.New()}
	h, w, labels := b.in(graph.Float32, true, 8, 6), b.in(graph.Float32, false, 10, 6), b.in(graph.Int64, true, 8)
	bad := []struct {
		why string
		ins []int
		a   graph.Attrs
		err error
	}{
		{"W's width", []int{h, b.in(graph.Float32, false, 10, 5), labels}, graph.Attrs{}, graph.ErrShape},
		{"labels' dtype", []int{h, w, b.in(graph.Float32, true, 8)}, graph.Attrs{}, graph.ErrDType},
		{"dtypes differ", []int{h, b.in(graph.BFloat16, false, 10, 6), labels}, graph.Attrs{}, graph.ErrDType},
		{"end past W", []int{h, w, labels}, graph.Attrs{End: 11}, graph.ErrShape},
		{"negative chunk", []int{h, w, labels}, graph.Attrs{LossChunk: -1}, graph.ErrAttr},
		{"scale not a scalar", []int{h, w, labels, b.in(graph.Float32, false, 2)}, graph.Attrs{}, graph.ErrShape},
	}
	for _, c := range bad {
		_, err := b.g.Append(graph.Node{Op: graph.OpLinearCrossEntropy, Inputs: c.ins, Attrs: c.a})
		require.ErrorIs(t, err, c.err, c.why)
		assert.Contains(t, err.Error(), "linear_cross_entropy", c.why)
	}
}
