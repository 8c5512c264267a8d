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

// TestQKVLSEProducer: attention_qkv_lse pairs with an attention_qkv over
// the same qkv with the same heads (query and key/value), scale and
// causality; CompanionProducer
// dispatches on the op.
func TestQKVLSEProducer(t *testing.T) {
	g := graph.New()
	in := func() int {
		id, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{2, 4, 24}, DType: graph.Float32, BatchAxis: 0, PerSample: 1}})
		require.NoError(t, err)
		return id
	}
	node := func(op graph.Op, a graph.Attrs, ins ...int) int {
		id, err := g.Append(graph.Node{Op: op, Attrs: a, Inputs: ins})
		require.NoError(t, err)
		return id
	}
	qkv, other := in(), in()
	a := graph.Attrs{Groups: 2, Scalar: 0.5, Causal: true}
	att := node(graph.OpAttentionQKV, a, qkv)
	lse := node(graph.OpAttentionQKVLSE, a, qkv)
	assert.Equal(t, att, graph.LSEProducer(g, lse))
	assert.Equal(t, att, graph.CompanionProducer(g, lse))
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionQKVLSE, graph.Attrs{Groups: 4, Scalar: 0.5, Causal: true}, qkv)), "other heads")
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionQKVLSE, graph.Attrs{Groups: 2, Scalar: 0.5}, qkv)), "not causal")
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionQKVLSE, graph.Attrs{Groups: 2, Scalar: 0.25, Causal: true}, qkv)), "another scale")
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionQKVLSE, a, other)), "another qkv")
	assert.Equal(t, -1, graph.LSEProducer(g, att), "an attention_qkv node")
	// Grouped-query heads: qkv [2, 4, 24] is also 4 query heads sharing 1
	// key/value head of 4; the key/value heads must agree too.
	ga := graph.Attrs{Groups: 4, KVHeads: 1, Scalar: 0.5}
	gatt := node(graph.OpAttentionQKV, ga, qkv)
	assert.Equal(t, gatt, graph.LSEProducer(g, node(graph.OpAttentionQKVLSE, ga, qkv)))
	assert.Equal(t, -1, graph.LSEProducer(g, node(graph.OpAttentionQKVLSE, graph.Attrs{Groups: 4, KVHeads: 2, Scalar: 0.5}, qkv)), "other key/value heads")
}

// TestBatchNormGradWProducer: a training-mode batch_norm_grad_w pairs with
// the batch_norm_grad_x over the same g and x with the same attributes;
// CompanionProducer dispatches on the op.
func TestBatchNormGradWProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	g, node := b.g, b.node
	in := func(shape ...int) int { return b.in(graph.Float32, true, shape...) }
	x, dy, other := in(4, 3, 5, 5), in(4, 3, 5, 5), in(4, 3, 5, 5)
	train := graph.Attrs{Training: true, Eps: 1e-5}
	gx := node(graph.OpBatchNormGradX, train, dy, x)
	gw := node(graph.OpBatchNormGradW, train, dy, x)
	assert.Equal(t, gx, graph.BatchNormGradWProducer(g, gw))
	assert.Equal(t, gx, graph.CompanionProducer(g, gw))
	assert.Equal(t, -1, graph.BatchNormGradWProducer(g, node(graph.OpBatchNormGradW, train, other, x)), "another g")
	assert.Equal(t, -1, graph.BatchNormGradWProducer(g, node(graph.OpBatchNormGradW, graph.Attrs{Training: true, Eps: 1e-3}, dy, x)), "another eps")
	assert.Equal(t, -1, graph.BatchNormGradWProducer(g, node(graph.OpBatchNormGradW, graph.Attrs{Training: true, PerChunk: true, Eps: 1e-5}, dy, x)), "per-chunk statistics")
	assert.Equal(t, -1, graph.BatchNormGradWProducer(g, gx), "a batch_norm_grad_x node")
	assert.Equal(t, -1, graph.CompanionProducer(g, gx))
	assert.Equal(t, -1, graph.CompanionProducer(g, -1))
}

// TestAttentionGradKVProducer: attention_grad_kv pairs with the earlier
// attention_grad_q over the same g, q, k, v, o, lse (and mask) with the
// same scale and causality; CompanionProducer dispatches on the op.
func TestAttentionGradKVProducer(t *testing.T) {
	g := graph.New()
	in := func(dt graph.DType, shape ...int) int {
		id, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: 0, PerSample: 1}})
		require.NoError(t, err)
		return id
	}
	node := func(op graph.Op, a graph.Attrs, ins ...int) int {
		id, err := g.Append(graph.Node{Op: op, Attrs: a, Inputs: ins})
		require.NoError(t, err)
		return id
	}
	q, k, v := in(graph.BFloat16, 2, 2, 4, 8), in(graph.BFloat16, 2, 2, 4, 8), in(graph.BFloat16, 2, 2, 4, 8)
	gr, o, other := in(graph.BFloat16, 2, 2, 4, 8), in(graph.BFloat16, 2, 2, 4, 8), in(graph.BFloat16, 2, 2, 4, 8)
	lse := in(graph.Float32, 2, 2, 4)
	mask := in(graph.BFloat16, 2, 1, 4, 4)
	causal := graph.Attrs{Scalar: 0.5, Causal: true}
	dq := node(graph.OpAttentionGradQ, causal, gr, q, k, v, o, lse)
	dkv := node(graph.OpAttentionGradKV, causal, gr, q, k, v, o, lse)
	assert.Equal(t, dq, graph.AttentionGradKVProducer(g, dkv))
	assert.Equal(t, dq, graph.CompanionProducer(g, dkv))
	assert.Equal(t, -1, graph.AttentionGradKVProducer(g, node(graph.OpAttentionGradKV, graph.Attrs{Scalar: 0.5}, gr, q, k, v, o, lse)), "not causal")
	assert.Equal(t, -1, graph.AttentionGradKVProducer(g, node(graph.OpAttentionGradKV, graph.Attrs{Scalar: 0.25, Causal: true}, gr, q, k, v, o, lse)), "another scale")
	assert.Equal(t, -1, graph.AttentionGradKVProducer(g, node(graph.OpAttentionGradKV, causal, other, q, k, v, o, lse)), "another g")
	assert.Equal(t, -1, graph.AttentionGradKVProducer(g, node(graph.OpAttentionGradKV, causal, gr, q, k, v, o, lse, mask)), "a mask dq does not have")
	masked := node(graph.OpAttentionGradQ, causal, gr, q, k, v, o, lse, mask)
	assert.Equal(t, masked, graph.AttentionGradKVProducer(g, node(graph.OpAttentionGradKV, causal, gr, q, k, v, o, lse, mask)), "the same mask")
	assert.Equal(t, -1, graph.AttentionGradKVProducer(g, dq), "an attention_grad_q node")
	assert.Equal(t, -1, graph.CompanionProducer(g, dq))
	assert.Equal(t, -1, graph.AttentionGradKVProducer(g, -1))
}

// TestCrossEntropyGradProducer: a cross_entropy_grad whose seed is a fill
// pairs with the cross_entropy over the same logits and labels with the
// same Scalar and End; a computed seed (loss scaling) pairs with nothing.
func TestCrossEntropyGradProducer(t *testing.T) {
	g := graph.New()
	node := func(n graph.Node) int {
		id, err := g.Append(n)
		require.NoError(t, err)
		return id
	}
	logits := node(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{4, 10}, DType: graph.Float32, BatchAxis: 0, PerSample: 10}})
	other := node(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{4, 10}, DType: graph.Float32, BatchAxis: 0, PerSample: 10}})
	labels := node(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{4}, DType: graph.Int64, BatchAxis: 0, PerSample: 1}})
	mean := graph.Attrs{Scalar: 0.25, End: 8}
	ce := node(graph.Node{Op: graph.OpCrossEntropy, Inputs: []int{logits, labels}, Attrs: mean})
	seed := node(graph.Node{Op: graph.OpFill, Attrs: graph.Attrs{Scalar: 1, Target: g.Node(ce).Type}})
	grad := func(a graph.Attrs, seed, logits int) int {
		return node(graph.Node{Op: graph.OpCrossEntropyGrad, Inputs: []int{seed, logits, labels}, Attrs: a})
	}
	gr := grad(mean, seed, logits)
	assert.Equal(t, ce, graph.CrossEntropyGradProducer(g, gr))
	assert.Equal(t, ce, graph.CompanionProducer(g, gr))
	assert.Equal(t, -1, graph.CrossEntropyGradProducer(g, grad(graph.Attrs{Scalar: 1, End: 8}, seed, logits)), "another scale")
	assert.Equal(t, -1, graph.CrossEntropyGradProducer(g, grad(graph.Attrs{Scalar: 0.25}, seed, logits)), "every class")
	assert.Equal(t, -1, graph.CrossEntropyGradProducer(g, grad(mean, seed, other)), "other logits")
	scale := node(graph.Node{Op: graph.OpParam, Type: graph.Type{Shape: []int{}, DType: graph.Float32, BatchAxis: -1}})
	scaled := node(graph.Node{Op: graph.OpMul, Inputs: []int{seed, scale}})
	assert.Equal(t, -1, graph.CrossEntropyGradProducer(g, grad(mean, scaled, logits)), "a computed seed")
	assert.Equal(t, -1, graph.CrossEntropyGradProducer(g, ce), "a cross_entropy node")
	assert.Equal(t, -1, graph.CrossEntropyGradProducer(g, g.Len()))
}

// TestFuseAttentionQKVRefusesBackward: the pass runs before autodiff; a
// graph holding a gradient op is refused with ErrAttr.
func TestFuseAttentionQKVRefusesBackward(t *testing.T) {
	g := graph.New()
	x, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{2, 4, 24}, DType: graph.Float32, BatchAxis: 0, PerSample: 1}})
	require.NoError(t, err)
	_, err = g.Append(graph.Node{Op: graph.OpAttentionQKVLSE, Attrs: graph.Attrs{Groups: 2}, Inputs: []int{x}})
	require.NoError(t, err)
	_, _, err = graph.FuseAttentionQKV(g)
	require.ErrorIs(t, err, graph.ErrAttr)
}

// TestLayerNormGradWProducer: layer_norm_grad_w pairs with the earlier
// layer_norm_grad_x over the same g and x with the same NormDims and Eps
// (with or without a weight input); CompanionProducer dispatches on the op.
func TestLayerNormGradWProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	g, node := b.g, b.node
	in := func(shape ...int) int { return b.in(graph.Float32, true, shape...) }
	x, dy, other := in(4, 6, 8), in(4, 6, 8), in(4, 6, 8)
	w, err := g.Append(graph.Node{Op: graph.OpParam, Type: graph.Type{Shape: []int{8}, DType: graph.Float32, BatchAxis: -1}})
	require.NoError(t, err)
	a := graph.Attrs{NormDims: 1, Eps: 1e-5}
	gx := node(graph.OpLayerNormGradX, a, dy, x, w)
	gw := node(graph.OpLayerNormGradW, a, dy, x)
	assert.Equal(t, gx, graph.LayerNormGradWProducer(g, gw))
	assert.Equal(t, gx, graph.CompanionProducer(g, gw))
	assert.Equal(t, -1, graph.LayerNormGradWProducer(g, node(graph.OpLayerNormGradW, a, other, x)), "another g")
	assert.Equal(t, -1, graph.LayerNormGradWProducer(g, node(graph.OpLayerNormGradW, a, dy, other)), "another x")
	assert.Equal(t, -1, graph.LayerNormGradWProducer(g, node(graph.OpLayerNormGradW, graph.Attrs{NormDims: 1, Eps: 1e-3}, dy, x)), "another eps")
	assert.Equal(t, -1, graph.LayerNormGradWProducer(g, node(graph.OpLayerNormGradW, graph.Attrs{NormDims: 2, Eps: 1e-5}, dy, x)), "other dims")
	assert.Equal(t, -1, graph.LayerNormGradWProducer(g, gx), "a layer_norm_grad_x node")
	assert.Equal(t, -1, graph.CompanionProducer(g, gx))

	// A layer_norm_grad_w before any layer_norm_grad_x has no producer.
	h := graph.New()
	hx, err := h.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{4, 8}, DType: graph.Float32, BatchAxis: 0, PerSample: 1}})
	require.NoError(t, err)
	hw, err := h.Append(graph.Node{Op: graph.OpLayerNormGradW, Attrs: a, Inputs: []int{hx, hx}})
	require.NoError(t, err)
	_, err = h.Append(graph.Node{Op: graph.OpLayerNormGradX, Attrs: a, Inputs: []int{hx, hx}})
	require.NoError(t, err)
	assert.Equal(t, -1, graph.LayerNormGradWProducer(h, hw), "the producer comes first")
}

// TestLayerNormBiasGradProducer: a layer norm's bias gradient, the sum of
// its g over every leading axis, pairs with the earlier
// layer_norm_grad_x of that g; near misses (other axes, KeepDim, another
// tensor, a cast of g, a sum emitted before the layer_norm_grad_x, other
// NormDims) do not. CompanionProducer dispatches sums to the rule.
func TestLayerNormBiasGradProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	g := b.g
	in := func(dt graph.DType, shape ...int) int { return b.in(dt, true, shape...) }
	node := b.node
	sum := func(x int, axes ...int) int { return node(graph.OpSum, graph.Attrs{Axes: axes}, x) }
	x, dy, other := in(graph.Float32, 4, 6, 8), in(graph.Float32, 4, 6, 8), in(graph.Float32, 4, 6, 8)
	early := sum(dy, 0, 1) // before the layer_norm_grad_x
	gx := node(graph.OpLayerNormGradX, graph.Attrs{NormDims: 1, Eps: 1e-5}, dy, x)
	db := sum(dy, 0, 1)
	assert.Equal(t, gx, graph.LayerNormBiasGradProducer(g, db))
	assert.Equal(t, gx, graph.CompanionProducer(g, db))
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, early), "the producer comes first")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, sum(dy, 0)), "not every leading axis")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, sum(dy, 0, 1, 2)), "the normalised axis too")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, node(graph.OpSum, graph.Attrs{Axes: []int{0, 1}, KeepDim: true}, dy)), "keepdim")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, sum(other, 0, 1)), "another tensor")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, sum(x, 0, 1)), "layer_norm_grad_x's x")
	wide := node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.BFloat16}}, dy)
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, sum(wide, 0, 1)), "a cast of g")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, node(graph.OpMean, graph.Attrs{Axes: []int{0, 1}}, dy)), "a mean")
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, gx), "a layer_norm_grad_x node")

	// Over two normalised dims, the bias gradient sums the one leading axis.
	gx2 := node(graph.OpLayerNormGradX, graph.Attrs{NormDims: 2, Eps: 1e-5}, other, x)
	assert.Equal(t, gx2, graph.LayerNormBiasGradProducer(g, sum(other, 0)))
	assert.Equal(t, -1, graph.LayerNormBiasGradProducer(g, sum(other, 0, 1)), "the other layer norm's axes")
	assert.Equal(t, -1, graph.CompanionProducer(g, sum(x, 0)), "a plain sum")
}

// TestBatchNormBiasGradProducer: a batch norm's bias gradient, the sum of
// its g over every axis but the channels (0, 2, 3 of NCHW g; 0, 1, 2 of
// channels-last g), pairs with the nearest earlier training-mode
// batch_norm_grad_x of that g in that layout; near misses (other axes,
// KeepDim, another tensor, x, a cast of g, a mean, a sum emitted before
// the batch_norm_grad_x, the other layout's axes) do not. Two
// batch_norm_grad_x of one g (a ResNet block's branch and its shortcut)
// each pair with the sum emitted after it. CompanionProducer dispatches
// sums to the rule.
func TestBatchNormBiasGradProducer(t *testing.T) {
	b := nodes{t, graph.New()}
	g := b.g
	in := func(dt graph.DType, shape ...int) int { return b.in(dt, true, shape...) }
	node := b.node
	sum := func(x int, axes ...int) int { return node(graph.OpSum, graph.Attrs{Axes: axes}, x) }
	train := graph.Attrs{Training: true, Eps: 1e-5}
	x, dy, other := in(graph.BFloat16, 4, 3, 5, 6), in(graph.BFloat16, 4, 3, 5, 6), in(graph.BFloat16, 4, 3, 5, 6)
	early := sum(dy, 0, 2, 3) // before the batch_norm_grad_x
	gx := node(graph.OpBatchNormGradX, train, dy, x)
	gw := node(graph.OpBatchNormGradW, train, dy, x)
	db := sum(dy, 0, 2, 3)
	assert.Equal(t, gx, graph.BatchNormBiasGradProducer(g, db))
	assert.Equal(t, gx, graph.CompanionProducer(g, db))
	assert.Equal(t, gx, graph.CompanionProducer(g, gw), "the weight's gradient too")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, early), "the producer comes first")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, sum(dy, 0, 2)), "not every axis but the channels")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, sum(dy, 0, 1, 2)), "channels-last axes of NCHW g")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, node(graph.OpSum, graph.Attrs{Axes: []int{0, 2, 3}, KeepDim: true}, dy)), "keepdim")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, sum(other, 0, 2, 3)), "another tensor")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, sum(x, 0, 2, 3)), "batch_norm_grad_x's x")
	wide := node(graph.OpCast, graph.Attrs{Target: graph.Type{DType: graph.Float32}}, dy)
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, sum(wide, 0, 2, 3)), "a cast of g")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, node(graph.OpMean, graph.Attrs{Axes: []int{0, 2, 3}}, dy)), "a mean")
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, gx), "a batch_norm_grad_x node")
	assert.Equal(t, -1, graph.CompanionProducer(g, sum(x, 0, 2, 3)), "a plain sum")

	// A second batch_norm_grad_x of the same g takes the sum after it.
	gx2 := node(graph.OpBatchNormGradX, train, dy, other)
	db2 := sum(dy, 0, 2, 3)
	assert.Equal(t, gx2, graph.BatchNormBiasGradProducer(g, db2))
	assert.Equal(t, gx, graph.BatchNormBiasGradProducer(g, db), "the first sum stays with the first")

	// Channels last: g [N, H, W, C] summed over N, H and W.
	xl, dyl := in(graph.BFloat16, 4, 5, 6, 3), in(graph.BFloat16, 4, 5, 6, 3)
	gxl := node(graph.OpBatchNormGradX, graph.Attrs{Training: true, Eps: 1e-5, ChannelsLast: true}, dyl, xl)
	assert.Equal(t, gxl, graph.BatchNormBiasGradProducer(g, sum(dyl, 0, 1, 2)))
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, sum(dyl, 0, 2, 3)), "NCHW axes of channels-last g")

	// A 2-D batch norm's g [N, C]: the sum over N.
	x2, dy2 := in(graph.Float32, 4, 5), in(graph.Float32, 4, 5)
	gx2d := node(graph.OpBatchNormGradX, train, dy2, x2)
	assert.Equal(t, gx2d, graph.BatchNormBiasGradProducer(g, sum(dy2, 0)))
	assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, -1))
}
