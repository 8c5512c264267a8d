package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Packed attention (attention_qkv, attention_qkv_lse, attention_qkv_grad):
// q, k and v read in place from the projection qkv [B, T, 3C] ([B, T, 3,
// H, d]), o written as [B, T, C] and d qkv as qkv is laid out. cuDNN's
// fused attention takes those layouts through its tensors' strides
// (sdpaKey.packed), so on cuDNN's shapes (sdpaShape: 16-bit, head dim 64
// or 128) nothing is copied: the forward pass also writes the log-sum-exp
// of its attention_qkv_lse companion, and the backward pass writes dq, dk
// and dv into d qkv in one call.
//
// Elsewhere (float32, other head dims, cuDNN off or refusing) the kernels
// of attention.go run on copies in the node's workspace, laid out as they
// want them: q, k, v (and o, g) gathered to [B, H, T, d], the results
// gathered back (the float32 path's GEMMs read the copies as they read
// attention's operands). Such a call is counted in DNN.AttnStats as
// attnQKVPermuted besides cuDNN's reason. The workspace holds the kernels'
// own (attnQKVInner) first, then the copies, and is declared from the
// types alone: the larger of that and cuDNN's.
var attentionQKVKernels = family{
	graph.OpAttentionQKV:     {run: attentionQKVFwd, ws: attnQKVWorkspace},
	graph.OpAttentionQKVLSE:  {run: attentionQKVLSE, ws: attnQKVWorkspace},
	graph.OpAttentionQKVGrad: {run: attentionQKVGrad, ws: attnQKVWorkspace},
}

// attnQKVPermuted is the AttnStats reason of a packed call that ran on
// copies.
const attnQKVPermuted = "attention_qkv permuted"

// attnQKVCopies is how many [B, T, C] arrays of the dtype a packed op's
// fallback keeps in its workspace after the kernels' own: q, k, v and o
// forward; q and k for the log-sum-exp; o, g, dq and dk|dv (2) backward,
// whose q, k and v go to d qkv's output until the gradients replace them.
func attnQKVCopies(op graph.Op) int64 {
	switch op {
	case graph.OpAttentionQKV:
		return 4
	case graph.OpAttentionQKVLSE:
		return 2
	}
	return 5
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
	n := int64(s.B*s.T*s.C()) * int64(dt.Size())
	return attnQKVInner(op, dt, s) + attnQKVCopies(op)*n
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
		s, err := graph.QKVDims(nd.Op, nd.Attrs.Groups, graph.Type{Shape: inputAt(g, nd, qi, b), DType: dt, BatchAxis: -1})
		if err != nil {
			return 0, 0
		}
		if sdpaShape(dt, s.D, false, s.H, s.H) {
			b, h, t, d := int64(s.B), int64(s.H), int64(s.T), int64(s.D)
			switch nd.Op {
			case graph.OpAttentionQKV:
				sdpa = sdpaFwdBytes(b, h, t, t, d)
			case graph.OpAttentionQKVGrad:
				sdpa = sdpaBwdBytes(b, h, t, t, d)
			}
		}
		return attnQKVFallbackBytes(nd.Op, dt, s), sdpa
	}
	f0, s0 := at(0)
	f1, s1 := at(1)
	return max(f0, s0) + int64(b)*max(f1-f0, s1-s0)
}

// qkvGeom checks qkv and returns its dtype, its shape and the geometry of
// the unpacked attention it holds.
func (k *kctx) qkvGeom(qkv operand) (graph.DType, graph.QKVShape, attnShape, error) {
	a := k.attrs()
	s, err := graph.QKVDims(k.nd.Op, a.Groups, graph.Type{Shape: qkv.shape, DType: qkv.dt, BatchAxis: -1})
	if err != nil {
		return 0, s, attnShape{}, err
	}
	if s.D > attMaxD && qkv.dt != graph.Float32 {
		return 0, s, attnShape{}, graph.Errorf(graph.ErrShape, "%s: head dim %d (qkv %v, %d heads) is larger than the CUDA kernels' %d", k.nd.Op, s.D, qkv.shape, s.H, attMaxD)
	}
	sh := attnShape{b: s.B, h: s.H, hkv: s.H, t: s.T, s: s.T, d: s.D, scale: float32(a.Scalar), causal: a.Causal}
	return qkv.dt, s, sh, nil
}

// qkvThirds is the addresses of the q, k and v (or dq, dk, dv) columns of
// a packed [B, T, 3C] array at p.
func qkvThirds(p alloc.Ptr, dt graph.DType, s graph.QKVShape) (alloc.Ptr, alloc.Ptr, alloc.Ptr) {
	c := alloc.Ptr(s.C() * dt.Size())
	return p, p + c, p + 2*c
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

// heads is the operands of count consecutive [B, H, T, d] arrays from p.
func heads(p alloc.Ptr, dt graph.DType, s graph.QKVShape, count int) []operand {
	out := make([]operand, count)
	n := alloc.Ptr(s.B * s.T * s.C() * dt.Size())
	for i := range out {
		out[i] = operand{p: p + alloc.Ptr(i)*n, shape: []int{s.B, s.H, s.T, s.D}, dt: dt}
	}
	return out
}

// gatherHeads copies the first count of q, k, v from qkv [B, T, 3, H, d]
// to consecutive [B, H, T, d] arrays at dst.
func (k *kctx) gatherHeads(dt graph.DType, qkv, dst alloc.Ptr, s graph.QKVShape, count int) error {
	c := s.C()
	return k.gatherView(dt, qkv, dst, []int{count, s.B, s.H, s.T, s.D}, []int{c, s.T * 3 * c, s.D, 3 * c, 1})
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
	if 3*out.n() != qkv.n() {
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
		q, kk, v := qkvThirds(qkv.p, dt, s)
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
	hs := heads(base, dt, s, 4) // q, k, v, o
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
	hs := heads(base, dt, s, 2)
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
	if out.n() != qkv.n() || 3*g.n() != qkv.n() || 3*o.n() != qkv.n() || lse.n() != int64(s.B*s.H*s.T) {
		return graph.Errorf(graph.ErrShape, "%s: g %v, o %v, lse %v, output %v for qkv %v", k.nd.Op, g.shape, o.shape, lse.shape, out.shape, qkv.shape)
	}
	if k.dnn != nil {
		ws, n := k.nodeWorkspace()
		q, kk, v := qkvThirds(qkv.p, dt, s)
		dq, dk, dv := qkvThirds(out.p, dt, s)
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
	// dk|dv [B, H, T, 2d] in the workspace.
	qkvh := heads(out.p, dt, s, 3)
	hs := heads(base, dt, s, 5)
	dkv := operand{p: hs[3].p, shape: []int{s.B, s.H, s.T, 2 * s.D}, dt: dt}
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
	// dk|dv [B, H, T, 2, d] → [B, T, 2, H, d] over o and g, then into
	// columns C to 3C of d qkv; dq [B, H, T, d] → [B, T, H, d] over o, then
	// into columns 0 to C.
	rows, c := int64(s.B*s.T), int64(s.C())
	h, t, d := s.H, s.T, s.D
	if err := k.gatherView(dt, dkv.p, hs[0].p, []int{s.B, t, 2, h, d}, []int{h * t * 2 * d, 2 * d, d, t * 2 * d, 1}); err != nil {
		return err
	}
	if err := k.copyColumns(dt, hs[0].p, out.p, rows, 2*c, 3*c, c); err != nil {
		return err
	}
	if err := k.gatherView(dt, hs[2].p, hs[0].p, []int{s.B, t, h, d}, []int{h * t * d, d, t * d, 1}); err != nil {
		return err
	}
	return k.copyColumns(dt, hs[0].p, out.p, rows, c, 3*c, 0)
}
