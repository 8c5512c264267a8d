package cuda

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Index geometry on the host side: strides, merged axes and the structs
// the kernels take, computed as exec/cpu computes them (walk.go, conv.go).

// mergeAxes drops the size-1 axes of shape and merges neighbouring axes that
// every stride set walks contiguously (as exec/cpu's newWalk), so kernels
// see few axes. It returns the merged sizes and, per stride set, the merged
// strides; no axes are left for a single element.
func mergeAxes(shape []int, strides ...[]int) ([]int, [][]int) {
	var dims []int
	st := make([][]int, len(strides))
	for ax, d := range shape {
		if d == 1 {
			continue
		}
		last := len(dims) - 1
		merge := last >= 0
		for k, s := range strides {
			if merge && st[k][last] != s[ax]*d {
				merge = false
			}
		}
		if merge {
			dims[last] *= d
			for k, s := range strides {
				st[k][last] = s[ax]
			}
			continue
		}
		dims = append(dims, d)
		for k, s := range strides {
			st[k] = append(st[k], s[ax])
		}
	}
	return dims, st
}

// checkRank fails when merged axes do not fit the kernels' structs.
func checkRank(what string, dims []int) error {
	if len(dims) > MaxDims {
		return graph.Errorf(graph.ErrShape, "%s needs %d axes after merging, more than the CUDA kernels' %d", what, len(dims), MaxDims)
	}
	return nil
}

// newStrided fills a Strided from merged axes; unused axes get shape 1 and
// stride 0.
func newStrided(dims, stride []int) Strided {
	g := Strided{Rank: int64(len(dims))}
	for d := range MaxDims {
		g.Shape[d] = 1
		if d < len(dims) {
			g.Shape[d], g.Stride[d] = int64(dims[d]), int64(stride[d])
		}
	}
	return g
}

// newStrided2 is newStrided for two stride sets.
func newStrided2(dims, sa, sb []int) Strided2 {
	g := Strided2{Rank: int64(len(dims))}
	for d := range MaxDims {
		g.Shape[d] = 1
		if d < len(dims) {
			g.Shape[d], g.SA[d], g.SB[d] = int64(dims[d]), int64(sa[d]), int64(sb[d])
		}
	}
	return g
}

// broadcastGeom is the Strided2 that reads a and b at each position of the
// broadcast shape out (contiguous).
func broadcastGeom(a, b, out []int) (Strided2, error) {
	sa, err := graph.BroadcastStrides(a, out)
	if err != nil {
		return Strided2{}, err
	}
	sb, err := graph.BroadcastStrides(b, out)
	if err != nil {
		return Strided2{}, err
	}
	dims, st := mergeAxes(out, sa, sb, graph.ContiguousStrides(out))
	if err := checkRank("broadcast", dims); err != nil {
		return Strided2{}, err
	}
	return newStrided2(dims, st[0], st[1]), nil
}

// reduceKind is the kernel a reduction runs with.
type reduceKind uint8

const (
	reduceRows    reduceKind = iota // [rows, n], last axis reduced
	reduceMid                       // [outer, n, inner], middle axis reduced
	reduceStrided                   // anything else, through a ReduceGeom
	// [outer, n, inner] with outer and inner reduced (a bias or batch
	// norm gradient over [N, C, H, W]): rows then partials, see reduce.
	reduceOuterInner
)

// reduceLayout is a reduction of a contiguous x over some axes after
// dropping size-1 axes and merging neighbours that are both kept or both
// reduced. Zero-sized reductions (nout or nred 0) are the caller's.
type reduceLayout struct {
	kind            reduceKind
	nout, nred      int64 // outputs, and elements combined into each
	outer, n, inner int64 // rows: outer = rows, inner = 1
	geom            ReduceGeom
}

// planReduce lays out the reduction of x (shape) over axes.
func planReduce(shape, axes []int) (reduceLayout, error) {
	reduced := make([]bool, len(shape))
	for _, ax := range axes {
		if ax < 0 || ax >= len(shape) {
			return reduceLayout{}, graph.Errorf(graph.ErrAttr, "reduction axis %d out of range for rank %d", ax, len(shape))
		}
		reduced[ax] = true
	}
	strides := graph.ContiguousStrides(shape)
	type axis struct {
		size, stride int
		red          bool
	}
	var merged []axis
	l := reduceLayout{nout: 1, nred: 1}
	for ax, d := range shape {
		if reduced[ax] {
			l.nred *= int64(d)
		} else {
			l.nout *= int64(d)
		}
		if d == 1 {
			continue
		}
		// x is contiguous, so neighbours left after dropping size-1 axes
		// merge whenever they are both kept or both reduced.
		if k := len(merged) - 1; k >= 0 && merged[k].red == reduced[ax] {
			merged[k].size *= d
			merged[k].stride = strides[ax]
			continue
		}
		merged = append(merged, axis{d, strides[ax], reduced[ax]})
	}
	var kept, red []axis
	for _, a := range merged {
		if a.red {
			red = append(red, a)
		} else {
			kept = append(kept, a)
		}
	}
	if len(kept) > MaxDims || len(red) > MaxDims {
		return l, graph.Errorf(graph.ErrShape, "reduction of %v over %v has %d kept and %d reduced axes after merging; the CUDA kernels take %d",
			shape, axes, len(kept), len(red), MaxDims)
	}
	// geom describes every layout: max_grad takes it whatever the kind.
	l.geom = ReduceGeom{KeptRank: int64(len(kept)), RedRank: int64(len(red))}
	for d := range MaxDims {
		l.geom.KeptShape[d], l.geom.RedShape[d] = 1, 1
		if d < len(kept) {
			l.geom.KeptShape[d], l.geom.KeptStride[d] = int64(kept[d].size), int64(kept[d].stride)
		}
		if d < len(red) {
			l.geom.RedShape[d], l.geom.RedStride[d] = int64(red[d].size), int64(red[d].stride)
		}
	}
	if l.nout == 0 || l.nred == 0 {
		return l, nil
	}
	switch last := len(merged) - 1; {
	case len(red) == 0: // nothing to combine: each output is its one element
		l.kind, l.outer, l.n, l.inner = reduceRows, l.nout, 1, 1
	case merged[last].red && len(merged) <= 2: // [rows, n] or [n]
		l.kind, l.outer, l.n, l.inner = reduceRows, l.nout, l.nred, 1
	case len(red) == 1 && len(merged) <= 3 && !merged[last].red: // [n, inner] or [outer, n, inner]
		l.kind, l.n, l.inner = reduceMid, l.nred, int64(merged[last].size)
		l.outer = l.nout / l.inner
	case len(merged) == 3 && merged[0].red && !merged[1].red && merged[2].red: // [outer, n, inner], n kept
		l.kind, l.outer, l.n, l.inner = reduceOuterInner, int64(merged[0].size), int64(merged[1].size), int64(merged[2].size)
	default:
		l.kind = reduceStrided
	}
	return l, nil
}

// axisSplit views shape as [outer, n, inner] around axis.
func axisSplit(shape []int, axis int) (outer, n, inner int) {
	return graph.Numel(shape[:axis]), shape[axis], graph.Numel(shape[axis+1:])
}

// newWindow checks an NCHW input x and an output of outC channels against a
// kh×kw window with a's stride, padding and dilation (already normalised
// to ≥ 1, as exec/cpu requires) and returns the geometry of all N images;
// outC < 0 means as many channels as the input (pooling).
func newWindow(op string, x, out []int, kh, kw int, a *graph.Attrs, outC int) (Window, error) {
	if len(x) != 4 {
		return Window{}, graph.Errorf(graph.ErrShape, "%s needs an NCHW input, got %v", op, x)
	}
	if outC < 0 {
		outC = x[1]
	}
	sh, sw, ph, pw, dh, dw := a.Stride[0], a.Stride[1], a.Padding[0], a.Padding[1], a.Dilation[0], a.Dilation[1]
	if sh < 1 || sw < 1 || dh < 1 || dw < 1 || ph < 0 || pw < 0 || kh < 1 || kw < 1 {
		return Window{}, graph.Errorf(graph.ErrAttr, "%s kernel %dx%d, stride %v, padding %v, dilation %v out of range",
			op, kh, kw, a.Stride, a.Padding, a.Dilation)
	}
	ho := shapeinfer.ConvOut(x[2], kh, sh, ph, dh)
	wo := shapeinfer.ConvOut(x[3], kw, sw, pw, dw)
	if want := []int{x[0], outC, ho, wo}; ho < 1 || wo < 1 || !slices.Equal(out, want) {
		return Window{}, graph.Errorf(graph.ErrShape, "%s of %v gives %v, output buffer is %v", op, x, want, out)
	}
	// The kernels' in-plane arithmetic is 32-bit (common.cuh's Geom32), as
	// are cuDNN's sizes; the image count and channels are not limited here.
	for _, v := range []int64{int64(x[2]) * int64(x[3]), int64(ho) * int64(wo), int64(kh) * int64(kw),
		int64(sh), int64(sw), int64(ph), int64(pw), int64(dh), int64(dw)} {
		if v > math.MaxInt32 {
			return Window{}, graph.Errorf(graph.ErrShape, "%s of %v: kernel %dx%d, stride %v, padding %v, dilation %v: a plane beyond 2³¹ positions",
				op, x, kh, kw, a.Stride, a.Padding, a.Dilation)
		}
	}
	return Window{N: int64(x[0]), C: int64(x[1]), H: int64(x[2]), W: int64(x[3]), KH: int64(kh), KW: int64(kw),
		SH: int64(sh), SW: int64(sw), PH: int64(ph), PW: int64(pw), DH: int64(dh), DW: int64(dw),
		HO: int64(ho), WO: int64(wo)}, nil
}

// direct reports whether a convolution's unfolded patches are its input
// itself: a 1×1 kernel with unit stride and no padding.
func (w Window) direct() bool {
	return w.KH == 1 && w.KW == 1 && w.SH == 1 && w.SW == 1 && w.PH == 0 && w.PW == 0
}
