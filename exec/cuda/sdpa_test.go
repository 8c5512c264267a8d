package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// sdpaExecutor is a fresh executor with cuDNN's fused attention on; it
// skips without a GPU, or without cuDNN (failing instead under
// BATCHFIT_REQUIRE_GPU: the GPU machine has cuDNN 9).
func sdpaExecutor(t *testing.T) (*cuda.Executor, *cuda.DNN) {
	t.Helper()
	e := freshExecutor(t, cuda.ExecutorOptions{})
	if e.DNN() == nil {
		if os.Getenv("BATCHFIT_REQUIRE_GPU") != "" {
			t.Fatalf("no cuDNN: %s", e.Convolutions())
		}
		t.Skipf("no cuDNN: %s", e.Convolutions())
	}
	return e, e.DNN()
}

// sdpaCase is a test problem of TestCuDNNAttention in dtype dt; taken says
// whether cuDNN must run it (S ≠ T is checked whoever runs it).
type sdpaCase struct {
	c     attnCase
	dt    graph.DType
	taken bool
}

// sdpaCases: T ∈ {1, 17, 64, 1000, 2048} (S = T), d ∈ {64, 128},
// causal or not, bfloat16 and float16, plus S ≠ T both ways; and
// grouped-query heads (4 over 2, 6 over 2 at T = 1024) and multi-query
// heads (3 over 1, 4 over 1 at T = 1000) at T ∈ {1, 17, 64, 1000, 1024},
// S ≠ T among them (which, causal, and T = 1's backward pass, run on the
// kernels: sdpaGroupedRefusal). T = 1000 is not a multiple of cuDNN's
// tiles, 1024 and 2048 are; at 2048 one head does (a second would double
// the float64 reference, which costs some 10·B·H·T·S·d multiply-adds and
// 4·B·H·T·S exponentials over the four nodes, half that when causal:
// BenchmarkGPUTestReferences).
func sdpaCases() []sdpaCase {
	var out []sdpaCase
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, d := range []int{64, 128} {
			for _, causal := range []bool{false, true} {
				for _, T := range []int{1, 17, 64, 1000, 2048} {
					c := attnCase{B: 2, H: 3, Hkv: 3, T: T, S: T, D: d, causal: causal}
					switch {
					case T == 2048:
						c.B, c.H, c.Hkv = 1, 1, 1
					case T >= 1000:
						c.B, c.H, c.Hkv = 1, 2, 2
					}
					out = append(out, sdpaCase{c: c, dt: dt, taken: true})
				}
				for _, ts := range [][2]int{{17, 100}, {100, 17}} {
					out = append(out, sdpaCase{c: attnCase{B: 2, H: 2, Hkv: 2, T: ts[0], S: ts[1], D: d, causal: causal}, dt: dt})
				}
				// T = S = 1 with grouped heads: the forward pass on cuDNN,
				// the backward pass on the kernels (sdpaGroupedRefusal).
				out = append(out, sdpaCase{c: attnCase{B: 2, H: 4, Hkv: 2, T: 1, S: 1, D: d, causal: causal}, dt: dt})
				for _, c := range []attnCase{
					{B: 2, H: 4, Hkv: 2, T: 17, S: 17},
					{B: 2, H: 4, Hkv: 2, T: 64, S: 64},
					{B: 2, H: 3, Hkv: 1, T: 64, S: 64},
					{B: 1, H: 6, Hkv: 2, T: 1024, S: 1024},
					{B: 1, H: 4, Hkv: 1, T: 1000, S: 1000},
				} {
					c.D, c.causal = d, causal
					out = append(out, sdpaCase{c: c, dt: dt, taken: true})
				}
				out = append(out, sdpaCase{c: attnCase{B: 2, H: 4, Hkv: 2, T: 17, S: 100, D: d, causal: causal}, dt: dt},
					sdpaCase{c: attnCase{B: 2, H: 3, Hkv: 1, T: 100, S: 17, D: d, causal: causal}, dt: dt})
			}
		}
	}
	return out
}

// compareAttn holds cuda's o, lse, dq and dk|dv to the float64 reference:
// |cuda − ref| ≤ rtol·|ref| + atol·max|ref| + abs, lse with lseTol.
func compareAttn(t *testing.T, name string, want []ref.Value, got [][]float32, tol, lseTol attnTol) {
	t.Helper()
	compareOutputs(t, name, []string{"o", "lse", "dq", "dkv"}, want, got, []attnTol{tol, lseTol, tol, tol})
}

// compareOutputs holds cuda's outputs (named what) to the float64
// reference: |cuda − ref| ≤ rtol·|ref| + atol·max|ref| + abs, each output
// with its tolerance of tols.
func compareOutputs(t *testing.T, name string, what []string, want []ref.Value, got [][]float32, tols []attnTol) {
	t.Helper()
	for i, what := range what {
		tl := tols[i]
		w, gd := want[i].Data, got[i]
		require.Len(t, gd, len(w), what)
		m := 0.0
		for _, x := range w {
			if !math.IsInf(x, 0) {
				m = math.Max(m, math.Abs(x))
			}
		}
		worst := 0.0
		for j, x := range w {
			y := float64(gd[j])
			require.False(t, math.IsNaN(y), "%s %s[%d] is NaN", name, what, j)
			if math.IsInf(x, 0) {
				require.Equal(t, x, y, "%s %s[%d]", name, what, j)
				continue
			}
			d := math.Abs(y - x)
			if m > 0 {
				worst = max(worst, d/m)
			}
			if d > tl.rtol*math.Abs(x)+tl.atol*m+tl.abs {
				require.Failf(t, "attention differs", "%s %s[%d]: float64 %g, cuda %g (diff %.3g > %.3g·|ref| + %.3g·%.3g + %.3g)",
					name, what, j, x, y, d, tl.rtol, tl.atol, m, tl.abs)
			}
		}
		t.Logf("%s %s: largest |cuda − float64| / max|float64| = %.3g", name, what, worst)
	}
}

// refRun is a graph to run, its outputs, and their float64 reference
// values (evalRefs fills want and err).
type refRun struct {
	g    *graph.Graph
	ids  []int
	want []ref.Value
	err  error
}

// evalRefs evaluates every run's reference at once, on every CPU: the
// float64 reference of an attention is slow (seconds at T = 2048).
func evalRefs(runs []refRun) {
	parallel(len(runs), func(i int) { runs[i].want, runs[i].err = ref.Eval(runs[i].g, nil, runs[i].ids...) })
}

// TestCuDNNAttention runs 16-bit attention (forward with its log-sum-exp,
// then dq and dk|dv from that o and lse) on cuDNN's fused attention and
// holds it to the float64 reference, which rounds to 16 bits where the
// kernels store. cuDNN, like the tensor-core kernels, rounds p to 16 bits
// for p·v and pᵀ·dO and ds for dsᵀ·q and ds·k: the tensor-core kernels'
// tolerances (attnTolMMABF16: one bfloat16 ulp relative plus 8e-3 of each
// output's largest magnitude; attnTolMMAF16: one float16 ulp plus 1e-3;
// lse float32, attnTolF32). With grouped heads dk and dv sum the group's
// query heads (two to four terms of the same size) before their one
// rounding, within the same tolerances. The S = T cases must run on cuDNN
// (its counters say so): a case that passed on the fallback would prove
// nothing.
func TestCuDNNAttention(t *testing.T) {
	e, n := sdpaExecutor(t)
	cases := sdpaCases()
	preps := make([]refRun, len(cases))
	for i, sc := range cases {
		preps[i].g, preps[i].ids = attnGraph(t, sc.c, sc.dt, rand.New(rand.NewPCG(uint64(sc.c.T*131+sc.c.D), 17)))
	}
	evalRefs(preps)
	for i, sc := range cases {
		name := fmt.Sprintf("%s_%s", sc.dt, sc.c)
		t.Run(name, func(t *testing.T) {
			p := preps[i]
			require.NoError(t, p.err)
			before := n.AttnStats()
			out, err := e.Run(context.Background(), p.g, p.ids...)
			require.NoError(t, err)
			after := n.AttnStats()
			fwd, bwd := after.Forward-before.Forward, after.Backward-before.Backward
			if sc.taken {
				require.Equal(t, 1, fwd, "forward on cuDNN (%s)", after)
				require.Equal(t, 1, bwd, "backward on cuDNN (%s)", after)
			}
			t.Logf("cuDNN ran %d forward, %d backward", fwd, bwd)
			got := make([][]float32, len(out))
			for j, o := range out {
				got[j] = o.Data().([]float32)
			}
			tol := attnTolMMABF16
			if sc.dt == graph.Float16 {
				tol = attnTolMMAF16
			}
			compareAttn(t, name, p.want, got, tol, attnTolF32)
		})
	}
	t.Logf("%s", n.AttnStats())
}

// TestCuDNNAttentionOff: ExecutorOptions.NoCuDNNAttention leaves every
// call to attention.cu's kernels.
func TestCuDNNAttentionOff(t *testing.T) {
	e := freshExecutor(t, cuda.ExecutorOptions{NoCuDNNAttention: true})
	if e.DNN() == nil {
		t.Skipf("no cuDNN: %s", e.Convolutions())
	}
	c := attnCase{B: 2, H: 2, Hkv: 2, T: 64, S: 64, D: 64, causal: true}
	g, ids := attnGraph(t, c, graph.BFloat16, newRand(3))
	_, err := e.Run(context.Background(), g, ids...)
	require.NoError(t, err)
	s := e.DNN().AttnStats()
	require.Zero(t, s.Forward+s.Backward, "%s", s)
}

// TestCuDNNAttentionWorkspace prints cuDNN's plan workspace for a spread of
// shapes, both passes, and holds it to the bound the nodes declare
// (sdpaPlanBytes). It also prints the engine each plan runs. Grouped and
// multi-query heads (Llama 3's 32 over 8 among them) print as
// SDPA_WS_GQA lines: the measurement sdpaPlanBytes's grouped bound awaits.
func TestCuDNNAttentionWorkspace(t *testing.T) {
	_, n := sdpaExecutor(t)
	var bad []string
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, d := range []int{64, 128} {
			for _, bh := range [][2]int{{1, 1}, {1, 16}, {8, 12}, {32, 16}} {
				for _, T := range []int{1, 17, 64, 1000, 1024, 2048, 4096, 8192} {
					for _, causal := range []bool{false, true} {
						if dt == graph.Float16 && (bh[0] != 8 || causal) {
							continue
						}
						s := cuda.SDPAShape{DT: dt, B: bh[0], H: bh[1], T: T, S: T, D: d, Causal: causal, Scale: float32(1 / math.Sqrt(float64(d)))}
						for _, bwd := range []bool{false, true} {
							ok, ws, bound, engine, why, err := n.SDPAPlan(bwd, s)
							require.NoError(t, err)
							pass := "fwd"
							if bwd {
								pass = "bwd"
							}
							if !ok {
								t.Logf("%s %+v: no plan: %s", pass, s, why)
								bad = append(bad, fmt.Sprintf("%s %+v: no plan", pass, s))
								continue
							}
							t.Logf("SDPA_WS %s dt=%s b=%d h=%d t=%d d=%d causal=%v engine=%d ws=%d bound=%d", pass, dt, s.B, s.H, T, d, causal, engine, ws, bound)
							if ws > bound {
								bad = append(bad, fmt.Sprintf("%s %+v: workspace %d > bound %d", pass, s, ws, bound))
							}
						}
					}
				}
			}
		}
	}
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, d := range []int{64, 128} {
			for _, bh := range [][3]int{{1, 4, 1}, {2, 8, 2}, {4, 32, 8}, {1, 16, 4}, {8, 32, 1}} {
				for _, T := range []int{17, 1000, 2048, 4096} {
					if dt == graph.Float16 && T != 2048 {
						continue
					}
					s := cuda.SDPAShape{DT: dt, B: bh[0], H: bh[1], Hkv: bh[2], T: T, S: T, D: d, Causal: true, Scale: float32(1 / math.Sqrt(float64(d)))}
					for _, bwd := range []bool{false, true} {
						ok, ws, bound, engine, why, err := n.SDPAPlan(bwd, s)
						require.NoError(t, err)
						pass := map[bool]string{false: "fwd", true: "bwd"}[bwd]
						if !ok {
							t.Logf("%s %+v: no plan: %s", pass, s, why)
							bad = append(bad, fmt.Sprintf("%s %+v: no plan", pass, s))
							continue
						}
						t.Logf("SDPA_WS_GQA %s dt=%s b=%d h=%d hkv=%d t=%d d=%d engine=%d ws=%d bound=%d", pass, dt, s.B, s.H, s.Hkv, T, d, engine, ws, bound)
						if ws > bound {
							bad = append(bad, fmt.Sprintf("%s %+v: workspace %d > bound %d", pass, s, ws, bound))
						}
					}
				}
			}
		}
	}
	require.Empty(t, bad)
}

// TestCuDNNAttentionWorkspaceRefused: a plan whose workspace exceeds what
// the node may give it is refused, counted, and attention.cu's kernels
// run the call, with the same results within tolerance.
func TestCuDNNAttentionWorkspaceRefused(t *testing.T) {
	e, n := sdpaExecutor(t)
	c := attnCase{B: 2, H: 2, Hkv: 2, T: 64, S: 64, D: 64, causal: true}
	s := cuda.SDPAShape{DT: graph.BFloat16, B: 2, H: 2, T: 64, S: 64, D: 64, Causal: true, Scale: 0.125}
	_, fws, _, _, _, err := n.SDPAPlan(false, s)
	require.NoError(t, err)
	_, bws, _, _, _, err := n.SDPAPlan(true, s)
	require.NoError(t, err)
	n.CapSDPAWorkspace(min(fws, bws) - 1)
	g, ids := attnGraph(t, c, graph.BFloat16, newRand(5))
	want, err := ref.Eval(g, nil, ids...)
	require.NoError(t, err)
	out, err := e.Run(context.Background(), g, ids...)
	require.NoError(t, err)
	st := n.AttnStats()
	require.Zero(t, st.Forward+st.Backward, "%s", st)
	require.Equal(t, 2, st.Fallbacks["workspace"], "%s", st)
	got := make([][]float32, len(out))
	for j, o := range out {
		got[j] = o.Data().([]float32)
	}
	compareAttn(t, "refused", want, got, attnTolMMABF16, attnTolF32)
}
