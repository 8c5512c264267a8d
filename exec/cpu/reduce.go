package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Reduction family: sum, mean and max, max's gradient, and expand (the
// gradient of sum and mean).
var reduceKernels = family{
	graph.OpSum:  {run: reduce},
	graph.OpMean: {run: reduce},
	graph.OpMax:  {run: reduce},
	graph.OpMaxGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return maxGrad(&nd.Attrs, in[0], in[1], in[2], out)
	}},
	graph.OpExpand: {run: expand},
}

func reduce(nd *graph.Node, in []*buf, out *buf, _ int) error {
	return reduceKernel(nd.Op, &nd.Attrs, in[0], out)
}

// expand broadcasts g to the output's shape.
func expand(_ *graph.Node, in []*buf, out *buf, _ int) error {
	g := in[0]
	idx, err := broadcastIndex(g.shape, out.shape)
	if err != nil {
		return err
	}
	for i, j := range idx {
		out.f[i] = g.f[j]
	}
	return nil
}

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

// keepDimShape is x's shape with the reduced axes set to 1.
func keepDimShape(x []int, axes []int) []int {
	s := append([]int(nil), x...)
	for _, a := range axes {
		s[a] = 1
	}
	return s
}

// maxGrad shares each reduced gradient evenly among the tied maxima.
func maxGrad(a *graph.Attrs, g, x, y, out *buf) error {
	// y's flat order is the keepdim order whether or not dims were kept.
	idx, err := broadcastIndex(keepDimShape(x.shape, a.Axes), x.shape)
	if err != nil {
		return err
	}
	count := make([]float32, len(y.f))
	for i, j := range idx {
		if x.f[i] == y.f[j] {
			count[j]++
		}
	}
	for i, j := range idx {
		out.f[i] = 0
		if x.f[i] == y.f[j] {
			out.f[i] = g.f[j] / count[j]
		}
	}
	return nil
}
