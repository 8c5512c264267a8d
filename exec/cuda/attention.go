package cuda

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Attention family (kernels/attention.cu): fused attention forward, the
// log-sum-exp its backward recomputes, dq and packed dk|dv. One thread per
// row, attRows rows a block, the other operand staged tile by tile in
// shared memory; nothing [T, S]-sized is stored, and no workspace: the
// row term D = Σ g∘o is recomputed from g and o inside each gradient
// kernel. Head dims up to attMaxD; larger ones are refused with a typed
// error naming the shapes. q, k, v, g, o and the output of dq or dk|dv
// share one float dtype, which picks the kernels' instantiation; lse is
// float32, and the mask may be of any float dtype (passed as a code).
// The forward pass of 16-bit values at head dim 64 or 128 without a mask
// runs on tensor cores (attention_fwd_mma: 16-bit P·v products, float32
// sums); everything else on the plain-FMA kernels.
var attentionKernels = family{
	graph.OpAttention: {run: func(k *kctx, in []operand, out operand) error {
		return k.attentionFwd(in[0], in[1], in[2], optional(in, 3), &out, nil)
	}},
	graph.OpAttentionLSE: {run: func(k *kctx, in []operand, out operand) error {
		return k.attentionFwd(in[0], in[1], in[1], optional(in, 2), nil, &out)
	}},
	graph.OpAttentionGradQ:  {run: attentionGrad},
	graph.OpAttentionGradKV: {run: attentionGrad},
}

const (
	attRows = 64  // rows per block (kernels/attention.cu ATT_ROWS)
	attMaxD = 128 // largest head dim the kernels hold in registers

	attMMARows    = 64  // query rows per block of attention_fwd_mma (ATT_MMA_ROWS)
	attMMAThreads = 128 // its block (ATT_MMA_THREADS)
)

// attnMMAKernel is the tensor-core forward kernel for head dim d and
// 16-bit dtype dt (kernels/attention.cu attention_fwd_mma_d*).
func attnMMAKernel(d int, dt graph.DType) string {
	return fmt.Sprintf("attention_fwd_mma_d%d_%s", d, suffixes[dt])
}

// attnMMAKernels lists the tensor-core forward kernels, for registration.
func attnMMAKernels() []string {
	var out []string
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, d := range []int{64, 128} {
			out = append(out, attnMMAKernel(d, dt))
		}
	}
	return out
}

// attnMMA reports whether the forward pass on these operands runs on
// tensor cores: 16-bit values, head dim 64 or 128, no mask, and every
// 16-bit array 16-byte aligned (the kernel stages rows 16 bytes at a
// time).
func attnMMA(dt graph.DType, d int, mask *operand, ptrs ...alloc.Ptr) bool {
	if !dt.IsHalf() || (d != 64 && d != 128) || mask != nil {
		return false
	}
	for _, p := range ptrs {
		if p%16 != 0 {
			return false
		}
	}
	return true
}

// attnLaunch launches an attention kernel over blocks tile blocks of
// threads threads (the tile layout: grid.x is exact, at most 2³¹ − 1); no
// work, no launch.
func (k *kctx) attnLaunch(name string, blocks int64, threads uint32, args ...any) error {
	if blocks == 0 {
		return nil
	}
	if blocks > 1<<31-1 {
		return graph.Errorf(graph.ErrShape, "%s: %d thread blocks exceed the grid's 2³¹ − 1", k.nd.Op, blocks)
	}
	return k.launch(name, [3]uint32{uint32(blocks), 1, 1}, [3]uint32{threads, 1, 1}, args...)
}

// attnMaskCode is the kernels' code of a mask's dtype (mdt): its position
// in floatDTypes, 0 without a mask.
func attnMaskCode(op graph.Op, mask *operand) (int64, error) {
	if mask == nil {
		return 0, nil
	}
	i := slices.Index(floatDTypes, mask.dt)
	if i < 0 {
		return 0, graph.Errorf(graph.ErrDType, "%s: mask %v is %s, want a float dtype", op, mask.shape, mask.dt)
	}
	return int64(i), nil
}

// attnGeom checks q, k, v[, mask] and returns their one dtype and the
// shape arguments every attention kernel takes after its pointers: B, H,
// Hkv, T, S, d, the mask's four strides, scale, causal and the mask's
// dtype code.
func (k *kctx) attnGeom(q, kk, v operand, mask *operand) (graph.DType, []any, error) {
	op := k.nd.Op
	dt, err := floatsOf(q, kk, v)
	if err != nil {
		return 0, nil, err
	}
	mdt, err := attnMaskCode(op, mask)
	if err != nil {
		return 0, nil, err
	}
	if len(q.shape) != 4 || len(kk.shape) != 4 || len(v.shape) != 4 {
		return 0, nil, graph.Errorf(graph.ErrShape, "%s: q %v, k %v, v %v must be [B, H, T, d]", op, q.shape, kk.shape, v.shape)
	}
	b, h, t, d := q.shape[0], q.shape[1], q.shape[2], q.shape[3]
	hkv, s := kk.shape[1], kk.shape[2]
	if kk.shape[0] != b || kk.shape[3] != d || hkv == 0 || h%hkv != 0 || v.shape[0] != b || v.shape[1] != hkv || v.shape[2] != s || v.shape[3] != d {
		return 0, nil, graph.Errorf(graph.ErrShape, "%s: q %v, k %v, v %v do not line up", op, q.shape, kk.shape, v.shape)
	}
	if d > attMaxD {
		return 0, nil, graph.Errorf(graph.ErrShape, "%s: head dim %d (q %v) is larger than the CUDA kernels' %d", op, d, q.shape, attMaxD)
	}
	var ms [4]int64
	if mask != nil {
		r, st := len(mask.shape), int64(1)
		if r > 4 {
			return 0, nil, graph.Errorf(graph.ErrShape, "%s: mask %v has rank > 4", op, mask.shape)
		}
		full := []int{b, h, t, s}
		for i := r - 1; i >= 0; i-- {
			switch m := mask.shape[i]; {
			case m == full[4-r+i]:
				ms[4-r+i] = st
			case m != 1:
				return 0, nil, graph.Errorf(graph.ErrShape, "%s: mask %v does not broadcast to %v", op, mask.shape, full)
			}
			st *= int64(mask.shape[i])
		}
	}
	a := k.attrs()
	return dt, []any{int64(b), int64(h), int64(hkv), int64(t), int64(s), int64(d),
		ms[0], ms[1], ms[2], ms[3], float32(a.Scalar), boolInt(a.Causal), mdt}, nil
}

// attentionFwd launches attention_fwd (or attention_fwd_mma, see attnMMA)
// for o or lse (the other nil): one block per (b, h, tile of 64 query
// rows). o has q's dtype, lse is float32.
func (k *kctx) attentionFwd(q, kk, v operand, mask, o, lse *operand) error {
	dt, geom, err := k.attnGeom(q, kk, v, mask)
	if err != nil {
		return err
	}
	var po, pl alloc.Ptr
	if o != nil {
		if err := sameDType(*o, q); err != nil {
			return err
		}
		if o.n() != q.n() {
			return graph.Errorf(graph.ErrShape, "%s: output %v for q %v", k.nd.Op, o.shape, q.shape)
		}
		po = o.p
	}
	if lse != nil {
		if err := floats(*lse); err != nil {
			return err
		}
		if lse.n() != int64(q.shape[0]*q.shape[1]*q.shape[2]) {
			return graph.Errorf(graph.ErrShape, "%s: lse %v for q %v", k.nd.Op, lse.shape, q.shape)
		}
		pl = lse.p
	}
	if d := q.shape[3]; attnMMA(dt, d, mask, q.p, kk.p, v.p, po) {
		blocks := int64(q.shape[0]*q.shape[1]) * ceilDiv(int64(q.shape[2]), attMMARows)
		// H, Hkv, T, S, scale, causal of geom.
		return k.attnLaunch(attnMMAKernel(d, dt), blocks, attMMAThreads,
			q.p, kk.p, v.p, po, pl, geom[1], geom[2], geom[3], geom[4], geom[10], geom[11])
	}
	blocks := int64(q.shape[0]*q.shape[1]) * ceilDiv(int64(q.shape[2]), attRows)
	return k.attnLaunch(typed(kAttentionFwd, dt), blocks, attRows, append([]any{q.p, kk.p, v.p, ptrOf(mask), po, pl}, geom...)...)
}

// attentionGrad launches attention_grad_q (one block per (b, h, query
// tile)) or attention_grad_kv (one per (b, hkv, key tile)) on g, q, k, v,
// o, lse[, mask]: g, o and the output have q's dtype, lse is float32.
func attentionGrad(k *kctx, in []operand, out operand) error {
	g, q, kk, v, o, lse := in[0], in[1], in[2], in[3], in[4], in[5]
	mask := optional(in, 6)
	dt, geom, err := k.attnGeom(q, kk, v, mask)
	if err != nil {
		return err
	}
	if err := sameDType(out, q, g, o); err != nil {
		return err
	}
	if err := floats(lse); err != nil {
		return err
	}
	if g.n() != q.n() || o.n() != q.n() || lse.n() != int64(q.shape[0]*q.shape[1]*q.shape[2]) {
		return graph.Errorf(graph.ErrShape, "%s: g %v, o %v, lse %v for q %v", k.nd.Op, g.shape, o.shape, lse.shape, q.shape)
	}
	name, blocks := kAttentionGradQ, int64(q.shape[0]*q.shape[1])*ceilDiv(int64(q.shape[2]), attRows)
	if k.nd.Op == graph.OpAttentionGradKV {
		name, blocks = kAttentionGradKV, int64(kk.shape[0]*kk.shape[1])*ceilDiv(int64(kk.shape[2]), attRows)
		if out.n() != 2*kk.n() {
			return graph.Errorf(graph.ErrShape, "%s: output %v for k %v", k.nd.Op, out.shape, kk.shape)
		}
	} else if out.n() != q.n() {
		return graph.Errorf(graph.ErrShape, "%s: output %v for q %v", k.nd.Op, out.shape, q.shape)
	}
	return k.attnLaunch(typed(name, dt), blocks, attRows, append([]any{g.p, q.p, kk.p, v.p, o.p, lse.p, ptrOf(mask), out.p}, geom...)...)
}
