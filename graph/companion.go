package graph

import "slices"

// CompanionProducer returns the node whose kernel can also compute node
// m's output in the same pass, −1 for none: an attention_lse's attention
// or an attention_qkv_lse's attention_qkv (LSEProducer), an
// attention_grad_kv's attention_grad_q (AttentionGradKVProducer), a
// training-mode batch_norm_grad_w's batch_norm_grad_x
// (BatchNormGradWProducer), a layer_norm_grad_w's layer_norm_grad_x
// (LayerNormGradWProducer), an rms_norm_grad_w's rms_norm_grad_x
// (RMSNormGradWProducer), a layer norm's bias gradient (a sum of g over
// the leading axes) and the layer_norm_grad_x of that g
// (LayerNormBiasGradProducer), a batch norm's bias gradient (a sum of g
// over every axis but the channels) and the batch_norm_grad_x of that g
// (BatchNormBiasGradProducer), another output of a fused_pointwise's
// expression and the node giving its first (FusedPointwiseProducer), a
// cross_entropy_grad's cross_entropy when
// its seed is constant (CrossEntropyGradProducer), a
// linear_cross_entropy's gradients and the linear_cross_entropy (or
// _grad_w and _grad_h) (LinearCrossEntropyGradProducer), a tanh-form gelu's
// linear (GeluProducer), a layer norm's or an rms_norm's feeding float32
// add (AddLayerNormProducer, AddRMSNormProducer), a swiglu's up gradient
// and its gate gradient (SwiGLUGradProducer), or a 16-bit cast's layer
// norm or RMS norm input gradient (LayerNormGradCastProducer). A
// layer_norm_grad_x_add stands for a layer_norm_grad_x throughout, an
// rms_norm_grad_x_add for an rms_norm_grad_x.
// planner.Compile allocates m's output with the producer's, so an executor may compute
// both at once (planner.Program.Companion); one that does not runs m as
// usual. A producer may have several companions (layer_norm_grad_x: its
// weight's and its bias's gradients); each is found from the companion,
// and the producer always comes before it (batch_norm_grad_x: its
// weight's and its bias's gradients too).
func CompanionProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	switch g.Node(m).Op {
	case OpAttentionLSE, OpAttentionQKVLSE:
		return LSEProducer(g, m)
	case OpAttentionGradKV:
		return AttentionGradKVProducer(g, m)
	case OpBatchNormGradW:
		return BatchNormGradWProducer(g, m)
	case OpLayerNormGradW:
		return LayerNormGradWProducer(g, m)
	case OpRMSNormGradW:
		return RMSNormGradWProducer(g, m)
	case OpRMSNorm:
		return AddRMSNormProducer(g, m)
	case OpSwiGLUGrad:
		return SwiGLUGradProducer(g, m)
	case OpSum:
		if p := LayerNormBiasGradProducer(g, m); p >= 0 {
			return p
		}
		return BatchNormBiasGradProducer(g, m)
	case OpCrossEntropyGrad:
		return CrossEntropyGradProducer(g, m)
	case OpLinearCrossEntropyGradH, OpLinearCrossEntropyGradW:
		return LinearCrossEntropyGradProducer(g, m)
	case OpGelu:
		return GeluProducer(g, m)
	case OpLayerNorm:
		return AddLayerNormProducer(g, m)
	case OpCast:
		return LayerNormGradCastProducer(g, m)
	case OpFusedPointwise:
		return FusedPointwiseProducer(g, m)
	}
	return -1
}

// FusedPointwiseProducer returns the fused_pointwise node whose kernel
// can also give fused_pointwise node m: the node giving output 0 of m's
// expression (the same Attrs.Pointwise) from the same inputs, made before
// m (FusePointwise makes a group's nodes one after another), when m gives
// another output; −1 otherwise. The generated kernel then stores every
// output of the expression in one pass.
func FusedPointwiseProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	n := g.Node(m)
	p := m - n.Attrs.Axis
	if n.Op != OpFusedPointwise || n.Attrs.Pointwise == nil || n.Attrs.Axis <= 0 || p < 0 {
		return -1
	}
	pn := g.Node(p)
	if pn.Op != OpFusedPointwise || pn.Attrs.Pointwise != n.Attrs.Pointwise || pn.Attrs.Axis != 0 ||
		!slices.Equal(pn.Inputs, n.Inputs) {
		return -1
	}
	return p
}

// isLayerNormGradX reports whether op is a layer norm's input gradient:
// layer_norm_grad_x, or layer_norm_grad_x_add with a gradient added.
func isLayerNormGradX(op Op) bool { return op == OpLayerNormGradX || op == OpLayerNormGradXAdd }

// isRMSNormGradX reports whether op is an RMS norm's input gradient:
// rms_norm_grad_x, or rms_norm_grad_x_add with a gradient added.
func isRMSNormGradX(op Op) bool { return op == OpRMSNormGradX || op == OpRMSNormGradXAdd }

// LayerNormGradCastProducer returns the layer norm input gradient whose
// pass can also give cast node m: m's input, when m narrows that float32
// layer_norm_grad_x or layer_norm_grad_x_add (or rms_norm_grad_x or
// rms_norm_grad_x_add) to a 16-bit dtype (mixed
// precision's backward pass feeds the gradient to 16-bit GEMMs); −1
// otherwise. The pass then rounds each element it writes into m's output
// too, instead of a cast reading the gradient back. The forward pass's
// cast of a layer norm is not paired with the add that computes that layer
// norm: a companion is allocated with its producer, before the add's
// inputs are freed, and that order raised GPT-2 small's bf16-mixed peak at
// batch 32 from 18.27 to 21.34 GiB reserved (the allocator's segments fell
// out another way), for 14 µs a layer saved.
func LayerNormGradCastProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	n := g.Node(m)
	if n.Op != OpCast || len(n.Inputs) != 1 || (n.Type.DType != BFloat16 && n.Type.DType != Float16) {
		return -1
	}
	p := n.Inputs[0]
	if ln := g.Node(p); (isLayerNormGradX(ln.Op) || isRMSNormGradX(ln.Op)) && ln.Type.DType == Float32 {
		return p
	}
	return -1
}

// AddLayerNormProducer returns the add whose pass can also give layer_norm
// node m: m's x, when it is a float32 add of a float32 value of its shape
// and a float value broadcast over whole rows (a shape that ends the
// add's and spans m's normalised dims: a transformer's residual stream
// plus a block's output, or the token plus the position embedding), and
// m's weight and bias are float32 parameters or values made before the
// add; −1 otherwise. The add's kernel then normalises each row it has just
// summed, in registers, instead of the layer norm reading it back.
func AddLayerNormProducer(g *Graph, m int) int { return addNormProducer(g, m, OpLayerNorm) }

// AddRMSNormProducer is AddLayerNormProducer for rms_norm node m (its
// weight as the layer norm's): the add's kernel sums each row of a
// residual stream and a block's output and normalises it by its root mean
// square in the same pass, the fused add-and-norm of Llama's decoder
// layers. The add stays a node of its own (the stream goes on from it to
// the next residual add) and the norm another: a node has one output, so
// a fused op would have to give the sum and the norm packed in one value.
func AddRMSNormProducer(g *Graph, m int) int { return addNormProducer(g, m, OpRMSNorm) }

// addNormProducer is AddLayerNormProducer and AddRMSNormProducer, for
// normalisation op op.
func addNormProducer(g *Graph, m int, op Op) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	n := g.Node(m)
	if n.Op != op || len(n.Inputs) < 1 {
		return -1
	}
	p := n.Inputs[0]
	add := g.Node(p)
	if add.Op != OpAdd || len(add.Inputs) != 2 || add.Type.DType != Float32 {
		return -1
	}
	for _, in := range n.Inputs[1:] {
		// A parameter is on the device from the step's start; a computed
		// weight must exist when the add runs.
		if w := g.Node(in); w.Type.DType != Float32 || in >= p && w.Op != OpParam {
			return -1
		}
	}
	a, b := g.Node(add.Inputs[0]).Type, g.Node(add.Inputs[1]).Type
	if a.DType != Float32 || !slices.Equal(a.Shape, add.Type.Shape) {
		a, b = b, a
	}
	s, r := add.Type.Shape, len(add.Type.Shape)
	if a.DType != Float32 || !slices.Equal(a.Shape, s) || !b.DType.IsFloat() ||
		len(b.Shape) < n.Attrs.NormDims || len(b.Shape) > r || !slices.Equal(b.Shape, s[r-len(b.Shape):]) {
		return -1
	}
	return p
}

// GeluProducer returns the linear whose GEMM can also give gelu node m:
// m's input, when m is the tanh form (a GEMM epilogue's GELU) and its
// input is a linear; −1 otherwise. The linear's output, GELU's input,
// stays what it was (the backward pass reads it); the epilogue writes
// both.
func GeluProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	n := g.Node(m)
	if n.Op != OpGelu || !n.Attrs.Approx || len(n.Inputs) != 1 {
		return -1
	}
	if p := n.Inputs[0]; g.Node(p).Op == OpLinear {
		return p
	}
	return -1
}

// CrossEntropyGradProducer returns the cross_entropy node whose pass over
// the logits can also give cross_entropy_grad node m: an earlier
// cross_entropy of the same logits and labels with the same Scalar and
// End, when m's upstream gradient is a fill (a constant, the backward
// pass's seed: its value is known before the forward pass runs, which a
// loss-scaled seed's is not); −1 otherwise. The pass that finds each row's
// log-sum-exp then writes its gradient too, instead of a second kernel
// reading the [N, C] logits twice more.
func CrossEntropyGradProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	gr := g.Node(m)
	if gr.Op != OpCrossEntropyGrad || len(gr.Inputs) != 3 {
		return -1
	}
	if seed := g.Node(gr.Inputs[0]); seed.Op != OpFill || len(seed.Inputs) != 0 {
		return -1
	}
	for id := m - 1; id >= 0; id-- {
		n := g.Node(id)
		if n.Op == OpCrossEntropy && len(n.Inputs) == 2 && n.Inputs[0] == gr.Inputs[1] && n.Inputs[1] == gr.Inputs[2] &&
			n.Attrs.Scalar == gr.Attrs.Scalar && n.Attrs.End == gr.Attrs.End {
			return id
		}
	}
	return -1
}

// AttentionGradKVProducer returns the attention_grad_q node whose pass can
// also give the dk|dv that attention_grad_kv node m computes: an earlier
// attention_grad_q of the same g, q, k, v, o, lse and mask with the same
// scale and causality (the one attention's backward pass emitted beside
// m; cuDNN's fused backward pass gives dq, dk and dv at once); −1 when m
// is no attention_grad_kv or none qualifies.
func AttentionGradKVProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() || g.Node(m).Op != OpAttentionGradKV {
		return -1
	}
	kv := g.Node(m)
	for id := m - 1; id >= 0; id-- {
		n := g.Node(id)
		if n.Op == OpAttentionGradQ && slices.Equal(n.Inputs, kv.Inputs) &&
			n.Attrs.Scalar == kv.Attrs.Scalar && n.Attrs.Causal == kv.Attrs.Causal && n.Attrs.Axis == kv.Attrs.Axis {
			return id
		}
	}
	return -1
}

// BatchNormGradWProducer returns the batch_norm_grad_x node whose pass over
// g and x can give Σ g·x̂, which training-mode batch_norm_grad_w node m
// computes: an earlier batch_norm_grad_x of the same g, x and attributes
// (the one the backward pass emitted beside m; a backward pass over x's
// statistics sums g·x̂ on its way to dx, as cuDNN's does); −1 when m is no
// such node or none qualifies.
func BatchNormGradWProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	w := g.Node(m)
	if w.Op != OpBatchNormGradW || !w.Attrs.Training || len(w.Inputs) != 2 {
		return -1
	}
	for id := m - 1; id >= 0; id-- {
		n := g.Node(id)
		if n.Op == OpBatchNormGradX && n.Inputs[0] == w.Inputs[0] && n.Inputs[1] == w.Inputs[1] &&
			n.Attrs.Training == w.Attrs.Training && n.Attrs.PerChunk == w.Attrs.PerChunk && n.Attrs.Eps == w.Attrs.Eps &&
			n.Attrs.ChannelsLast == w.Attrs.ChannelsLast {
			return id
		}
	}
	return -1
}

// LayerNormGradWProducer returns the layer_norm_grad_x node whose pass over
// g and x can give Σ g·x̂, which layer_norm_grad_w node m computes: an
// earlier layer_norm_grad_x of the same g and x with the same NormDims and
// Eps (the one layer_norm's backward pass emitted beside m: the pass finds
// each row's statistics and x̂ on its way to dx); −1 when m is no such node
// or none qualifies.
func LayerNormGradWProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	w := g.Node(m)
	if w.Op != OpLayerNormGradW || len(w.Inputs) != 2 {
		return -1
	}
	// The producer reads g and x, so it comes after both.
	for id := m - 1; id > max(w.Inputs[0], w.Inputs[1]); id-- {
		n := g.Node(id)
		if isLayerNormGradX(n.Op) && len(n.Inputs) >= 2 && n.Inputs[0] == w.Inputs[0] && n.Inputs[1] == w.Inputs[1] &&
			n.Attrs.NormDims == w.Attrs.NormDims && n.Attrs.Eps == w.Attrs.Eps {
			return id
		}
	}
	return -1
}

// RMSNormGradWProducer is LayerNormGradWProducer for rms_norm_grad_w
// node m: an earlier rms_norm_grad_x (or rms_norm_grad_x_add) of the same
// g and x with the same NormDims and Eps, whose pass over g and x finds
// each row's rstd and x̂ on its way to dx; −1 when m is no such node or
// none qualifies.
func RMSNormGradWProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	w := g.Node(m)
	if w.Op != OpRMSNormGradW || len(w.Inputs) != 2 {
		return -1
	}
	for id := m - 1; id > max(w.Inputs[0], w.Inputs[1]); id-- {
		n := g.Node(id)
		if isRMSNormGradX(n.Op) && len(n.Inputs) >= 2 && n.Inputs[0] == w.Inputs[0] && n.Inputs[1] == w.Inputs[1] &&
			n.Attrs.NormDims == w.Attrs.NormDims && n.Attrs.Eps == w.Attrs.Eps {
			return id
		}
	}
	return -1
}

// SwiGLUGradProducer returns the swiglu_grad node whose pass over g, gate
// and up can also give swiglu_grad node m: m is up's gradient (Axis 1)
// and the producer an earlier gate gradient (Axis 0) of the same g, gate
// and up (the pair swiglu's backward pass emits); −1 otherwise. One pass
// then reads the three once and writes both gradients.
func SwiGLUGradProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	up := g.Node(m)
	if up.Op != OpSwiGLUGrad || up.Attrs.Axis != 1 || len(up.Inputs) != 3 {
		return -1
	}
	for id := m - 1; id > max(up.Inputs[0], up.Inputs[1], up.Inputs[2]); id-- {
		if n := g.Node(id); n.Op == OpSwiGLUGrad && n.Attrs.Axis == 0 && slices.Equal(n.Inputs, up.Inputs) {
			return id
		}
	}
	return -1
}

// LayerNormBiasGradProducer returns the layer_norm_grad_x node whose pass
// over g can also give sum node m, a layer norm's bias gradient: m sums
// exactly that g over all its leading axes (Axes 0, 1, …, in order, no
// KeepDim), those in front of the layer_norm_grad_x's NormDims trailing
// ones, in g's dtype, as layer_norm's backward pass emits it; −1 for any
// other sum, or when no earlier layer_norm_grad_x reads m's input as its g.
func LayerNormBiasGradProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	s := g.Node(m)
	if s.Op != OpSum || len(s.Inputs) != 1 || s.Attrs.KeepDim || len(s.Attrs.Axes) == 0 {
		return -1
	}
	for i, a := range s.Attrs.Axes {
		if a != i {
			return -1
		}
	}
	gt := g.Node(s.Inputs[0]).Type
	lead := len(s.Attrs.Axes)
	if lead >= len(gt.Shape) || s.Type.DType != gt.DType || !slices.Equal(s.Type.Shape, gt.Shape[lead:]) {
		return -1
	}
	for id := m - 1; id > s.Inputs[0]; id-- {
		n := g.Node(id)
		if isLayerNormGradX(n.Op) && len(n.Inputs) >= 2 && n.Inputs[0] == s.Inputs[0] &&
			n.Attrs.NormDims == len(gt.Shape)-lead && n.Type.DType == gt.DType {
			return id
		}
	}
	return -1
}

// BatchNormBiasGradProducer returns the batch_norm_grad_x node whose pass
// over g can also give sum node m, a batch norm's bias gradient: m sums
// exactly that g over every axis but the channels, in order and without
// KeepDim (axes 0, 2, 3, … of NCHW g [N, C, …]; 0, 1, 2 of channels-last g
// [N, H, W, C], graph.Attrs.ChannelsLast), into [C] in g's dtype, as
// batch_norm's backward pass emits it. The producer is the nearest earlier
// batch_norm_grad_x (training mode, in the layout of m's axes) that reads
// m's input as its g: its statistics pass sums g per channel on its way to dx (cuDNN's
// backward gives the sum as its dBias). −1 for any other sum, or when no
// such batch_norm_grad_x exists.
func BatchNormBiasGradProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	s := g.Node(m)
	if s.Op != OpSum || len(s.Inputs) != 1 || s.Attrs.KeepDim {
		return -1
	}
	gt := g.Node(s.Inputs[0]).Type
	if len(gt.Shape) < 2 || s.Type.DType != gt.DType || len(s.Type.Shape) != 1 {
		return -1
	}
	for id := m - 1; id > s.Inputs[0]; id-- {
		n := g.Node(id)
		if n.Op != OpBatchNormGradX || len(n.Inputs) < 2 || n.Inputs[0] != s.Inputs[0] || !n.Attrs.Training {
			continue
		}
		if ch, ok := bnBiasAxes(gt.Shape, n.Attrs.ChannelsLast, s.Attrs.Axes); ok && s.Type.Shape[0] == gt.Shape[ch] {
			return id
		}
	}
	return -1
}

// bnBiasAxes reports whether axes are every axis of a batch norm's g of
// shape but its channel axis, in order, and gives the channel axis: 1, or
// the last of a 4-D channels-last g.
func bnBiasAxes(shape []int, channelsLast bool, axes []int) (int, bool) {
	ch := 1
	if channelsLast {
		if len(shape) != 4 {
			return 0, false
		}
		ch = 3
	}
	if len(axes) != len(shape)-1 {
		return 0, false
	}
	i := 0
	for a := range shape {
		if a == ch {
			continue
		}
		if axes[i] != a {
			return 0, false
		}
		i++
	}
	return ch, true
}
