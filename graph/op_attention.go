package graph

import (
	"math"
	"slices"
)

const (
	// OpAttention is fused scaled dot-product attention: inputs q [B, H, T,
	// d], k [B, Hkv, S, d], v [B, Hkv, S, d][, mask broadcastable to [B, H,
	// T, S]]; Attrs.Scalar is the scale (0 asks for 1/√d; the rule writes
	// the value in), Attrs.Causal hides key j from query i when j > i
	// (PyTorch's is_causal: top-left aligned). Grouped-query attention: Hkv
	// divides H and query head h reads key/value head h/(H/Hkv). The output
	// is [B, H, T, d]; no [T, S] value exists anywhere, forward or backward.
	OpAttention Op = endConvOps + iota
	// OpAttentionLSE is the log-sum-exp of each query's scaled, masked
	// scores: inputs q, k[, mask]; same attributes; output [B, H, T]
	// float32 whatever the dtype of q (−Inf for a row with every key
	// masked). Only attention's backward emits it: it is recomputed there
	// rather than kept from the forward pass (see attentionVJP).
	OpAttentionLSE
	// OpAttentionGradQ is dq: inputs g, q, k, v, o, lse[, mask].
	OpAttentionGradQ
	// OpAttentionGradKV is dk and dv packed along the last axis: inputs g,
	// q, k, v, o, lse[, mask]; output [B, Hkv, S, 2d] (dk then dv), summed
	// over the query heads that share each key/value head.
	OpAttentionGradKV
	// OpAttentionQKV is OpAttention reading q, k and v straight from the
	// packed projection of a transformer block: input qkv [B, T, (H +
	// 2·Hkv)·d], its columns q [H, d], then k [Hkv, d], then v [Hkv, d]
	// (H = Attrs.Groups query heads, Hkv = Attrs.KVHeads key/value heads,
	// H when 0; Hkv divides H and query head h reads key/value head
	// h/(H/Hkv), grouped-query attention as OpAttention's); with Hkv = H
	// that is [B, T, 3, H, d]. Output [B, T, H·d], read as [B, T, H, d].
	// Same Scalar and Causal as OpAttention. It stands for slicing qkv,
	// permuting each part to [B, heads, T, d], attending and permuting
	// back, without the copies: cuDNN reads and writes those layouts
	// through strides.
	OpAttentionQKV
	// OpAttentionQKVLSE is attention_qkv's log-sum-exp: input qkv; output
	// [B, H, T] float32 (as OpAttentionLSE).
	OpAttentionQKVLSE
	// OpAttentionQKVGrad is d qkv in one op: inputs g [B, T, H·d], qkv, o
	// [B, T, H·d], lse [B, H, T]; output qkv's shape (dq, dk, dv packed as
	// qkv is; dk and dv summed over the query heads of each group).
	OpAttentionQKVGrad
	// OpRotary is the rotary position embedding of x [B, T, N, d] (N heads
	// of d at each of T positions; q or k, or a packed projection viewed
	// so) with the table cs [T, d] (float32): head n < Attrs.End of
	// position t is rotated by the angles θ_t,i of row t, each pair (i,
	// i + d/2) of Hugging Face's rotate_half convention,
	//
	//	y_i = x_i·cos θ_i − x_{i+d/2}·sin θ_i,  y_{i+d/2} = x_{i+d/2}·cos θ_i + x_i·sin θ_i,
	//
	// with cs[t, i] = cos θ_t,i and cs[t, d/2 + i] = sin θ_t,i (i < d/2);
	// heads from Attrs.End on are copied as they are (a packed qkv's v).
	// End 0 means all N (the rule writes N in). The output has x's type,
	// computed in float32 and rounded once.
	//
	// A table [T, 2d] is the full form: cos in columns 0 to d − 1 and sin
	// in d to 2d − 1, one value per element as x·cos + rotate_half(x)·sin
	// reads them, so
	//
	//	y_i = x_i·c_i − x_{i+d/2}·s_i,  y_{i+d/2} = x_{i+d/2}·c_{i+d/2} + x_i·s_{i+d/2},
	//
	// which is the rotation above when the two halves of each row are
	// equal (Hugging Face's tables, cat(freqs, freqs)); graph.FuseAttentionQKV
	// rewrites that expression, written out, to this form without reading
	// the tables' values. Its gradient is the transpose of each pair's 2×2
	// map.
	//
	// The angles come as a table rather than being computed in the
	// kernels: the table is a constant of T·d float32 values (512 KiB for
	// Llama 3's T = 2048, d = 64) that the planner counts like any
	// resident, made once on the host in float64 from the model's
	// frequencies (models.RopeConfig: rope_theta, linear or llama3
	// scaling), so every executor rotates by the same angles whatever
	// scaling made them, and the kernels read two values per pair, shared
	// by every head and sample, from cache, where computing them would
	// cost a precise sincos per element of a memory-bound pass.
	OpRotary
	// OpRotaryGrad is rotary's gradient: inputs g (x's shape), cs; the
	// rotation by −θ (the transpose of an orthogonal map), same End.
	OpRotaryGrad
	endAttentionOps
)

// Attention ops. Memory: the forward op keeps q, k, v, the mask and its
// output for backward ([B, H, T, d]-sized, as the projections are anyway)
// and nothing [T, S]-sized. Backward first recomputes the [B, H, T] float32
// log-sum-exp (one pass of q·kᵀ), then dq (a second pass, with the row
// term D = Σ g∘o computed per query row) and dk|dv (a third pass). The
// forward kernel never writes the log-sum-exp, so evaluation pays one pass
// and a training step keeps O(T) per head between forward and backward.
//
// Convention for rows whose every key is masked (−Inf scores): the output
// row is 0, the log-sum-exp −Inf and every gradient through that row 0,
// never NaN. PyTorch's SDPA returns 0 for such rows since 2.5 ("fully
// masked rows no longer cause NaNs"); earlier versions gave NaN on some
// paths (pytorch/pytorch#110213).
var attentionOps = []OpInfo{
	OpAttention: {Name: "attention", Category: CatContraction, MinArity: 3, Arity: 3, MaxArity: 4,
		Attrs: []string{"scalar", "causal"}, Rule: attentionRule, Chunk: attentionChunk,
		Saves: SavesInput(0, 1, 2, 3) | SavesOutput, VJP: attentionVJP},
	// attention_lse is emitted by attention's backward only, so it is
	// classed with the gradient ops.
	OpAttentionLSE: {Name: "attention_lse", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3,
		Attrs: []string{"scalar", "causal"}, Rule: attentionLSERule, Chunk: attentionChunk, NoVJP: noVJPGrad},
	OpAttentionGradQ: {Name: "attention_grad_q", Category: CatGrad, MinArity: 6, Arity: 6, MaxArity: 7,
		Attrs: []string{"scalar", "causal"}, Rule: attentionGradRule, Chunk: attentionChunk, NoVJP: noVJPGrad},
	OpAttentionGradKV: {Name: "attention_grad_kv", Category: CatGrad, MinArity: 6, Arity: 6, MaxArity: 7,
		Attrs: []string{"scalar", "causal"}, Rule: attentionGradRule, Chunk: attentionChunk, NoVJP: noVJPGrad},
	OpAttentionQKV: {Name: "attention_qkv", Category: CatContraction, MinArity: 1, Arity: 1,
		Attrs: []string{"groups", "kv_heads", "scalar", "causal"}, Rule: attentionQKVRule, Chunk: attentionChunk,
		Saves: SavesInput(0) | SavesOutput, VJP: attentionQKVVJP},
	OpAttentionQKVLSE: {Name: "attention_qkv_lse", Category: CatGrad, MinArity: 1, Arity: 1,
		Attrs: []string{"groups", "kv_heads", "scalar", "causal"}, Rule: attentionQKVRule, Chunk: attentionChunk, NoVJP: noVJPGrad},
	OpAttentionQKVGrad: {Name: "attention_qkv_grad", Category: CatGrad, MinArity: 4, Arity: 4,
		Attrs: []string{"groups", "kv_heads", "scalar", "causal"}, Rule: attentionQKVGradRule, Chunk: attentionChunk, NoVJP: noVJPGrad},
	// The table is shared by every sample (Weights): a batched one would
	// mix them. Backward reads only the table.
	OpRotary: {Name: "rotary", Category: CatMovement, MinArity: 2, Arity: 2, Attrs: []string{"end"},
		Rule: rotaryRule, Chunk: &Chunk{Weights: true, Linear: Multiplies}, Saves: SavesInput(1), VJP: rotaryVJP},
	OpRotaryGrad: {Name: "rotary_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"end", "axis"},
		Rule: rotaryRule, Chunk: &Chunk{Weights: true, Linear: Multiplies}, NoVJP: noVJPGrad},
}

// attentionChunk: the rules admit only inputs batched on axis 0 (or
// unbatched ones that broadcast over it), and every batch row is one
// sample's attention, so the ops are per-sample.
var attentionChunk = &Chunk{}

// AttentionShape is what the attention rule reads off q, k, v: batch B,
// query heads H, key/value heads Hkv, query length T, key length S, head
// dim D.
type AttentionShape struct{ B, H, Hkv, T, S, D int }

// AttentionDims checks q, k, v[, mask] and returns their sizes.
func AttentionDims(op Op, in []Type) (AttentionShape, error) {
	if err := needFloat(op, in...); err != nil {
		return AttentionShape{}, err
	}
	q, k, v := in[0], in[1], in[2]
	// q, k and v share a dtype; the mask may be any float type (it is added
	// to float32 scores, as a 16-bit q's are computed).
	for i, t := range in[:3] {
		if t.DType != q.DType {
			return AttentionShape{}, Errorf(ErrDType, "%s: input %d is %s, q is %s", op, i, t.DType, q.DType)
		}
	}
	for i, t := range []Type{q, k, v} {
		if len(t.Shape) != 4 {
			return AttentionShape{}, Errorf(ErrShape, "%s: %s must be [B, H, T, d], got %v", op, []string{"q", "k", "v"}[i], t.Shape)
		}
	}
	a := AttentionShape{B: q.Shape[0], H: q.Shape[1], T: q.Shape[2], D: q.Shape[3], Hkv: k.Shape[1], S: k.Shape[2]}
	switch {
	case k.Shape[0] != a.B || v.Shape[0] != a.B:
		return a, Errorf(ErrShape, "%s: batch sizes differ: q %v, k %v, v %v", op, q.Shape, k.Shape, v.Shape)
	case k.Shape[3] != a.D:
		return a, Errorf(ErrShape, "%s: head dims differ: q %v, k %v", op, q.Shape, k.Shape)
	case !slices.Equal(v.Shape, k.Shape):
		return a, Errorf(ErrShape, "%s: v %v must have k's shape %v (same heads, length and head dim)", op, v.Shape, k.Shape)
	case a.Hkv == 0 || a.H%a.Hkv != 0:
		return a, Errorf(ErrShape, "%s: k and v have %d heads, which does not divide q's %d heads (q %v, k %v)", op, a.Hkv, a.H, q.Shape, k.Shape)
	}
	// Batched inputs carry the batch on axis 0 with q's per-sample size;
	// an unbatched one beside a batched q would keep the full batch in a
	// chunk, so only the mask may be unbatched, and then of size 1 there.
	for i, t := range in {
		if t.BatchAxis == q.BatchAxis && (t.BatchAxis < 0 || t.PerSample == q.PerSample) {
			continue
		}
		if i == 3 && !t.Batched() && (len(t.Shape) < 4 || t.Shape[0] == 1) {
			continue
		}
		if q.Batched() && q.BatchAxis != 0 {
			return a, Errorf(ErrShape, "%s: q %v carries the batch on axis %d, not 0", op, q.Shape, q.BatchAxis)
		}
		return a, Errorf(ErrShape, "%s: input %d %v has batch axis %d, q %v has %d: q, k, v and a mask of the batch's size share the batch axis 0",
			op, i, t.Shape, t.BatchAxis, q.Shape, q.BatchAxis)
	}
	if q.Batched() && q.BatchAxis != 0 {
		return a, Errorf(ErrShape, "%s: q %v carries the batch on axis %d, not 0", op, q.Shape, q.BatchAxis)
	}
	if len(in) == 4 {
		m := in[3]
		full := []int{a.B, a.H, a.T, a.S}
		if len(m.Shape) > 4 {
			return a, Errorf(ErrShape, "%s: mask %v does not broadcast to [B, H, T, S] = %v", op, m.Shape, full)
		}
		for i, d := range m.Shape {
			if f := full[4-len(m.Shape)+i]; d != 1 && d != f {
				return a, Errorf(ErrShape, "%s: mask %v does not broadcast to [B, H, T, S] = %v", op, m.Shape, full)
			}
		}
	}
	return a, nil
}

// attentionScale writes the default scale 1/√d into attrs.
func attentionScale(op Op, attrs *Attrs, d int) error {
	if attrs.Scalar == 0 {
		attrs.Scalar = 1 / math.Sqrt(float64(max(d, 1)))
	}
	if math.IsNaN(attrs.Scalar) || math.IsInf(attrs.Scalar, 0) {
		return Errorf(ErrAttr, "%s: scale must be finite, got %g", op, attrs.Scalar)
	}
	return nil
}

func attentionRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	a, err := AttentionDims(op, in)
	if err != nil {
		return Type{}, err
	}
	if err := attentionScale(op, attrs, a.D); err != nil {
		return Type{}, err
	}
	q := in[0]
	return Type{Shape: slices.Clone(q.Shape), DType: q.DType, BatchAxis: q.BatchAxis, PerSample: q.PerSample}, nil
}

// attentionLSERule takes q, k[, mask]: k stands in for v.
func attentionLSERule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	full := append([]Type{in[0], in[1], in[1]}, in[2:]...)
	a, err := AttentionDims(op, full)
	if err != nil {
		return Type{}, err
	}
	if err := attentionScale(op, attrs, a.D); err != nil {
		return Type{}, err
	}
	return Type{Shape: []int{a.B, a.H, a.T}, DType: Float32, BatchAxis: in[0].BatchAxis, PerSample: in[0].PerSample}, nil
}

// attentionGradRule types dq (q's type) and dk|dv (k's, with 2d columns)
// from g, q, k, v, o, lse[, mask]. Attrs.Axis = 1 marks a request for the
// mask's gradient, which is refused: it would be [B, H, T, S].
func attentionGradRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	if attrs.Axis == 1 {
		return Type{}, Errorf(ErrAttr, "attention has no gradient for its additive mask (it would be [B, H, T, S]-sized); pass the mask as a constant")
	}
	fwd := append([]Type{in[1], in[2], in[3]}, in[6:]...)
	a, err := AttentionDims(op, fwd)
	if err != nil {
		return Type{}, err
	}
	if err := attentionScale(op, attrs, a.D); err != nil {
		return Type{}, err
	}
	if err := needFloat(op, in[0]); err != nil {
		return Type{}, err
	}
	q := in[1]
	for i, what := range []string{"g", "o"} {
		t := in[[]int{0, 4}[i]]
		if !slices.Equal(t.Shape, q.Shape) || t.DType != q.DType {
			return Type{}, Errorf(ErrShape, "%s: %s is %s%v, attention's output is %s%v", op, what, t.DType, t.Shape, q.DType, q.Shape)
		}
	}
	if lse := in[5]; !slices.Equal(lse.Shape, []int{a.B, a.H, a.T}) || lse.DType != Float32 {
		return Type{}, Errorf(ErrShape, "%s: lse is %s%v, want float32%v", op, lse.DType, lse.Shape, []int{a.B, a.H, a.T})
	}
	// The output is batched when any input is (g may be batched alone).
	ax, per := q.BatchAxis, q.PerSample
	if !q.Batched() && in[0].Batched() {
		ax, per = in[0].BatchAxis, in[0].PerSample
	}
	if op == OpAttentionGradQ {
		return Type{Shape: slices.Clone(q.Shape), DType: q.DType, BatchAxis: ax, PerSample: per}, nil
	}
	return Type{Shape: []int{a.B, a.Hkv, a.S, 2 * a.D}, DType: q.DType, BatchAxis: ax, PerSample: per}, nil
}

// attentionVJP recomputes the log-sum-exp, then emits dq and dk|dv, each of
// which recomputes the scores block by block (three passes of q·kᵀ in all
// besides the forward one; nothing [T, S]-sized is allocated).
func attentionVJP(b VJPBuilder, n *Node, g int) {
	in := n.Inputs
	a := Attrs{Scalar: n.Attrs.Scalar, Causal: n.Attrs.Causal}
	var mask []int
	if len(in) == 4 {
		mask = in[3:]
		if b.Wants(3) {
			bad := a
			bad.Axis = 1
			b.Emit(OpAttentionGradQ, bad, g, in[0], in[1], in[2], n.ID, g)
			return
		}
	}
	if !b.Wants(0) && !b.Wants(1) && !b.Wants(2) {
		return
	}
	lse := b.Emit(OpAttentionLSE, a, append([]int{in[0], in[1]}, mask...)...)
	args := append([]int{g, in[0], in[1], in[2], n.ID, lse}, mask...)
	if b.Wants(0) {
		b.Accumulate(in[0], b.Emit(OpAttentionGradQ, a, args...))
	}
	if b.Wants(1) || b.Wants(2) {
		kv := b.Emit(OpAttentionGradKV, a, args...)
		d := b.Type(in[1]).Shape[3]
		if b.Wants(1) {
			b.Accumulate(in[1], b.Emit(OpSlice, Attrs{Axis: 3, Start: 0, End: d, Step: 1}, kv))
		}
		if b.Wants(2) {
			b.Accumulate(in[2], b.Emit(OpSlice, Attrs{Axis: 3, Start: d, End: 2 * d, Step: 1}, kv))
		}
	}
}

// QKVShape is what attention_qkv's rule reads off qkv [B, T, (H +
// 2·Hkv)·D] and its head counts: batch B, query heads H, key/value heads
// Hkv, length T, head dim D.
type QKVShape struct{ B, H, Hkv, T, D int }

// C is the width H·D of q and of the output.
func (a QKVShape) C() int { return a.H * a.D }

// KV is the width Hkv·D of k and of v.
func (a QKVShape) KV() int { return a.Hkv * a.D }

// Pitch is qkv's row width (H + 2·Hkv)·D: C + 2·KV.
func (a QKVShape) Pitch() int { return a.C() + 2*a.KV() }

// Attention is the shape of the unpacked attention it stands for: q [B,
// H, T, D], k and v [B, Hkv, T, D].
func (a QKVShape) Attention() AttentionShape {
	return AttentionShape{B: a.B, H: a.H, Hkv: a.Hkv, T: a.T, S: a.T, D: a.D}
}

// QKVHeads is attention_qkv's query and key/value heads from its
// attributes: Groups, and KVHeads or Groups when 0.
func QKVHeads(a Attrs) (heads, kvHeads int) {
	if a.KVHeads == 0 {
		return a.Groups, a.Groups
	}
	return a.Groups, a.KVHeads
}

// QKVDims checks the packed projection qkv [B, T, (H + 2·Hkv)·d] (batch
// on axis 0, or unbatched) for the heads of attrs (QKVHeads) and returns
// its sizes.
func QKVDims(op Op, attrs Attrs, qkv Type) (QKVShape, error) {
	if err := needFloat(op, qkv); err != nil {
		return QKVShape{}, err
	}
	if len(qkv.Shape) != 3 {
		return QKVShape{}, Errorf(ErrShape, "%s: qkv must be [B, T, (heads + 2·kv_heads)·d], got %v", op, qkv.Shape)
	}
	h, hkv := QKVHeads(attrs)
	switch {
	case h < 1:
		return QKVShape{}, Errorf(ErrAttr, "%s: %d heads for qkv %v: want at least 1", op, h, qkv.Shape)
	case hkv < 1 || h%hkv != 0:
		return QKVShape{}, Errorf(ErrAttr, "%s: %d key/value heads do not divide %d heads (qkv %v)", op, hkv, h, qkv.Shape)
	case qkv.Shape[2]%(h+2*hkv) != 0:
		return QKVShape{}, Errorf(ErrAttr, "%s: %d heads and %d key/value heads do not split qkv %v into q, k and v of whole heads ((heads + 2·kv_heads) must divide the last axis)",
			op, h, hkv, qkv.Shape)
	}
	if qkv.Batched() && qkv.BatchAxis != 0 {
		return QKVShape{}, Errorf(ErrShape, "%s: qkv %v carries the batch on axis %d, not 0", op, qkv.Shape, qkv.BatchAxis)
	}
	return QKVShape{B: qkv.Shape[0], H: h, Hkv: hkv, T: qkv.Shape[1], D: qkv.Shape[2] / (h + 2*hkv)}, nil
}

// attentionQKVRule types attention_qkv ([B, T, C], qkv's dtype) and
// attention_qkv_lse ([B, H, T] float32) from qkv.
func attentionQKVRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	a, err := QKVDims(op, *attrs, in[0])
	if err != nil {
		return Type{}, err
	}
	if err := attentionScale(op, attrs, a.D); err != nil {
		return Type{}, err
	}
	qkv := in[0]
	if op == OpAttentionQKVLSE {
		return Type{Shape: []int{a.B, a.H, a.T}, DType: Float32, BatchAxis: qkv.BatchAxis, PerSample: qkv.PerSample}, nil
	}
	return Type{Shape: []int{a.B, a.T, a.C()}, DType: qkv.DType, BatchAxis: qkv.BatchAxis, PerSample: qkv.PerSample}, nil
}

// attentionQKVGradRule types d qkv (qkv's type) from g, qkv, o, lse.
func attentionQKVGradRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	g, qkv, o, lse := in[0], in[1], in[2], in[3]
	a, err := QKVDims(op, *attrs, qkv)
	if err != nil {
		return Type{}, err
	}
	if err := attentionScale(op, attrs, a.D); err != nil {
		return Type{}, err
	}
	want := []int{a.B, a.T, a.C()}
	for i, t := range []Type{g, o} {
		if !slices.Equal(t.Shape, want) || t.DType != qkv.DType {
			return Type{}, Errorf(ErrShape, "%s: %s is %s%v, attention_qkv's output is %s%v", op, []string{"g", "o"}[i], t.DType, t.Shape, qkv.DType, want)
		}
		if t.Batched() && t.BatchAxis != 0 {
			return Type{}, Errorf(ErrShape, "%s: %s %v carries the batch on axis %d, not 0", op, []string{"g", "o"}[i], t.Shape, t.BatchAxis)
		}
	}
	if !slices.Equal(lse.Shape, []int{a.B, a.H, a.T}) || lse.DType != Float32 {
		return Type{}, Errorf(ErrShape, "%s: lse is %s%v, want float32%v", op, lse.DType, lse.Shape, []int{a.B, a.H, a.T})
	}
	out := Type{Shape: slices.Clone(qkv.Shape), DType: qkv.DType, BatchAxis: qkv.BatchAxis, PerSample: qkv.PerSample}
	if !qkv.Batched() && g.Batched() { // g may be batched alone
		out.BatchAxis, out.PerSample = g.BatchAxis, g.PerSample
	}
	return out, nil
}

// attentionQKVVJP recomputes the log-sum-exp (the forward pass gives it
// where the executor can: LSEProducer), then d qkv in one op: no slices
// of the gradient to concatenate.
func attentionQKVVJP(b VJPBuilder, n *Node, g int) {
	if !b.Wants(0) {
		return
	}
	a := Attrs{Groups: n.Attrs.Groups, KVHeads: n.Attrs.KVHeads, Scalar: n.Attrs.Scalar, Causal: n.Attrs.Causal}
	lse := b.Emit(OpAttentionQKVLSE, a, n.Inputs[0])
	b.Accumulate(n.Inputs[0], b.Emit(OpAttentionQKVGrad, a, g, n.Inputs[0], n.ID, lse))
}

// LSEProducer returns the attention node whose forward pass can give the
// log-sum-exp that attention_lse node m recomputes: an earlier attention
// over the same q, k and mask with the same scale and causality (the
// forward node the backward pass emitted m for); for an attention_qkv_lse,
// an earlier attention_qkv of the same qkv and attributes; −1 when m is no
// attention_lse or attention_qkv_lse, or none qualifies. planner.Compile allocates m's output
// with that node's, so an executor may compute both in one pass
// (planner.Program.Companion).
func LSEProducer(g *Graph, m int) int {
	if m >= 0 && m < g.Len() && g.Node(m).Op == OpAttentionQKVLSE {
		return qkvLSEProducer(g, m)
	}
	if m < 0 || m >= g.Len() || g.Node(m).Op != OpAttentionLSE {
		return -1
	}
	lse := g.Node(m)
	for id := m - 1; id >= 0; id-- {
		n := g.Node(id)
		if n.Op != OpAttention || len(n.Inputs) != len(lse.Inputs)+1 ||
			n.Attrs.Scalar != lse.Attrs.Scalar || n.Attrs.Causal != lse.Attrs.Causal {
			continue
		}
		// attention: q, k, v[, mask]; attention_lse: q, k[, mask].
		if n.Inputs[0] == lse.Inputs[0] && n.Inputs[1] == lse.Inputs[1] &&
			(len(lse.Inputs) == 2 || n.Inputs[3] == lse.Inputs[2]) {
			return id
		}
	}
	return -1
}

// qkvLSEProducer is LSEProducer for attention_qkv_lse node m: an earlier
// attention_qkv of the same qkv, heads (query and key/value), scale and
// causality.
func qkvLSEProducer(g *Graph, m int) int {
	lse := g.Node(m)
	for id := m - 1; id >= 0; id-- {
		n := g.Node(id)
		if n.Op == OpAttentionQKV && n.Inputs[0] == lse.Inputs[0] && n.Attrs.Groups == lse.Attrs.Groups && n.Attrs.KVHeads == lse.Attrs.KVHeads &&
			n.Attrs.Scalar == lse.Attrs.Scalar && n.Attrs.Causal == lse.Attrs.Causal {
			return id
		}
	}
	return -1
}

// RotaryShape is what rotary's rule reads off x [B, T, N, D] and its
// table: batch B, positions T, heads N of D values, the first End of them
// rotated; Full for a table [T, 2D] (OpRotary's full form), false for
// [T, D].
type RotaryShape struct {
	B, T, N, D, End int
	Full            bool
}

// RotaryDims checks x [B, T, N, d] and the table cs [T, d] or [T, 2d]
// (float32, no batch axis) for rotating the first end heads (0: all) and
// returns the sizes, End filled in.
func RotaryDims(op Op, end int, x, cs Type) (RotaryShape, error) {
	if err := needFloat(op, x); err != nil {
		return RotaryShape{}, err
	}
	if len(x.Shape) != 4 {
		return RotaryShape{}, Errorf(ErrShape, "%s: x must be [B, T, heads, d], got %v", op, x.Shape)
	}
	a := RotaryShape{B: x.Shape[0], T: x.Shape[1], N: x.Shape[2], D: x.Shape[3], End: end}
	if a.End == 0 {
		a.End = a.N
	}
	switch {
	case a.D%2 != 0:
		return a, Errorf(ErrShape, "%s: head dim %d of x %v is odd: rotate_half pairs i with i + d/2", op, a.D, x.Shape)
	case a.End < 0 || a.End > a.N:
		return a, Errorf(ErrAttr, "%s: %d rotated heads of x %v (want 0 for all, or 1 to %d)", op, end, x.Shape, a.N)
	case cs.DType != Float32:
		return a, Errorf(ErrDType, "%s: the cos/sin table is %s, want float32", op, cs.DType)
	case !slices.Equal(cs.Shape, []int{a.T, a.D}) && !slices.Equal(cs.Shape, []int{a.T, 2 * a.D}):
		return a, Errorf(ErrShape, "%s: the cos/sin table is %v, want [T, d] = [%d, %d] or [T, 2d] = [%[3]d, %[5]d] for x %[6]v",
			op, cs.Shape, a.T, a.D, 2*a.D, x.Shape)
	case cs.Batched():
		return a, Errorf(ErrShape, "%s: the cos/sin table %v carries the batch (axis %d): one table serves every sample", op, cs.Shape, cs.BatchAxis)
	case x.Batched() && x.BatchAxis > 1:
		return a, Errorf(ErrShape, "%s: x %v carries the batch on axis %d, a head or head-dim axis", op, x.Shape, x.BatchAxis)
	}
	a.Full = cs.Shape[1] == 2*a.D
	return a, nil
}

// rotaryRule types rotary and rotary_grad: x's type. rotary_grad's
// Attrs.Axis = 1 marks a request for the table's gradient, which is
// refused.
func rotaryRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	if op == OpRotaryGrad && attrs.Axis == 1 {
		return Type{}, Errorf(ErrAttr, "rotary has no gradient for its cos/sin table; pass the table as a constant")
	}
	a, err := RotaryDims(op, attrs.End, in[0], in[1])
	if err != nil {
		return Type{}, err
	}
	attrs.End = a.End
	return in[0], nil
}

// rotaryVJP: the rotation's transpose, by −θ.
func rotaryVJP(b VJPBuilder, n *Node, g int) {
	if b.Wants(1) {
		b.Emit(OpRotaryGrad, Attrs{End: n.Attrs.End, Axis: 1}, g, n.Inputs[1])
		return
	}
	if b.Wants(0) {
		b.Accumulate(n.Inputs[0], b.Emit(OpRotaryGrad, Attrs{End: n.Attrs.End}, g, n.Inputs[1]))
	}
}
