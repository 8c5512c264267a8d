package cuda_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
)

// A matmul of 16-bit operands with a float32 output (Attrs.Target, the
// precision pass's folded weight gradients) runs as one cublasGemmEx into
// float32 on each path (one tall GEMM, strided-batched GEMMs with
// transposes, a weight gradient) and matches the CPU,
// which sums the same rounded operands in float32 and does not round the
// result: within 1e-5 absolute plus 1e-5 relative (float32 sums of at most
// 40 products of values in [−1, 1], in another order). A 16-bit output
// rounds there, so it would miss by up to 2⁻⁹ relative in bfloat16.
func TestMatmulHalfToFloat32(t *testing.T) {
	e := executor(t)
	gpu := runOn(e)
	cpuRun := conformance.RunnerOf(func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
		return cpu.New().RunBatch(ctx, g, b, feed, outputs...)
	})
	wide := graph.Attrs{Target: graph.Type{DType: graph.Float32}}
	rng := newRand(23)
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		t.Run(dt.String(), func(t *testing.T) {
			h := &halfGraph{t: t, g: graph.New(), dt: dt}
			x, w := h.input(6, 5, 40), h.param(40, 24)
			tall := h.op(graph.OpMatMul, wide, x, w) // [6·5, 40]·[40, 24]
			a, b := h.input(6, 40, 5), h.input(6, 24, 40)
			tw := wide
			tw.TransA, tw.TransB = true, true
			batched := h.op(graph.OpMatMul, tw, a, b) // [6][5, 40]·[6][40, 24], both transposed
			g := h.input(6, 5, 24)
			bw := wide
			bw.TransB = true
			bcast := h.op(graph.OpMatMul, bw, g, h.param(40, 24)) // [6][5, 24]·[24, 40]: tall with a transpose
			ga := wide
			ga.TransA = true
			grad := h.op(graph.OpMatMul, ga, h.op(graph.OpReshape, graph.Attrs{Shape: []int{-1, 24}}, g),
				h.op(graph.OpReshape, graph.Attrs{Shape: []int{-1, 40}}, x)) // weight gradient [24, 30]·[30, 40]
			outs := []int{tall, batched, bcast, grad}
			for _, o := range outs {
				require.Equal(t, graph.Float32, h.g.Node(o).Type.DType)
			}
			feeds := map[int]ref.Value{}
			for _, nd := range h.g.Nodes() {
				if nd.Op == graph.OpInput || nd.Op == graph.OpParam {
					v := ref.Zeros(nd.Type.Shape...)
					for i := range v.Data {
						v.Data[i] = 2*rng.Float64() - 1
					}
					feeds[nd.ID] = v
				}
			}
			want, err := cpuRun(h.g, feeds, outs...)
			require.NoError(t, err)
			got, err := gpu(h.g, feeds, outs...)
			require.NoError(t, err)
			for k := range outs {
				require.Equal(t, want[k].Shape, got[k].Shape)
				for i, v := range want[k].Data {
					require.InDelta(t, v, got[k].Data[i], 1e-5+1e-5*math.Abs(v), "output %d element %d", k, i)
				}
			}
		})
	}
}
