package cuda

import (
	"math"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// float32 attention on cuBLAS: FlashAttention's memory at GEMM speed.
// Every pass walks the queries in blocks of bq rows (attnBlockRows) and,
// per block, runs its matrix products as strided-batched SGEMMs over all
// B·H heads at once (on TF32 tensor cores when the executor's TF32 option
// is on, as matmul's GEMMs), with the row work between them in
// attention_rows_{fwd,bwd}_f32 (kernels/attention.cu):
//
//   - attention, attention_lse: s = scale·q·kᵀ into the workspace; the row
//     kernel adds the mask, hides the keys past the causal diagonal, takes
//     the softmax and writes the log-sum-exp (attention's companion, or
//     attention_lse's output) and p; attention then runs o = p·v.
//   - attention_grad_q: s = scale·q·kᵀ and dp = g·vᵀ; the row kernel
//     computes D = Σ g∘o per row and ds = p·(dp − D)·scale with p =
//     exp(s − lse) from the saved log-sum-exp; dq = ds·k.
//   - attention_grad_kv: the same, keeping p; dk += dsᵀ·q and dv += pᵀ·g
//     accumulate (beta = 1) into the packed dk|dv, zeroed first, over the
//     blocks and over the query heads of each group.
//
// Under causal a block's products stop at its last query's key (keys [0,
// min(S, i0 + bq))). The workspace holds one block's scores for every head
// (two arrays for the gradients), [B·H, bq, ld] float32 with ld = S
// rounded up to 4 (16-byte rows for cuBLAS): O(T) per query row, never
// [T, S] per head unless T ≤ bq. Any head dim works: nothing is held in
// registers.
const (
	attnBlockMax = 128      // query rows per block at most
	attnBlockMin = 16       // and at least, whatever the cap
	attnBlockCap = 64 << 20 // bytes of one [H, bq, ld] float32 array per sample, bq permitting
)

// Row kernels of the float32 path (one warp a row, flat launch).
const (
	kAttnRowsFwd = "attention_rows_fwd_f32"
	kAttnRowsBwd = "attention_rows_bwd_f32"
)

// negInf32 is fill_f32's value for the log-sum-exp of a query with no keys.
var negInf32 = float32(math.Inf(-1))

// attnLD is the workspace's row stride for s keys: s rounded up to 4
// floats.
func attnLD(s int) int { return (s + 3) &^ 3 }

// attnBlockRows is the query rows per block for h query heads, t queries
// and s keys: the largest multiple of 16 from 16 to 128 whose [h, bq, ld]
// float32 array of one sample stays within attnBlockCap, and never more
// than t. It depends on the per-sample shapes only (not on the batch), so
// the workspace it sizes is linear in the chunk size, as the planner's
// model of a workspace (fixed + per-sample bytes) requires, and the
// planner and the executor compute the same blocks.
func attnBlockRows(h, t, s int) int {
	if t <= 0 {
		return 0
	}
	bq := attnBlockMax
	if row := 4 * int64(max(h, 1)) * int64(attnLD(max(s, 1))); int64(bq)*row > attnBlockCap {
		bq = max(int(attnBlockCap/row)&^15, attnBlockMin)
	}
	return min(bq, t)
}

// attnBlockBytes is one workspace array: b·h heads of bq rows of ld
// floats. A multiple of 16 bytes, so the second array is 16-byte aligned.
func attnBlockBytes(b, h, t, s int) int64 {
	return 4 * int64(b) * int64(h) * int64(attnBlockRows(h, t, s)) * int64(attnLD(s))
}

// attnF32Workspace is the float32 path's workspace of an attention op at
// chunk size b: one array for attention and attention_lse, two for the
// gradients; 0 for other dtypes.
func attnF32Workspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	qi, arrays := 0, int64(1)
	if nd.Op == graph.OpAttentionGradQ || nd.Op == graph.OpAttentionGradKV {
		qi, arrays = 1, 2
	}
	if len(nd.Inputs) <= qi+1 || g.Node(nd.Inputs[qi]).Type.DType != graph.Float32 {
		return 0
	}
	q, k := inputAt(g, nd, qi, b), inputAt(g, nd, qi+1, b)
	if len(q) != 4 || len(k) != 4 {
		return 0
	}
	return arrays * attnBlockBytes(q[0], q[1], q[2], k[2])
}

// attnCall is one strided-batched GEMM over heads: count products, the
// first on flat query head qh (of the B·H, bh = b·H + h) and flat key/value
// head kh (of the B·Hkv), the next ones qs and ks heads further on.
type attnCall struct{ qh, qs, kh, ks, count int }

// attnCalls pairs each of the b·h query heads with its key/value head:
// query head h of sample b reads head h/G of the same sample (G = h/hkv),
// so flat query head G·p + r reads flat key/value head p. A strided batch
// cannot divide, so the GEMMs go per member r of a group: G calls of b·hkv
// products (one call of b·h when G = 1). When the key/value operand is
// only read (!kvOut) and there are fewer (b, hkv) pairs than group
// members, they go per pair instead: b·hkv calls of G products with the
// key/value head broadcast (stride 0), which a written operand cannot be.
func attnCalls(b, h, hkv int, kvOut bool) []attnCall {
	if b <= 0 || h <= 0 || hkv <= 0 {
		return nil
	}
	g, pairs := h/hkv, b*hkv
	var calls []attnCall
	if !kvOut && pairs < g {
		for p := range pairs {
			calls = append(calls, attnCall{qh: g * p, qs: 1, kh: p, ks: 0, count: g})
		}
		return calls
	}
	for r := range g {
		calls = append(calls, attnCall{qh: r, qs: g, kh: 0, ks: 1, count: pairs})
	}
	return calls
}

// attnMat is a GEMM operand of the float32 path: per query head (q, g, o,
// dq, the workspace) or per key/value head (k, v, dk, dv), head i starting
// stride floats after head i − 1 at p, rows ld floats apart.
type attnMat struct {
	p      alloc.Ptr
	ld     int
	stride int64
	kv     bool
}

// at is the operand's first matrix and batch stride in call c.
func (m attnMat) at(c attnCall) (alloc.Ptr, int64) {
	h, s := c.qh, c.qs
	if m.kv {
		h, s = c.kh, c.ks
	}
	return m.p + alloc.Ptr(4*int64(h)*m.stride), int64(s) * m.stride
}

// attnDev is what the float32 path needs of the device: kctx's, or a host
// emulation in the tests (attention32_internal_test.go).
type attnDev interface {
	// sgemm is BLAS.GemmStridedBatched: count row-major products C =
	// alpha·op(A)·op(B) + beta·C, op(A) m×k, op(B) k×n.
	sgemm(ta, tb bool, m, n, k int, alpha float32, a alloc.Ptr, lda int, sa int64, b alloc.Ptr, ldb int, sb int64,
		beta float32, c alloc.Ptr, ldc int, sc int64, count int) error
	memzero(p alloc.Ptr, bytes int64) error
	flat(name string, work int64, args ...any) error
	workspace(bytes int64) (alloc.Ptr, error)
}

func (k *kctx) sgemm(ta, tb bool, m, n, kd int, alpha float32, a alloc.Ptr, lda int, sa int64, b alloc.Ptr, ldb int, sb int64,
	beta float32, c alloc.Ptr, ldc int, sc int64, count int) error {
	return k.blas.GemmStridedBatchedOf(graph.Float32, ta, tb, m, n, kd, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, count)
}

func (k *kctx) memzero(p alloc.Ptr, bytes int64) error { return k.d.Memzero(p, bytes) }

// attnGemm runs C = alpha·op(A)·op(B) + beta·C (row-major, op(A) m×k,
// op(B) k×n) for every head, call by call.
func attnGemm(dev attnDev, calls []attnCall, ta, tb bool, m, n, kd int, alpha float32, a, b attnMat, beta float32, c attnMat) error {
	for _, cl := range calls {
		pa, sa := a.at(cl)
		pb, sb := b.at(cl)
		pc, sc := c.at(cl)
		if err := dev.sgemm(ta, tb, m, n, kd, alpha, pa, a.ld, sa, pb, b.ld, sb, beta, pc, c.ld, sc, cl.count); err != nil {
			return err
		}
	}
	return nil
}

// attnF32 is one float32 attention problem on the device: the shapes, and
// the operands every pass reads.
type attnF32 struct {
	sh     attnShape
	q, k   alloc.Ptr
	v      alloc.Ptr
	mask   alloc.Ptr
	bq, ld int
}

// block is the query block starting at row i0: its rows and the keys its
// products run over.
func (a *attnF32) block(i0 int) (nq, n int) {
	nq, n = min(a.bq, a.sh.t-i0), a.sh.s
	if a.sh.causal {
		n = min(n, i0+nq)
	}
	return nq, n
}

// qrows is a [B, H, T, d] operand from query row i0 on; kvMat a [B, Hkv,
// S, d] one (ld floats a row: 2d for the packed dk|dv); ws a workspace
// array of the block (nq rows of ld floats per head).
func (a *attnF32) qrows(p alloc.Ptr, i0 int) attnMat {
	d := a.sh.d
	return attnMat{p: p + alloc.Ptr(4*int64(i0)*int64(d)), ld: d, stride: int64(a.sh.t) * int64(d)}
}
func (a *attnF32) kvMat(p alloc.Ptr, ld int) attnMat {
	return attnMat{p: p, ld: ld, stride: int64(a.sh.s) * int64(ld), kv: true}
}
func (a *attnF32) ws(p alloc.Ptr, nq int) attnMat {
	return attnMat{p: p, ld: a.ld, stride: int64(nq) * int64(a.ld)}
}

// scores runs s = scale·q·kᵀ (or, with q = g, k = v and alpha 1, dp =
// g·vᵀ) for the block at i0 into the workspace array w.
func attnScores(k attnDev, a *attnF32, calls []attnCall, i0 int, q, kk alloc.Ptr, alpha float32, w alloc.Ptr) error {
	nq, n := a.block(i0)
	if a.sh.d == 0 { // empty dot products
		return k.memzero(w, 4*int64(a.sh.b*a.sh.h)*int64(nq)*int64(a.ld))
	}
	return attnGemm(k, calls, false, true, nq, n, a.sh.d, alpha, a.qrows(q, i0), a.kvMat(kk, a.sh.d), 0, a.ws(w, nq))
}

// rowsTail is the row kernels' shape arguments from the row stride on:
// ld, H, T.
func (a *attnF32) rowsTail() []any { return []any{int64(a.ld), int64(a.sh.h), int64(a.sh.t)} }

// newAttnF32 sets up the float32 path for q, k, v[, mask] of shape sh.
func newAttnF32(sh attnShape, q, kk, v operand, mask *operand) *attnF32 {
	return &attnF32{sh: sh, q: q.p, k: kk.p, v: v.p, mask: ptrOf(mask), bq: attnBlockRows(sh.h, sh.t, sh.s), ld: attnLD(sh.s)}
}

// attnFwd32 is attentionFwd for float32: o (po, 0 for attention_lse)
// and/or the log-sum-exp (pl, 0 when not wanted).
func attnFwd32(k attnDev, sh attnShape, q, kk, v operand, mask *operand, po, pl alloc.Ptr) error {
	bh := sh.b * sh.h
	if bh == 0 || sh.t == 0 {
		return nil
	}
	if sh.s == 0 { // no keys: o = 0, lse = −Inf
		if po != 0 {
			if err := k.memzero(po, 4*q.n()); err != nil {
				return err
			}
		}
		if pl != 0 {
			return k.flat(kFillF32, int64(bh*sh.t), pl, int64(bh*sh.t), negInf32)
		}
		return nil
	}
	a := newAttnF32(sh, q, kk, v, mask)
	w, err := k.workspace(attnBlockBytes(sh.b, sh.h, sh.t, sh.s))
	if err != nil {
		return err
	}
	calls := attnCalls(sh.b, sh.h, sh.hkv, false)
	for i0 := 0; i0 < sh.t; i0 += a.bq {
		nq, n := a.block(i0)
		if err := attnScores(k, a, calls, i0, a.q, a.k, sh.scale, w); err != nil {
			return err
		}
		rows := int64(bh) * int64(nq)
		args := append([]any{w, a.mask, pl, boolInt(po != 0), rows, int64(nq), int64(n)}, a.rowsTail()...)
		args = append(args, int64(i0), sh.ms[0], sh.ms[1], sh.ms[2], sh.ms[3], boolInt(sh.causal), sh.mdt)
		if err := k.flat(kAttnRowsFwd, 32*rows, args...); err != nil {
			return err
		}
		if po == 0 || sh.d == 0 {
			continue
		}
		if err := attnGemm(k, calls, false, false, nq, sh.d, n, 1, a.ws(w, nq), a.kvMat(a.v, sh.d), 0, a.qrows(po, i0)); err != nil {
			return err
		}
	}
	return nil
}

// attnGrad32 is attentionGrad for float32: dq (kv false) or the packed
// dk|dv (kv true) into out.
func attnGrad32(k attnDev, sh attnShape, kv bool, g, q, kk, v, o, lse operand, mask *operand, out operand) error {
	bh := sh.b * sh.h
	if out.n() == 0 {
		return nil
	}
	if kv || sh.s == 0 || sh.t == 0 {
		// dk|dv accumulate; with no keys or no queries every gradient is 0.
		if err := k.memzero(out.p, 4*out.n()); err != nil {
			return err
		}
	}
	if bh == 0 || sh.t == 0 || sh.s == 0 {
		return nil
	}
	a := newAttnF32(sh, q, kk, v, mask)
	bytes := attnBlockBytes(sh.b, sh.h, sh.t, sh.s)
	w, err := k.workspace(2 * bytes)
	if err != nil {
		return err
	}
	sw, dw := w, w+alloc.Ptr(bytes)
	calls := attnCalls(sh.b, sh.h, sh.hkv, false)
	kvCalls := attnCalls(sh.b, sh.h, sh.hkv, true)
	d := sh.d
	for i0 := 0; i0 < sh.t; i0 += a.bq {
		nq, n := a.block(i0)
		if err := attnScores(k, a, calls, i0, a.q, a.k, sh.scale, sw); err != nil {
			return err
		}
		if err := attnScores(k, a, calls, i0, g.p, a.v, 1, dw); err != nil {
			return err
		}
		rows := int64(bh) * int64(nq)
		args := append([]any{sw, dw, g.p, o.p, lse.p, a.mask, boolInt(kv), rows, int64(nq), int64(n)}, a.rowsTail()...)
		args = append(args, int64(d), int64(i0), sh.ms[0], sh.ms[1], sh.ms[2], sh.ms[3], sh.scale, boolInt(sh.causal), sh.mdt)
		if err := k.flat(kAttnRowsBwd, 32*rows, args...); err != nil {
			return err
		}
		if !kv {
			// dq = ds·k for the block's rows.
			if err := attnGemm(k, calls, false, false, nq, d, n, 1, a.ws(dw, nq), a.kvMat(a.k, d), 0, a.qrows(out.p, i0)); err != nil {
				return err
			}
			continue
		}
		// dk += dsᵀ·q, dv += pᵀ·g over the block's keys.
		dk, dv := a.kvMat(out.p, 2*d), a.kvMat(out.p+alloc.Ptr(4*d), 2*d)
		if err := attnGemm(k, kvCalls, true, false, n, d, nq, 1, a.ws(dw, nq), a.qrows(a.q, i0), 1, dk); err != nil {
			return err
		}
		if err := attnGemm(k, kvCalls, true, false, n, d, nq, 1, a.ws(sw, nq), a.qrows(g.p, i0), 1, dv); err != nil {
			return err
		}
	}
	return nil
}
