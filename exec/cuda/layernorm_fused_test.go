package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// lnGrads is a layer norm's backward pass as autodiff emits it, with its
// data: loss = Σ layer_norm(x, w, b)·r for an input x, the weight w and
// (when bias) the bias b, and a random r (so the layer norm's g is r).
// outs are dx, then dw (when trainW), then db (when bias); feeds hold
// random data rounded to dt.
type lnGrads struct {
	g     *graph.Graph
	outs  []int
	feeds map[int]ref.Value
	batch int
}

func newLNGrads(t testing.TB, dt graph.DType, shape []int, normDims int, bias, trainW bool, seed uint64) lnGrads {
	t.Helper()
	x := lazy.Placeholder(shape, dt, 0)
	r := x.Graph().Placeholder(shape, dt, 0)
	norm := shape[len(shape)-normDims:]
	w := lazy.ParamSpec(norm, dt, "w")
	var b *lazy.Tensor
	wrt := []*lazy.Tensor{x}
	if trainW {
		wrt = append(wrt, w)
	}
	if bias {
		b = lazy.ParamSpec(norm, dt, "b")
		wrt = append(wrt, b)
	}
	loss := x.LayerNorm(w, b, normDims, 1e-5).Mul(r).Sum()
	grads := lazy.Grad(loss, wrt...)
	l := lnGrads{g: x.Graph().IR(), feeds: map[int]ref.Value{}, batch: shape[0]}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		l.outs = append(l.outs, gr.ID())
	}
	rng := rand.New(rand.NewPCG(seed, 77))
	round := func(v float64) float64 {
		switch dt {
		case graph.BFloat16:
			return float64(half.RoundBF16(float32(v)))
		case graph.Float16:
			return float64(half.RoundF16(float32(v)))
		}
		return float64(float32(v))
	}
	for _, nd := range l.g.Nodes() {
		if (nd.Op != graph.OpInput && nd.Op != graph.OpParam) || nd.Value != nil {
			continue
		}
		v := ref.Zeros(nd.Type.Shape...)
		d := graph.Numel(norm)
		for i := range v.Data {
			u := rng.Float64()*2 - 1
			switch {
			case nd.ID == x.ID(): // rows of several offsets and spreads, as activations
				row := i / d
				u = u*(1+0.5*float64(row%3)) + float64(row%7-3)
			case nd.ID == l.g.NodeNamed("w"):
				u = 1 + u/2
			}
			v.Data[i] = round(u)
		}
		l.feeds[nd.ID] = v
	}
	return l
}

// feed is the inputs' and parameters' data as host tensors.
func (l lnGrads) feed(id int) tensor.Tensor {
	v, ok := l.feeds[id]
	if !ok {
		return nil
	}
	d := make([]float32, len(v.Data))
	for i, x := range v.Data {
		d[i] = float32(x)
	}
	return tensor.New(tensor.WithShape(v.Shape...), tensor.WithBacking(d))
}

// program compiles the backward pass with workspace rule ws, dw and db
// kept (summed over chunks on the device).
func (l lnGrads) program(t testing.TB, ws planner.WorkspaceFunc) *planner.Program {
	t.Helper()
	info, err := shapeinfer.Analyze(l.g, l.outs...)
	require.NoError(t, err)
	p, err := planner.Compile(l.g, info, l.outs, planner.CompileOptions{Kept: l.outs[1:], Workspace: ws})
	require.NoError(t, err)
	return p
}

// run runs the backward pass on e in chunks chunks and returns the
// outputs.
func (l lnGrads) run(t testing.TB, e exec.Executor, ws planner.WorkspaceFunc, chunks int) []ref.Value {
	t.Helper()
	res, err := e.Execute(context.Background(), l.program(t, ws), planner.Chunks(l.batch, chunks), exec.Options{Feed: l.feed})
	require.NoError(t, err)
	out := make([]ref.Value, len(res.Outputs))
	for i, d := range res.Outputs {
		out[i], err = ref.FromTensor(d)
		require.NoError(t, err)
	}
	return out
}

// unfusedWorkspace is cuda.Workspace without layer_norm_grad_x's: a
// program compiled with it plans no partials, so the fused pass cannot
// run and each gradient runs on its own.
func unfusedWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	if nd.Op == graph.OpLayerNormGradX {
		return 0
	}
	return cuda.Workspace(g, nd, b)
}

// TestLayerNormFusedBackward: layer_norm_grad_x computes its companions,
// the weight's gradient Σ g·x̂ and the bias's Σ g, in its own pass
// (layer_norm_grad_fused_*, layer_norm_grad_wb_*), in float32, bfloat16
// and float16, against the float64 reference interpreter (which rounds a
// 16-bit result once, where the kernel does), over rows of d below, at and
// above multiples of the block (5, 96, 129, 768, 1000, 1024, 1600, 2048,
// and d = 768 over two normalised dims), tiny row counts (1, 6), row
// counts no grid divides, and 10,000 rows (512 blocks of 20 rows), whole
// and in three chunks. Rows too long for the fused pass (3000) and a
// backward pass with no companion (only dx) run unfused and agree too;
// so do a layer norm without a bias (dw alone) and one whose weight is not
// trained (db alone).
//
// Tolerances: dx rounds once from the double the kernel computes it in,
// so it is held to one ulp of its dtype relative (2⁻²³ float32, 2⁻⁷
// bfloat16, 2⁻¹⁰ float16) plus 1e-6 of its largest magnitude. The sums
// add float partials, each rounded once (≲ 2⁻²⁴ of its magnitude): float32
// is held to 1e-5 relative plus 1e-5 of the largest sum, 16-bit to one
// ulp plus that. In chunks, a 16-bit sum is rounded once per chunk and
// once per accumulation (the executor's kept sums), each by up to half an
// ulp of a partial or running sum, which may exceed the result: chunks
// ulps of the largest magnitude.
func TestLayerNormFusedBackward(t *testing.T) {
	e := executor(t)
	type lnCase struct {
		shape        []int
		normDims     int
		bias, trainW bool
		fused        bool
		dts          []graph.DType
	}
	all := []graph.DType{graph.Float32, graph.BFloat16, graph.Float16}
	f32 := []graph.DType{graph.Float32}
	cases := []lnCase{
		{[]int{1, 1, 5}, 1, true, true, true, all},
		{[]int{3, 2, 5}, 1, true, true, true, all},
		{[]int{3, 1001, 96}, 1, true, true, true, all},
		{[]int{4, 33, 129}, 1, true, true, true, all},
		{[]int{3, 100, 768}, 1, true, true, true, all},
		{[]int{4, 2500, 768}, 1, true, true, true, f32},
		{[]int{3, 7, 1000}, 1, true, true, true, all},
		{[]int{3, 17, 1024}, 1, true, true, true, all},
		{[]int{3, 9, 1600}, 1, true, true, true, f32},
		{[]int{3, 2, 2048}, 1, true, true, true, all},
		{[]int{3, 6, 4, 192}, 2, true, true, true, f32},
		{[]int{3, 5, 3000}, 1, true, true, false, f32},
		{[]int{3, 40, 96}, 1, false, true, true, all},
		{[]int{3, 40, 96}, 1, true, false, true, all},
		{[]int{3, 40, 96}, 1, false, false, false, f32},
	}
	for ci, c := range cases {
		for _, dt := range c.dts {
			name := fmt.Sprintf("%s/%v/norm%d/bias=%t/w=%t", dt, c.shape, c.normDims, c.bias, c.trainW)
			t.Run(name, func(t *testing.T) {
				l := newLNGrads(t, dt, c.shape, c.normDims, c.bias, c.trainW, uint64(ci))
				want, err := ref.Eval(l.g, l.feeds, l.outs...)
				require.NoError(t, err)
				counts := []int{1}
				if c.shape[0] >= 3 {
					counts = append(counts, 3)
				}
				for _, chunks := range counts {
					before := cuda.FusedLayerNorms()
					got := l.run(t, e, e.Workspace(), chunks)
					fused := cuda.FusedLayerNorms() - before
					if c.fused {
						// Each chunk's launches are new to the CUDA graphs
						// (they start at another row), so every chunk's
						// eager, and counted; a replayed graph would not be.
						assert.Positive(t, fused, "the fused pass ran")
					} else {
						assert.Zero(t, fused, "no fused pass")
					}
					for k, id := range l.outs {
						lnClose(t, dt, k > 0, chunks, want[k], got[k], fmt.Sprintf("%d chunks: output %d (%s)", chunks, k, l.g.Node(id).Op))
					}
				}
				if c.fused && ci%4 == 0 { // without the partials' workspace: unfused, as before
					before := cuda.FusedLayerNorms()
					got := l.run(t, e, unfusedWorkspace, 1)
					assert.Equal(t, before, cuda.FusedLayerNorms(), "no fused pass without the workspace")
					for k, id := range l.outs {
						lnClose(t, dt, k > 0, 1, want[k], got[k], fmt.Sprintf("unfused: output %d (%s)", k, l.g.Node(id).Op))
					}
				}
			})
		}
	}
}

// lnClose compares a layer norm gradient with the reference under
// TestLayerNormFusedBackward's tolerances (sum: a weight or bias gradient,
// summed over chunks chunks).
func lnClose(t *testing.T, dt graph.DType, sum bool, chunks int, want, got ref.Value, what string) {
	t.Helper()
	require.Equal(t, want.Shape, got.Shape, what)
	ulp := map[graph.DType]float64{graph.Float32: 0x1p-23, graph.BFloat16: 0x1p-7, graph.Float16: 0x1p-10}[dt]
	rtol, atol := ulp, 1e-6
	if sum {
		rtol, atol = max(ulp, 1e-5), 1e-5
		if dt != graph.Float32 && chunks > 1 {
			atol = max(atol, float64(chunks)*ulp)
		}
	}
	big := 0.0
	for _, w := range want.Data {
		big = max(big, math.Abs(w))
	}
	atol *= big
	for i, w := range want.Data {
		if d := math.Abs(got.Data[i] - w); !(d <= atol+rtol*math.Abs(w)) {
			t.Fatalf("%s element %d: got %.9g, want %.9g (|diff| %.3g > %.3g)", what, i, got.Data[i], w, d, atol+rtol*math.Abs(w))
		}
	}
}

// BenchmarkLayerNormBackward times a GPT-2 small layer norm's backward
// pass at batch 8, seq 1024 (g and x [8192, 768] float32, as under
// bf16-mixed): the device time of layer_norm_grad_x, layer_norm_grad_w
// and the bias gradient's sum together (µs/pass, from
// ExecOptions.OpTime's events), fused (dx's pass gives dw and db too) and
// unfused (unfusedWorkspace: three passes, as before the fusion).
func BenchmarkLayerNormBackward(b *testing.B) {
	e := executor(b)
	l := newLNGrads(b, graph.Float32, []int{8, 1024, 768}, 1, true, true, 1)
	grid, groups, resident, err := cuda.LayerNormFusedGrid(e, 8192, 768)
	require.NoError(b, err)
	b.Logf("fused pass: %d blocks (the device holds %d), %d row groups", grid, resident, groups)
	for _, bc := range []struct {
		name string
		ws   planner.WorkspaceFunc
	}{{"fused", e.Workspace()}, {"unfused", unfusedWorkspace}} {
		b.Run(bc.name, func(b *testing.B) {
			p := l.program(b, bc.ws)
			var total time.Duration
			passes := 0
			o := exec.Options{Feed: l.feed, OpTime: func(nd *graph.Node, _ planner.Chunk, d time.Duration) {
				switch nd.Op {
				case graph.OpLayerNormGradX, graph.OpLayerNormGradW:
					total += d
				case graph.OpSum:
					if graph.LayerNormBiasGradProducer(l.g, nd.ID) >= 0 {
						total += d
					}
				}
			}}
			for b.Loop() {
				_, err := e.Execute(context.Background(), p, planner.Chunks(8, 1), o)
				require.NoError(b, err)
				passes++
			}
			b.ReportMetric(float64(total.Microseconds())/float64(passes), "µs/pass")
		})
	}
}
