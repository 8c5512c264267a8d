package cuda_test

import (
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
)

// An MLP's GEMMs with cuBLASLt epilogues match the CPU, in every float
// dtype: a linear with its bias (EPILOGUE_BIAS), a linear whose tanh-form
// gelu is its companion (GELU_AUX_BIAS: the linear's output is GELU's
// input, the gelu's output GELU of it), and matmul_gelu_grad (DGELU),
// whose bias gradient, a sum, follows it. A width of 20 (not a
// multiple of 8, which cuBLASLt's GELU input stride needs) runs the
// unfused kernels and must match too. Tolerance: 1e-4·(1 + |v|) in
// float32; 2⁻⁶·(1 + |v|) in 16 bits, where the epilogue applies GELU and
// GELU′ to the float32 product that the CPU first rounds (a few 16-bit
// roundings apart); the bias gradient, a sum over 30 rows, within
// 2⁻⁶·(1 + Σ|terms|).
func TestGemmEpiloguesMatchCPU(t *testing.T) {
	e := executor(t)
	gpu := runOn(e)
	cpuRun := cpuRunner()
	rng := newRand(41)
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		t.Run(dt.String(), func(t *testing.T) {
			h := &halfGraph{t: t, g: graph.New(), dt: dt}
			var outs []int
			var sums []int // bias gradients: compared against Σ|terms|
			for _, width := range []int{24, 20} {
				x := h.input(6, 5, 40)
				pre := h.op(graph.OpLinear, graph.Attrs{}, x, h.param(width, 40), h.param(width))
				act := h.op(graph.OpGelu, graph.Attrs{Approx: true}, pre)
				lin := h.op(graph.OpLinear, graph.Attrs{}, act, h.param(16, width), h.param(16)) // bias only
				dy := h.input(6, 5, 16)
				fused := h.op(graph.OpMatMulGeluGrad, graph.Attrs{Approx: true}, dy, h.param(16, width), pre)
				db := h.op(graph.OpSum, graph.Attrs{Axes: []int{0, 1}}, fused)
				require.Equal(t, pre, graph.CompanionProducer(h.g, act))
				outs = append(outs, pre, act, lin, fused, db)
				sums = append(sums, db)
			}
			feeds := h.uniformFeeds(rng, -1, 1)
			want, err := cpuRun(h.g, feeds, outs...)
			require.NoError(t, err)
			before := cuda.EpilogueGEMMs()
			got, err := gpu(h.g, feeds, outs...)
			require.NoError(t, err)
			ran := cuda.EpilogueGEMMs() - before
			t.Logf("%s: %d GEMMs with epilogues", dt, ran)
			// Width 24: GELU_AUX_BIAS, the bias linear, DGELU; width 20:
			// the bias epilogue for both linears, no GELU epilogue.
			require.Equal(t, int64(5), ran, "the epilogues ran")
			tol := 1e-4
			if dt != graph.Float32 {
				tol = math.Ldexp(1, -6)
			}
			for k, o := range outs {
				require.Equal(t, want[k].Shape, got[k].Shape)
				for i, v := range want[k].Data {
					d := tol * (1 + math.Abs(v))
					if slices.Contains(sums, o) {
						terms := 0.0
						f := want[k-1] // the fused output it sums
						w := len(want[k].Data)
						for r := range len(f.Data) / w {
							terms += math.Abs(f.Data[r*w+i])
						}
						d = tol * (1 + terms)
					}
					require.InDelta(t, v, got[k].Data[i], d, "output %d (node %d) element %d", k, o, i)
				}
			}
		})
	}
}
