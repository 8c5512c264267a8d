package ref

import "github.com/batchfit/batchfit/graph"

// Movement family: reshape, permute, slice, concat and slice's gradient.
var movementKernels = family{
	graph.OpReshape: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		copy(out.Data, in[0].Data)
		return nil
	},
	graph.OpPermute: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		permute(out, in[0], a.Perm)
		return nil
	},
	graph.OpSlice: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		slice(out, in[0], a)
		return nil
	},
	graph.OpConcat: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		concat(out, in, a.Axis)
		return nil
	},
	graph.OpSliceGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		sliceGrad(out, in[0], a)
		return nil
	},
}

// permute: output axis i is input axis perm[i].
func permute(out, x Value, perm []int) {
	idx := make([]int, len(out.Shape))
	src := make([]int, len(x.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		for d, p := range perm {
			src[p] = idx[d]
		}
		out.Data[i] = x.Data[ravel(src, x.Shape)]
	}
}

// slice keeps indices Start, Start+Step, … below End of a.Axis.
func slice(out, x Value, a *graph.Attrs) {
	idx := make([]int, len(out.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		idx[a.Axis] = a.Start + idx[a.Axis]*a.Step
		out.Data[i] = x.Data[ravel(idx, x.Shape)]
	}
}

// sliceGrad writes g into a zero array of the sliced input's shape at the
// positions slice read from.
func sliceGrad(out, g Value, a *graph.Attrs) {
	idx := make([]int, len(g.Shape))
	for i, v := range g.Data {
		unravel(i, g.Shape, idx)
		idx[a.Axis] = a.Start + idx[a.Axis]*a.Step
		out.Data[ravel(idx, out.Shape)] += v
	}
}

// concat joins the inputs along axis, in order.
func concat(out Value, in []Value, axis int) {
	idx := make([]int, len(out.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		k := idx[axis]
		for _, x := range in {
			if k < x.Shape[axis] {
				idx[axis] = k
				out.Data[i] = x.Data[ravel(idx, x.Shape)]
				break
			}
			k -= x.Shape[axis]
		}
	}
}
