package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
	"github.com/batchfit/batchfit/graph"
	"slices"
)

// reduceCodes are the reduce_* kernels' op codes (R_SUM, R_MAX),
// declared once and generated into kernels/opcodes.cuh; mean is R_SUM
// with a scale.
var reduceCodes = opcode.Enum{Prefix: "R_", Doc: "Reduction op codes (the reduce_*_f32 kernels' op).", Names: []opcode.Name{
	{Op: graph.OpSum, Note: "sum and mean"}, {Op: graph.OpMax},
}}

var (
	rSum = reduceCodes.Code(graph.OpSum, "")
	rMax = reduceCodes.Code(graph.OpMax, "")
)

// Reduction family (kernels/reduce.cu): sum, mean and max over axes, max's
// gradient, and expand (the gradient of sum and mean, a gather).
var reduceKernels = family{
	graph.OpSum:  {run: reduce, ws: reduceWorkspace},
	graph.OpMean: {run: reduce, ws: reduceWorkspace},
	graph.OpMax:  {run: reduce, ws: reduceWorkspace},
	graph.OpMaxGrad: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.maxGrad(dt, k.attrs(), g, in[1], in[2], out)
	})},
	graph.OpExpand: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, _ []operand, out operand) error {
		return k.expand(dt, g, out)
	})},
}

// Splitting long reductions (kernels/README.md): a reduction with few
// outputs runs as up to maxSplits partial reductions per output, combined
// by a second pass. Whether a node may split is decided from its full-batch
// types, so that its workspace is affine in the chunk size as the planner
// requires; how many splits a chunk uses depends on the chunk.
const (
	maxSplits       = 32
	splitMaxOutputs = 1 << 14 // reductions with more outputs have blocks enough
	splitLen        = 1 << 8  // elements each split reduces, at least
)

// reduceSplittable reports whether a sum, mean or max node may split its
// reductions: few outputs, long reductions, at the full batch.
func reduceSplittable(g *graph.Graph, nd *graph.Node) bool {
	nout := int64(nd.Type.Numel())
	nin := int64(g.Node(nd.Inputs[0]).Type.Numel())
	return nout > 0 && nout <= splitMaxOutputs && nin/nout >= 2*splitLen
}

// splitsFor is how many splits a reduction of n elements uses, with at
// least per elements each.
func splitsFor(n, per int64) int64 { return min(max(n/per, 1), maxSplits) }

// splitBytes is the workspace of splits float partials of nout outputs.
func splitBytes(splits, nout int64) int64 { return 4 * splits * nout }

// reduceWorkspace: the partials of a split reduction, for a node that may
// split.
func reduceWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	var ws int64
	if reduceSplittable(g, nd) {
		ws = splitBytes(maxSplits, int64(graph.Numel(nd.Type.AtBatch(b))))
	}
	if len(nd.Inputs) > 0 {
		ws += outerInnerBytes(g.Node(nd.Inputs[0]).Type.Shape, inputAt(g, nd, 0, b), nd.Attrs.Axes)
	}
	return ws
}

// outerInnerBytes is the float partials [outer, n] of a reduceOuterInner
// reduction of x (full, at the graph's batch; x, at the chunk's), 0 for
// another layout. The layout is the full batch's, and the partials are
// counted as the rows in front of the trailing reduced axes, so that the
// bytes are affine in the chunk (a chunk of one, whose batch axis drops
// out, may run another kernel and use less).
func outerInnerBytes(full, x []int, axes []int) int64 {
	if l, err := planReduce(full, axes); err != nil || l.kind != reduceOuterInner || len(x) != len(full) {
		return 0
	}
	k := len(full) // the trailing run of reduced (or size-1) axes starts at k
	for k > 0 && (full[k-1] == 1 || slices.Contains(axes, k-1)) {
		k--
	}
	return 4 * int64(graph.Numel(x[:k]))
}

// reduce computes sum, mean or max over a.Axes: rows, middle-axis or
// strided layout, split into partial reductions when the node may split
// (reduceSplittable) and the chunk's reductions are long. x and the output
// share one float dtype; split partials are float32 whatever it is.
func reduce(k *kctx, in []operand, out operand) error {
	nd, a, x := k.nd, k.attrs(), in[0]
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	l, err := planReduce(x.shape, a.Axes)
	if err != nil {
		return err
	}
	if l.nout != out.n() {
		return graph.Errorf(graph.ErrShape, "%s over axes %v of %v cannot give %v", nd.Op, a.Axes, x.shape, out.shape)
	}
	op, scale := rSum, 1.0
	switch nd.Op {
	case graph.OpMax:
		op = rMax
	case graph.OpMean:
		scale = a.Scalar
	}
	switch {
	case l.nout == 0:
		return nil
	case l.nred == 0: // empty reductions: rows of none give the sum's 0, the max's −inf, as on the CPU
		block := rowBlock(0)
		return k.launch(typed(kReduceRows, dt), rowGrid(l.nout, block, 1), block, x.p, out.p, alloc.Ptr(0), l.nout, int64(0), op, scale)
	}
	if l.kind == reduceOuterInner && (k.ws == nil || k.ws.Requested() < splitBytes(l.outer, l.n)) {
		// A chunk whose layout differs from the full batch's (its batch
		// axis dropped out) has no partials planned: the strided kernel.
		l.kind = reduceStrided
	}
	if l.kind == reduceOuterInner {
		// Two coalesced passes instead of the strided kernel's one: each
		// of the outer·n rows of inner contiguous values into float
		// partials [outer, n] (reduce_rows), then the partials over outer
		// (reduce_splits, which scales). A [64, 1024, 14, 14] bias
		// gradient took 0.78 ms on the strided kernel on the H100.
		part, err := k.workspace(splitBytes(l.outer, l.n))
		if err != nil {
			return err
		}
		rows, block := l.outer*l.n, rowBlock(l.inner)
		if err := k.launch(typed(kReduceRows, dt), rowGrid(rows, block, 1), block, x.p, out.p, part, rows, l.inner, op, 1.0); err != nil {
			return err
		}
		return k.combineSplits(dt, part, out.p, l.outer, l.n, op, scale)
	}
	splits := int64(1)
	if reduceSplittable(k.g, nd) {
		splits = splitsFor(l.nred, splitLen)
	}
	var part alloc.Ptr // the partials of a split reduction; none when unsplit
	first := scale
	if splits > 1 {
		if part, err = k.workspace(splitBytes(splits, l.nout)); err != nil {
			return err
		}
		first = 1
	}
	switch l.kind {
	case reduceRows:
		block := rowBlock(l.n)
		err = k.launch(typed(kReduceRows, dt), rowGrid(l.outer, block, splits), block, x.p, out.p, part, l.outer, l.n, op, first)
	case reduceMid:
		if midV8(dt, op, x.p, l.n, l.inner, splits) {
			grid := [3]uint32{uint32(min(max(ceilDiv(l.inner/8, midV8TX), 1), maxGridX)), uint32(min(l.outer, maxGridYZ)), uint32(splits)}
			err = k.launch(typed(kReduceMidV8, dt), grid, [3]uint32{midV8TX, midV8TY, 1}, x.p, out.p, part, l.outer, l.n, l.inner, first)
			break
		}
		grid := [3]uint32{tileGridX(l.inner), uint32(min(l.outer, maxGridYZ)), uint32(splits)}
		err = k.launch(typed(kReduceMid, dt), grid, tileBlock, x.p, out.p, part, l.outer, l.n, l.inner, op, first)
	default:
		block := rowBlock(l.nred)
		err = k.launch(typed(kReduceStrided, dt), rowGrid(l.nout, block, splits), block, x.p, out.p, part, l.geom, l.nout, l.nred, op, first)
	}
	if err != nil || splits == 1 {
		return err
	}
	return k.combineSplits(dt, part, out.p, splits, l.nout, op, scale)
}

// midV8 reports whether a middle-axis reduction takes reduce_mid_v8_*: a
// sum of 16-bit x at p, inner a multiple of 8 (whole 16-byte loads), and
// at most midV8Rows rows a split, so that each thread's float sum stays
// short.
func midV8(dt graph.DType, op opcode.Code, p alloc.Ptr, n, inner, splits int64) bool {
	return op == rSum && (dt == graph.BFloat16 || dt == graph.Float16) && inner%8 == 0 && p%16 == 0 &&
		ceilDiv(n, splits) <= midV8Rows
}

// reduce_mid_v8_*'s block (V8_TX, V8_TY), and the rows of one split it
// takes: 256 a thread at most.
const (
	midV8TX   = 8
	midV8TY   = 32
	midV8Rows = midV8TY * 256
)

// combineSplits reduces the float32 partials [splits, nout] at part into
// out (nout values of dtype dt) with reduce_splits_*, scaling sums.
func (k *kctx) combineSplits(dt graph.DType, part, out alloc.Ptr, splits, nout int64, op opcode.Code, scale float64) error {
	return k.launch(typed(kReduceSplits, dt), [3]uint32{tileGridX(nout), 1, 1}, tileBlock, part, out, splits, nout, op, scale)
}

// maxGrad shares each reduced gradient evenly among the tied maxima; g, x,
// y and the output share one float dtype, dt.
func (k *kctx) maxGrad(dt graph.DType, a *graph.Attrs, g, x, y, out operand) error {
	if _, err := floatsOf(g, x, y, out); err != nil {
		return err
	}
	l, err := planReduce(x.shape, a.Axes)
	if err != nil {
		return err
	}
	if out.n() != x.n() || g.n() != l.nout || y.n() != l.nout {
		return graph.Errorf(graph.ErrShape, "max_grad of g %v, x %v, y %v into %v", g.shape, x.shape, y.shape, out.shape)
	}
	if x.n() == 0 {
		return nil
	}
	block := rowBlock(l.nred)
	return k.launch(typed(kMaxGrad, dt), rowGrid(l.nout, block, 1), block, g.p, x.p, y.p, out.p, l.geom, l.nout, l.nred)
}

// expand broadcasts g to out's shape (the backward of reductions).
func (k *kctx) expand(dt graph.DType, g, out operand) error {
	s, err := graph.BroadcastStrides(g.shape, out.shape)
	if err != nil {
		return err
	}
	n := out.n()
	if n == 0 {
		return nil
	}
	dims, st := mergeAxes(out.shape, s, graph.ContiguousStrides(out.shape))
	return k.gather(dt, g.p, out.p, dims, st[0])
}
