package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Attention family: fused attention, its log-sum-exp and its gradients.
// The kernels walk one query row at a time over blocks of attnBlock keys
// with a running max and sum (the online softmax of FlashAttention), so
// their scratch is O(attnBlock + d) per call, nothing [T, S]-sized: no
// workspace to declare. Sums accumulate in float64.
var attentionKernels = family{
	graph.OpAttention: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		attentionFwd(newAttn(&nd.Attrs, in[0], in[1], in[2], optional(in, 3)), out)
		return nil
	}},
	graph.OpAttentionLSE: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		attentionLSE(newAttn(&nd.Attrs, in[0], in[1], in[1], optional(in, 2)), out)
		return nil
	}},
	graph.OpAttentionGradQ:  {run: attentionGrad},
	graph.OpAttentionGradKV: {run: attentionGrad},
	// attention_qkv and its gradients read q, k, v (and write o, d qkv) in
	// place through the packed layout's strides (newAttnQKV).
	graph.OpAttentionQKV: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		attentionFwd(newAttnQKV(&nd.Attrs, in[0]), out)
		return nil
	}},
	graph.OpAttentionQKVLSE: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		attentionLSE(newAttnQKV(&nd.Attrs, in[0]), out)
		return nil
	}},
	graph.OpAttentionQKVGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		at := newAttnQKV(&nd.Attrs, in[1])
		at.gradInto(in[0], in[2], in[3], out, true, true)
		return nil
	}},
	graph.OpRotary:     {run: rotaryKernel},
	graph.OpRotaryGrad: {run: rotaryKernel},
}

// rotaryKernel rotates heads below End of x [B, T, N, d] by the angles of
// cs [T, d] (cos, then sin), each pair (i, i + d/2): by θ for rotary, by
// −θ for rotary_grad. The other heads are copied. A table [T, 2d] is
// rotary's full form (graph.OpRotary): cos and sin of every element, the
// pair's map [[c_i, −s_i], [s_{i+h}, c_{i+h}]], transposed for
// rotary_grad.
func rotaryKernel(nd *graph.Node, in []*buf, out *buf, _ int) error {
	x, cs := in[0], in[1]
	if len(x.shape) != 4 || len(cs.shape) != 2 || cs.shape[0] != x.shape[1] || (cs.shape[1] != x.shape[3] && cs.shape[1] != 2*x.shape[3]) ||
		x.shape[3]%2 != 0 || len(out.f) != len(x.f) {
		return graph.Errorf(graph.ErrShape, "%s: x %v, table %v, output %v", nd.Op, x.shape, cs.shape, out.shape)
	}
	t, n, d, w := x.shape[1], x.shape[2], x.shape[3], cs.shape[1]
	end, h := nd.Attrs.End, d/2
	grad := nd.Op == graph.OpRotaryGrad
	for r := range len(x.f) / max(d, 1) {
		row, dst := x.f[r*d:(r+1)*d], out.f[r*d:(r+1)*d]
		if r%n >= end {
			copy(dst, row)
			continue
		}
		tab := cs.f[r/n%t*w:][:w]
		for i := range h {
			cLo, cHi, sLo, sHi := float64(tab[i]), float64(tab[i]), float64(tab[h+i]), float64(tab[h+i])
			if w == 2*d {
				cHi, sLo, sHi = float64(tab[h+i]), float64(tab[d+i]), float64(tab[d+h+i])
			}
			if grad { // the transpose
				sLo, sHi = -sHi, -sLo
			}
			a, b := float64(row[i]), float64(row[i+h])
			dst[i], dst[i+h] = float32(a*cLo-b*sLo), float32(b*cHi+a*sHi)
		}
	}
	return nil
}

// attentionFwd writes attention's output o.
func attentionFwd(at *attn, out *buf) {
	acc := make([]float64, at.D)
	at.forEachRow(func(b, h, i int) {
		clear(acc)
		lse := at.online(b, h, i, func(j int, w float64, rescale float64) {
			if rescale != 1 {
				for c := range acc {
					acc[c] *= rescale
				}
			}
			v := at.v.f[at.v0+at.kvoff(b, h, j):][:at.D]
			for c := range acc {
				acc[c] += w * float64(v[c])
			}
		})
		o := out.f[at.ooff(b, h, i):][:at.D]
		if math.IsInf(lse, -1) { // every key hidden: 0
			clear(o)
			return
		}
		// acc holds Σ exp(s − m)·v and lse = m + log l: divide by l.
		inv := 1 / at.lastSum
		for c := range o {
			o[c] = float32(acc[c] * inv)
		}
	})
}

// attentionLSE writes each query row's log-sum-exp, [B, H, T].
func attentionLSE(at *attn, out *buf) {
	at.forEachRow(func(b, h, i int) {
		out.f[(b*at.H+h)*at.T+i] = float32(at.online(b, h, i, nil))
	})
}

// attnBlock is the number of keys scored at once.
const attnBlock = 64

type attn struct {
	q, k, v, m         *buf
	mstride            [4]int
	B, H, Hkv, T, S, D int
	scale              float32
	causal             bool
	s                  [attnBlock]float64
	lastSum            float64
	// Layout: q's strides over (b, h, row) and k's and v's (shared) over
	// (b, key/value head, row); k and v start at k0 and v0 of their
	// buffers. oc is 0 when o and g are laid out as q ([B, H, T, d]), else
	// the width C of their [B, T, C] rows (attention_qkv).
	qs, ks [3]int
	k0, v0 int
	oc     int
}

func newAttn(a *graph.Attrs, q, k, v, m *buf) *attn {
	at := &attn{q: q, k: k, v: v, m: m, scale: float32(a.Scalar), causal: a.Causal,
		B: q.shape[0], H: q.shape[1], T: q.shape[2], D: q.shape[3], Hkv: k.shape[1], S: k.shape[2]}
	at.qs = [3]int{at.H * at.T * at.D, at.T * at.D, at.D}
	at.ks = [3]int{at.Hkv * at.S * at.D, at.S * at.D, at.D}
	if m != nil {
		r, st := len(m.shape), 1
		for i := r - 1; i >= 0; i-- {
			if m.shape[i] != 1 {
				at.mstride[4-r+i] = st
			}
			st *= m.shape[i]
		}
	}
	return at
}

// newAttnQKV reads q, k, v in place from qkv [B, T, (H + 2·Hkv)·d]: every
// row (H + 2·Hkv)·d apart, head h d further on, k and v H·d and (H +
// Hkv)·d after q; o and g are [B, T, H·d].
func newAttnQKV(a *graph.Attrs, qkv *buf) *attn {
	h, hkv := graph.QKVHeads(*a)
	b, t := qkv.shape[0], qkv.shape[1]
	d := qkv.shape[2] / (h + 2*hkv)
	p := qkv.shape[2]
	st := [3]int{t * p, d, p}
	return &attn{q: qkv, k: qkv, v: qkv, scale: float32(a.Scalar), causal: a.Causal,
		B: b, H: h, Hkv: hkv, T: t, S: t, D: d, qs: st, ks: st, k0: h * d, v0: (h + hkv) * d, oc: h * d}
}

// qoff is the offset of query row i of head h in q (and of dq in its
// gradient).
func (at *attn) qoff(b, h, i int) int { return b*at.qs[0] + h*at.qs[1] + i*at.qs[2] }

// ooff is the offset of row i of head h in o and g.
func (at *attn) ooff(b, h, i int) int {
	if at.oc == 0 {
		return at.qoff(b, h, i)
	}
	return (b*at.T+i)*at.oc + h*at.D
}

// kvoff is the offset of key/value row j read by query head h, from k0
// (in k) or v0 (in v).
func (at *attn) kvoff(b, h, j int) int {
	return b*at.ks[0] + h/(at.H/at.Hkv)*at.ks[1] + j*at.ks[2]
}

func (at *attn) forEachRow(f func(b, h, i int)) {
	for b := range at.B {
		for h := range at.H {
			for i := range at.T {
				f(b, h, i)
			}
		}
	}
}

// keys is the number of keys query i may see.
func (at *attn) keys(i int) int {
	if at.causal {
		return min(i+1, at.S)
	}
	return at.S
}

// score is query i's scaled, masked score for key j (−Inf when hidden).
func (at *attn) score(b, h, i, j int) float64 {
	q := at.q.f[at.qoff(b, h, i):][:at.D]
	k := at.k.f[at.k0+at.kvoff(b, h, j):][:at.D]
	var dot float32
	for c := range q {
		dot += q[c] * k[c]
	}
	s := float64(dot * at.scale)
	if at.m != nil {
		s += float64(at.m.f[b*at.mstride[0]+h*at.mstride[1]+i*at.mstride[2]+j*at.mstride[3]])
	}
	return s
}

// online runs the online softmax over query i's keys block by block and
// returns the log-sum-exp (−Inf when every key is hidden). emit, when set,
// gets each key's weight exp(s − m) under the running max m, after a
// rescale factor for what came before whenever m grew; lastSum is the
// final Σ exp(s − m).
func (at *attn) online(b, h, i int, emit func(j int, w, rescale float64)) float64 {
	m, l := math.Inf(-1), 0.0
	n := at.keys(i)
	for j0 := 0; j0 < n; j0 += attnBlock {
		blk := at.s[:min(attnBlock, n-j0)]
		bm := math.Inf(-1)
		for t := range blk {
			blk[t] = at.score(b, h, i, j0+t)
			bm = math.Max(bm, blk[t])
		}
		if math.IsInf(bm, -1) {
			continue // a block of hidden keys changes nothing
		}
		nm := math.Max(m, bm)
		r := math.Exp(m - nm) // 0 when m was −Inf
		l *= r
		for t, x := range blk {
			w := math.Exp(x - nm)
			l += w
			if emit != nil {
				rs := 1.0
				if t == 0 {
					rs = r
				}
				emit(j0+t, w, rs)
			}
		}
		m = nm
	}
	at.lastSum = l
	if l == 0 {
		return math.Inf(-1)
	}
	return m + math.Log(l)
}

// attentionGrad computes dq or dk|dv (the op says which) from g, q, k, v,
// o, lse[, mask].
func attentionGrad(nd *graph.Node, in []*buf, out *buf, _ int) error {
	at := newAttn(&nd.Attrs, in[1], in[2], in[3], optional(in, 6))
	q := nd.Op == graph.OpAttentionGradQ
	at.gradInto(in[0], in[4], in[5], out, q, !q)
	return nil
}

// gradInto computes dq (wantQ) and/or dk and dv (wantKV) into out,
// recomputing each probability p = exp(s − lse): with D = Σ g∘o per query
// row and dS = p·(g·v − D), dq = scale·Σ dS·k, dk = scale·Σ dS·q and dv =
// Σ p·g. Rows with lse = −Inf contribute nothing. Unpacked (oc = 0), out
// is dq [B, H, T, d] or dk|dv [B, Hkv, S, 2d]; packed, d qkv laid out as
// qkv.
func (at *attn) gradInto(g, o, lse, out *buf, wantQ, wantKV bool) {
	d := at.D
	clear(out.f)
	at.forEachRow(func(b, h, i int) {
		li := float64(lse.f[(b*at.H+h)*at.T+i])
		if math.IsInf(li, -1) {
			return
		}
		qo, oo := at.qoff(b, h, i), at.ooff(b, h, i)
		gi, oi, qi := g.f[oo:][:d], o.f[oo:][:d], at.q.f[qo:][:d]
		var dd float64
		for c := range gi {
			dd += float64(gi[c]) * float64(oi[c])
		}
		for j := range at.keys(i) {
			s := at.score(b, h, i, j)
			if math.IsInf(s, -1) {
				continue
			}
			p := math.Exp(s - li)
			ko := at.kvoff(b, h, j)
			k, v := at.k.f[at.k0+ko:][:d], at.v.f[at.v0+ko:][:d]
			var dp float64
			for c := range gi {
				dp += float64(gi[c]) * float64(v[c])
			}
			ds := float32(p * (dp - dd) * float64(at.scale))
			if wantQ {
				dq := out.f[qo:][:d]
				for c := range dq {
					dq[c] += ds * k[c]
				}
			}
			if !wantKV {
				continue
			}
			k0, v0 := 2*ko, 2*ko+d // dk|dv
			if at.oc != 0 {
				k0, v0 = at.k0+ko, at.v0+ko
			}
			dk, dv := out.f[k0:][:d], out.f[v0:][:d]
			pf := float32(p)
			for c := range d {
				dk[c] += ds * qi[c]
				dv[c] += pf * gi[c]
			}
		}
	})
}
