package cuda_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
)

// An add whose result a layer norm reads runs as one add_layer_norm pass
// (graph.AddLayerNormProducer) and matches the CPU: the float32 sum
// exactly (both add in float32), the layer norm within 1e-5·(1 + |v|)
// (statistics in double on both, summed in another order). Cases: a
// transformer block's residual (float32 + bfloat16, d = 768, rows kept in
// registers), the position embedding broadcast over the batch (float32 +
// float32 [T, d], no affine), and rows too long for registers (d = 9000,
// read back), and d = 1024 (one warp a row).
func TestAddLayerNormMatchesCPU(t *testing.T) {
	e := executor(t)
	gpu := runOn(e)
	cpuRun := cpuRunner()
	rng := newRand(47)
	ln := graph.Attrs{NormDims: 1, Eps: 1e-5}
	h := &halfGraph{t: t, g: graph.New(), dt: graph.Float32}
	f32 := func(shape ...int) int { return h.input(shape...) }
	var outs []int
	for _, d := range []int{768, 9000} {
		x := f32(3, 5, d)
		hb := h.add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{3, 5, d}, DType: graph.BFloat16, BatchAxis: 0}})
		s := h.op(graph.OpAdd, graph.Attrs{}, x, hb)
		y := h.op(graph.OpLayerNorm, ln, s, h.param(d), h.param(d))
		require.Equal(t, s, graph.CompanionProducer(h.g, y))
		outs = append(outs, s, y)
	}
	// d = 1024, a bfloat16 y: the one-warp-a-row kernel.
	x, hb := f32(3, 7, 1024), h.add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{3, 7, 1024}, DType: graph.BFloat16, BatchAxis: 0}})
	s4 := h.op(graph.OpAdd, graph.Attrs{}, x, hb)
	y4 := h.op(graph.OpLayerNorm, ln, s4, h.param(1024), h.param(1024))
	require.Equal(t, s4, graph.CompanionProducer(h.g, y4))
	outs = append(outs, s4, y4)
	emb, pos := f32(3, 6, 64), h.param(6, 64)
	s := h.op(graph.OpAdd, graph.Attrs{}, emb, pos)
	y := h.op(graph.OpLayerNorm, ln, s)
	outs = append(outs, s, y, h.op(graph.OpMulScalar, graph.Attrs{Scalar: 2}, s)) // s read beside the norm
	feeds := h.uniformFeeds(rng, -2, 2)
	want, err := cpuRun(h.g, feeds, outs...)
	require.NoError(t, err)
	before := cuda.AddLayerNorms()
	got, err := gpu(h.g, feeds, outs...)
	require.NoError(t, err)
	require.Equal(t, int64(4), cuda.AddLayerNorms()-before, "each add ran with its layer norm")
	for k, o := range outs {
		exact := h.g.Node(o).Op == graph.OpAdd
		for i, v := range want[k].Data {
			if exact {
				require.Equal(t, v, got[k].Data[i], "sum %d element %d", o, i)
				continue
			}
			require.InDelta(t, v, got[k].Data[i], 1e-5*(1+math.Abs(v)), "output %d (node %d) element %d", k, o, i)
		}
	}
}
