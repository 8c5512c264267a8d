package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Attention family: the fused attention op, the log-sum-exp its backward
// recomputes, and its gradients, straight from the definitions in float64,
// one query row at a time (O(S) scratch, nothing [T, S]-sized).
var attentionKernels = family{
	graph.OpAttention: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		at := newAttn(a, in[0], in[1], in[2], mask(in, 3))
		at.rows(func(b, h, i int, p []float64, _ float64) {
			o := out.Data[at.qoff(b, h, i):][:at.D]
			for j, pj := range p {
				if pj != 0 {
					v := at.v.Data[at.kvoff(b, h, j):][:at.D]
					for c := range o {
						o[c] += pj * v[c]
					}
				}
			}
		})
		return nil
	},
	graph.OpAttentionLSE: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		at := newAttn(a, in[0], in[1], in[1], mask(in, 2))
		at.rows(func(b, h, i int, _ []float64, lse float64) { out.Data[(b*at.H+h)*at.T+i] = lse })
		return nil
	},
	graph.OpAttentionGradQ:  attentionGrad,
	graph.OpAttentionGradKV: attentionGrad,
}

func mask(in []Value, i int) *Value {
	if i < len(in) {
		return &in[i]
	}
	return nil
}

// attentionGrad computes dq or dk|dv from g, q, k, v, o[, lse ignored:
// recomputed exactly here][, mask]: with P the softmax row, D = Σ g∘o,
// dS = P∘(g·vᵀ − D): dq = scale·dS·k, dk = scale·dSᵀ·q, dv = Pᵀ·g.
func attentionGrad(nd *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	g, q, o := in[0], in[1], in[4]
	at := newAttn(a, q, in[2], in[3], mask(in, 6))
	d := at.D
	at.rows(func(b, h, i int, p []float64, _ float64) {
		qo := at.qoff(b, h, i)
		gi, oi := g.Data[qo:][:d], o.Data[qo:][:d]
		dd := 0.0
		for c := range gi {
			dd += gi[c] * oi[c]
		}
		for j, pj := range p {
			if pj == 0 {
				continue
			}
			ko := at.kvoff(b, h, j)
			k, v := at.k.Data[ko:][:d], at.v.Data[ko:][:d]
			dp := 0.0
			for c := range gi {
				dp += gi[c] * v[c]
			}
			ds := pj * (dp - dd) * at.scale
			if nd.Op == graph.OpAttentionGradQ {
				dq := out.Data[qo:][:d]
				for c := range dq {
					dq[c] += ds * k[c]
				}
				continue
			}
			dkv := out.Data[2*ko:][:2*d]
			qi := q.Data[qo:][:d]
			for c := range d {
				dkv[c] += ds * qi[c]
				dkv[d+c] += pj * gi[c]
			}
		}
	})
	return nil
}

// attn holds one attention call's operands and sizes.
type attn struct {
	q, k, v            Value
	m                  *Value
	mstride            [4]int // the mask's strides over [B, H, T, S], 0 where it broadcasts
	B, H, Hkv, T, S, D int
	scale              float64
	causal             bool
}

func newAttn(a *graph.Attrs, q, k, v Value, m *Value) *attn {
	at := &attn{q: q, k: k, v: v, m: m, scale: a.Scalar, causal: a.Causal,
		B: q.Shape[0], H: q.Shape[1], T: q.Shape[2], D: q.Shape[3], Hkv: k.Shape[1], S: k.Shape[2]}
	if m != nil {
		r, st := len(m.Shape), 1
		for i := r - 1; i >= 0; i-- {
			if m.Shape[i] != 1 {
				at.mstride[4-r+i] = st
			}
			st *= m.Shape[i]
		}
	}
	return at
}

func (at *attn) qoff(b, h, i int) int { return ((b*at.H+h)*at.T + i) * at.D }

// kvoff is the offset of key/value row j read by query head h.
func (at *attn) kvoff(b, h, j int) int {
	return ((b*at.Hkv+h/(at.H/at.Hkv))*at.S + j) * at.D
}

// rows calls f for every query row with its softmax probabilities p (0
// for hidden keys; all 0 when every key is hidden) and its log-sum-exp.
func (at *attn) rows(f func(b, h, i int, p []float64, lse float64)) {
	s := make([]float64, at.S)
	d := at.D
	for b := range at.B {
		for h := range at.H {
			for i := range at.T {
				qi := at.q.Data[at.qoff(b, h, i):][:d]
				mx := math.Inf(-1)
				for j := range s {
					if at.causal && j > i {
						s[j] = math.Inf(-1)
						continue
					}
					k := at.k.Data[at.kvoff(b, h, j):][:d]
					dot := 0.0
					for c := range qi {
						dot += qi[c] * k[c]
					}
					s[j] = dot * at.scale
					if at.m != nil {
						s[j] += at.m.Data[b*at.mstride[0]+h*at.mstride[1]+i*at.mstride[2]+j*at.mstride[3]]
					}
					mx = math.Max(mx, s[j])
				}
				lse := math.Inf(-1)
				if !math.IsInf(mx, -1) {
					sum := 0.0
					for _, x := range s {
						sum += math.Exp(x - mx)
					}
					lse = mx + math.Log(sum)
				}
				for j, x := range s {
					if math.IsInf(lse, -1) {
						s[j] = 0
					} else {
						s[j] = math.Exp(x - lse)
					}
				}
				f(b, h, i, s, lse)
			}
		}
	}
}

// Packed attention (attention_qkv): the unpacked kernels above on q, k, v
// gathered from qkv [B, T, (H + 2·Hkv)·d] into [B, H, T, d] and [B, Hkv, T,
// d], the results scattered back; the reference spends the copies the
// executors avoid. Rotary embedding (rotary, rotary_grad) is here too.
var attentionQKVKernels = family{
	graph.OpAttentionQKV: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		s, q, k, v := unpackQKV(in[0], a)
		o := Zeros(s.B, s.H, s.T, s.D)
		if err := attentionKernels[graph.OpAttention](nil, a, []Value{q, k, v}, o); err != nil {
			return err
		}
		headsMove(out.Data, o.Data, s, s.H, s.C(), 0, false)
		return nil
	},
	graph.OpAttentionQKVLSE: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		_, q, k, _ := unpackQKV(in[0], a)
		return attentionKernels[graph.OpAttentionLSE](nil, a, []Value{q, k}, out)
	},
	graph.OpAttentionQKVGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		s, q, k, v := unpackQKV(in[1], a)
		g, o := Zeros(s.B, s.H, s.T, s.D), Zeros(s.B, s.H, s.T, s.D)
		headsMove(g.Data, in[0].Data, s, s.H, s.C(), 0, true)
		headsMove(o.Data, in[2].Data, s, s.H, s.C(), 0, true)
		args := []Value{g, q, k, v, o, in[3]}
		dq, dkv := Zeros(s.B, s.H, s.T, s.D), Zeros(s.B, s.Hkv, s.T, 2*s.D)
		if err := attentionGrad(&graph.Node{Op: graph.OpAttentionGradQ}, a, args, dq); err != nil {
			return err
		}
		if err := attentionGrad(&graph.Node{Op: graph.OpAttentionGradKV}, a, args, dkv); err != nil {
			return err
		}
		w, c := s.Width(), s.C()
		headsMove(out.Data, dq.Data, s, s.H, w, 0, false)
		// dk|dv is [B, Hkv, T, 2d]: read it as two [B, Hkv, T, d] halves.
		dk, dv := Zeros(s.B, s.Hkv, s.T, s.D), Zeros(s.B, s.Hkv, s.T, s.D)
		for r := range s.B * s.Hkv * s.T {
			copy(dk.Data[r*s.D:][:s.D], dkv.Data[r*2*s.D:])
			copy(dv.Data[r*s.D:][:s.D], dkv.Data[r*2*s.D+s.D:])
		}
		headsMove(out.Data, dk.Data, s, s.Hkv, w, c, false)
		headsMove(out.Data, dv.Data, s, s.Hkv, w, c+s.KVC(), false)
		return nil
	},
	graph.OpRotary: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		rotary(out, in[0], in[1], a.End, 1)
		return nil
	},
	graph.OpRotaryGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		rotary(out, in[0], in[1], a.End, -1)
		return nil
	},
}

// rotary rotates heads below end of x [B, T, N, d] by the angles of cs
// [T, d] (cos, then sin), each pair (i, i + d/2), by sign·θ; the other
// heads are copied.
func rotary(out, x, cs Value, end int, sign float64) {
	b, t, n, d := x.Shape[0], x.Shape[1], x.Shape[2], x.Shape[3]
	h := d / 2
	for r := range b * t * n {
		row := x.Data[r*d : (r+1)*d]
		dst := out.Data[r*d : (r+1)*d]
		if r%n >= end {
			copy(dst, row)
			continue
		}
		pos := r / n % t
		for i := range h {
			c, s := cs.Data[pos*d+i], sign*cs.Data[pos*d+h+i]
			dst[i] = row[i]*c - row[i+h]*s
			dst[i+h] = row[i+h]*c + row[i]*s
		}
	}
}

// unpackQKV gathers q [B, H, T, d] and k, v [B, Hkv, T, d] from qkv [B, T,
// (H + 2·Hkv)·d].
func unpackQKV(qkv Value, a *graph.Attrs) (s graph.QKVShape, q, k, v Value) {
	hkv := a.KVHeads
	if hkv == 0 {
		hkv = a.Groups
	}
	s = graph.QKVShape{B: qkv.Shape[0], H: a.Groups, Hkv: hkv, T: qkv.Shape[1], D: qkv.Shape[2] / (a.Groups + 2*hkv)}
	q, k, v = Zeros(s.B, s.H, s.T, s.D), Zeros(s.B, s.Hkv, s.T, s.D), Zeros(s.B, s.Hkv, s.T, s.D)
	headsMove(q.Data, qkv.Data, s, s.H, s.Width(), 0, true)
	headsMove(k.Data, qkv.Data, s, s.Hkv, s.Width(), s.C(), true)
	headsMove(v.Data, qkv.Data, s, s.Hkv, s.Width(), s.C()+s.KVC(), true)
	return s, q, k, v
}

// headsMove moves between heads [B, heads, T, d] (contiguous) and rows
// [B, T, ·] of pitch elements whose columns off to off + heads·d hold
// [heads, d]: into the heads when toHeads, else into the rows.
func headsMove(dst, src []float64, s graph.QKVShape, heads, pitch, off int, toHeads bool) {
	for b := range s.B {
		for h := range heads {
			for t := range s.T {
				hi := ((b*heads+h)*s.T + t) * s.D
				ri := (b*s.T+t)*pitch + off + h*s.D
				if toHeads {
					copy(dst[hi:hi+s.D], src[ri:ri+s.D])
				} else {
					copy(dst[ri:ri+s.D], src[hi:hi+s.D])
				}
			}
		}
	}
}
