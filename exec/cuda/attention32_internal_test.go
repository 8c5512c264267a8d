package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// The float32 path's query block is a pure function of the per-sample
// shapes: 128 rows while one sample's [H, bq, ld] float32 array stays
// within 64 MiB, fewer (a multiple of 16, at least 16) beyond, never more
// than T.
func TestAttnBlockRows(t *testing.T) {
	for _, c := range []struct{ h, t, s, want int }{
		{12, 1024, 1024, 128}, // GPT-2 small: 6 MiB a sample
		{1, 17, 17, 17},
		{4, 1, 5, 1},
		{6, 300, 300, 128},
		{100, 1000, 1000, 128},
		{200, 1000, 1000, 80},     // 800,000 bytes a row: 83 rows fit
		{256, 1024, 1024, 64},     // 1 MiB a row
		{32, 32768, 32768, 16},    // 4 MiB a row: 16
		{64, 32768, 32768, 16},    // 8 MiB a row: 8 would fit, 16 is the floor
		{12, 1024, 0, 128},        // no keys
		{12, 0, 1024, 0},          // no queries
		{1, 5000, 7, 128},         // ld 8
		{3, 1 << 20, 1 << 20, 16}, // 12 MiB a row
	} {
		got := attnBlockRows(c.h, c.t, c.s)
		assert.Equal(t, c.want, got, "h %d t %d s %d", c.h, c.t, c.s)
		if got > 0 && got < c.t {
			assert.Zero(t, got%16)
		}
		if got > attnBlockMin {
			assert.LessOrEqual(t, 4*int64(c.h)*int64(got)*int64(attnLD(c.s)), int64(attnBlockCap))
		}
	}
	assert.Equal(t, 8, attnLD(5))
	assert.Equal(t, 1024, attnLD(1024))
	assert.Equal(t, 0, attnLD(0))
}

// attnTestGraph appends q [B, H, T, d], k, v [B, Hkv, S, d], g and an
// optional mask of shape mask to a graph, with data drawn from rng (the
// mask hides about one key in five, and every key of its first row), and
// the four attention ops over them; it returns the graph and the ids of q,
// k, v, g, mask (−1 without), o, lse, dq and dk|dv. With lseFirst the
// attention_lse node precedes the forward one, so it is no companion
// (graph.LSEProducer looks backwards) and runs on its own.
func attnTestGraph(t *testing.T, c attn32Case, rng *rand.Rand, lseFirst bool) (*graph.Graph, [9]int) {
	t.Helper()
	g := graph.New()
	add := func(n graph.Node) int {
		id, err := g.Append(n)
		require.NoError(t, err)
		return id
	}
	in := func(shape ...int) int {
		d := make([]float32, graph.Numel(shape))
		for i := range d {
			d[i] = float32(2*rng.Float64() - 1)
		}
		return add(graph.Node{Op: graph.OpInput, Value: tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d)),
			Type: graph.Type{Shape: shape, DType: graph.Float32, BatchAxis: 0}})
	}
	var ids [9]int
	ids[0], ids[1], ids[2] = in(c.B, c.H, c.T, c.D), in(c.B, c.Hkv, c.S, c.D), in(c.B, c.Hkv, c.S, c.D)
	ids[3] = in(c.B, c.H, c.T, c.D)
	ids[4] = -1
	var mask []int
	if c.mask != nil {
		md := make([]float32, graph.Numel(c.mask))
		for i := range md {
			md[i] = float32(4*rng.Float64() - 2)
			if rng.IntN(5) == 0 {
				md[i] = float32(math.Inf(-1))
			}
		}
		if len(md) > c.S {
			for i := range c.S {
				md[i] = float32(math.Inf(-1))
			}
		}
		n := graph.Node{Op: graph.OpConst, Value: tensor.New(tensor.WithShape(c.mask...), tensor.WithBacking(md)),
			Type: graph.Type{Shape: c.mask, DType: graph.Float32, BatchAxis: -1}}
		if len(c.mask) == 4 && c.mask[0] == c.B {
			n.Op, n.Type.BatchAxis = graph.OpInput, 0
		}
		ids[4] = add(n)
		mask = []int{ids[4]}
	}
	a := graph.Attrs{Scalar: c.scale, Causal: c.causal}
	lse := func() int {
		return add(graph.Node{Op: graph.OpAttentionLSE, Inputs: append([]int{ids[0], ids[1]}, mask...), Attrs: a})
	}
	if lseFirst {
		ids[6] = lse()
	}
	ids[5] = add(graph.Node{Op: graph.OpAttention, Inputs: append([]int{ids[0], ids[1], ids[2]}, mask...), Attrs: a})
	if !lseFirst {
		ids[6] = lse()
	}
	args := append([]int{ids[3], ids[0], ids[1], ids[2], ids[5], ids[6]}, mask...)
	ids[7] = add(graph.Node{Op: graph.OpAttentionGradQ, Inputs: args, Attrs: a})
	ids[8] = add(graph.Node{Op: graph.OpAttentionGradKV, Inputs: args, Attrs: a})
	return g, ids
}

type attn32Case struct {
	B, H, Hkv, T, S, D int
	causal             bool
	mask               []int
	scale              float64
}

func (c attn32Case) String() string {
	return fmt.Sprintf("B%d_H%d_Hkv%d_T%d_S%d_d%d_causal%v_mask%v", c.B, c.H, c.Hkv, c.T, c.S, c.D, c.causal, c.mask)
}

// The float32 path's workspace is one [B·H, bq, ld] float32 array for
// attention and attention_lse and two for the gradients, linear in the
// chunk size (the planner evaluates it at 0 and 1 samples); 16-bit
// attention declares the tensor-core dk|dv pass's D, and cuDNN's
// workspace for the forward pass and dq (sdpaFwdBytes, sdpaBwdBytes).
func TestAttnF32Workspace(t *testing.T) {
	c := attn32Case{B: 3, H: 6, Hkv: 2, T: 300, S: 200, D: 64, causal: true, mask: []int{300, 200}}
	g, ids := attnTestGraph(t, c, rand.New(rand.NewPCG(1, 2)), false)
	one := int64(4 * 6 * 128 * 200) // [H, bq, ld] float32 of one sample
	for i, arrays := range map[int]int64{5: 1, 6: 1, 7: 2, 8: 2} {
		nd := g.Node(ids[i])
		for _, b := range []int{0, 1, 2, 3, 7} {
			assert.Equal(t, arrays*one*int64(b), Workspace(g, nd, b), "%s at %d samples", nd.Op, b)
		}
	}
	// bf16 at head dim 64 with no mask: the tensor-core D of dk|dv only.
	h := graph.New()
	in := func(dt graph.DType, shape ...int) int {
		id, err := h.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: 0}})
		require.NoError(t, err)
		return id
	}
	q, k := in(graph.BFloat16, 2, 4, 10, 64), in(graph.BFloat16, 2, 2, 7, 64)
	o, err := h.Append(graph.Node{Op: graph.OpAttention, Inputs: []int{q, k, k}})
	require.NoError(t, err)
	l, err := h.Append(graph.Node{Op: graph.OpAttentionLSE, Inputs: []int{q, k}})
	require.NoError(t, err)
	args := []int{q, q, k, k, o, l}
	dq, err := h.Append(graph.Node{Op: graph.OpAttentionGradQ, Inputs: args})
	require.NoError(t, err)
	dkv, err := h.Append(graph.Node{Op: graph.OpAttentionGradKV, Inputs: args})
	require.NoError(t, err)
	// cuDNN's fused attention takes these grouped-query heads: the forward
	// pass and dq declare its arrays and plan bound, the log-sum-exp
	// nothing.
	x := sdpaDims{b: 2, h: 4, hkv: 2, t: 10, s: 7, d: 64}
	assert.Equal(t, sdpaFwdBytes(x), Workspace(h, h.Node(o), 2))
	assert.Zero(t, Workspace(h, h.Node(l), 2))
	assert.Equal(t, sdpaBwdBytes(x), Workspace(h, h.Node(dq), 2))
	assert.Equal(t, int64(4*2*4*10), Workspace(h, h.Node(dkv), 2))
}

// attnCalls pairs every flat query head bh = b·H + h with its key/value
// head b·Hkv + h/(H/Hkv), each exactly once; a call that writes the
// key/value operand never has two products on one key/value head.
func TestAttnCalls(t *testing.T) {
	for _, c := range [][3]int{{1, 1, 1}, {2, 12, 12}, {2, 6, 2}, {1, 8, 1}, {3, 8, 2}, {1, 6, 3}, {4, 32, 8}, {1, 32, 8}, {0, 4, 2}} {
		b, h, hkv := c[0], c[1], c[2]
		for _, kvOut := range []bool{false, true} {
			seen := make([]int, b*h)
			calls := attnCalls(b, h, hkv, kvOut)
			for _, cl := range calls {
				written := map[int]bool{}
				for i := range cl.count {
					qh, kh := cl.qh+i*cl.qs, cl.kh+i*cl.ks
					require.Less(t, qh, b*h)
					seen[qh]++
					assert.Equal(t, (qh/h)*hkv+(qh%h)/(h/hkv), kh, "b %d h %d hkv %d: query head %d", b, h, hkv, qh)
					if kvOut {
						assert.False(t, written[kh], "b %d h %d hkv %d: key/value head %d written twice in one call", b, h, hkv, kh)
						written[kh] = true
					}
				}
			}
			for qh, n := range seen {
				assert.Equal(t, 1, n, "b %d h %d hkv %d kvOut %v: query head %d", b, h, hkv, kvOut, qh)
			}
			if g := h / max(hkv, 1); b > 0 && (g == 1 || kvOut || b*hkv >= g) {
				assert.Len(t, calls, g, "one call per group member")
			}
		}
	}
	// MQA at batch 1 goes per (b, hkv) pair when only read: one call.
	assert.Equal(t, []attnCall{{qh: 0, qs: 1, kh: 0, ks: 0, count: 8}}, attnCalls(1, 8, 1, false))
}

// hostDev emulates the device for the float32 path: one arena of float32s
// (pointers are byte addresses from hostBase), strided-batched GEMMs as
// cuBLAS computes them (row-major, after checkGemm), the row kernels as
// kernels/attention.cu writes them, fill_f32, and a workspace of the
// planned size. Every array is followed by a guard of NaNs, so a read past
// an array poisons the results and a write past it is caught.
type hostDev struct {
	t      *testing.T
	mem    []float32
	guards [][2]int
	ws     alloc.Ptr
	wsSize int64
	args   map[string][]string // each kernel's C parameter types
}

const hostBase = alloc.Ptr(1 << 20)

func newHostDev(t *testing.T) *hostDev {
	src, err := Source("attention.cu")
	require.NoError(t, err)
	args := map[string][]string{}
	for _, k := range []string{kAttnRowsFwd, kAttnRowsBwd} {
		m := regexp.MustCompile(k + `\(([^)]*)\)`).FindStringSubmatch(src)
		require.NotNil(t, m, k)
		for _, p := range strings.Split(m[1], ",") {
			f := strings.Fields(p)
			args[k] = append(args[k], strings.Join(f[:len(f)-1], " "))
		}
	}
	args[kFillF32] = []string{"T*", "i64", "float"} // accumulate.cu's fill_##S(T* dst, i64 n, float v)
	return &hostDev{t: t, args: args}
}

func (h *hostDev) alloc(n int) alloc.Ptr {
	const guard = 64
	for len(h.mem)%4 != 0 { // 16-byte aligned arrays
		h.mem = append(h.mem, float32(math.NaN()))
	}
	p := hostBase + alloc.Ptr(4*len(h.mem))
	h.mem = append(h.mem, make([]float32, n)...)
	h.guards = append(h.guards, [2]int{len(h.mem), len(h.mem) + guard})
	for range guard {
		h.mem = append(h.mem, float32(math.NaN()))
	}
	return p
}

func (h *hostDev) upload(d []float32) alloc.Ptr {
	p := h.alloc(len(d))
	copy(h.f(p), d)
	return p
}

// f is the arena from p on.
func (h *hostDev) f(p alloc.Ptr) []float32 {
	if p < hostBase || (p-hostBase)%4 != 0 {
		h.t.Fatalf("pointer %#x is outside the arena or not float-aligned", p)
	}
	return h.mem[(p-hostBase)/4:]
}

func (h *hostDev) checkGuards() {
	for _, g := range h.guards {
		for i := g[0]; i < g[1]; i++ {
			if !math.IsNaN(float64(h.mem[i])) {
				h.t.Fatalf("a write past an array, at float %d", i)
			}
		}
	}
}

func (h *hostDev) sgemm(ta, tb bool, m, n, k int, alpha float32, a alloc.Ptr, lda int, sa int64, b alloc.Ptr, ldb int, sb int64,
	beta float32, c alloc.Ptr, ldc int, sc int64, count int) error {
	if err := checkGemm(ta, tb, m, n, k, lda, ldb, ldc, count); err != nil {
		return err
	}
	require.True(h.t, sa >= 0 && sb >= 0 && sc > 0)
	for bi := range int64(count) {
		A, B, C := h.f(a+alloc.Ptr(4*bi*sa)), h.f(b+alloc.Ptr(4*bi*sb)), h.f(c+alloc.Ptr(4*bi*sc))
		for i := range m {
			for j := range n {
				var s float64
				for p := range k {
					var av, bv float32
					if ta {
						av = A[p*lda+i]
					} else {
						av = A[i*lda+p]
					}
					if tb {
						bv = B[j*ldb+p]
					} else {
						bv = B[p*ldb+j]
					}
					s += float64(av) * float64(bv)
				}
				v := float64(alpha) * s
				if beta != 0 {
					v += float64(beta) * float64(C[i*ldc+j])
				}
				C[i*ldc+j] = float32(v)
			}
		}
	}
	return nil
}

func (h *hostDev) memzero(p alloc.Ptr, bytes int64) error {
	require.Zero(h.t, bytes%4)
	clear(h.f(p)[:bytes/4])
	return nil
}

func (h *hostDev) workspace(bytes int64) (alloc.Ptr, error) {
	if bytes > h.wsSize {
		return 0, fmt.Errorf("workspace of %d bytes, %d planned", bytes, h.wsSize)
	}
	return h.ws, nil
}

// flat checks the arguments against the kernel's C parameters and runs it.
func (h *hostDev) flat(name string, work int64, args ...any) error {
	want, ok := h.args[name]
	require.True(h.t, ok, "kernel %s is not emulated", name)
	require.Len(h.t, args, len(want), name)
	for i, a := range args {
		switch want[i] {
		case "i64":
			require.IsType(h.t, int64(0), a, "%s argument %d", name, i)
		case "float":
			require.IsType(h.t, float32(0), a, "%s argument %d", name, i)
		default:
			require.True(h.t, strings.HasSuffix(want[i], "*"), "%s argument %d is %s", name, i, want[i])
			require.IsType(h.t, alloc.Ptr(0), a, "%s argument %d", name, i)
		}
	}
	ptr := func(i int) alloc.Ptr { return args[i].(alloc.Ptr) }
	i64 := func(i int) int { return int(args[i].(int64)) }
	ninf := math.Inf(-1)
	switch name {
	case kFillF32:
		for i := range i64(1) {
			h.f(ptr(0))[i] = args[2].(float32)
		}
		return nil
	case kAttnRowsFwd:
		// sp, mask, lse, writep, rows, nq, n, ld, H, T, i0, ms0..ms3, causal, mdt
		require.Equal(h.t, 32*int64(i64(4)), work)
		require.Zero(h.t, i64(16), "float32 masks only here")
		nq, n, ld, H, T, i0 := i64(5), i64(6), i64(7), i64(8), i64(9), i64(10)
		for r := range i64(4) {
			bh, i := r/nq, i0+r%nq
			moff := (bh/H)*i64(11) + (bh%H)*i64(12) + i*i64(13)
			jend := n
			if i64(15) != 0 {
				jend = min(n, i+1)
			}
			row := h.f(ptr(0) + alloc.Ptr(4*r*ld))[:n]
			var mk []float32
			if ptr(1) != 0 {
				mk = h.f(ptr(1))
			}
			s := make([]float64, n)
			m := ninf
			for j := range n {
				s[j] = ninf
				if j < jend {
					s[j] = float64(row[j])
					if mk != nil {
						s[j] += float64(mk[moff+j*i64(14)])
					}
					s[j] = float64(float32(s[j]))
				}
				m = math.Max(m, s[j])
			}
			var l float64
			for _, x := range s {
				if x != ninf {
					l += math.Exp(x - m)
				}
			}
			if ptr(2) != 0 {
				v := ninf
				if l > 0 {
					v = m + math.Log(l)
				}
				h.f(ptr(2))[bh*T+i] = float32(v)
			}
			if i64(3) != 0 {
				for j, x := range s {
					row[j] = 0
					if l > 0 && x != ninf {
						row[j] = float32(math.Exp(x-m) / l)
					}
				}
			}
		}
		return nil
	case kAttnRowsBwd:
		// sp, dp, g, o, lse, mask, keepp, rows, nq, n, ld, H, T, d, i0, ms0..ms3, scale, causal, mdt
		require.Equal(h.t, 32*int64(i64(7)), work)
		require.Zero(h.t, i64(21), "float32 masks only here")
		nq, n, ld, H, T, d, i0 := i64(8), i64(9), i64(10), i64(11), i64(12), i64(13), i64(14)
		scale := float64(args[19].(float32))
		for r := range i64(7) {
			bh, i := r/nq, i0+r%nq
			q := bh*T + i
			var D float64
			gq, oq := h.f(ptr(2))[q*d:], h.f(ptr(3))[q*d:]
			for c := range d {
				D += float64(gq[c]) * float64(oq[c])
			}
			var mk []float32
			if ptr(5) != 0 {
				mk = h.f(ptr(5))
			}
			li := float64(h.f(ptr(4))[q])
			moff := (bh/H)*i64(15) + (bh%H)*i64(16) + i*i64(17)
			jend := n
			if i64(20) != 0 {
				jend = min(n, i+1)
			}
			srow, drow := h.f(ptr(0) + alloc.Ptr(4*r*ld))[:n], h.f(ptr(1) + alloc.Ptr(4*r*ld))[:n]
			for j := range n {
				var p float64
				if j < jend && li != ninf {
					s := float64(srow[j])
					if mk != nil {
						s += float64(mk[moff+j*i64(18)])
					}
					p = math.Exp(float64(float32(s)) - li)
				}
				ds := p * (float64(drow[j]) - float64(float32(D))) * scale
				if i64(6) != 0 {
					srow[j] = float32(p)
				}
				drow[j] = float32(ds)
			}
		}
		return nil
	}
	h.t.Fatalf("kernel %s is not emulated", name)
	return nil
}

// TestAttnF32Emulated runs the float32 path's host side (query blocks,
// GEMM batching over grouped heads, workspace layout, the row kernels'
// arguments) on hostDev, with the workspace the planner would declare,
// against the float64 reference: T from 1 to 1000 (not multiples of the
// 128-row block, and several blocks), S ≠ T, causal or not, grouped-query
// heads (both ways of batching them), masks broadcast several ways with
// hidden keys and a hidden row, head dims 4 to 160; attention_lse on its
// own too. The emulated GEMMs sum in float64 and round once, so the
// tolerance is float32's: 1e-5 of each output's largest magnitude, plus
// 1e-6 for gradients that cancel to 0.
func TestAttnF32Emulated(t *testing.T) {
	cases := []attn32Case{
		{B: 2, H: 2, Hkv: 2, T: 1, S: 1, D: 8},
		{B: 2, H: 4, Hkv: 2, T: 17, S: 17, D: 8, causal: true},
		{B: 1, H: 3, Hkv: 1, T: 17, S: 29, D: 4, mask: []int{17, 29}, scale: 0.3},
		{B: 3, H: 2, Hkv: 1, T: 29, S: 17, D: 4, causal: true, mask: []int{3, 1, 1, 17}},
		{B: 1, H: 6, Hkv: 2, T: 300, S: 300, D: 16, causal: true},
		{B: 2, H: 6, Hkv: 2, T: 300, S: 130, D: 8, mask: []int{2, 6, 300, 130}},
		{B: 1, H: 4, Hkv: 1, T: 200, S: 257, D: 8, causal: true, mask: []int{200, 257}},
		{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 4, causal: true},
		{B: 1, H: 2, Hkv: 2, T: 130, S: 70, D: 160, causal: true},
	}
	for n, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			for _, lseFirst := range []bool{false, true} {
				g, ids := attnTestGraph(t, c, rand.New(rand.NewPCG(uint64(n), 3)), lseFirst)
				want, err := ref.Eval(g, nil, ids[5], ids[6], ids[7], ids[8])
				require.NoError(t, err)
				h := newHostDev(t)
				ptrs := map[int]alloc.Ptr{}
				operandOf := func(id int) operand {
					nd := g.Node(id)
					p, ok := ptrs[id]
					if !ok {
						if nd.Value != nil {
							p = h.upload(nd.Value.Data().([]float32))
						} else {
							p = h.alloc(graph.Numel(nd.Type.Shape))
						}
						ptrs[id] = p
					}
					return operand{p: p, shape: nd.Type.Shape, dt: nd.Type.DType}
				}
				q, k, v, gr := operandOf(ids[0]), operandOf(ids[1]), operandOf(ids[2]), operandOf(ids[3])
				var mask *operand
				if ids[4] >= 0 {
					m := operandOf(ids[4])
					mask = &m
				}
				o, lse, dq, dkv := operandOf(ids[5]), operandOf(ids[6]), operandOf(ids[7]), operandOf(ids[8])
				lseAlone := operand{p: h.alloc(int(lse.n())), shape: lse.shape, dt: lse.dt}
				run := func(id int, f func(k *kctx, sh attnShape) error) {
					nd := g.Node(id)
					h.wsSize = Workspace(g, nd, c.B)
					h.ws = h.alloc(int(h.wsSize / 4))
					for i := range h.f(h.ws)[:h.wsSize/4] {
						h.f(h.ws)[i] = float32(math.NaN()) // the path must not read what it did not write
					}
					kc := &kctx{nd: nd}
					_, sh, err := kc.attnGeom(q, k, v, mask)
					require.NoError(t, err)
					require.NoError(t, f(kc, sh))
				}
				run(ids[5], func(_ *kctx, sh attnShape) error { return attnFwd32(h, sh, q, k, v, mask, o.p, lse.p) })
				run(ids[6], func(_ *kctx, sh attnShape) error { return attnFwd32(h, sh, q, k, k, mask, 0, lseAlone.p) })
				run(ids[7], func(_ *kctx, sh attnShape) error {
					return attnGrad32(h, sh, false, gr, q, k, v, o, lse, mask, dq)
				})
				run(ids[8], func(_ *kctx, sh attnShape) error {
					return attnGrad32(h, sh, true, gr, q, k, v, o, lse, mask, dkv)
				})
				h.checkGuards()
				require.Equal(t, h.f(lse.p)[:lse.n()], h.f(lseAlone.p)[:lse.n()], "attention_lse alone")
				for i, out := range []operand{o, lse, dq, dkv} {
					name := []string{"o", "lse", "dq", "dkv"}[i]
					checkF32Against(t, name, want[i].Data, h.f(out.p)[:out.n()], 1e-5, 1e-6)
				}
			}
		})
	}
}

// checkF32Against holds got to want within atol of want's largest finite
// magnitude plus abs; −Inf must match exactly, and nothing may be NaN.
func checkF32Against(t *testing.T, name string, want []float64, got []float32, atol, abs float64) {
	t.Helper()
	require.Len(t, got, len(want), name)
	m := 0.0
	for _, x := range want {
		if !math.IsInf(x, 0) {
			m = math.Max(m, math.Abs(x))
		}
	}
	worst := 0.0
	for j, x := range want {
		y := float64(got[j])
		require.False(t, math.IsNaN(y), "%s[%d] is NaN", name, j)
		if math.IsInf(x, 0) {
			require.Equal(t, x, y, "%s[%d]", name, j)
			continue
		}
		d := math.Abs(y - x)
		if m > 0 {
			worst = max(worst, d/m)
		}
		require.LessOrEqual(t, d, atol*m+abs, "%s[%d]: want %g, got %g", name, j, x, y)
	}
	t.Logf("%s: largest |got − want| / max|want| = %.3g", name, worst)
}
