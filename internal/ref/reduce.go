package ref

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// Reduction family: sum, mean and max, max's gradient, and expand.
var reduceKernels = family{
	graph.OpSum:  reduceOp,
	graph.OpMean: reduceOp,
	graph.OpMax:  reduceOp,
	graph.OpExpand: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		expand(out, in[0])
		return nil
	},
	graph.OpMaxGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		maxGrad(out, in[0], in[1], in[2], a)
		return nil
	},
}

func reduceOp(nd *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	reduce(out, in[0], nd.Op, a)
	return nil
}

// reducedPos maps multi-index idx of the reduction input to the flat
// position of its output element in out (keepdim or not).
func reducedPos(idx, axes []int, keep bool, out []int) int {
	o := make([]int, 0, len(idx))
	for d, i := range idx {
		switch {
		case !slices.Contains(axes, d):
			o = append(o, i)
		case keep:
			o = append(o, 0)
		}
	}
	return ravel(o, out)
}

// reduce computes sum, mean (sum·Scalar) or max over a.Axes.
func reduce(out, x Value, op graph.Op, a *graph.Attrs) {
	if op == graph.OpMax {
		for i := range out.Data {
			out.Data[i] = math.Inf(-1)
		}
	}
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		p := reducedPos(idx, a.Axes, a.KeepDim, out.Shape)
		if op == graph.OpMax {
			out.Data[p] = math.Max(out.Data[p], v)
		} else {
			out.Data[p] += v
		}
	}
	if op == graph.OpMean {
		for i := range out.Data {
			out.Data[i] *= a.Scalar
		}
	}
}

// expand broadcasts g to out's shape (NumPy rules).
func expand(out, g Value) {
	idx := make([]int, len(out.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		out.Data[i] = g.Data[broadcastPos(idx, g.Shape)]
	}
}

// maxGrad gives each element of x equal to its group's maximum y an equal
// share of the group's gradient g.
func maxGrad(out, g, x, y Value, a *graph.Attrs) {
	ties := make([]int, len(y.Data))
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		if p := reducedPos(idx, a.Axes, a.KeepDim, y.Shape); v == y.Data[p] {
			ties[p]++
		}
	}
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		if p := reducedPos(idx, a.Axes, a.KeepDim, y.Shape); v == y.Data[p] {
			out.Data[i] = g.Data[p] / float64(ties[p])
		}
	}
}
