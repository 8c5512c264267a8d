package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// reduceKernel computes sum, mean or max over a.Axes (normalised, sorted,
// non-negative). It accumulates in float64. Mean is the sum times a.Scalar,
// the 1/count fixed when the graph was built, so a chunk's mean is its share
// of the full-batch mean and chunk results add up exactly.
func reduceKernel(op graph.Op, a *graph.Attrs, x, out *buf) error {
	rank := len(x.shape)
	reduced := make([]bool, rank)
	for _, ax := range a.Axes {
		if ax < 0 || ax >= rank {
			return graph.Errorf(graph.ErrAttr, "%s axis %d out of range for rank %d", op, ax, rank)
		}
		reduced[ax] = true
	}
	// Strides into the output over x's axes: 0 on reduced axes.
	os := make([]int, rank)
	kept := 1
	for i := rank - 1; i >= 0; i-- {
		if !reduced[i] {
			os[i] = kept
			kept *= x.shape[i]
		}
	}
	if kept != len(out.f) {
		return graph.Errorf(graph.ErrShape, "%s over axes %v of %v cannot give %v", op, a.Axes, x.shape, out.shape)
	}
	acc := make([]float64, len(out.f))
	w := newWalk(x.shape, graph.ContiguousStrides(x.shape), os)
	switch op {
	case graph.OpSum, graph.OpMean:
		w.rows(func(offs []int, n int, inner []int) {
			src := x.f[offs[0] : offs[0]+n]
			if inner[1] == 0 { // the row is reduced into one output
				var s float64
				for _, v := range src {
					s += float64(v)
				}
				acc[offs[1]] += s
				return
			}
			dst := acc[offs[1] : offs[1]+n]
			for i, v := range src {
				dst[i] += float64(v)
			}
		})
		scale := 1.0
		if op == graph.OpMean {
			scale = a.Scalar
		}
		for i, v := range acc {
			out.f[i] = float32(v * scale)
		}
	case graph.OpMax:
		for i := range acc {
			acc[i] = math.Inf(-1)
		}
		// Builtin max propagates NaN, as torch.amax does.
		w.rows(func(offs []int, n int, inner []int) {
			src := x.f[offs[0] : offs[0]+n]
			if inner[1] == 0 {
				m := acc[offs[1]]
				for _, v := range src {
					m = max(m, float64(v))
				}
				acc[offs[1]] = m
				return
			}
			dst := acc[offs[1] : offs[1]+n]
			for i, v := range src {
				dst[i] = max(dst[i], float64(v))
			}
		})
		for i, v := range acc {
			out.f[i] = float32(v)
		}
	default:
		return graph.Errorf(graph.ErrAttr, "%s is not a reduction", op)
	}
	return nil
}
