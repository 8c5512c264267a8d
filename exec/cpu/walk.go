package cpu

import "github.com/batchfit/batchfit/graph"

// walk visits an index space in row-major order while tracking one element
// offset per operand, each with its own strides (0 on broadcast axes). Axes
// of size 1 are dropped and neighbouring axes that every operand walks
// contiguously are merged, so the common cases (same shape, a row or column
// broadcast, a transpose of two blocks) reduce to a few long rows and the hot
// loops see plain unit or zero strides.
type walk struct {
	dims    []int   // merged axes, outermost first; empty when there is one element
	strides [][]int // strides[op][axis]
	n       int     // total elements; 0 when some axis is empty
}

// newWalk builds a walk over shape; strides[op] has one entry per axis of shape.
func newWalk(shape []int, strides ...[]int) *walk {
	w := &walk{strides: make([][]int, len(strides)), n: graph.Numel(shape)}
	for k := range strides {
		w.strides[k] = make([]int, 0, len(shape))
	}
	for ax, d := range shape {
		if d == 1 {
			continue
		}
		last := len(w.dims) - 1
		merge := last >= 0
		for k, s := range strides {
			if merge && w.strides[k][last] != s[ax]*d {
				merge = false
			}
		}
		if merge {
			w.dims[last] *= d
			for k, s := range strides {
				w.strides[k][last] = s[ax]
			}
			continue
		}
		w.dims = append(w.dims, d)
		for k, s := range strides {
			w.strides[k] = append(w.strides[k], s[ax])
		}
	}
	return w
}

// rows calls fn once per innermost row with each operand's offset of the
// row's first element, the row length and each operand's stride along the
// row. offs is reused between calls.
func (w *walk) rows(fn func(offs []int, n int, inner []int)) {
	if w.n == 0 {
		return
	}
	ops := len(w.strides)
	offs := make([]int, ops)
	inner := make([]int, ops)
	r := len(w.dims)
	if r == 0 {
		fn(offs, 1, inner)
		return
	}
	for k := range ops {
		inner[k] = w.strides[k][r-1]
	}
	n := w.dims[r-1]
	outer := w.dims[:r-1]
	idx := make([]int, len(outer))
	for {
		fn(offs, n, inner)
		// Advance the odometer over the outer axes.
		ax := len(outer) - 1
		for ; ax >= 0; ax-- {
			idx[ax]++
			for k := range ops {
				offs[k] += w.strides[k][ax]
			}
			if idx[ax] < outer[ax] {
				break
			}
			for k := range ops {
				offs[k] -= w.strides[k][ax] * outer[ax]
			}
			idx[ax] = 0
		}
		if ax < 0 {
			return
		}
	}
}
