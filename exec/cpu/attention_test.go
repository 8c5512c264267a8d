package cpu_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
)

// TestAttentionAgainstReference runs fused attention forward and its three
// gradients (through loss = Σ out·r) on the CPU and in the float64
// reference: lengths 1 to 2048, head dims 4 to 128, causal or not,
// grouped-query heads, additive masks with hidden keys and hidden rows.
func TestAttentionAgainstReference(t *testing.T) {
	type tc struct {
		B, H, Hkv, T, S, D int
		causal             bool
		mask               []int // the mask's shape, nil for none
		scale              float64
	}
	cases := []tc{
		{B: 2, H: 2, Hkv: 2, T: 1, S: 1, D: 8},
		{B: 2, H: 4, Hkv: 2, T: 17, S: 17, D: 8, causal: true},
		{B: 1, H: 3, Hkv: 1, T: 17, S: 29, D: 4, mask: []int{17, 29}, scale: 0.3},
		{B: 3, H: 2, Hkv: 1, T: 29, S: 17, D: 4, causal: true, mask: []int{3, 1, 1, 17}},
		{B: 2, H: 2, Hkv: 2, T: 64, S: 64, D: 64, causal: true},
		{B: 1, H: 2, Hkv: 1, T: 64, S: 64, D: 128, mask: []int{1, 2, 64, 64}},
		{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 16, causal: true},
		{B: 1, H: 1, Hkv: 1, T: 1000, S: 1000, D: 64, mask: []int{1000, 1000}},
		{B: 1, H: 1, Hkv: 1, T: 1024, S: 1024, D: 128, causal: true},
	}
	if !testing.Short() {
		cases = append(cases, tc{B: 1, H: 1, Hkv: 1, T: 2048, S: 2048, D: 64, causal: true})
	}
	for n, c := range cases {
		t.Run(fmt.Sprintf("B%d_H%d_Hkv%d_T%d_S%d_d%d_causal%v_mask%v", c.B, c.H, c.Hkv, c.T, c.S, c.D, c.causal, c.mask), func(t *testing.T) {
			rng := newRNG(uint64(n))
			gr := lazy.NewGraph()
			wrap := func(s ...int) *lazy.Tensor { return gr.Wrap(dense(s, uniform(rng, numel(s), -1, 1)), 0) }
			q, k, v := wrap(c.B, c.H, c.T, c.D), wrap(c.B, c.Hkv, c.S, c.D), wrap(c.B, c.Hkv, c.S, c.D)
			r := wrap(c.B, c.H, c.T, c.D)
			o := lazy.AttentionOptions{Causal: c.causal, Scale: c.scale}
			if c.mask != nil {
				md := uniform(rng, numel(c.mask), -2, 2)
				for i := range md {
					if rng.IntN(5) == 0 {
						md[i] = float32(math.Inf(-1))
					}
				}
				if len(md) > c.S {
					for i := range c.S { // the first row hides every key
						md[i] = float32(math.Inf(-1))
					}
				}
				if c.mask[0] == c.B && len(c.mask) == 4 {
					o.Mask = gr.Wrap(dense(c.mask, md), 0)
				} else {
					o.Mask = lazy.Const(dense(c.mask, md))
				}
			}
			out := q.Attention(k, v, o)
			grads := lazy.Grad(out.Mul(r).Sum(), q, k, v)
			ids := []int{out.ID(), grads[0].ID(), grads[1].ID(), grads[2].ID()}
			require.NoError(t, errors.Join(out.Err(), grads[0].Err(), grads[1].Err(), grads[2].Err()))
			g := out.Graph().IR()
			want, err := ref.Eval(g, nil, ids...)
			require.NoError(t, err)
			got, err := cpu.New().Run(context.Background(), g, ids...)
			require.NoError(t, err)
			for i, name := range []string{"out", "dq", "dk", "dv"} {
				gd := got[i].Data().([]float32)
				require.Len(t, gd, len(want[i].Data), name)
				scale := 0.0
				for _, x := range want[i].Data {
					scale = math.Max(scale, math.Abs(x))
				}
				for j, w := range want[i].Data {
					require.False(t, math.IsNaN(float64(gd[j])), "%s[%d] is NaN", name, j)
					require.InDelta(t, w, float64(gd[j]), 1e-4*math.Abs(w)+2e-5*math.Max(scale, 1), "%s[%d]", name, j)
				}
			}
		})
	}
}

// A query whose every key is hidden gets 0 output and sends 0 gradient.
func TestAttentionHiddenRow(t *testing.T) {
	inf := float32(math.Inf(-1))
	rng := newRNG(3)
	gr := lazy.NewGraph()
	q := gr.Wrap(dense([]int{1, 1, 2, 4}, uniform(rng, 8, -1, 1)), 0)
	k := gr.Wrap(dense([]int{1, 1, 3, 4}, uniform(rng, 12, -1, 1)), 0)
	v := gr.Wrap(dense([]int{1, 1, 3, 4}, uniform(rng, 12, -1, 1)), 0)
	m := lazy.Const(dense([]int{2, 3}, []float32{inf, inf, inf, 0, inf, 1}))
	out := q.Attention(k, v, lazy.AttentionOptions{Mask: m})
	grads := lazy.Grad(out.Sum(), q, k, v)
	got, err := cpu.New().Run(context.Background(), out.Graph().IR(), out.ID(), grads[0].ID())
	require.NoError(t, err)
	o, dq := got[0].Data().([]float32), got[1].Data().([]float32)
	require.Equal(t, []float32{0, 0, 0, 0}, o[:4], "hidden row's output")
	require.Equal(t, []float32{0, 0, 0, 0}, dq[:4], "hidden row's dq")
	for _, x := range append(o, dq...) {
		require.False(t, math.IsNaN(float64(x)))
	}
}

// Bad shapes are typed errors that name them.
func TestAttentionRejects(t *testing.T) {
	for _, c := range []struct {
		name    string
		q, k, v []int
		want    string
	}{
		{"head dims", []int{2, 4, 5, 8}, []int{2, 2, 5, 16}, []int{2, 2, 5, 16}, "[2 4 5 8]"},
		{"k and v lengths", []int{2, 4, 5, 8}, []int{2, 2, 5, 8}, []int{2, 2, 6, 8}, "[2 2 6 8]"},
		{"heads that do not divide", []int{2, 4, 5, 8}, []int{2, 3, 5, 8}, []int{2, 3, 5, 8}, "[2 3 5 8]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			gr := lazy.NewGraph()
			p := func(s []int) *lazy.Tensor { return gr.Wrap(dense(s, make([]float32, numel(s))), 0) }
			err := p(c.q).Attention(p(c.k), p(c.v), lazy.AttentionOptions{}).Err()
			require.ErrorIs(t, err, graph.ErrShape)
			require.Contains(t, err.Error(), c.want)
		})
	}
}

// TestAttentionQKVAgainstReference runs attention_qkv and d qkv (through
// loss = Σ out·r) on the CPU, against the float64 reference (tolerance as
// TestAttentionAgainstReference's) and against the same attention built
// from q, k, v sliced out of qkv and permuted to [B, heads, T, d], its
// output permuted back: the same float32 sums in the same order, so within
// 1e-6 of each output's largest magnitude. Hkv < H packs grouped-query
// heads ([B, T, (H + 2·Hkv)·d]), Hkv = 1 multi-query.
func TestAttentionQKVAgainstReference(t *testing.T) {
	type tc struct {
		B, H, Hkv, T, D int
		causal          bool
		scale           float64
	}
	cases := []tc{
		{B: 2, H: 1, Hkv: 1, T: 1, D: 8},
		{B: 2, H: 3, Hkv: 3, T: 17, D: 8, causal: true},
		{B: 1, H: 2, Hkv: 2, T: 64, D: 64, scale: 0.3},
		{B: 2, H: 2, Hkv: 2, T: 200, D: 16, causal: true},
		{B: 2, H: 4, Hkv: 2, T: 17, D: 8, causal: true},
		{B: 1, H: 6, Hkv: 3, T: 70, D: 16, scale: 0.4},
		{B: 2, H: 4, Hkv: 1, T: 33, D: 8, causal: true},
	}
	for n, c := range cases {
		t.Run(fmt.Sprintf("B%d_H%d_Hkv%d_T%d_d%d_causal%v", c.B, c.H, c.Hkv, c.T, c.D, c.causal), func(t *testing.T) {
			rng := newRNG(uint64(100 + n))
			gr := lazy.NewGraph()
			cc, kc := c.H*c.D, c.Hkv*c.D
			w := cc + 2*kc
			qkv := gr.Wrap(dense([]int{c.B, c.T, w}, uniform(rng, c.B*c.T*w, -1, 1)), 0)
			r := gr.Wrap(dense([]int{c.B, c.T, cc}, uniform(rng, c.B*c.T*cc, -1, 1)), 0)
			o := lazy.AttentionOptions{Causal: c.causal, Scale: c.scale, KVHeads: c.Hkv}
			packed := qkv.AttentionQKV(c.H, o)
			part := func(start, heads int) *lazy.Tensor {
				return qkv.Slice(2, start, start+heads*c.D).Reshape(c.B, c.T, heads, c.D).Permute(0, 2, 1, 3)
			}
			o.KVHeads = 0
			unpacked := part(0, c.H).Attention(part(cc, c.Hkv), part(cc+kc, c.Hkv), o).Permute(0, 2, 1, 3).Reshape(c.B, c.T, cc)
			dp := lazy.Grad(packed.Mul(r).Sum(), qkv)[0]
			du := lazy.Grad(unpacked.Mul(r).Sum(), qkv)[0]
			require.NoError(t, errors.Join(packed.Err(), unpacked.Err(), dp.Err(), du.Err()))
			ids := []int{packed.ID(), dp.ID(), unpacked.ID(), du.ID()}
			g := packed.Graph().IR()
			want, err := ref.Eval(g, nil, ids[:2]...)
			require.NoError(t, err)
			got, err := cpu.New().Run(context.Background(), g, ids...)
			require.NoError(t, err)
			for i, name := range []string{"out", "dqkv"} {
				gd, gu := got[i].Data().([]float32), got[i+2].Data().([]float32)
				require.Len(t, gd, len(want[i].Data), name)
				scale := 0.0
				for _, x := range want[i].Data {
					scale = math.Max(scale, math.Abs(x))
				}
				require.Positive(t, scale, name)
				for j, w := range want[i].Data {
					require.False(t, math.IsNaN(float64(gd[j])), "%s[%d] is NaN", name, j)
					require.InDelta(t, w, float64(gd[j]), 1e-4*math.Abs(w)+2e-5*math.Max(scale, 1), "%s[%d]", name, j)
					require.InDelta(t, float64(gu[j]), float64(gd[j]), 1e-6*scale, "%s[%d] packed vs unpacked", name, j)
				}
			}
		})
	}
}

// TestFuseAttentionQKV: graph.FuseAttentionQKV rewrites attention over q,
// k, v sliced from one projection (a GPT block as PyTorch code writes it)
// into attention_qkv, with no slice, permute or attention left, and the
// fused graph gives the unfused one's loss and gradients (of the
// projection's weight and of the input) on the CPU, within 1e-6 of each
// value's largest magnitude (the same float32 sums in the same order).
// Graphs that differ from the pattern come back unchanged (the same
// signature): a mask, k and q swapped, and a permute other than
// [0, 2, 1, 3].
func TestFuseAttentionQKV(t *testing.T) {
	const B, T, H, D = 2, 9, 3, 4
	const C = H * D
	type variant struct {
		name  string
		fused bool
		heads func(qkv *lazy.Tensor, mask *lazy.Tensor) *lazy.Tensor
	}
	head := func(qkv *lazy.Tensor, i int, perm ...int) *lazy.Tensor {
		return qkv.Slice(2, i*C, (i+1)*C).Reshape(-1, T, H, D).Permute(perm...)
	}
	back := func(y *lazy.Tensor) *lazy.Tensor { return y.Permute(0, 2, 1, 3).Reshape(-1, T, C) }
	opts := lazy.AttentionOptions{Causal: true, Scale: 0.4}
	variants := []variant{
		{"gpt block", true, func(qkv, _ *lazy.Tensor) *lazy.Tensor {
			return back(head(qkv, 0, 0, 2, 1, 3).Attention(head(qkv, 1, 0, 2, 1, 3), head(qkv, 2, 0, 2, 1, 3), opts))
		}},
		{"mask", false, func(qkv, m *lazy.Tensor) *lazy.Tensor {
			o := opts
			o.Mask = m
			return back(head(qkv, 0, 0, 2, 1, 3).Attention(head(qkv, 1, 0, 2, 1, 3), head(qkv, 2, 0, 2, 1, 3), o))
		}},
		{"k and q swapped", false, func(qkv, _ *lazy.Tensor) *lazy.Tensor {
			return back(head(qkv, 1, 0, 2, 1, 3).Attention(head(qkv, 0, 0, 2, 1, 3), head(qkv, 2, 0, 2, 1, 3), opts))
		}},
		{"other permute", false, func(qkv, _ *lazy.Tensor) *lazy.Tensor {
			return back(head(qkv, 0, 2, 0, 1, 3).Permute(1, 0, 2, 3).Attention(head(qkv, 1, 0, 2, 1, 3), head(qkv, 2, 0, 2, 1, 3), opts))
		}},
	}
	for n, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			rng := newRNG(uint64(200 + n))
			gr := lazy.NewGraph()
			x := gr.Wrap(dense([]int{B, T, C}, uniform(rng, B*T*C, -1, 1)), 0)
			w := lazy.Param(dense([]int{3 * C, C}, uniform(rng, 3*C*C, -0.5, 0.5)), "w")
			r := gr.Wrap(dense([]int{B, T, C}, uniform(rng, B*T*C, -1, 1)), 0)
			m := lazy.Const(dense([]int{T, T}, uniform(rng, T*T, -1, 1)))
			loss := v.heads(x.Linear(w, nil), m).Mul(r).Sum()
			count := checkFuseAttentionQKV(t, loss, []*lazy.Tensor{w, x}, v.fused, 1e-6)
			if !v.fused {
				return
			}
			require.Equal(t, 1, count[graph.OpAttentionQKV])
			for _, op := range []graph.Op{graph.OpAttention, graph.OpSlice, graph.OpPermute} {
				require.Zero(t, count[op], "%s left", op)
			}
		})
	}
}

// TestFuseAttentionQKVLlama: graph.FuseAttentionQKV packs a Llama block's
// q_proj, k_proj and v_proj (grouped heads, 4 query heads over 2) into
// one linear of the three weights side by side and one attention_qkv,
// with q and k rotated once in the packed projection, and the fused graph
// gives the unfused one's loss and gradients (each weight's and bias's,
// and the input's) on the CPU within 1e-5 of each value's largest
// magnitude (float32 sums in another order; the rotation in one rounding
// instead of three). Rotations: written out as Hugging Face writes
// apply_rotary_pos_emb, with cos and sin tables [T, 1, d] whose halves
// differ (the full table form carries them exactly), or rotary ops of
// one table. Graphs that differ from the pattern come back unchanged: a
// bias on q only, k not rotated, q and k rotated by other tables, cos and
// sin of two dtypes, and rotate_half's halves the other way round.
func TestFuseAttentionQKVLlama(t *testing.T) {
	const B, T, H, KV, D, C = 2, 7, 4, 2, 8, 12
	rng := newRNG(300)
	table := func(shape ...int) *lazy.Tensor { return lazy.Const(dense(shape, uniform(rng, T*D, -1, 1))) }
	cos, sin, sin2 := table(T, 1, D), table(1, T, 1, D), table(T, 1, D)
	cs := table(T, D)
	sinHalf := sin.Cast(graph.Float16)
	written := func(x, c, s *lazy.Tensor) *lazy.Tensor {
		rot := lazy.Concat(-1, x.Slice(-1, D/2, D).Neg(), x.Slice(-1, 0, D/2))
		return x.Mul(c).Add(s.Mul(rot))
	}
	none := func(x *lazy.Tensor) *lazy.Tensor { return x }
	type variant struct {
		name       string
		fused      bool
		biases     [3]bool
		rotQ, rotK func(*lazy.Tensor) *lazy.Tensor
	}
	variants := []variant{
		{"written rotary", true, [3]bool{}, func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sin) },
			func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sin) }},
		{"rotary ops, biases", true, [3]bool{true, true, true}, func(x *lazy.Tensor) *lazy.Tensor { return x.Rotary(cs) },
			func(x *lazy.Tensor) *lazy.Tensor { return x.Rotary(cs) }},
		{"no rotation", true, [3]bool{}, none, none},
		{"bias on q only", false, [3]bool{true, false, false}, none, none},
		{"k not rotated", false, [3]bool{}, func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sin) }, none},
		{"other tables", false, [3]bool{}, func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sin) },
			func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sin2) }},
		{"tables of two dtypes", false, [3]bool{}, func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sinHalf) },
			func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sinHalf) }},
		{"halves swapped", false, [3]bool{}, func(x *lazy.Tensor) *lazy.Tensor {
			return x.Mul(cos).Add(lazy.Concat(-1, x.Slice(-1, 0, D/2), x.Slice(-1, D/2, D).Neg()).Mul(sin))
		}, func(x *lazy.Tensor) *lazy.Tensor { return written(x, cos, sin) }},
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			gr := lazy.NewGraph()
			x := gr.Wrap(dense([]int{B, T, C}, uniform(rng, B*T*C, -1, 1)), 0)
			r := gr.Wrap(dense([]int{B, T, H * D}, uniform(rng, B*T*H*D, -1, 1)), 0)
			var params []*lazy.Tensor
			proj := func(i, heads int, rot func(*lazy.Tensor) *lazy.Tensor) *lazy.Tensor {
				w := lazy.Param(dense([]int{heads * D, C}, uniform(rng, heads*D*C, -0.5, 0.5)), fmt.Sprintf("w%d", i))
				params = append(params, w)
				var b *lazy.Tensor
				if v.biases[i] {
					b = lazy.Param(dense([]int{heads * D}, uniform(rng, heads*D, -0.5, 0.5)), fmt.Sprintf("b%d", i))
					params = append(params, b)
				}
				return rot(x.Linear(w, b).Reshape(-1, T, heads, D)).Permute(0, 2, 1, 3)
			}
			q, k, vv := proj(0, H, v.rotQ), proj(1, KV, v.rotK), proj(2, KV, none)
			o := q.Attention(k, vv, lazy.AttentionOptions{Causal: true, KVHeads: KV, Scale: 0.35})
			loss := o.Permute(0, 2, 1, 3).Reshape(-1, T, H*D).Mul(r).Sum()
			count := checkFuseAttentionQKV(t, loss, append([]*lazy.Tensor{x}, params...), v.fused, 1e-5)
			if !v.fused {
				return
			}
			require.Equal(t, 1, count[graph.OpAttentionQKV])
			require.Equal(t, 1, count[graph.OpLinear], "one packed projection")
			for _, op := range []graph.Op{graph.OpAttention, graph.OpSlice, graph.OpPermute, graph.OpNeg} {
				require.Zero(t, count[op], "%s left", op)
			}
			require.Equal(t, 1, count[graph.OpMul], "the loss's mul only")
		})
	}
}

// checkFuseAttentionQKV runs graph.FuseAttentionQKV on loss's graph. When
// fused is false it requires the graph back unchanged (the same
// signature) and returns nil; otherwise it requires the fused graph's
// loss and gradients with respect to wrt to equal the unfused graph's on
// the CPU within tol of each value's largest magnitude, and returns the
// fused graph's count of each op.
func checkFuseAttentionQKV(t *testing.T, loss *lazy.Tensor, wrt []*lazy.Tensor, fused bool, tol float64) map[graph.Op]int {
	t.Helper()
	require.NoError(t, loss.Err())
	g := loss.Graph().IR()
	fg, ids, err := graph.FuseAttentionQKV(g)
	require.NoError(t, err)
	if !fused {
		require.Equal(t, g.Signature(), fg.Signature(), "unmatched graph unchanged")
		return nil
	}
	count := map[graph.Op]int{}
	for _, nd := range fg.Nodes() {
		count[nd.Op]++
	}
	values := func(g *graph.Graph, loss int, wrt []int) []*tensor.Dense {
		grads, err := autodiff.Backward(g, loss, wrt)
		require.NoError(t, err)
		out, err := cpu.New().Run(context.Background(), g, append([]int{loss}, grads...)...)
		require.NoError(t, err)
		return out
	}
	var old, now []int
	for _, p := range wrt {
		id := loss.Graph().NodeOf(p)
		old, now = append(old, id), append(now, ids[id])
	}
	want, got := values(g, loss.ID(), old), values(fg, ids[loss.ID()], now)
	for i := range want {
		wd, gd := flat32(want[i]), flat32(got[i])
		require.Len(t, gd, len(wd))
		scale := 0.0
		for _, x := range wd {
			scale = math.Max(scale, math.Abs(float64(x)))
		}
		require.Positive(t, scale, "output %d", i)
		for j := range wd {
			require.InDelta(t, float64(wd[j]), float64(gd[j]), tol*scale, "output %d [%d]", i, j)
		}
	}
	return count
}

// flat32 is d's float32 values, a scalar's as one.
func flat32(d *tensor.Dense) []float32 {
	if v, ok := d.Data().(float32); ok {
		return []float32{v}
	}
	return d.Data().([]float32)
}
