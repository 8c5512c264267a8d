package cuda_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/shapeinfer"
)

// pwHalfTol is the fuzz tolerance where a 16-bit dtype appears: float32 on
// the device and float64 in the reference may round a value to two sides
// of a 16-bit boundary, and later ops carry that unit on.
var pwHalfTol = conformance.Tolerance{RTol: 2e-2, ATol: 1e-3}

// The generated kernels against the float64 reference on the random DAGs
// × shapes × dtypes of exec/cpu's TestPointwiseFuzz (the same seed, and
// more of them), through the 32-bit entry points and again through the
// 64-bit ones (a case of several outputs writes them all in one pass, the
// nodes of the others its companions), every kernel compiled before its
// step (Execute's warm-up) and none at its launch: 1e-4 relative, 1e-5 absolute in float32 (expf, tanhf, erff
// and powf are within a few ulp; block sums run in another order), 2e-2
// and 1e-3 where a 16-bit dtype appears.
func TestPointwiseFuzzGPU(t *testing.T) {
	e := executor(t)
	tol := conformance.Tolerance{RTol: 1e-4, ATol: 1e-5}
	before, compiles := cuda.FusedPointwiseRuns(), cuda.PointwiseLaunchCompiles()
	conformance.RunPointwiseFuzz(t, runOn(e), 600, 1, tol, pwHalfTol)
	require.Greater(t, cuda.FusedPointwiseRuns(), before, "cases of several outputs wrote them in one pass (companions)")
	require.Equal(t, compiles, cuda.PointwiseLaunchCompiles(), "kernels compiled at their launch, not before the step")
	prev := cuda.SetPointwiseIndex64(true)
	defer cuda.SetPointwiseIndex64(prev)
	conformance.RunPointwiseFuzz(t, runOn(e), 100, 1, tol, pwHalfTol)
}

// Past 2³¹ − 1 elements the 64-bit entry point runs: y = x·2 + 1 and the
// row sums of x·x over [2²¹ + 3, 1024] bfloat16 values (4.3 GiB each way)
// are right at the first, middle and last rows. Skipped with -short.
func TestPointwiseIndex64GPU(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates 13 GiB of device memory")
	}
	e := executor(t)
	rows, cols := 1<<21+3, 1024
	g := graph.New()
	x, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{rows, cols}, DType: graph.BFloat16, BatchAxis: 0, PerSample: 1}})
	require.NoError(t, err)
	p, err := graph.NewPointwise([]graph.PWNode{{Op: graph.PWInput}, {Op: graph.PWConst, Scalar: 2}, {Op: graph.PWMul, A: 0, B: 1},
		{Op: graph.PWConst, Scalar: 1}, {Op: graph.PWAdd, A: 2, B: 3}, {Op: graph.PWMul, A: 0, B: 0}, {Op: graph.PWRowSum, A: 5, Scalar: 1}},
		[]graph.PWOut{{Node: 4, DType: graph.BFloat16}})
	require.NoError(t, err)
	y, err := g.Append(graph.Node{Op: graph.OpFusedPointwise, Inputs: []int{x}, Attrs: graph.Attrs{Pointwise: p}})
	require.NoError(t, err)
	q, err := graph.NewPointwise(p.Nodes, []graph.PWOut{{Node: 6, DType: graph.Float32}})
	require.NoError(t, err)
	s, err := g.Append(graph.Node{Op: graph.OpFusedPointwise, Inputs: []int{x}, Attrs: graph.Attrs{Pointwise: q}})
	require.NoError(t, err)
	data := make([]float32, rows*cols)
	for i := range data {
		data[i] = float32(i%7) / 4 // exact in bfloat16
	}
	feed := func(id int) tensor.Tensor {
		return tensor.New(tensor.WithShape(rows, cols), tensor.WithBacking(data))
	}
	out, err := e.RunBatch(context.Background(), g, rows, feed, y, s)
	require.NoError(t, err)
	yd, sd := out[0].Data().([]float32), out[1].Data().([]float32)
	for _, r := range []int{0, rows / 2, rows - 1} {
		var want float64
		for j := range cols {
			v := float64(data[r*cols+j])
			want += v * v
			require.Equal(t, float32(v*2+1), yd[r*cols+j], "y[%d, %d]", r, j)
		}
		require.InDelta(t, want, float64(sd[r]), 1e-5*math.Abs(want), "row %d's sum", r)
	}
}

// Column sums on the paths the fuzz test's small shapes do not reach,
// against the float64 reference within 1e-5 (float32 sums of thousands of
// terms in another order) of each column's Σ |term|, or 1e-2 for a
// bfloat16 output (its rounding): 3,000 rows of 256 (more rows than the
// grid's 1,024 blocks, accumulators in shared memory), 56 rows of 13,000
// (52 KB of accumulators: they live in the partials), and three sums of
// 4,100-wide rows at once (49,200 B of accumulators, over 48 KiB), one of
// them stored as bfloat16 beside a per-element output.
func TestPointwiseColSumGPU(t *testing.T) {
	e := executor(t)
	run := runOn(e)
	rng := rand.New(rand.NewPCG(8, 9))
	for _, c := range []struct {
		shape []int
		sums  int
	}{{[]int{3, 1000, 256}, 1}, {[]int{7, 8, 13000}, 1}, {[]int{4, 300, 4100}, 3}} {
		g := graph.New()
		x, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: c.shape, DType: graph.Float32, BatchAxis: 0, PerSample: 1}})
		require.NoError(t, err)
		cols := c.shape[len(c.shape)-1]
		w, err := shapeinfer.AppendSource(g, graph.Node{Op: graph.OpParam, Name: "w", Type: graph.Type{Shape: []int{cols}, DType: graph.Float32}})
		require.NoError(t, err)
		// x·w, tanh(x), and x·x − w: per element; the first c.sums of
		// them summed over the rows, the next stored as it is.
		nodes := []graph.PWNode{{Op: graph.PWInput}, {Op: graph.PWInput, In: 1}, {Op: graph.PWMul, A: 0, B: 1},
			{Op: graph.PWTanh, A: 0}, {Op: graph.PWMul, A: 0, B: 0}, {Op: graph.PWSub, A: 4, B: 1}}
		terms := []int{2, 3, 5}
		term := func(node int, x, w float64) float64 {
			switch node {
			case 2:
				return x * w
			case 3:
				return math.Tanh(x)
			}
			return x*x - w
		}
		var outs []graph.PWOut
		for q := range c.sums {
			dt := graph.Float32
			if q == 1 {
				dt = graph.BFloat16
			}
			outs = append(outs, graph.PWOut{Node: terms[q], DType: dt, ColSum: true})
		}
		outs = append(outs, graph.PWOut{Node: terms[c.sums%3], DType: graph.Float32})
		p, err := graph.NewPointwise(nodes, outs)
		require.NoError(t, err)
		var ids []int
		for k := range outs {
			id, err := g.Append(graph.Node{Op: graph.OpFusedPointwise, Inputs: []int{x, w}, Attrs: graph.Attrs{Pointwise: p, Axis: k}})
			require.NoError(t, err)
			ids = append(ids, id)
		}
		vals := map[int]ref.Value{x: ref.Zeros(c.shape...), w: ref.Zeros(cols)}
		for _, v := range vals {
			for i := range v.Data {
				v.Data[i] = float64(float32(rng.Float64()*2 - 1))
			}
		}
		want, err := ref.Eval(g, vals, ids...)
		require.NoError(t, err)
		got, err := run(g, vals, ids...)
		require.NoError(t, err)
		rows := graph.Numel(c.shape) / cols
		for k, o := range outs {
			require.Equal(t, want[k].Shape, got[k].Shape, "%v output %d", c.shape, k)
			tol := 1e-5
			if o.DType == graph.BFloat16 {
				tol = 1e-2
			}
			for j := range want[k].Data {
				scale := math.Abs(want[k].Data[j])
				if o.ColSum { // Σ |term| of column j
					scale = 0
					for r := range rows {
						xv, wv := vals[x].Data[r*cols+j], vals[w].Data[j]
						scale += math.Abs(term(o.Node, xv, wv))
					}
				}
				require.InDelta(t, want[k].Data[j], got[k].Data[j], tol*scale+1e-6, "%v output %d (column sum %v) element %d", c.shape, k, o.ColSum, j)
			}
		}
	}
}
