package precision_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/precision"
)

// withPass builds a step under p with one of Train's rewrites on or off:
// set is its switch (setFoldCasts, SetFoldNorms, SetFuseGelu),
// which returns the previous setting.
func withPass(t *testing.T, set func(bool) bool, on bool, p precision.Policy, fwd *graph.Graph, loss int, wrt []int) *precision.Step {
	t.Helper()
	defer set(set(on))
	st, err := trainStep(fwd, loss, wrt, compile.Options{Policy: p})
	require.NoError(t, err)
	return st
}

// withFold builds a step under p with the folding of widening casts into
// matmuls on or off.
func withFold(t *testing.T, on bool, p precision.Policy, fwd *graph.Graph, loss int, wrt []int) *precision.Step {
	t.Helper()
	return withPass(t, setFoldCasts, on, p, fwd, loss, wrt)
}

// wideMatmuls counts g's matmuls that write float32 from 16-bit operands.
func wideMatmuls(g *graph.Graph) int {
	n := 0
	for _, nd := range g.Nodes() {
		if nd.Op == graph.OpMatMul && nd.Type.DType == graph.Float32 && g.Node(nd.Inputs[0]).Type.DType.IsHalf() {
			n++
		}
	}
	return n
}

// Under both mixed policies every weight gradient of a small GPT is a
// matmul that writes float32 (no cast reads a 16-bit matmul, directly or
// through reshapes and slices), the step has exactly one cast fewer per
// folded matmul, and its loss, gradients and ids keep their types.
func TestFoldCastsRewrite(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(p), func(t *testing.T) {
			m := gptVocab(t, 1030)
			fwd, wrt := m.forward(t)
			folded, plain := withFold(t, true, p, fwd, m.loss.ID(), wrt), withFold(t, false, p, fwd, m.loss.ID(), wrt)
			wide := wideMatmuls(folded.Graph)
			require.Zero(t, wideMatmuls(plain.Graph))
			require.Positive(t, wide)
			assert.Equal(t, countOps(plain.Graph, graph.OpCast)-wide, countOps(folded.Graph, graph.OpCast))
			assert.Equal(t, plain.Graph.Len()-wide, folded.Graph.Len())
			g := folded.Graph
			for _, nd := range g.Nodes() {
				if nd.Op != graph.OpCast || nd.Type.DType != graph.Float32 {
					continue
				}
				in := g.Node(nd.Inputs[0])
				for in.Op == graph.OpReshape || in.Op == graph.OpSlice {
					in = g.Node(in.Inputs[0])
				}
				assert.NotEqual(t, graph.OpMatMul, in.Op, "cast %d widens a matmul's result", nd.ID)
			}
			for i, id := range folded.Grads {
				assert.Equal(t, plain.Graph.Node(plain.Grads[i]).Type, g.Node(id).Type, "gradient %d", i)
				assert.Equal(t, graph.Float32, g.Node(id).Type.DType)
			}
			assert.Equal(t, plain.Graph.Node(plain.Loss).Type, g.Node(folded.Loss).Type)
			for i := range folded.IDs {
				assert.Equal(t, plain.Graph.Node(plain.IDs[i]).Type, g.Node(folded.IDs[i]).Type, "forward node %d", i)
			}
			for i, id := range folded.Params {
				assert.Equal(t, graph.OpParam, g.Node(id).Op, "parameter %d", i)
			}
		})
	}
}

// The folded step's loss and gradients on the CPU equal the float64
// reference's evaluation of the same graph (which rounds to 16 bits where
// the CPU does, and nowhere at a folded matmul) within 1e-3 of each
// output's largest magnitude, as the unfolded step's do; and they equal
// the unfolded step's within 2⁻⁶ of it: the folded gradients skip one
// 16-bit rounding (relative error at most 2⁻⁹ in bfloat16, 2⁻¹² in
// float16) of each weight gradient and of the linear input gradients,
// whose difference passes through the rest of the backward pass, where
// 16-bit roundings may then fall on the other side.
func TestFoldCastsValues(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(p), func(t *testing.T) {
			m := gptVocab(t, 1030)
			fwd, wrt := m.forward(t)
			folded, plain := withFold(t, true, p, fwd, m.loss.ID(), wrt), withFold(t, false, p, fwd, m.loss.ID(), wrt)
			requireRewriteAgrees(t, folded, plain)
		})
	}
}

// requireRewriteAgrees holds a rewritten step's loss and gradients on the
// CPU to the float64 reference's evaluation of the same graph, within 1e-3
// of each output's largest magnitude, and to the step without the rewrite
// within 2⁻⁶ of it.
func requireRewriteAgrees(t *testing.T, rewritten, plain *precision.Step) {
	t.Helper()
	got, want := stepValues(t, rewritten), stepValues(t, plain)
	exact, err := ref.Eval(rewritten.Graph, nil, append([]int{rewritten.Loss}, rewritten.Grads...)...)
	require.NoError(t, err)
	for i := range got {
		scale := 0.0
		for _, v := range exact[i].Data {
			scale = math.Max(scale, math.Abs(v))
		}
		require.Positive(t, scale, "output %d is not all zero", i)
		for j, v := range exact[i].Data {
			require.InDelta(t, v, float64(got[i][j]), 1e-3*scale, "output %d [%d] against the reference", i, j)
			require.InDelta(t, float64(want[i][j]), float64(got[i][j]), math.Ldexp(scale, -6), "output %d [%d] against the step without the rewrite", i, j)
		}
	}
}

// A cast is left as it is when its matmul has another reader, when it
// narrows, when a reader other than a reshape or slice stands between,
// and under float32 policies (nothing to fold).
func TestFoldCastsLeavesOtherGraphs(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	x := lazy.Wrap(testutil.UniformF32(rng, 4, 8), 0)
	w := lazy.Param(testutil.UniformF32(rng, 8, 8), "w")
	h := x.MatMul(w)                                  // bf16, read by relu and (cast) softmax: kept
	u := h.Relu().MatMul(w)                           // bf16, read by relu only: no widening cast
	loss := h.Softmax(-1).Mean().Add(u.Relu().Mean()) // mean widens relu's output, not the matmul's
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, w)
	require.NoError(t, err)
	fwd := loss.Graph().IR()
	st := withFold(t, true, precision.BF16Mixed, fwd, loss.ID(), wrt)
	for _, id := range []int{h.ID(), u.ID()} {
		assert.Equal(t, graph.BFloat16, st.Graph.Node(st.IDs[id]).Type.DType, "forward matmul %d", id)
	}
	plain := withFold(t, false, precision.BF16Mixed, fwd, loss.ID(), wrt)
	assert.Equal(t, plain.Graph.Len()-wideMatmuls(st.Graph), st.Graph.Len(), "only the backward's folds")

	for _, p := range []precision.Policy{precision.FP32, precision.TF32} {
		a, b := withFold(t, true, p, fwd, loss.ID(), wrt), withFold(t, false, p, fwd, loss.ID(), wrt)
		require.Equal(t, b.Graph.Signature(), a.Graph.Signature(), string(p))
	}
}

// A matmul's output dtype may be float32 from 16-bit operands, or the
// operands' own; any other is refused with ErrDType, and a float32
// output's gradient reaches the operands in their dtype.
func TestMatmulTarget(t *testing.T) {
	g := graph.New()
	a, err := g.Append(graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: []int{2, 3}, DType: graph.BFloat16}})
	require.NoError(t, err)
	b, err := g.Append(graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: []int{3, 4}, DType: graph.BFloat16}})
	require.NoError(t, err)
	for _, c := range []struct {
		to, want graph.DType
	}{{graph.InvalidDType, graph.BFloat16}, {graph.BFloat16, graph.BFloat16}, {graph.Float32, graph.Float32}} {
		id, err := g.Append(graph.Node{Op: graph.OpMatMul, Inputs: []int{a, b}, Attrs: graph.Attrs{Target: graph.Type{DType: c.to}}})
		require.NoError(t, err)
		assert.Equal(t, c.want, g.Node(id).Type.DType)
	}
	_, err = g.Append(graph.Node{Op: graph.OpMatMul, Inputs: []int{a, b}, Attrs: graph.Attrs{Target: graph.Type{DType: graph.Float16}}})
	require.ErrorIs(t, err, graph.ErrDType)
}

// withNorms builds a step under p with the 16-bit layer norms (halfNorm)
// on or off, widening casts folded into matmuls either way.
func withNorms(t *testing.T, on bool, p precision.Policy, fwd *graph.Graph, loss int, wrt []int) *precision.Step {
	t.Helper()
	return withPass(t, precision.SetFoldNorms, on, p, fwd, loss, wrt)
}

// liveReaders lists, for each node of st's graph, the nodes that read it
// among those the loss and gradients depend on.
func liveReaders(st *precision.Step) [][]int {
	g := st.Graph
	live := make([]bool, g.Len())
	for _, o := range append([]int{st.Loss}, st.Grads...) {
		live[o] = true
	}
	users := make([][]int, g.Len())
	for i := g.Len() - 1; i >= 0; i-- {
		if live[i] {
			for _, in := range g.Node(i).Inputs {
				live[in] = true
				users[in] = append(users[in], i)
			}
		}
	}
	return users
}

// A small GPT's layer norms all feed linears: under both mixed policies
// each gets a 16-bit counterpart that the linears read, no cast of a
// layer norm runs, and the float32 layer norms stay in the graph (Apply's
// ids name them) read by nothing the step runs.
func TestHalfNormRewrite(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(p), func(t *testing.T) {
			m := gptVocab(t, 1030)
			fwd, wrt := m.forward(t)
			st := withNorms(t, true, p, fwd, m.loss.ID(), wrt)
			users := liveReaders(st)
			g := st.Graph
			half, wide := 0, 0
			for _, nd := range g.Nodes() {
				if nd.Op != graph.OpLayerNorm {
					continue
				}
				if nd.Type.DType == graph.Float32 {
					wide++
					assert.Empty(t, users[nd.ID], "float32 layer norm %d", nd.ID)
					continue
				}
				half++
				assert.Equal(t, p.Half(), nd.Type.DType)
				assert.Equal(t, graph.Float32, g.Node(nd.Inputs[0]).Type.DType)
				require.NotEmpty(t, users[nd.ID])
				for _, u := range users[nd.ID] {
					op := g.Node(u).Op
					next := graph.OpInvalid
					if len(users[u]) > 0 {
						next = g.Node(users[u][0]).Op
					}
					assert.True(t, op == graph.OpLinear || op == graph.OpReshape && (next == graph.OpMatMul || graph.IsLinearCrossEntropy(next)),
						"layer norm %d read by %s", nd.ID, op) // the linear, its weight gradient's reshape, or the fused loss's h
				}
			}
			assert.Equal(t, 3, half, "ln_1, ln_2, ln_f")
			assert.Equal(t, half, wide)
			for _, nd := range g.Nodes() {
				if nd.Op == graph.OpCast && len(users[nd.ID]) > 0 {
					assert.NotEqual(t, graph.OpLayerNorm, g.Node(nd.Inputs[0]).Op, "cast %d", nd.ID)
				}
			}
		})
	}
}

// The 16-bit layer norm rounds once where the cast did, and its gradient
// reaches the layer norm's backward in float32 as the cast's did: the
// step's loss and gradients on the CPU are bit for bit those without it.
func TestHalfNormValues(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(p), func(t *testing.T) {
			m := gptVocab(t, 1030)
			fwd, wrt := m.forward(t)
			got := stepValues(t, withNorms(t, true, p, fwd, m.loss.ID(), wrt))
			want := stepValues(t, withNorms(t, false, p, fwd, m.loss.ID(), wrt))
			require.Len(t, got, len(want))
			for i := range want {
				require.Equal(t, want[i], got[i], "output %d", i)
			}
		})
	}
}

// A layer norm that anything but a GEMM-class op reads (here a residual
// add) stays float32 and is cast for its linear, as before.
func TestHalfNormLeavesOtherGraphs(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	x := lazy.Wrap(testutil.UniformF32(rng, 4, 8), 0)
	w := lazy.Param(testutil.UniformF32(rng, 8, 8), "w")
	lw, lb := lazy.Param(testutil.UniformF32(rng, 8), "lw"), lazy.Param(testutil.UniformF32(rng, 8), "lb")
	h := x.LayerNorm(lw, lb, 1, 1e-5)
	loss := h.Linear(w, nil).Add(h).Mean()
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, w, lw, lb)
	require.NoError(t, err)
	fwd := loss.Graph().IR()
	on, off := withNorms(t, true, precision.BF16Mixed, fwd, loss.ID(), wrt), withNorms(t, false, precision.BF16Mixed, fwd, loss.ID(), wrt)
	require.Equal(t, off.Graph.Signature(), on.Graph.Signature())
	assert.Equal(t, 1, countOps(on.Graph, graph.OpLayerNorm))
}

// A matmul that writes float32 from 16-bit operands takes its gradient
// back in their dtype (its VJP casts the float32 gradient once), so the
// gradient of a weight it reads through a cast is float32 and equals the
// unfolded graph's (matmul, then a cast to float32) within 2⁻⁷ of its
// largest magnitude: the folded forward value is not rounded to 16 bits,
// so the loss's gradient y·2 differs by at most one bfloat16 rounding
// before the backward GEMM rounds it again.
func TestMatmulTargetGradient(t *testing.T) {
	build := func(folded bool) (*graph.Graph, int) {
		g := graph.New()
		add := func(n graph.Node) int {
			id, err := g.Append(n)
			require.NoError(t, err, "%s", n.Op)
			return id
		}
		r := rand.New(rand.NewPCG(8, 9)) // the same data for both graphs
		x := add(graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: []int{6, 4}, DType: graph.BFloat16}, Value: testutil.UniformF32(r, 6, 4)})
		w := add(graph.Node{Op: graph.OpParam, Name: "w", Type: graph.Type{Shape: []int{4, 5}, DType: graph.Float32}, Value: testutil.UniformF32(r, 4, 5)})
		wc := add(graph.Node{Op: graph.OpCast, Inputs: []int{w}, Attrs: graph.Attrs{Target: graph.Type{DType: graph.BFloat16}}})
		var y int
		if folded {
			y = add(graph.Node{Op: graph.OpMatMul, Inputs: []int{x, wc}, Attrs: graph.Attrs{Target: graph.Type{DType: graph.Float32}}})
		} else {
			m := add(graph.Node{Op: graph.OpMatMul, Inputs: []int{x, wc}})
			y = add(graph.Node{Op: graph.OpCast, Inputs: []int{m}, Attrs: graph.Attrs{Target: graph.Type{DType: graph.Float32}}})
		}
		sq := add(graph.Node{Op: graph.OpMul, Inputs: []int{y, y}})
		loss := add(graph.Node{Op: graph.OpSum, Inputs: []int{sq}, Attrs: graph.Attrs{Axes: []int{0, 1}}})
		grads, err := autodiff.Backward(g, loss, []int{w})
		require.NoError(t, err)
		require.Equal(t, graph.Type{Shape: []int{4, 5}, DType: graph.Float32, BatchAxis: -1, PerSample: 1}, g.Node(grads[0]).Type)
		return g, grads[0]
	}
	run := func(folded bool) []float32 {
		g, grad := build(folded)
		out, err := cpu.New().Run(context.Background(), g, grad)
		require.NoError(t, err)
		return out[0].Data().([]float32)
	}
	got, want := run(true), run(false)
	scale := float32(0)
	for _, v := range want {
		scale = max(scale, abs32(v))
	}
	require.Positive(t, scale)
	for i := range want {
		require.InDelta(t, want[i], got[i], math.Ldexp(float64(scale), -7), "element %d", i)
	}
}
