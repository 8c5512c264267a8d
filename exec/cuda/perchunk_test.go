package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Per-chunk batch statistics on CUDA: a training step with per-chunk
// batch norm (graph.Attrs.PerChunk) and the batch_norm_stats its running
// statistics are updated from, run in 1, 2 and 3 chunks on the GPU and
// on the CPU executor over the same program and chunks. The loss, the
// weight and bias gradients and the merged statistics agree within 1e-5
// of each output's largest magnitude (both compute the moments in double;
// they sum in different orders).
func TestPerChunkBatchNormMatchesCPU(t *testing.T) {
	const n, c, hw = 12, 3, 5
	ctx := context.Background()
	e := freshExecutor(t, cuda.ExecutorOptions{})
	rng := rand.New(rand.NewPCG(91, 92))
	xs := make([]float32, n*c*hw*hw)
	for i := range xs {
		xs[i] = float32(2*rng.NormFloat64() + 0.5)
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(n, c, hw, hw), tensor.WithBacking(xs)), 0)
	wd, bd := []float32{1.5, -0.5, 0.75}, []float32{0.1, 0.2, -0.3}
	w := lazy.Param(tensor.New(tensor.WithShape(c), tensor.WithBacking(wd)), "w")
	b := lazy.Param(tensor.New(tensor.WithShape(c), tensor.WithBacking(bd)), "b")
	y := x.BatchNorm2dPerChunk(w, b, 1e-5)
	loss := y.Relu().Mul(y).Mean()
	outs := []int{loss.ID()}
	for _, gr := range lazy.Grad(loss, w, b) {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
	}
	stats := x.BatchStats()
	require.NoError(t, stats.Err())
	outs = append(outs, stats.ID())
	g := x.Graph().IR()
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, planner.CompileOptions{Kept: outs[1:3], Workspace: cuda.Workspace})
	require.NoError(t, err)
	for _, k := range []int{1, 2, 3} {
		t.Run(fmt.Sprintf("chunks=%d", k), func(t *testing.T) {
			want, err := cpu.New().Execute(ctx, p, planner.Chunks(n, k), cpu.ExecOptions{})
			require.NoError(t, err)
			got, err := e.Execute(ctx, p, planner.Chunks(n, k), cuda.ExecOptions{})
			require.NoError(t, err)
			for i, name := range []string{"loss", "grad w", "grad b", "batch_norm_stats"} {
				a, b := want.Outputs[i].Float32s(), got.Outputs[i].Float32s()
				require.Len(t, b, len(a), name)
				scale := 0.0
				for _, v := range a {
					scale = math.Max(scale, math.Abs(float64(v)))
				}
				require.Positive(t, scale, "%s: the data are not all zero", name)
				for j := range a {
					require.InDelta(t, a[j], b[j], 1e-5*scale, "%s [%d]", name, j)
				}
			}
		})
	}
}
