package cuda_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
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
