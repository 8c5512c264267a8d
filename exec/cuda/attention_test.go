package cuda_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/internal/ref"
)

// attnCase is one attention problem: q [B, H, T, D], k and v [B, Hkv, S,
// D], an optional additive mask of shape mask and dtype mdt (q's dtype
// when 0), causal or not.
type attnCase struct {
	B, H, Hkv, T, S, D int
	causal             bool
	mask               []int
	mdt                graph.DType
	scale              float64
}

func (c attnCase) String() string {
	s := fmt.Sprintf("B%d_H%d_Hkv%d_T%d_S%d_d%d_causal%v", c.B, c.H, c.Hkv, c.T, c.S, c.D, c.causal)
	if c.mask != nil {
		s += fmt.Sprintf("_mask%v", c.mask)
	}
	if c.mdt != graph.InvalidDType {
		s += "_" + c.mdt.String()
	}
	return s
}

// roundTo rounds float32 data to dt's nearest value, as an executor
// reading it as dt would.
func roundTo(dt graph.DType, d []float32) []float32 {
	for i, x := range d {
		switch dt {
		case graph.BFloat16:
			d[i] = half.RoundBF16(x)
		case graph.Float16:
			d[i] = half.RoundF16(x)
		}
	}
	return d
}

// attnGraph builds the four attention ops of c on inputs of dtype dt, with
// an upstream gradient g of q's shape: outputs o, lse, dq and dk|dv.
func attnGraph(t testing.TB, c attnCase, dt graph.DType, rng *rand.Rand) (*graph.Graph, []int) {
	t.Helper()
	return attnGraphOrder(t, c, dt, rng, false)
}

// attnGraphOrder is attnGraph, with the attention_lse node before the
// forward one when lseFirst: it is then no companion of the forward pass
// (graph.LSEProducer looks back), and its own kernels compute it. The
// inputs draw the same data either way.
func attnGraphOrder(t testing.TB, c attnCase, dt graph.DType, rng *rand.Rand, lseFirst bool) (*graph.Graph, []int) {
	t.Helper()
	g, ids, err := attnGraphErr(c, dt, rng, lseFirst)
	require.NoError(t, err)
	return g, ids
}

// attnGraphErr is attnGraphOrder, returning the first Append error.
func attnGraphErr(c attnCase, dt graph.DType, rng *rand.Rand, lseFirst bool) (*graph.Graph, []int, error) {
	g := graph.New()
	var first error
	uni := func(n int, lo, hi float64) []float32 {
		d := make([]float32, n)
		for i := range d {
			d[i] = float32(lo + (hi-lo)*rng.Float64())
		}
		return d
	}
	add := func(n graph.Node) int {
		id, err := g.Append(n)
		if err != nil && first == nil {
			first = err
		}
		return id
	}
	in := func(shape ...int) int {
		d := roundTo(dt, uni(graph.Numel(shape), -1, 1))
		return add(graph.Node{Op: graph.OpInput, Value: tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d)),
			Type: graph.Type{Shape: shape, DType: dt, BatchAxis: 0}})
	}
	q, k, v := in(c.B, c.H, c.T, c.D), in(c.B, c.Hkv, c.S, c.D), in(c.B, c.Hkv, c.S, c.D)
	gr := in(c.B, c.H, c.T, c.D)
	var mask []int
	if c.mask != nil {
		mdt := c.mdt
		if mdt == graph.InvalidDType {
			mdt = dt
		}
		md := uni(graph.Numel(c.mask), -2, 2)
		for i := range md {
			if rng.IntN(5) == 0 {
				md[i] = float32(math.Inf(-1))
			}
		}
		if len(md) > c.S { // the first row hides every key
			for i := range c.S {
				md[i] = float32(math.Inf(-1))
			}
		}
		roundTo(mdt, md)
		n := graph.Node{Op: graph.OpConst, Value: tensor.New(tensor.WithShape(c.mask...), tensor.WithBacking(md)),
			Type: graph.Type{Shape: c.mask, DType: mdt, BatchAxis: -1}}
		if len(c.mask) == 4 && c.mask[0] == c.B {
			n.Op, n.Type.BatchAxis = graph.OpInput, 0
		}
		mask = []int{add(n)}
	}
	a := graph.Attrs{Scalar: c.scale, Causal: c.causal}
	var o, lse int
	if lseFirst {
		lse = add(graph.Node{Op: graph.OpAttentionLSE, Inputs: append([]int{q, k}, mask...), Attrs: a})
	}
	o = add(graph.Node{Op: graph.OpAttention, Inputs: append([]int{q, k, v}, mask...), Attrs: a})
	if !lseFirst {
		lse = add(graph.Node{Op: graph.OpAttentionLSE, Inputs: append([]int{q, k}, mask...), Attrs: a})
	}
	args := append([]int{gr, q, k, v, o, lse}, mask...)
	dq := add(graph.Node{Op: graph.OpAttentionGradQ, Inputs: args, Attrs: a})
	dkv := add(graph.Node{Op: graph.OpAttentionGradKV, Inputs: args, Attrs: a})
	return g, []int{o, lse, dq, dkv}, first
}

// attnTol bounds |cuda − cpu| per element by rtol·|cpu| + atol·m + abs,
// m the largest finite |cpu| of that output.
type attnTol struct{ rtol, atol, abs float64 }

// cpuAttn is one attention problem's graph in dtype dt and its outputs on
// the CPU executor: the reference checkAttn holds CUDA to.
type cpuAttn struct {
	c    attnCase
	dt   graph.DType
	g    *graph.Graph
	ids  []int
	want []*tensor.Dense
	err  error
}

// cpuAttnRefs builds each problem's graph and runs it on the CPU
// executor, all at once on every CPU: at T = 1000 one takes seconds
// (BenchmarkGPUTestReferences), and a test of dozens would spend minutes
// of a GPU call on them one by one.
func cpuAttnRefs(t testing.TB, problems []cpuAttn) []cpuAttn {
	t.Helper()
	for i := range problems {
		p := &problems[i]
		p.g, p.ids = attnGraph(t, p.c, p.dt, rand.New(rand.NewPCG(uint64(p.c.T*131+p.c.D), 7)))
	}
	parallel(len(problems), func(i int) {
		p := &problems[i]
		p.want, p.err = cpu.New().Run(context.Background(), p.g, p.ids...)
	})
	return problems
}

// parallel calls f(0) … f(n−1), as many at once as there are CPUs.
func parallel(n int, f func(i int)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.NumCPU())
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			f(i)
		}()
	}
	wg.Wait()
}

// checkAttn runs p's graph on CUDA and compares o, lse, dq and dk|dv with
// the CPU executor's; lse is float32 whatever the dtype is, so it gets the
// float32 tolerance.
func checkAttn(t *testing.T, p cpuAttn, tol, lseTol attnTol) {
	t.Helper()
	checkAttnOn(t, executor(t), p, tol, lseTol)
}

// checkAttnOn is checkAttn on executor e.
func checkAttnOn(t *testing.T, e *cuda.Executor, p cpuAttn, tol, lseTol attnTol) {
	t.Helper()
	require.NoError(t, p.err)
	got, err := e.Run(context.Background(), p.g, p.ids...)
	require.NoError(t, err)
	for i, name := range []string{"o", "lse", "dq", "dkv"} {
		tl := tol
		if i == 1 {
			tl = lseTol
		}
		w, gd := p.want[i].Data().([]float32), got[i].Data().([]float32)
		require.Len(t, gd, len(w), name)
		m := 0.0
		for _, x := range w {
			if !math.IsInf(float64(x), 0) {
				m = math.Max(m, math.Abs(float64(x)))
			}
		}
		worst := 0.0
		for j, x := range w {
			y := float64(gd[j])
			require.False(t, math.IsNaN(y), "%s[%d] is NaN", name, j)
			if math.IsInf(float64(x), 0) {
				require.Equal(t, x, gd[j], "%s[%d]", name, j)
				continue
			}
			d := math.Abs(y - float64(x))
			if m > 0 {
				worst = max(worst, d/m)
			}
			if d > tl.rtol*math.Abs(float64(x))+tl.atol*m+tl.abs {
				require.Failf(t, "attention differs", "%s %s[%d]: cpu %g, cuda %g (diff %.3g > %.3g·|cpu| + %.3g·%.3g + %.3g)",
					p.dt, name, j, x, gd[j], d, tl.rtol, tl.atol, m, tl.abs)
			}
		}
		t.Logf("%s %s: largest |cuda − cpu| / max|cpu| = %.3g", p.dt, name, worst)
	}
}

// attnCases covers lengths 1 to 1000, head dims 4 to 128, grouped-query
// heads, causal, masks of q's dtype and of float32 (with hidden keys and
// a row with every key hidden).
var attnCases = []attnCase{
	{B: 2, H: 2, Hkv: 2, T: 1, S: 1, D: 8},
	{B: 2, H: 4, Hkv: 2, T: 17, S: 17, D: 8, causal: true},
	{B: 1, H: 3, Hkv: 1, T: 17, S: 29, D: 4, mask: []int{17, 29}, scale: 0.3},
	{B: 3, H: 2, Hkv: 1, T: 29, S: 17, D: 4, causal: true, mask: []int{3, 1, 1, 17}, mdt: graph.Float32},
	{B: 2, H: 2, Hkv: 2, T: 64, S: 64, D: 64, causal: true},
	{B: 1, H: 2, Hkv: 1, T: 64, S: 64, D: 128, mask: []int{1, 2, 64, 64}},
	{B: 1, H: 2, Hkv: 1, T: 17, S: 17, D: 128, mask: []int{17, 17}, mdt: graph.Float32},
	{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 16, causal: true},
	{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 64, mask: []int{1000, 1000}},
	{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 128, causal: true},
}

// Tolerances against the CPU executor.
//
// Plain-FMA kernels: CUDA and the CPU compute in float32 from the same
// rounded inputs and round each output once, so they differ by float32
// summation order and, where that moves a value across a rounding
// boundary, one 16-bit ulp: rtol one ulp (2⁻⁷ bfloat16, 2⁻¹⁰ float16)
// plus atol 1e-4 of the output's largest magnitude. lse is float32 in
// every case: rtol and atol 1e-4. float32 itself runs on cuBLAS
// (attention32.go); its abs 1e-6 covers gradients that cancel to 0 (one
// key: ds = p·(g·v − g·o) with o = v), where the CPU's result is exactly 0
// and cuBLAS's sums leave a few 1e-10 (−8.4e-10 seen on an H200).
//
// Tensor-core kernels (16-bit, d 64 or 128, no mask): the forward pass
// rounds P to 16 bits for P·v (unit roundoff u = 2⁻⁸ bfloat16, 2⁻¹¹
// float16), which moves o by at most u·max|v| and in practice by far less
// (the errors of the weights average out); the gradients read that o
// through D = Σ g∘o. The backward passes round p for pᵀ·g (dv) and ds =
// p·(dp − D) for dsᵀ·q (dk) and ds·k (dq) the same way, each a relative
// error of at most u per term that averages out over the sum. atol 2u of
// each output's largest magnitude (8e-3 bfloat16, 1e-3 float16) on top of
// the one-ulp rtol; a wrong fragment layout is off by the order of the
// values themselves. abs 1e-5 covers gradients that cancel to 0 (one key:
// ds = p·(g·v − g·o) with o = v), where the CPU's float64 dp and D agree
// exactly and the kernels' float32 sums of different orders leave ~1e-8.
var (
	attnTolF32     = attnTol{rtol: 1e-4, atol: 1e-4, abs: 1e-6}
	attnTolBF16    = attnTol{rtol: 1.0 / 128, atol: 1e-4}
	attnTolF16     = attnTol{rtol: 1.0 / 1024, atol: 1e-4}
	attnTolMMABF16 = attnTol{rtol: 1.0 / 128, atol: 8e-3, abs: 1e-5}
	attnTolMMAF16  = attnTol{rtol: 1.0 / 1024, atol: 1e-3, abs: 1e-5}
)

// mma reports whether c's 16-bit passes run on tensor cores (cuda's
// attnMMA; the test's arrays are aligned).
func (c attnCase) mma() bool { return c.mask == nil && (c.D == 64 || c.D == 128) }

// TestAttention16 checks the bfloat16 and float16 instantiations of the
// attention kernels (and float32's, with its new mask argument) against
// the CPU executor.
func TestAttention16(t *testing.T) {
	executor(t)
	refs := cpuAttnRefs(t, attention16Problems())
	for i, c := range attnCases {
		t.Run(c.String(), func(t *testing.T) {
			checkAttn(t, refs[3*i], attnTolF32, attnTolF32)
			bf, f16 := attnTolBF16, attnTolF16
			if c.mma() {
				bf, f16 = attnTolMMABF16, attnTolMMAF16
			}
			checkAttn(t, refs[3*i+1], bf, attnTolF32)
			checkAttn(t, refs[3*i+2], f16, attnTolF32)
		})
	}
}

// attention16Problems are TestAttention16's: every case of attnCases in
// float32, bfloat16 and float16, in that order.
func attention16Problems() []cpuAttn {
	var out []cpuAttn
	for _, c := range attnCases {
		for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
			out = append(out, cpuAttn{c: c, dt: dt})
		}
	}
	return out
}

// TestAttentionMMA runs the tensor-core kernels, forward (o and lse) and
// backward (dq and dk|dv from that o and lse), over T ∈ {1, 17, 64, 1000}
// (S = T, and S ≠ T), d ∈ {64, 128}, causal or not, grouped-query heads
// (groups of 2, 3 and 4), against the CPU executor, on an executor with
// cuDNN's attention off (cuDNN takes these grouped heads otherwise).
func TestAttentionMMA(t *testing.T) {
	e := freshExecutor(t, cuda.ExecutorOptions{NoCuDNNAttention: true})
	cases := attnMMACases()
	var problems []cpuAttn
	for _, c := range cases {
		problems = append(problems, cpuAttn{c: c, dt: graph.BFloat16}, cpuAttn{c: c, dt: graph.Float16})
	}
	refs := cpuAttnRefs(t, problems)
	for i, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			checkAttnOn(t, e, refs[2*i], attnTolMMABF16, attnTolF32)
			checkAttnOn(t, e, refs[2*i+1], attnTolMMAF16, attnTolF32)
		})
	}
}

// attnMMACases are TestAttentionMMA's problems.
func attnMMACases() []attnCase {
	var cases []attnCase
	for _, d := range []int{64, 128} {
		for _, causal := range []bool{false, true} {
			for _, ts := range [][2]int{{1, 1}, {17, 17}, {64, 64}, {1000, 1000}, {17, 100}, {100, 17}, {65, 130}, {1000, 777}} {
				c := attnCase{B: 2, H: 4, Hkv: 2, T: ts[0], S: ts[1], D: d, causal: causal}
				if ts[0] >= 1000 {
					c.B, c.H, c.Hkv = 1, 2, 1
				}
				cases = append(cases, c)
			}
			cases = append(cases,
				attnCase{B: 1, H: 6, Hkv: 2, T: 200, S: 300, D: d, causal: causal},
				attnCase{B: 1, H: 4, Hkv: 1, T: 129, S: 129, D: d, causal: causal})
		}
	}
	return cases
}

// attnF32Cases are the float32 path's problems (cuBLAS over query blocks
// of 128 rows, attention32.go): T from 1 to 1000, not multiples of the
// block and several blocks long, S ≠ T both ways, causal or not,
// grouped-query heads (H = 6 over Hkv = 2: one GEMM per group member;
// H = 4 over Hkv = 1 at batch 1: one per (b, hkv) pair, k and v
// broadcast), additive masks broadcast several ways (float32 and
// bfloat16, with hidden keys and a row with every key hidden), head dims
// 4, 64, 128 and 160 (above the 16-bit kernels' 128).
var attnF32Cases = []attnCase{
	{B: 2, H: 2, Hkv: 2, T: 1, S: 1, D: 64},
	{B: 2, H: 6, Hkv: 2, T: 17, S: 17, D: 64, causal: true},
	{B: 1, H: 6, Hkv: 2, T: 300, S: 300, D: 64, causal: true},
	{B: 1, H: 6, Hkv: 2, T: 300, S: 300, D: 128},
	{B: 2, H: 6, Hkv: 2, T: 300, S: 200, D: 64, mask: []int{2, 1, 300, 200}},
	{B: 1, H: 6, Hkv: 2, T: 200, S: 300, D: 128, causal: true, mask: []int{200, 300}},
	{B: 1, H: 4, Hkv: 1, T: 129, S: 129, D: 64, causal: true},
	{B: 1, H: 3, Hkv: 1, T: 17, S: 29, D: 4, mask: []int{17, 29}, scale: 0.3},
	{B: 3, H: 2, Hkv: 1, T: 29, S: 17, D: 4, causal: true, mask: []int{3, 1, 1, 17}, mdt: graph.BFloat16},
	{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 64, causal: true},
	{B: 1, H: 2, Hkv: 2, T: 1000, S: 1000, D: 128},
	{B: 1, H: 2, Hkv: 1, T: 1000, S: 1000, D: 64, mask: []int{1000, 1000}},
	{B: 1, H: 2, Hkv: 1, T: 65, S: 130, D: 160, causal: true},
}

// graphRunner runs a graph: cuda.Executor, or exec/cpu's.
type graphRunner interface {
	Run(ctx context.Context, g *graph.Graph, outputs ...int) ([]*tensor.Dense, error)
}

// checkAttnRef runs c's float32 graph on e, with attention_lse computed in
// the forward pass (its companion) and on its own, and holds o, lse, dq
// and dk|dv to want, the float64 reference (attnF32Refs), within tol.atol
// of each output's largest magnitude plus tol.abs.
func checkAttnRef(t *testing.T, e graphRunner, c attnCase, want []ref.Value, tol attnTol) {
	t.Helper()
	ctx := context.Background()
	for _, lseFirst := range []bool{false, true} {
		g, ids := attnGraphOrder(t, c, graph.Float32, rand.New(rand.NewPCG(uint64(c.T*131+c.D), 11)), lseFirst)
		got, err := e.Run(ctx, g, ids...)
		require.NoError(t, err)
		gd := make([][]float32, len(got))
		for i, v := range got {
			gd[i] = v.Data().([]float32)
		}
		compareAttn(t, fmt.Sprintf("lseFirst %v", lseFirst), want, gd, tol, tol)
	}
}

// attnF32Refs is the float64 reference of every case of attnF32Cases (the
// same data either order of attention_lse), computed once for both tests
// that use them, all cases at once on every CPU.
var attnF32Refs = sync.OnceValues(func() ([][]ref.Value, error) {
	out := make([][]ref.Value, len(attnF32Cases))
	errs := make([]error, len(attnF32Cases))
	parallel(len(attnF32Cases), func(i int) {
		c := attnF32Cases[i]
		g, ids, err := attnGraphErr(c, graph.Float32, rand.New(rand.NewPCG(uint64(c.T*131+c.D), 11)), false)
		if err == nil {
			out[i], err = ref.Eval(g, nil, ids...)
		}
		errs[i] = err
	})
	return out, errors.Join(errs...)
})

// Float32 and TF32 attention against the float64 reference.
//
// float32: cuBLAS sums the products in float32 (d terms for the scores,
// at most S or T for the others), the row kernels take expf and float32
// sums: a few 1e-7 of each output's largest magnitude. atol 1e-5; abs
// 1e-6 covers gradients that cancel to 0 (one visible key: ds = p·(g·v −
// g·o) with o = v), where the float64 reference is exactly 0 and float32
// sums of different orders leave ~1e-8.
//
// TF32: the GEMMs round their operands to a 10-bit mantissa (2⁻¹¹
// relative, 2⁻¹⁰ if truncated), so the scores move by ~1e-4, p and o by
// ~1e-3 relative, and the gradients as much: atol 1e-2 of each output's
// largest magnitude. Where a gradient cancels to 0 the rounding of g·v
// against D = Σ g∘o (o itself from TF32 products) leaves up to ~3e-4: abs
// 1e-3.
var (
	attnTolF32Ref  = attnTol{atol: 1e-5, abs: 1e-6}
	attnTolTF32Ref = attnTol{atol: 1e-2, abs: 1e-3}
)

// TestAttentionF32Blocked runs float32 attention (attention32.go: cuBLAS
// over query blocks, forward, attention_lse alone, dq and dk|dv) over
// attnF32Cases against the float64 reference.
func TestAttentionF32Blocked(t *testing.T) {
	e := executor(t)
	want, err := attnF32Refs()
	require.NoError(t, err)
	for i, c := range attnF32Cases {
		t.Run(c.String(), func(t *testing.T) { checkAttnRef(t, e, c, want[i], attnTolF32Ref) })
	}
}

// TestAttentionTF32Blocked is TestAttentionF32Blocked on an executor with
// TF32 on: the same GEMMs on TF32 tensor cores.
func TestAttentionTF32Blocked(t *testing.T) {
	e := freshExecutor(t, cuda.ExecutorOptions{TF32: true})
	want, err := attnF32Refs()
	require.NoError(t, err)
	for i, c := range attnF32Cases {
		t.Run(c.String(), func(t *testing.T) { checkAttnRef(t, e, c, want[i], attnTolTF32Ref) })
	}
}

// BenchmarkAttentionForward times the bfloat16 forward pass on one
// [1, 16, 4096, d] problem: cuDNN's fused attention (the executor's path
// for these shapes, o and the log-sum-exp), the tensor-core kernel and
// the plain-FMA one, causal or not, in TFLOP/s (4·B·H·T·S·d, halved under
// causal).
func BenchmarkAttentionForward(b *testing.B) {
	d, a, m := attentionModule(b)
	dnn := benchDNN(b)
	var err error
	const B, H, T = 1, 16, 4096
	r := newRand(9)
	for _, hd := range []int{64, 128} {
		n := B * H * T * hd
		x := make([]uint16, n)
		for i := range x {
			x[i] = uint16(half.BF16From(float32(r.Float64()*2 - 1)))
		}
		q, k, v, o := upload(b, d, a, x), upload(b, d, a, x), upload(b, d, a, x), upload(b, d, a, x)
		lse := upload(b, d, a, make([]float32, B*H*T))
		scale := float32(1 / math.Sqrt(float64(hd)))
		for _, causal := range []int64{0, 1} {
			b.Run(fmt.Sprintf("d%d_causal%d_cudnn", hd, causal), func(b *testing.B) {
				sh := cuda.SDPAShape{DT: graph.BFloat16, B: B, H: H, T: T, S: T, D: hd, Causal: causal != 0, Scale: scale}
				ws, n := benchWorkspace(b, a, false, sh)
				run := func() error {
					done, err := dnn.SDPAForward(sh, q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), ws, n)
					if err == nil && !done {
						err = fmt.Errorf("cuDNN did not take it: %s", dnn.AttnStats())
					}
					return err
				}
				require.NoError(b, run())
				require.NoError(b, d.Synchronize())
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := run(); err != nil {
						b.Fatal(err)
					}
				}
				require.NoError(b, d.Synchronize())
				flops := 4.0 * B * H * T * T * float64(hd)
				if causal != 0 {
					flops /= 2
				}
				b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
			})
			for _, kind := range []string{"mma", "fma"} {
				b.Run(fmt.Sprintf("d%d_causal%d_%s", hd, causal, kind), func(b *testing.B) {
					var fn cuda.CUfunction
					var grid, block [3]uint32
					var args []any
					if kind == "mma" {
						fn, err = m.Function(fmt.Sprintf("attention_fwd_mma_d%d_bf16", hd))
						grid, block = [3]uint32{B * H * T / 64, 1, 1}, [3]uint32{128, 1, 1}
						args = []any{q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), int64(H), int64(H), int64(T), int64(T), scale, causal}
					} else {
						fn, err = m.Function("attention_fwd_bf16")
						grid, block = [3]uint32{B * H * T / 64, 1, 1}, [3]uint32{64, 1, 1}
						args = []any{q.Ptr(), k.Ptr(), v.Ptr(), alloc.Ptr(0), o.Ptr(), lse.Ptr(), int64(B), int64(H), int64(H), int64(T), int64(T),
							int64(hd), int64(0), int64(0), int64(0), int64(0), scale, causal, int64(0)}
					}
					require.NoError(b, err)
					require.NoError(b, m.Launch(fn, grid, block, 0, args...))
					require.NoError(b, d.Synchronize())
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						if err := m.Launch(fn, grid, block, 0, args...); err != nil {
							b.Fatal(err)
						}
					}
					require.NoError(b, d.Synchronize())
					flops := 4.0 * B * H * T * T * float64(hd)
					if causal != 0 {
						flops /= 2
					}
					b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
				})
			}
		}
	}
}

// BenchmarkAttentionBackward times the bfloat16 backward kernels on GPT-2's
// attention, [8, 12, 1024, 64], causal: "bwd" is the gradient pass alone
// (tensor cores: attention_grad_dot, attention_grad_q_mma and
// attention_grad_kv_mma; plain FMAs: attention_grad_q and
// attention_grad_kv), "fwdbwd" the forward pass, the log-sum-exp
// recomputed for the backward pass and the gradients, as the executor runs
// a training step. TFLOP/s counts FlashAttention's matrix products, halved
// under causal: 4·B·H·T·S·d for the forward pass (q·kᵀ, p·v) and 10·B·H·T·S·d
// for the backward pass (q·kᵀ, g·vᵀ, pᵀ·g, dsᵀ·q, ds·k); the work the
// kernels redo (the log-sum-exp pass; q·kᵀ and g·vᵀ in both the dq and the
// dk|dv pass) is not counted.
//
// The "_cudnn" cases run cuDNN's fused attention, the executor's path for
// these shapes: "bwd_cudnn" its backward pass (dq, dk and dv in one
// call), "fwdbwd_cudnn" its forward pass (o with the log-sum-exp) and
// then the backward pass.
func BenchmarkAttentionBackward(b *testing.B) {
	d, a, m := attentionModule(b)
	dnn := benchDNN(b)
	for _, T := range []int{1024, 4096} {
		b.Run(fmt.Sprintf("T%d", T), func(b *testing.B) { attentionBackwardAt(b, d, a, m, dnn, T) })
	}
}

// benchDNN is the cuDNN handle of a fresh executor, for the cuDNN
// sub-benchmarks; it skips without cuDNN (fails under
// BATCHFIT_REQUIRE_GPU).
func benchDNN(b *testing.B) *cuda.DNN {
	e := freshExecutor(b, cuda.ExecutorOptions{})
	if e.DNN() == nil {
		if os.Getenv("BATCHFIT_REQUIRE_GPU") != "" {
			b.Fatalf("no cuDNN: %s", e.Convolutions())
		}
		b.Skipf("no cuDNN: %s", e.Convolutions())
	}
	return e.DNN()
}

// benchWorkspace allocates the workspace a node of sh declares for cuDNN's
// pass, freed when the benchmark ends.
func benchWorkspace(b *testing.B, a *alloc.Allocator, backward bool, sh cuda.SDPAShape) (alloc.Ptr, int64) {
	n := cuda.SDPAWorkspaceBytes(backward, sh)
	blk, err := a.Malloc(n, alloc.Tag{Node: -1, Op: "bench"})
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, a.Free(blk)) })
	return blk.Ptr(), n
}

// attentionModule is the device, an allocator and attention.cu compiled,
// for the kernel benchmarks.
func attentionModule(b *testing.B) (*cuda.Device, *alloc.Allocator, *cuda.Module) {
	d := device(b)
	a := newAllocator(b, d)
	src, err := cuda.Source("attention.cu")
	require.NoError(b, err)
	m, err := d.Compile("attention.cu", src)
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, m.Close()) })
	return d, a, m
}

func attentionBackwardAt(b *testing.B, d *cuda.Device, a *alloc.Allocator, m *cuda.Module, dnn *cuda.DNN, T int) {
	const B, H, hd, causal = 8, 12, 64, int64(1)
	r := newRand(uint64(10 + T))
	rnd := func(n int) *alloc.Block {
		x := make([]uint16, n)
		for i := range x {
			x[i] = uint16(half.BF16From(float32(r.Float64()*2 - 1)))
		}
		return upload(b, d, a, x)
	}
	n := B * H * T * hd
	q, k, v, g := rnd(n), rnd(n), rnd(n), rnd(n)
	o, dq := rnd(n), rnd(n)
	dkv := upload(b, d, a, make([]uint16, 2*n))
	lse := upload(b, d, a, make([]float32, B*H*T))
	dot := upload(b, d, a, make([]float32, B*H*T))
	scale := float32(1 / math.Sqrt(hd))
	fn := func(name string) cuda.CUfunction {
		f, err := m.Function(name)
		require.NoError(b, err)
		return f
	}
	type launch struct {
		f           cuda.CUfunction
		grid, block uint32
		args        []any
	}
	mmaBlock := [3]uint32{128, 1, 1}
	fwdMMA := func(o, lse alloc.Ptr) launch {
		return launch{fn(fmt.Sprintf("attention_fwd_mma_d%d_bf16", hd)), uint32(B * H * T / 64), mmaBlock[0],
			[]any{q.Ptr(), k.Ptr(), v.Ptr(), o, lse, int64(H), int64(H), int64(T), int64(T), scale, causal}}
	}
	fwdFMA := func(o, lse alloc.Ptr) launch {
		return launch{fn("attention_fwd_bf16"), uint32(B * H * T / 64), 64,
			[]any{q.Ptr(), k.Ptr(), v.Ptr(), alloc.Ptr(0), o, lse, int64(B), int64(H), int64(H), int64(T), int64(T),
				int64(hd), int64(0), int64(0), int64(0), int64(0), scale, causal, int64(0)}}
	}
	bwdMMA := []launch{
		{fn("attention_grad_dot_bf16"), uint32(B * H * T * 8 / 256), 256, []any{g.Ptr(), o.Ptr(), dot.Ptr(), int64(B * H * T), int64(hd)}},
		{fn(fmt.Sprintf("attention_grad_q_mma_d%d_bf16", hd)), uint32(B * H * T / 64), 128,
			[]any{g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), dq.Ptr(), int64(H), int64(H), int64(T), int64(T), scale, causal}},
		{fn(fmt.Sprintf("attention_grad_kv_mma_d%d_bf16", hd)), uint32(B * H * T / 64), 128,
			[]any{g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), lse.Ptr(), dot.Ptr(), dkv.Ptr(), int64(H), int64(H), int64(T), int64(T), scale, causal}},
	}
	plain := func(name string, out alloc.Ptr) launch {
		return launch{fn(name), uint32(B * H * T / 64), 64,
			[]any{g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), alloc.Ptr(0), out, int64(B), int64(H), int64(H), int64(T), int64(T),
				int64(hd), int64(0), int64(0), int64(0), int64(0), scale, causal, int64(0)}}
	}
	bwdFMA := []launch{plain("attention_grad_q_bf16", dq.Ptr()), plain("attention_grad_kv_bf16", dkv.Ptr())}
	run := func(ls []launch) error {
		for _, l := range ls {
			if err := m.Launch(l.f, [3]uint32{l.grid, 1, 1}, [3]uint32{l.block, 1, 1}, 0, l.args...); err != nil {
				return err
			}
		}
		return nil
	}
	// o and lse of the real forward pass, so that p = exp(s − lse) is what
	// training sees.
	require.NoError(b, run([]launch{fwdMMA(o.Ptr(), lse.Ptr())}))
	require.NoError(b, d.Synchronize())
	flops := map[string]float64{"bwd": 10.0 * B * H * float64(T*T) * hd / 2, "fwdbwd": 14.0 * B * H * float64(T*T) * hd / 2}
	sh := cuda.SDPAShape{DT: graph.BFloat16, B: B, H: H, T: T, S: T, D: hd, Causal: true, Scale: scale}
	fws, fn1 := benchWorkspace(b, a, false, sh)
	bws, bn1 := benchWorkspace(b, a, true, sh)
	taken := func(done bool, err error) error {
		if err == nil && !done {
			err = fmt.Errorf("cuDNN did not take it: %s", dnn.AttnStats())
		}
		return err
	}
	dnnBwd := func() error {
		return taken(dnn.SDPABackward(sh, g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), dq.Ptr(), dkv.Ptr(), bws, bn1))
	}
	// cuDNN's forward pass writes its o and log-sum-exp to spare blocks, as
	// the kernels' fwdbwd does, so the backward pass reads the real ones.
	dnnFwdBwd := func() error {
		if err := taken(dnn.SDPAForward(sh, q.Ptr(), k.Ptr(), v.Ptr(), dq.Ptr(), dot.Ptr(), fws, fn1)); err != nil {
			return err
		}
		return dnnBwd()
	}
	for _, c := range []struct {
		name string
		fn   func() error
	}{{"bwd_cudnn", dnnBwd}, {"fwdbwd_cudnn", dnnFwdBwd}} {
		b.Run(c.name, func(b *testing.B) {
			require.NoError(b, c.fn())
			require.NoError(b, d.Synchronize())
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := c.fn(); err != nil {
					b.Fatal(err)
				}
			}
			require.NoError(b, d.Synchronize())
			b.ReportMetric(flops[c.name[:len(c.name)-6]]*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
		})
	}
	for _, c := range []struct {
		name string
		ls   []launch
	}{
		{"bwd_mma", bwdMMA},
		{"bwd_fma", bwdFMA},
		// The training step's launches: o, then lse (attention_lse), then the
		// gradients; o and lse are written to spare blocks.
		{"fwdbwd_mma", append([]launch{fwdMMA(dq.Ptr(), 0), fwdMMA(0, dot.Ptr())}, bwdMMA...)},
		{"fwdbwd_fma", append([]launch{fwdFMA(dq.Ptr(), 0), fwdFMA(0, dot.Ptr())}, bwdFMA...)},
	} {
		if T > 1024 && c.name[len(c.name)-3:] == "fma" {
			continue // the FMA kernels are the slow reference path: timed at T = 1024 only
		}
		b.Run(c.name, func(b *testing.B) {
			require.NoError(b, run(c.ls))
			require.NoError(b, d.Synchronize())
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := run(c.ls); err != nil {
					b.Fatal(err)
				}
			}
			require.NoError(b, d.Synchronize())
			kind := c.name[:len(c.name)-4]
			b.ReportMetric(flops[kind]*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
		})
	}
}
