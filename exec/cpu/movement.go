package cpu

import (
	"slices"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Movement family: reshape, permute, slice and concat on float32 and int64
// alike, and slice's gradient.
var movementKernels = family{
	graph.OpReshape: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error { return reshapeKernel(in[0], out) }},
	graph.OpPermute: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return permuteKernel(nd.Attrs.Perm, in[0], out)
	}},
	graph.OpSlice:  {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return sliceKernel(&nd.Attrs, in[0], out) }},
	graph.OpConcat: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return concatKernel(nd.Attrs.Axis, in, out) }},
	graph.OpSliceGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		sliceGrad(&nd.Attrs, in[0], out)
		return nil
	}},
}

// Movement kernels work on float and int64 buffers alike; isInt picks which
// slice they move and checks that input and output agree.
func isInt(out *buf, in ...*buf) (bool, error) {
	want := out.i != nil
	for _, x := range in {
		if (x.i != nil) != want {
			return false, graph.Errorf(graph.ErrDType, "input %v and output %v have different dtypes", x.shape, out.shape)
		}
	}
	return want, nil
}

// reshapeKernel copies: buffers are row-major, so only the shape changes.
func reshapeKernel(x, out *buf) error {
	asInt, err := isInt(out, x)
	if err != nil {
		return err
	}
	if graph.Numel(x.shape) != graph.Numel(out.shape) {
		return graph.Errorf(graph.ErrShape, "reshape of %v to %v", x.shape, out.shape)
	}
	if asInt {
		copy(out.i, x.i)
	} else {
		copy(out.f, x.f)
	}
	return nil
}

// permuteKernel reorders axes: output axis k is input axis perm[k].
func permuteKernel(perm []int, x, out *buf) error {
	asInt, err := isInt(out, x)
	if err != nil {
		return err
	}
	rank := len(x.shape)
	if len(perm) != rank || len(out.shape) != rank {
		return graph.Errorf(graph.ErrAttr, "permute %v of %v into %v", perm, x.shape, out.shape)
	}
	xs := graph.ContiguousStrides(x.shape)
	src := make([]int, rank) // stride into x along each output axis
	seen := make([]bool, rank)
	for k, p := range perm {
		if p < 0 || p >= rank || seen[p] || out.shape[k] != x.shape[p] {
			return graph.Errorf(graph.ErrAttr, "permute %v of %v into %v", perm, x.shape, out.shape)
		}
		seen[p] = true
		src[k] = xs[p]
	}
	w := newWalk(out.shape, src, graph.ContiguousStrides(out.shape))
	if asInt {
		gather(w, 0, x.i, out.i)
	} else {
		gather(w, 0, x.f, out.f)
	}
	return nil
}

// gather fills dst (operand 1 of w, contiguous) from src (operand 0) starting
// at element base of src.
func gather[T float32 | int64](w *walk, base int, src, dst []T) {
	w.rows(func(offs []int, n int, inner []int) {
		d := dst[offs[1] : offs[1]+n]
		o, s := base+offs[0], inner[0]
		if s == 1 {
			copy(d, src[o:o+n])
			return
		}
		for i := range d {
			d[i] = src[o]
			o += s
		}
	})
}

// sliceKernel keeps indices a.Start, a.Start+a.Step, … below a.End of a.Axis.
func sliceKernel(a *graph.Attrs, x, out *buf) error {
	asInt, err := isInt(out, x)
	if err != nil {
		return err
	}
	ax, rank := a.Axis, len(x.shape)
	if ax < 0 || ax >= rank || a.Step < 1 || a.Start < 0 || a.Start > a.End || a.End > x.shape[ax] {
		return graph.Errorf(graph.ErrAttr, "slice [%d:%d:%d] of axis %d of %v", a.Start, a.End, a.Step, ax, x.shape)
	}
	want := slices.Clone(x.shape)
	want[ax] = (a.End - a.Start + a.Step - 1) / a.Step
	if !slices.Equal(want, out.shape) {
		return graph.Errorf(graph.ErrShape, "slice [%d:%d:%d] of axis %d of %v gives %v, not %v", a.Start, a.End, a.Step, ax, x.shape, want, out.shape)
	}
	if graph.Numel(out.shape) == 0 {
		return nil
	}
	src := graph.ContiguousStrides(x.shape)
	base := a.Start * src[ax]
	src[ax] *= a.Step
	w := newWalk(out.shape, src, graph.ContiguousStrides(out.shape))
	if asInt {
		gather(w, base, x.i, out.i)
	} else {
		gather(w, base, x.f, out.f)
	}
	return nil
}

// concatKernel joins in along axis: each input contributes a contiguous block
// to every outer row of the output.
func concatKernel(axis int, in []*buf, out *buf) error {
	asInt, err := isInt(out, in...)
	if err != nil {
		return err
	}
	if err := exec.CheckConcat(axis, out.shape, shapesOf(in)); err != nil {
		return err
	}
	outer := graph.Numel(out.shape[:axis])
	inner := graph.Numel(out.shape[axis+1:])
	if asInt {
		ins := make([][]int64, len(in))
		for k, x := range in {
			ins[k] = x.i
		}
		concatBlocks(ins, in, axis, outer, inner, out.i)
	} else {
		ins := make([][]float32, len(in))
		for k, x := range in {
			ins[k] = x.f
		}
		concatBlocks(ins, in, axis, outer, inner, out.f)
	}
	return nil
}

func concatBlocks[T float32 | int64](data [][]T, in []*buf, axis, outer, inner int, dst []T) {
	row := len(dst) / max(outer, 1)
	off := 0 // where input k's block starts within an output row
	for k, src := range data {
		block := in[k].shape[axis] * inner
		for o := range outer {
			copy(dst[o*row+off:o*row+off+block], src[o*block:(o+1)*block])
		}
		off += block
	}
}

// sliceGrad scatters g into zeros at the sliced positions.
func sliceGrad(a *graph.Attrs, g, out *buf) {
	clear(out.f)
	outer, n, inner := axisSplit(out.shape, a.Axis)
	m := g.shape[a.Axis]
	for o := range outer {
		for k := range m {
			src := (o*m + k) * inner
			dst := (o*n + a.Start + k*a.Step) * inner
			copy(out.f[dst:dst+inner], g.f[src:src+inner])
		}
	}
}
