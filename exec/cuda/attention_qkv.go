package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Packed attention (attention_qkv, attention_qkv_lse, attention_qkv_grad):
// q, k and v read in place from the projection qkv [B, T, (H + 2·Hkv)·d]
// (q [B, T, H, d] in its first C = H·d columns, then k and v [B, T, Hkv,
// d]; [B, T, 3, H, d] when Hkv = H), o written as [B, T, C] and d qkv as
// qkv is laid out. cuDNN's fused attention takes those layouts through
// its tensors' strides (sdpaKey.packed), so on cuDNN's shapes (sdpaShape:
// 16-bit, head dim 64 or 128, grouped heads or not) nothing is copied:
// the forward pass also writes the log-sum-exp of its attention_qkv_lse
// companion, and the backward pass writes dq, dk and dv (each group's sum)
// into d qkv in one call.
//
// Elsewhere (float32, other head dims, cuDNN off or refusing) the kernels
// of attention.go run on copies in the node's workspace, laid out as they
// want them: q (and o, g) gathered to [B, H, T, d], k and v to [B, Hkv,
// T, d], the results gathered back (the float32 path's GEMMs read the
// copies as they read attention's operands). Such a call is counted in
// DNN.AttnStats as attnQKVPermuted besides cuDNN's reason. The workspace
// holds the kernels' own (attnQKVInner) first, then the copies, and is
// declared from the types alone: the larger of that and cuDNN's.
var attentionQKVKernels = family{
	graph.OpAttentionQKV:     {run: attentionQKVFwd, ws: attnQKVWorkspace},
	graph.OpAttentionQKVLSE:  {run: attentionQKVLSE, ws: attnQKVWorkspace},
	graph.OpAttentionQKVGrad: {run: attentionQKVGrad, ws: attnQKVWorkspace},
}

// attnQKVPermuted is the AttnStats reason of a packed call that ran on
// copies.
const attnQKVPermuted = "attention_qkv permuted"

// attnQKVCopies is how many elements of the dtype a packed op's fallback
// keeps in its workspace after the kernels' own: q, k, v and o forward; q
// and k for the log-sum-exp; o, g, dq and dk|dv backward, whose q, k and
// v go to d qkv's output (of their size) until the gradients replace them.
func attnQKVCopies(op graph.Op, s graph.QKVShape) int64 {
	nq, nkv := int64(s.B*s.T*s.C()), int64(s.B*s.T*s.KV())
	switch op {
	case graph.OpAttentionQKV:
		return 2*nq + 2*nkv
	case graph.OpAttentionQKVLSE:
		return nq + nkv
	}
	return 3*nq + 2*nkv
}

// attnQKVInner is the workspace the kernels of attention.go take for op's
// pass at shape s and dtype dt: the float32 path's score blocks (one
// array, two for the gradients), the tensor-core dk|dv pass's row term D
// (each sample's rounded up to 16 bytes, so the copies after it stay
// aligned and the size stays linear in B).
func attnQKVInner(op graph.Op, dt graph.DType, s graph.QKVShape) int64 {
	grad := op == graph.OpAttentionQKVGrad
	switch {
	case dt == graph.Float32 && grad:
		return 2 * attnBlockBytes(s.B, s.H, s.T, s.T)
	case dt == graph.Float32:
		return attnBlockBytes(s.B, s.H, s.T, s.T)
	case grad && attnMMAShape(dt, s.D, false):
		return int64(s.B) * ceilDiv(attnDotBytes(int64(s.H*s.T)), 16) * 16
	}
	return 0
}

// attnQKVFallbackBytes is the fallback's workspace: the kernels' own, then
// the copies (attnQKVCopies).
func attnQKVFallbackBytes(op graph.Op, dt graph.DType, s graph.QKVShape) int64 {
	return attnQKVInner(op, dt, s) + attnQKVCopies(op, s)*int64(dt.Size())
}

// attnQKVWorkspace is a packed op's workspace at chunk size b: enough for
// the fallback and, on cuDNN's shapes, for cuDNN (sdpaFwdBytes for the
// forward pass, sdpaBwdBytes for the backward one). The planner reads a
// workspace as fixed + per-sample bytes, so the bound is the larger fixed
// part plus the larger per-sample part of the two, not their pointwise
// maximum (which is not affine in b).
func attnQKVWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	qi := 0
	if nd.Op == graph.OpAttentionQKVGrad {
		qi = 1
	}
	dt := g.Node(nd.Inputs[qi]).Type.DType
	at := func(b int) (fallback, sdpa int64) {
		s, err := graph.QKVDims(nd.Op, nd.Attrs, graph.Type{Shape: inputAt(g, nd, qi, b), DType: dt, BatchAxis: -1})
		if err != nil {
			return 0, 0
		}
		if sdpaShape(dt, s.D, false, s.H, s.Hkv) {
			x := qkvDims(s)
			switch nd.Op {
			case graph.OpAttentionQKV:
				sdpa = sdpaFwdBytes(x)
			case graph.OpAttentionQKVGrad:
				sdpa = sdpaBwdBytes(x)
			}
		}
		return attnQKVFallbackBytes(nd.Op, dt, s), sdpa
	}
	f0, s0 := at(0)
	f1, s1 := at(1)
	return max(f0, s0) + int64(b)*max(f1-f0, s1-s0)
}

// qkvDims is the sizes of the unpacked attention s holds.
func qkvDims(s graph.QKVShape) sdpaDims {
	return sdpaDims{b: int64(s.B), h: int64(s.H), hkv: int64(s.Hkv), t: int64(s.T), s: int64(s.T), d: int64(s.D)}
}

// qkvGeom checks qkv and returns its dtype, its shape and the geometry of
// the unpacked attention it holds.
func (k *kctx) qkvGeom(qkv operand) (graph.DType, graph.QKVShape, attnShape, error) {
	a := k.attrs()
	s, err := graph.QKVDims(k.nd.Op, *a, graph.Type{Shape: qkv.shape, DType: qkv.dt, BatchAxis: -1})
	if err != nil {
		return 0, s, attnShape{}, err
	}
	if s.D > attMaxD && qkv.dt != graph.Float32 {
		return 0, s, attnShape{}, graph.Errorf(graph.ErrShape, "%s: head dim %d (qkv %v, %d heads) is larger than the CUDA kernels' %d", k.nd.Op, s.D, qkv.shape, s.H, attMaxD)
	}
	sh := attnShape{b: s.B, h: s.H, hkv: s.Hkv, t: s.T, s: s.T, d: s.D, scale: float32(a.Scalar), causal: a.Causal}
	return qkv.dt, s, sh, nil
}

// qkvParts is the addresses of the q, k and v (or dq, dk, dv) columns of
// a packed [B, T, (H + 2·Hkv)·d] array at p: columns 0, C and C + KV.
func qkvParts(p alloc.Ptr, dt graph.DType, s graph.QKVShape) (alloc.Ptr, alloc.Ptr, alloc.Ptr) {
	c, kv := alloc.Ptr(s.C()*dt.Size()), alloc.Ptr(s.KV()*dt.Size())
	return p, p + c, p + c + kv
}

// qkvFallback counts a packed call left to the kernels (with cuDNN on)
// and returns the start of its copies in the workspace and a context for
// the kernels of attention.go: no cuDNN, no companion, the node seen as
// op (attention_grad_q or attention_grad_kv tell attentionGrad which).
func (k *kctx) qkvFallback(op graph.Op, dt graph.DType, s graph.QKVShape) (alloc.Ptr, *kctx, error) {
	if k.dnn != nil && !k.dnn.noSDPA {
		k.dnn.fallback(attnQKVPermuted)
	}
	ws, err := k.workspace(attnQKVFallbackBytes(k.nd.Op, dt, s))
	if err != nil {
		return 0, nil, err
	}
	sub := *k
	sub.dnn, sub.co, sub.coDone, sub.more = nil, nil, false, nil
	if op != k.nd.Op {
		sub.nd = &graph.Node{Op: op, Attrs: k.nd.Attrs}
	}
	return ws + alloc.Ptr(attnQKVInner(k.nd.Op, dt, s)), &sub, nil
}

// heads is the operands of consecutive contiguous arrays from p, one per
// entry of n: [B, n[i], T, d] of dtype dt.
func heads(p alloc.Ptr, dt graph.DType, s graph.QKVShape, n ...int) []operand {
	out := make([]operand, len(n))
	for i, h := range n {
		out[i] = operand{p: p, shape: []int{s.B, h, s.T, s.D}, dt: dt}
		p += alloc.Ptr(s.B * h * s.T * s.D * dt.Size())
	}
	return out
}

// gatherHeads copies the first count of q [B, T, H, d], k and v [B, T,
// Hkv, d] from the rows of qkv to consecutive arrays at dst: q as [B, H,
// T, d], k and v as [B, Hkv, T, d] (heads' layout).
func (k *kctx) gatherHeads(dt graph.DType, qkv, dst alloc.Ptr, s graph.QKVShape, count int) error {
	p := s.Pitch()
	src := [3]alloc.Ptr{}
	src[0], src[1], src[2] = qkvParts(qkv, dt, s)
	for i, h := range []int{s.H, s.Hkv, s.Hkv}[:count] {
		if err := k.gatherView(dt, src[i], dst, []int{s.B, h, s.T, s.D}, []int{s.T * p, s.D, p, 1}); err != nil {
			return err
		}
		dst += alloc.Ptr(s.B * h * s.T * s.D * dt.Size())
	}
	return nil
}

// gatherView copies the view of src with sizes dims and element strides
// strides to dst, contiguous.
func (k *kctx) gatherView(dt graph.DType, src, dst alloc.Ptr, dims, strides []int) error {
	n := int64(graph.Numel(dims))
	if n == 0 {
		return nil
	}
	md, st := mergeAxes(dims, strides, graph.ContiguousStrides(dims))
	if len(md) == 0 || len(md) == 1 && st[0][0] == 1 {
		return k.copy(dt, src, dst, n)
	}
	return k.gather(dt, src, dst, md, st[0])
}

// copyColumns copies rows rows of cols elements, contiguous at src, into
// columns off to off + cols of rows pitch elements long at dst (copy2d).
func (k *kctx) copyColumns(dt graph.DType, src, dst alloc.Ptr, rows, cols, pitch, off int64) error {
	name, err := moving(kCopy2d, dt)
	if err != nil {
		return err
	}
	return k.flat(name, units16(dt, rows*cols), src, cols, int64(0), dst, pitch, off, rows, cols)
}

// attentionQKVFwd runs attention_qkv: o [B, T, C] and, with its
// attention_qkv_lse companion, the log-sum-exp.
func attentionQKVFwd(k *kctx, in []operand, out operand) error {
	qkv := in[0]
	dt, s, sh, err := k.qkvGeom(qkv)
	if err != nil {
		return err
	}
	if err := sameDType(out, qkv); err != nil {
		return err
	}
	rows := int64(s.B * s.T)
	if out.n() != rows*int64(s.C()) || qkv.n() != rows*int64(s.Pitch()) {
		return graph.Errorf(graph.ErrShape, "%s: output %v for qkv %v", k.nd.Op, out.shape, qkv.shape)
	}
	var lse *operand
	if co := k.co; co != nil && co.dt == graph.Float32 && co.n() == int64(s.B*s.H*s.T) {
		lse = co
	}
	if k.dnn != nil {
		var pl alloc.Ptr
		if lse != nil {
			pl = lse.p
		}
		ws, n := k.nodeWorkspace()
		q, kk, v := qkvParts(qkv.p, dt, s)
		done, err := k.dnn.sdpaForward(dt, sh, false, true, q, kk, v, out.p, pl, ws, n)
		if done || err != nil {
			k.coDone = done && err == nil && lse != nil
			return err
		}
	}
	base, sub, err := k.qkvFallback(graph.OpAttention, dt, s)
	if err != nil {
		return err
	}
	hs := heads(base, dt, s, s.H, s.Hkv, s.Hkv, s.H) // q, k, v, o
	if err := k.gatherHeads(dt, qkv.p, base, s, 3); err != nil {
		return err
	}
	if err := sub.attentionFwd(hs[0], hs[1], hs[2], nil, &hs[3], lse); err != nil {
		return err
	}
	// o [B, H, T, d] → [B, T, H, d].
	if err := k.gatherView(dt, hs[3].p, out.p, []int{s.B, s.T, s.H, s.D}, []int{s.H * s.T * s.D, s.D, s.T * s.D, 1}); err != nil {
		return err
	}
	k.coDone = lse != nil
	return nil
}

// attentionQKVLSE runs attention_qkv_lse where no forward pass gave it:
// the kernels on copies of q and k.
func attentionQKVLSE(k *kctx, in []operand, out operand) error {
	qkv := in[0]
	dt, s, _, err := k.qkvGeom(qkv)
	if err != nil {
		return err
	}
	if err := floats(out); err != nil {
		return err
	}
	if out.n() != int64(s.B*s.H*s.T) {
		return graph.Errorf(graph.ErrShape, "%s: lse %v for qkv %v", k.nd.Op, out.shape, qkv.shape)
	}
	base, sub, err := k.qkvFallback(graph.OpAttentionLSE, dt, s)
	if err != nil {
		return err
	}
	hs := heads(base, dt, s, s.H, s.Hkv) // q, k
	if err := k.gatherHeads(dt, qkv.p, base, s, 2); err != nil {
		return err
	}
	return sub.attentionFwd(hs[0], hs[1], hs[1], nil, nil, &out)
}

// attentionQKVGrad runs attention_qkv_grad: d qkv from g, qkv, o, lse.
func attentionQKVGrad(k *kctx, in []operand, out operand) error {
	g, qkv, o, lse := in[0], in[1], in[2], in[3]
	dt, s, sh, err := k.qkvGeom(qkv)
	if err != nil {
		return err
	}
	if err := sameDType(out, qkv, g, o); err != nil {
		return err
	}
	if err := floats(lse); err != nil {
		return err
	}
	rows := int64(s.B * s.T)
	if out.n() != qkv.n() || qkv.n() != rows*int64(s.Pitch()) || g.n() != rows*int64(s.C()) || o.n() != rows*int64(s.C()) ||
		lse.n() != int64(s.B*s.H*s.T) {
		return graph.Errorf(graph.ErrShape, "%s: g %v, o %v, lse %v, output %v for qkv %v", k.nd.Op, g.shape, o.shape, lse.shape, out.shape, qkv.shape)
	}
	if k.dnn != nil {
		ws, n := k.nodeWorkspace()
		q, kk, v := qkvParts(qkv.p, dt, s)
		dq, dk, dv := qkvParts(out.p, dt, s)
		done, err := k.dnn.sdpaBackward(dt, sh, false, true, g.p, q, kk, v, o.p, lse.p, dq, dk, dv, ws, n)
		if done || err != nil {
			return err
		}
	}
	base, subQ, err := k.qkvFallback(graph.OpAttentionGradQ, dt, s)
	if err != nil {
		return err
	}
	subKV := *subQ
	subKV.nd = &graph.Node{Op: graph.OpAttentionGradKV, Attrs: k.nd.Attrs}
	// q, k, v into the output until the gradients are done; o, g, dq and
	// dk|dv [B, Hkv, T, 2d] in the workspace.
	qkvh := heads(out.p, dt, s, s.H, s.Hkv, s.Hkv)
	hs := heads(base, dt, s, s.H, s.H, s.H, 2*s.Hkv) // o, g, dq, dk|dv
	dkv := operand{p: hs[3].p, shape: []int{s.B, s.Hkv, s.T, 2 * s.D}, dt: dt}
	if err := k.gatherHeads(dt, qkv.p, out.p, s, 3); err != nil {
		return err
	}
	toHeads := []int{s.T * s.C(), s.D, s.C(), 1} // [B, T, H, d] read as [B, H, T, d]
	dims := []int{s.B, s.H, s.T, s.D}
	if err := k.gatherView(dt, o.p, hs[0].p, dims, toHeads); err != nil {
		return err
	}
	if err := k.gatherView(dt, g.p, hs[1].p, dims, toHeads); err != nil {
		return err
	}
	args := []operand{hs[1], qkvh[0], qkvh[1], qkvh[2], hs[0], lse}
	if err := attentionGrad(subQ, args, hs[2]); err != nil {
		return err
	}
	if err := attentionGrad(&subKV, args, dkv); err != nil {
		return err
	}
	// dk|dv [B, Hkv, T, 2, d] → [B, T, 2, Hkv, d] over o and g (2·Hkv ≤
	// 2·H heads), then into columns C to C + 2·KV of d qkv; dq [B, H, T,
	// d] → [B, T, H, d] over o, then into columns 0 to C.
	rows, c, kv, p := int64(s.B*s.T), int64(s.C()), int64(s.KV()), int64(s.Pitch())
	h, hkv, t, d := s.H, s.Hkv, s.T, s.D
	if err := k.gatherView(dt, dkv.p, hs[0].p, []int{s.B, t, 2, hkv, d}, []int{hkv * t * 2 * d, 2 * d, d, t * 2 * d, 1}); err != nil {
		return err
	}
	if err := k.copyColumns(dt, hs[0].p, out.p, rows, 2*kv, p, c); err != nil {
		return err
	}
	if err := k.gatherView(dt, hs[2].p, hs[0].p, []int{s.B, t, h, d}, []int{h * t * d, d, t * d, 1}); err != nil {
		return err
	}
	return k.copyColumns(dt, hs[0].p, out.p, rows, c, p, 0)
}
