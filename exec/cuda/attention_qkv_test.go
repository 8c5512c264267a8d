package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
)

// qkvCase is one packed attention problem: qkv [B, T, (H + 2·Hkv)·D]
// (Hkv = H when 0: [B, T, 3, H, D]).
type qkvCase struct {
	B, H, Hkv, T, D int
	causal          bool
}

// kv is the key/value heads.
func (c qkvCase) kv() int {
	if c.Hkv == 0 {
		return c.H
	}
	return c.Hkv
}

func (c qkvCase) String() string {
	if c.kv() != c.H {
		return fmt.Sprintf("B%d_H%d_Hkv%d_T%d_d%d_causal%v", c.B, c.H, c.kv(), c.T, c.D, c.causal)
	}
	return fmt.Sprintf("B%d_H%d_T%d_d%d_causal%v", c.B, c.H, c.T, c.D, c.causal)
}

// qkvGraph builds attention_qkv of c on qkv of dtype dt (entries uniform
// in [−1, 1), rounded to dt), its log-sum-exp (the forward pass's
// companion) and d qkv for an upstream gradient g [B, T, C]: outputs o,
// lse and d qkv.
func qkvGraph(t testing.TB, c qkvCase, dt graph.DType, rng *rand.Rand) (*graph.Graph, []int) {
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
		roundTo(dt, d)
		return add(graph.Node{Op: graph.OpInput, Value: tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d)),
			Type: graph.Type{Shape: shape, DType: dt, BatchAxis: 0, PerSample: 1}})
	}
	cc := c.H * c.D
	qkv, gr := in(c.B, c.T, cc+2*c.kv()*c.D), in(c.B, c.T, cc)
	a := graph.Attrs{Groups: c.H, Causal: c.causal}
	if c.Hkv != 0 {
		a.KVHeads = c.Hkv
	}
	o := add(graph.Node{Op: graph.OpAttentionQKV, Inputs: []int{qkv}, Attrs: a})
	lse := add(graph.Node{Op: graph.OpAttentionQKVLSE, Inputs: []int{qkv}, Attrs: a})
	d := add(graph.Node{Op: graph.OpAttentionQKVGrad, Inputs: []int{gr, qkv, o, lse}, Attrs: a})
	return g, []int{o, lse, d}
}

// qkvCases: T ∈ {1, 17, 64, 1024}, d ∈ {64, 128}, causal or not; and
// grouped-query heads (4 over 2) at T ∈ {17, 64} and multi-query heads
// (3 over 1 at T = 64, 4 over 1 at T = 1024).
func qkvCases() []qkvCase {
	var out []qkvCase
	for _, d := range []int{64, 128} {
		for _, causal := range []bool{false, true} {
			for _, T := range []int{1, 17, 64, 1024} {
				c := qkvCase{B: 2, H: 3, T: T, D: d, causal: causal}
				if T == 1024 {
					c.B, c.H = 1, 2
				}
				out = append(out, c)
			}
			out = append(out,
				qkvCase{B: 2, H: 4, Hkv: 2, T: 17, D: d, causal: causal},
				qkvCase{B: 2, H: 4, Hkv: 2, T: 64, D: d, causal: causal},
				qkvCase{B: 2, H: 3, Hkv: 1, T: 64, D: d, causal: causal},
				qkvCase{B: 1, H: 4, Hkv: 1, T: 1024, D: d, causal: causal})
		}
	}
	return out
}

// TestAttentionQKV runs attention_qkv, its log-sum-exp and d qkv over
// qkvCases and holds them to the float64 reference:
//
//   - bfloat16 and float16 on cuDNN's fused attention, reading q, k, v in
//     place through strides (AttnStats: one forward, one backward call on
//     cuDNN per case and no copies), at the tolerances of the unpacked
//     cuDNN path (TestCuDNNAttention: attnTolMMABF16, attnTolMMAF16; lse
//     float32, attnTolF32);
//   - float32, which cuDNN does not take: the fallback copies q, k, v to
//     [B, H, T, d] in the planned workspace and runs attention32.go there
//     (AttnStats counts both passes as attnQKVPermuted), at the float32
//     path's tolerance (attnTolF32Ref);
//   - bfloat16 with head dim 32 (the plain-FMA kernels on copies) and with
//     cuDNN's attention off (the tensor-core kernels on copies), at the
//     kernels' tolerances (attnTolBF16, attnTolMMABF16).
//
// Grouped-query and multi-query cases run every one of these paths: in
// place on cuDNN (dk and dv each group's sum), and on copies of q [B, H,
// T, d], k and v [B, Hkv, T, d] otherwise.
func TestAttentionQKV(t *testing.T) {
	e, n := sdpaExecutor(t)
	off := freshExecutor(t, cuda.ExecutorOptions{NoCuDNNAttention: true})
	type run struct {
		name    string
		c       qkvCase
		dt      graph.DType
		e       *cuda.Executor
		tol     attnTol
		lseTol  attnTol
		cudnn   bool // both passes on cuDNN, in place
		permute bool // both passes on copies (counted)
	}
	var runs []run
	for _, c := range qkvCases() {
		runs = append(runs,
			run{name: "bf16_" + c.String(), c: c, dt: graph.BFloat16, e: e, tol: attnTolMMABF16, lseTol: attnTolF32, cudnn: true},
			run{name: "f16_" + c.String(), c: c, dt: graph.Float16, e: e, tol: attnTolMMAF16, lseTol: attnTolF32, cudnn: true},
			run{name: "f32_" + c.String(), c: c, dt: graph.Float32, e: e, tol: attnTolF32Ref, lseTol: attnTolF32Ref, permute: true})
	}
	for _, c := range []qkvCase{{B: 2, H: 3, T: 17, D: 32, causal: true}, {B: 1, H: 2, T: 200, D: 32}, {B: 2, H: 4, Hkv: 2, T: 17, D: 32, causal: true},
		{B: 1, H: 3, Hkv: 1, T: 200, D: 32}} {
		runs = append(runs, run{name: "bf16_" + c.String(), c: c, dt: graph.BFloat16, e: e, tol: attnTolBF16, lseTol: attnTolF32, permute: true})
	}
	for _, c := range []qkvCase{{B: 2, H: 3, T: 64, D: 64, causal: true}, {B: 1, H: 2, T: 1024, D: 128}, {B: 2, H: 4, Hkv: 2, T: 64, D: 64, causal: true},
		{B: 1, H: 4, Hkv: 1, T: 1024, D: 128}} {
		runs = append(runs, run{name: "cudnn_off_bf16_" + c.String(), c: c, dt: graph.BFloat16, e: off, tol: attnTolMMABF16, lseTol: attnTolF32})
	}
	preps := make([]refRun, len(runs))
	for i, r := range runs {
		preps[i].g, preps[i].ids = qkvGraph(t, r.c, r.dt, rand.New(rand.NewPCG(uint64(r.c.T*131+r.c.D), 19)))
	}
	evalRefs(preps)
	for i, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			p := preps[i]
			require.NoError(t, p.err)
			before := n.AttnStats()
			out, err := r.e.Run(context.Background(), p.g, p.ids...)
			require.NoError(t, err)
			after := n.AttnStats()
			fwd, bwd := after.Forward-before.Forward, after.Backward-before.Backward
			permuted := after.Fallbacks["attention_qkv permuted"] - before.Fallbacks["attention_qkv permuted"]
			if r.cudnn {
				require.Equal(t, 1, fwd, "forward on cuDNN (%s)", after)
				require.Equal(t, 1, bwd, "backward on cuDNN (%s)", after)
				require.Zero(t, permuted, "no copies (%s)", after)
			}
			if r.permute {
				require.Zero(t, fwd+bwd, "%s", after)
				require.Equal(t, 2, permuted, "forward and backward on copies (%s)", after)
			}
			got := make([][]float32, len(out))
			for j, o := range out {
				got[j] = o.Data().([]float32)
			}
			compareOutputs(t, r.name, []string{"o", "lse", "dqkv"}, p.want, got, []attnTol{r.tol, r.lseTol, r.tol})
		})
	}
	t.Logf("%s", n.AttnStats())
	if s := off.DNN(); s != nil {
		st := s.AttnStats()
		require.Zero(t, st.Forward+st.Backward, "cuDNN's attention off: %s", st)
	}
}

// TestAttentionQKVMatchesUnpacked: on cuDNN, attention_qkv gives the
// values of the unpacked attention over q, k, v sliced from qkv and
// permuted to [B, H, T, d]: o, and d qkv against the unpacked path's dq,
// dk, dv permuted back and concatenated. The same plans on the same
// numbers, only the strides differ, but cuDNN's backward pass sums dq in
// float32 with atomics, in no fixed order: within one bfloat16 ulp
// (rtol 2⁻⁷) plus 1e-3 of the largest magnitude (the order of float32
// sums, rounded once), not bit for bit.
func TestAttentionQKVMatchesUnpacked(t *testing.T) {
	e, _ := sdpaExecutor(t)
	for _, c := range []qkvCase{{B: 2, H: 3, T: 64, D: 64, causal: true}, {B: 1, H: 2, T: 1024, D: 128},
		{B: 2, H: 4, Hkv: 2, T: 64, D: 64, causal: true}, {B: 1, H: 8, Hkv: 1, T: 1024, D: 128}} {
		t.Run(c.String(), func(t *testing.T) { matchUnpacked(t, e, c) })
	}
}

// matchUnpacked runs c's packed graph and the unpacked composition on e and
// compares them (TestAttentionQKVMatchesUnpacked).
func matchUnpacked(t *testing.T, e graphRunner, c qkvCase) {
	t.Helper()
	g, ids := qkvGraph(t, c, graph.BFloat16, rand.New(rand.NewPCG(3, 4)))
	packed, err := e.Run(context.Background(), g, ids[0], ids[2])
	require.NoError(t, err)
	// The same graph's inputs, unpacked by hand.
	qkvIn, gIn := g.Node(ids[2]).Inputs[1], g.Node(ids[2]).Inputs[0]
	cc, kc := c.H*c.D, c.kv()*c.D
	add := func(op graph.Op, a graph.Attrs, in ...int) int {
		id, err := g.Append(graph.Node{Op: op, Inputs: in, Attrs: a})
		require.NoError(t, err)
		return id
	}
	toHeads := func(x, start, heads int) int { // columns [start, start + heads·d) of x [B, T, ·] → [B, heads, T, d]
		s := add(graph.OpSlice, graph.Attrs{Axis: 2, Start: start, End: start + heads*c.D, Step: 1}, x)
		r := add(graph.OpReshape, graph.Attrs{Shape: []int{-1, c.T, heads, c.D}}, s)
		return add(graph.OpPermute, graph.Attrs{Perm: []int{0, 2, 1, 3}}, r)
	}
	fromHeads := func(x, heads int) int { // [B, heads, T, d] → [B, T, heads·d]
		p := add(graph.OpPermute, graph.Attrs{Perm: []int{0, 2, 1, 3}}, x)
		return add(graph.OpReshape, graph.Attrs{Shape: []int{-1, c.T, heads * c.D}}, p)
	}
	q, k, v, gh := toHeads(qkvIn, 0, c.H), toHeads(qkvIn, cc, c.kv()), toHeads(qkvIn, cc+kc, c.kv()), toHeads(gIn, 0, c.H)
	a := graph.Attrs{Causal: c.causal}
	o := add(graph.OpAttention, a, q, k, v)
	lse := add(graph.OpAttentionLSE, a, q, k)
	args := []int{gh, q, k, v, o, lse}
	dq := add(graph.OpAttentionGradQ, a, args...)
	dkv := add(graph.OpAttentionGradKV, a, args...)
	dk := add(graph.OpSlice, graph.Attrs{Axis: 3, Start: 0, End: c.D, Step: 1}, dkv)
	dv := add(graph.OpSlice, graph.Attrs{Axis: 3, Start: c.D, End: 2 * c.D, Step: 1}, dkv)
	d := add(graph.OpConcat, graph.Attrs{Axis: 2}, fromHeads(dq, c.H), fromHeads(dk, c.kv()), fromHeads(dv, c.kv()))
	unpacked, err := e.Run(context.Background(), g, fromHeads(o, c.H), d)
	require.NoError(t, err)
	for i, what := range []string{"o", "dqkv"} {
		w, gd := unpacked[i].Data().([]float32), packed[i].Data().([]float32)
		require.Len(t, gd, len(w))
		m := 0.0
		for _, x := range w {
			m = math.Max(m, math.Abs(float64(x)))
		}
		require.Positive(t, m, what)
		same := 0
		for j := range w {
			x, y := float64(w[j]), float64(gd[j])
			if x == y {
				same++
			}
			if math.Abs(x-y) > math.Abs(x)/128+1e-3*m {
				require.Failf(t, "packed differs", "%s[%d]: unpacked %g, packed %g", what, j, x, y)
			}
		}
		t.Logf("%s: %d of %d bit-identical", what, same, len(w))
	}
}
