package cuda

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Attention family (kernels/attention.cu): fused attention forward, the
// log-sum-exp its backward recomputes, dq and packed dk|dv. q, k, v, g, o
// and the output of dq or dk|dv share one float dtype; lse is float32, and
// the mask may be of any float dtype (passed as a code). float32 runs on
// cuBLAS over blocks of queries (attention32.go: strided-batched SGEMMs,
// TF32 under the executor's TF32 option, with row kernels between them and
// a workspace of one block's scores), any head dim. 16-bit values at head
// dim 64 or 128 without a mask, grouped-query heads or not, run on cuDNN's
// fused attention where it loads (dnn_sdpa.go: the forward pass with the
// log-sum-exp, and dq with dk|dv in one backward call), unless
// ExecutorOptions.NoCuDNNAttention; otherwise they run on
// tensor cores (attnMMA:
// attention_fwd_mma for the forward pass and the log-sum-exp,
// attention_grad_q_mma and attention_grad_kv_mma for the gradients; 16-bit
// products, float32 sums); other 16-bit attention on the plain-FMA kernels
// (one thread per row, attRows rows a block, the other operand staged tile
// by tile in shared memory; nothing [T, S]-sized is stored), head dims up
// to attMaxD: larger ones are refused with a typed error naming the
// shapes. The plain gradient kernels and the tensor-core dq
// kernel recompute the row term D = Σ g∘o from g and o; the tensor-core
// dk|dv kernel reads it from its workspace, where attention_grad_dot
// writes it first (attnGradKVWorkspace).
var attentionKernels = family{
	// The forward pass writes the log-sum-exp of its attention_lse
	// companion too, when the program has one (planner.Program.Companion):
	// attention_lse then has nothing left to do.
	graph.OpAttention: {run: func(k *kctx, in []operand, out operand) error {
		err := k.attentionFwd(in[0], in[1], in[2], optional(in, 3), &out, k.co)
		k.coDone = k.co != nil
		return err
	}, ws: attnFwdWorkspace},
	graph.OpAttentionLSE: {run: func(k *kctx, in []operand, out operand) error {
		return k.attentionFwd(in[0], in[1], in[1], optional(in, 2), nil, &out)
	}, ws: attnF32Workspace},
	// On cuDNN (dnn_sdpa.go) dq's pass also gives dk|dv, the output of its
	// attention_grad_kv companion (graph.AttentionGradKVProducer).
	graph.OpAttentionGradQ:  {run: attentionGrad, ws: attnGradQWorkspace},
	graph.OpAttentionGradKV: {run: attentionGrad, ws: attnGradKVWorkspace},
}

const (
	attRows = 64  // rows per block (kernels/attention.cu ATT_ROWS)
	attMaxD = 128 // largest head dim the kernels hold in registers

	attMMARows    = 64  // query rows per block of attention_fwd_mma and attention_grad_q_mma (ATT_MMA_ROWS)
	attMMAKeys    = 64  // keys per block of attention_grad_kv_mma (ATT_MMA_KEYS)
	attMMAThreads = 128 // the tensor-core kernels' block (ATT_MMA_THREADS)
)

// Tensor-core passes (kernels/attention.cu attention_*_mma_d*).
const (
	attnPassFwd    = "fwd"
	attnPassGradQ  = "grad_q"
	attnPassGradKV = "grad_kv"
)

// attnMMAKernel is the tensor-core kernel of pass (attnPassFwd, …) for
// head dim d and 16-bit dtype dt.
func attnMMAKernel(pass string, d int, dt graph.DType) string {
	return fmt.Sprintf("attention_%s_mma_d%d_%s", pass, d, suffixes[dt])
}

// attnDotKernel computes D = Σ g∘o per query row for the tensor-core dk|dv
// pass (attention_grad_dot_{bf16,f16}).
func attnDotKernel(dt graph.DType) string { return "attention_grad_dot_" + suffixes[dt] }

// attnPlainKernels lists the plain-FMA kernels, for registration: 16-bit
// only, float32 runs on cuBLAS (attention32.go).
func attnPlainKernels() []string {
	var out []string
	for _, n := range []string{kAttentionFwd, kAttentionGradQ, kAttentionGradKV} {
		for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
			out = append(out, typed(n, dt))
		}
	}
	return out
}

// attnMMAKernels lists the tensor-core kernels, for registration.
func attnMMAKernels() []string {
	var out []string
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, pass := range []string{attnPassFwd, attnPassGradQ, attnPassGradKV} {
			for _, d := range []int{64, 128} {
				out = append(out, attnMMAKernel(pass, d, dt))
			}
		}
		out = append(out, attnDotKernel(dt))
	}
	return out
}

// attnMMAShape reports whether attention of dtype dt at head dim d, with
// or without a mask, has tensor-core kernels: 16-bit values, d 64 or 128,
// no mask. (attnMMA adds the alignment the launch needs.)
func attnMMAShape(dt graph.DType, d int, masked bool) bool {
	return dt.IsHalf() && (d == 64 || d == 128) && !masked
}

// attnMMA reports whether a pass on these operands runs on tensor cores:
// attnMMAShape, and every 16-bit array 16-byte aligned (the kernels stage
// rows 16 bytes at a time).
func attnMMA(dt graph.DType, d int, mask *operand, ptrs ...alloc.Ptr) bool {
	if !attnMMAShape(dt, d, mask != nil) {
		return false
	}
	for _, p := range ptrs {
		if p%16 != 0 {
			return false
		}
	}
	return true
}

// attnFwdWorkspace is attention's workspace at chunk size b: the float32
// path's (attnF32Workspace), or for the shapes cuDNN's fused attention
// takes (sdpaShape) what its forward pass needs (sdpaFwdBytes); the
// kernels of attention.cu need none then, so a call cuDNN does not take
// fits too.
func attnFwdWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	return attnSDPAWorkspace(g, nd, b, 0, 3, sdpaFwdBytes)
}

// attnGradQWorkspace is attention_grad_q's workspace at chunk size b: the
// float32 path's, or for cuDNN's shapes its backward pass's (sdpaBwdBytes:
// the dQ accumulator, softmax_sum and the plan's workspace).
func attnGradQWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	return attnSDPAWorkspace(g, nd, b, 1, 6, sdpaBwdBytes)
}

// attnSDPAWorkspace is the larger of the float32 path's workspace and, when
// q (input qi, k the next) and the mask (an input past the first unmasked
// arity) make a shape cuDNN's fused attention takes, bytes of its shape.
func attnSDPAWorkspace(g *graph.Graph, nd *graph.Node, b, qi, unmasked int, bytes func(sdpaDims) int64) int64 {
	ws := attnF32Workspace(g, nd, b)
	q, kk := inputAt(g, nd, qi, b), inputAt(g, nd, qi+1, b)
	if len(q) == 4 && len(kk) == 4 && sdpaShape(g.Node(nd.Inputs[qi]).Type.DType, q[3], len(nd.Inputs) > unmasked, q[1], kk[1]) {
		ws = max(ws, bytes(sdpaDims{b: int64(q[0]), h: int64(q[1]), hkv: int64(kk[1]), t: int64(q[2]), s: int64(kk[2]), d: int64(q[3])}))
	}
	return ws
}

// attnGradKVWorkspace is attention_grad_kv's workspace at chunk size b:
// on the tensor-core path (attnMMAShape; inputs g, q, k, v, o, lse[,
// mask]), the float32 row term D of every query row, 4·B·H·T bytes; for
// float32, the float32 path's two arrays (attnF32Workspace); none
// otherwise. It is declared from the types alone: a run whose arrays turn
// out misaligned falls back to the plain kernel and leaves it unused.
func attnGradKVWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	if ws := attnF32Workspace(g, nd, b); ws > 0 {
		return ws
	}
	q := inputAt(g, nd, 1, b)
	if len(q) != 4 || !attnMMAShape(g.Node(nd.Inputs[1]).Type.DType, q[3], len(nd.Inputs) > 6) {
		return 0
	}
	return attnDotBytes(int64(graph.Numel(q[:3])))
}

// attnDotBytes is the float32 D of rows query rows.
func attnDotBytes(rows int64) int64 { return 4 * rows }

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

// attnShape is an attention problem's geometry: q [b, h, t, d], k and v
// [b, hkv, s, d], the mask's strides over [b, h, t, s] (0 on broadcast
// axes), the scale, causality and the mask's dtype code.
type attnShape struct {
	b, h, hkv, t, s, d int
	ms                 [4]int64
	scale              float32
	causal             bool
	mdt                int64
}

// args is the shape arguments every plain and tensor-core kernel takes
// after its pointers: B, H, Hkv, T, S, d, the mask's four strides, scale,
// causal and the mask's dtype code.
func (sh attnShape) args() []any {
	return []any{int64(sh.b), int64(sh.h), int64(sh.hkv), int64(sh.t), int64(sh.s), int64(sh.d),
		sh.ms[0], sh.ms[1], sh.ms[2], sh.ms[3], sh.scale, boolInt(sh.causal), sh.mdt}
}

// attnGeom checks q, k, v[, mask] and returns their one dtype and their
// geometry. Head dims above attMaxD are refused for 16-bit values (the
// plain and tensor-core kernels hold rows in registers); float32 runs on
// cuBLAS and takes any.
func (k *kctx) attnGeom(q, kk, v operand, mask *operand) (graph.DType, attnShape, error) {
	op := k.nd.Op
	dt, err := floatsOf(q, kk, v)
	if err != nil {
		return 0, attnShape{}, err
	}
	mdt, err := attnMaskCode(op, mask)
	if err != nil {
		return 0, attnShape{}, err
	}
	if len(q.shape) != 4 || len(kk.shape) != 4 || len(v.shape) != 4 {
		return 0, attnShape{}, graph.Errorf(graph.ErrShape, "%s: q %v, k %v, v %v must be [B, H, T, d]", op, q.shape, kk.shape, v.shape)
	}
	b, h, t, d := q.shape[0], q.shape[1], q.shape[2], q.shape[3]
	hkv, s := kk.shape[1], kk.shape[2]
	if kk.shape[0] != b || kk.shape[3] != d || hkv == 0 || h%hkv != 0 || v.shape[0] != b || v.shape[1] != hkv || v.shape[2] != s || v.shape[3] != d {
		return 0, attnShape{}, graph.Errorf(graph.ErrShape, "%s: q %v, k %v, v %v do not line up", op, q.shape, kk.shape, v.shape)
	}
	if d > attMaxD && dt != graph.Float32 {
		return 0, attnShape{}, graph.Errorf(graph.ErrShape, "%s: head dim %d (q %v) is larger than the CUDA kernels' %d", op, d, q.shape, attMaxD)
	}
	var ms [4]int64
	if mask != nil {
		r, st := len(mask.shape), int64(1)
		if r > 4 {
			return 0, attnShape{}, graph.Errorf(graph.ErrShape, "%s: mask %v has rank > 4", op, mask.shape)
		}
		full := []int{b, h, t, s}
		for i := r - 1; i >= 0; i-- {
			switch m := mask.shape[i]; {
			case m == full[4-r+i]:
				ms[4-r+i] = st
			case m != 1:
				return 0, attnShape{}, graph.Errorf(graph.ErrShape, "%s: mask %v does not broadcast to %v", op, mask.shape, full)
			}
			st *= int64(mask.shape[i])
		}
	}
	a := k.attrs()
	return dt, attnShape{b: b, h: h, hkv: hkv, t: t, s: s, d: d, ms: ms, scale: float32(a.Scalar), causal: a.Causal, mdt: mdt}, nil
}

// attentionFwd launches attention_fwd (or attention_fwd_mma, see attnMMA)
// for o and/or lse (either may be nil): one block per (b, h, tile of 64
// query rows); float32 runs attnFwd32. o has q's dtype, lse is float32.
func (k *kctx) attentionFwd(q, kk, v operand, mask, o, lse *operand) error {
	dt, sh, err := k.attnGeom(q, kk, v, mask)
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
	if dt.IsHalf() && o != nil {
		if done, err := k.dnnAttnFwd(dt, sh, q, kk, v, mask != nil, o, lse); done || err != nil {
			return err
		}
	}
	if dt == graph.Float32 {
		return attnFwd32(k, sh, q, kk, v, mask, po, pl)
	}
	geom := sh.args()
	if d := q.shape[3]; attnMMA(dt, d, mask, q.p, kk.p, v.p, po) {
		blocks := int64(q.shape[0]*q.shape[1]) * ceilDiv(int64(q.shape[2]), attMMARows)
		// H, Hkv, T, S, scale, causal of geom.
		return k.attnLaunch(attnMMAKernel(attnPassFwd, d, dt), blocks, attMMAThreads,
			q.p, kk.p, v.p, po, pl, geom[1], geom[2], geom[3], geom[4], geom[10], geom[11])
	}
	blocks := int64(q.shape[0]*q.shape[1]) * ceilDiv(int64(q.shape[2]), attRows)
	return k.attnLaunch(typed(kAttentionFwd, dt), blocks, attRows, append([]any{q.p, kk.p, v.p, ptrOf(mask), po, pl}, geom...)...)
}

// attentionGrad launches attention_grad_q (one block per (b, h, query
// tile)) or attention_grad_kv (one per (b, hkv, key tile)) on g, q, k, v,
// o, lse[, mask]: g, o and the output have q's dtype, lse is float32. On
// the tensor-core path (attnMMA), dk|dv first has attention_grad_dot write
// D into the workspace; float32 runs attnGrad32.
func attentionGrad(k *kctx, in []operand, out operand) error {
	g, q, kk, v, o, lse := in[0], in[1], in[2], in[3], in[4], in[5]
	mask := optional(in, 6)
	dt, sh, err := k.attnGeom(q, kk, v, mask)
	if err != nil {
		return err
	}
	if err := sameDType(out, q, g, o); err != nil {
		return err
	}
	if err := floats(lse); err != nil {
		return err
	}
	rows := int64(q.shape[0] * q.shape[1] * q.shape[2])
	if g.n() != q.n() || o.n() != q.n() || lse.n() != rows {
		return graph.Errorf(graph.ErrShape, "%s: g %v, o %v, lse %v for q %v", k.nd.Op, g.shape, o.shape, lse.shape, q.shape)
	}
	kv := k.nd.Op == graph.OpAttentionGradKV
	if kv && out.n() != 2*kk.n() {
		return graph.Errorf(graph.ErrShape, "%s: output %v for k %v", k.nd.Op, out.shape, kk.shape)
	} else if !kv && out.n() != q.n() {
		return graph.Errorf(graph.ErrShape, "%s: output %v for q %v", k.nd.Op, out.shape, q.shape)
	}
	if !kv && dt.IsHalf() && k.dnn != nil {
		// One cuDNN call gives dq and its companion's dk|dv; without the
		// companion there is nowhere to put dk|dv, and the kernels run.
		if co := k.co; co == nil || co.dt != dt || co.n() != 2*kk.n() {
			if !k.dnn.noSDPA && sdpaShape(dt, sh.d, mask != nil, sh.h, sh.hkv) {
				k.dnn.fallback("no attention_grad_kv companion")
			}
		} else if done, err := k.dnnAttnBwd(dt, sh, g, q, kk, v, o, lse, out, *co, mask != nil); done || err != nil {
			k.coDone = done && err == nil
			return err
		}
	}
	if dt == graph.Float32 {
		return attnGrad32(k, sh, kv, g, q, kk, v, o, lse, mask, out)
	}
	geom := sh.args()
	bh, bhkv := int64(q.shape[0]*q.shape[1]), int64(kk.shape[0]*kk.shape[1])
	t, s := int64(q.shape[2]), int64(kk.shape[2])
	if d := q.shape[3]; attnMMA(dt, d, mask, g.p, q.p, kk.p, v.p, o.p, out.p) {
		// H, Hkv, T, S, scale, causal of geom.
		tail := []any{geom[1], geom[2], geom[3], geom[4], geom[10], geom[11]}
		if !kv {
			return k.attnLaunch(attnMMAKernel(attnPassGradQ, d, dt), bh*ceilDiv(t, attMMARows), attMMAThreads,
				append([]any{g.p, q.p, kk.p, v.p, o.p, lse.p, out.p}, tail...)...)
		}
		dot, err := k.workspace(attnDotBytes(rows))
		if err != nil {
			return err
		}
		// 8 threads a row (kernels/attention.cu attention_grad_dot).
		if err := k.flat(attnDotKernel(dt), rows*8, g.p, o.p, dot, rows, int64(d)); err != nil {
			return err
		}
		return k.attnLaunch(attnMMAKernel(attnPassGradKV, d, dt), bhkv*ceilDiv(s, attMMAKeys), attMMAThreads,
			append([]any{g.p, q.p, kk.p, v.p, lse.p, dot, out.p}, tail...)...)
	}
	name, blocks := kAttentionGradQ, bh*ceilDiv(t, attRows)
	if kv {
		name, blocks = kAttentionGradKV, bhkv*ceilDiv(s, attRows)
	}
	return k.attnLaunch(typed(name, dt), blocks, attRows, append([]any{g.p, q.p, kk.p, v.p, o.p, lse.p, ptrOf(mask), out.p}, geom...)...)
}
