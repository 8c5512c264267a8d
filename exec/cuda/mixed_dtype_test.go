package cuda_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

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
	cpuRun := cpuRunner()
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
			feeds := h.uniformFeeds(rng, -1, 1)
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

// A layer norm of float32 x, weight and bias with a 16-bit output
// (Attrs.Target, the precision pass's layer norms that only GEMMs read)
// stores bit for bit the cast of the float32 layer norm's result, on both
// row paths (a row held in registers, d = 96, and one read twice, d =
// 9000), and matches the CPU's within one 16-bit rounding
// (conformance.BFloat16Tol, Float16Tol).
func TestLayerNormFloat32ToHalf(t *testing.T) {
	e := executor(t)
	gpu := runOn(e)
	cpuRun := cpuRunner()
	rng := newRand(29)
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		tol := conformance.BFloat16Tol
		if dt == graph.Float16 {
			tol = conformance.Float16Tol
		}
		for _, d := range []int{96, 9000} {
			t.Run(fmt.Sprintf("%s/d=%d", dt, d), func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: graph.Float32}
				x, w, b := h.input(3, 5, d), h.param(d), h.param(d)
				ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
				wide := h.op(graph.OpLayerNorm, ln, x, w, b)
				cast := h.op(graph.OpCast, graph.Attrs{Target: graph.Type{DType: dt}}, wide)
				ln.Target = graph.Type{DType: dt}
				direct := h.op(graph.OpLayerNorm, ln, x, w, b)
				plain := h.op(graph.OpLayerNorm, graph.Attrs{NormDims: 1, Eps: 1e-5}, x) // no weight or bias
				bare := h.op(graph.OpLayerNorm, ln, x)
				require.Equal(t, dt, h.g.Node(direct).Type.DType)
				plainCast := h.op(graph.OpCast, graph.Attrs{Target: graph.Type{DType: dt}}, plain)
				outs := []int{cast, direct, plainCast, bare}
				feeds := map[int]ref.Value{}
				for _, nd := range h.g.Nodes() {
					if nd.Op == graph.OpInput || nd.Op == graph.OpParam {
						v := ref.Zeros(nd.Type.Shape...)
						for i := range v.Data {
							v.Data[i] = 3*rng.Float64() - 1
						}
						feeds[nd.ID] = v
					}
				}
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				want, err := cpuRun(h.g, feeds, outs...)
				require.NoError(t, err)
				require.Equal(t, got[0].Data, got[1].Data, "the direct 16-bit layer norm against the cast")
				require.Equal(t, got[2].Data, got[3].Data, "without weight and bias")
				for k := range outs {
					for i, v := range want[k].Data {
						require.InDelta(t, v, got[k].Data[i], tol.ATol+tol.RTol*math.Abs(v), "output %d element %d", k, i)
					}
				}
			})
		}
	}
}
