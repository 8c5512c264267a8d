package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Normalisation family (kernels/softmax.cu, layernorm.cu, batchnorm.cu):
// softmax and log_softmax, layer_norm and batch_norm, and their gradients.
// Every operand of a node (x, g, the weight, bias and running statistics,
// the output) has one float dtype; statistics stay double in workspaces.
var normKernels = family{
	graph.OpSoftmax:    {run: softmax},
	graph.OpLogSoftmax: {run: softmax},
	graph.OpLayerNorm: {run: func(k *kctx, in []operand, out operand) error {
		return k.layerNorm(k.attrs(), in[0], optional(in, 1), optional(in, 2), out)
	}},
	graph.OpBatchNorm: {run: func(k *kctx, in []operand, out operand) error {
		return k.batchNorm(k.attrs(), in, out)
	}, ws: bnWorkspace},
	graph.OpBatchNormStats: {run: func(k *kctx, in []operand, out operand) error { return k.batchNormMoments(in[0], out) }, ws: bnWorkspace},

	graph.OpSoftmaxGrad:    {run: typedGradOf(softmaxGrad)},
	graph.OpLogSoftmaxGrad: {run: typedGradOf(softmaxGrad)},
	graph.OpLayerNormGradX: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.layerNormGradX(dt, k.attrs(), g, in[1], optional(in, 2), out)
	})},
	graph.OpLayerNormGradW: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.layerNormGradW(dt, k.nd, g, in[1], out)
	}), ws: lnGradWWorkspace},
	graph.OpBatchNormGradX: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.batchNormGradX(dt, k.attrs(), g, in[1], optional(in, 2), out)
	}), ws: bnWorkspace},
	graph.OpBatchNormGradW: {run: typedGradOf(func(k *kctx, dt graph.DType, _ operand, in []operand, out operand) error {
		return k.batchNormGradW(dt, k.attrs(), in, out)
	}), ws: bnWorkspace},
}

func softmax(k *kctx, in []operand, out operand) error {
	x, axis := in[0], k.attrs().Axis
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	if axis < 0 || axis >= len(x.shape) {
		return graph.Errorf(graph.ErrAttr, "softmax axis %d out of range for rank %d", axis, len(x.shape))
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "softmax: input %v, output %v", x.shape, out.shape)
	}
	return k.softmaxLaunch(typed(kSoftmaxRows, dt), typed(kSoftmaxCols, dt), k.nd.Op == graph.OpLogSoftmax, x.shape, axis, x.p, out.p)
}

func softmaxGrad(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
	y, axis := in[1], k.attrs().Axis
	if _, err := floatsOf(g, y, out); err != nil {
		return err
	}
	if err := sameN(k.nd.Op, out, g, y); err != nil {
		return err
	}
	if axis < 0 || axis >= len(y.shape) {
		return graph.Errorf(graph.ErrAttr, "softmax axis %d out of range for rank %d", axis, len(y.shape))
	}
	return k.softmaxLaunch(typed(kSoftmaxGradRows, dt), typed(kSoftmaxGradCols, dt), k.nd.Op == graph.OpLogSoftmaxGrad, y.shape, axis, g.p, y.p, out.p)
}

// softmaxLaunch views shape as [outer, n, inner] around axis: the rows
// kernel when inner = 1, the columns kernel otherwise; ptrs are the
// kernel's buffers in order.
func (k *kctx) softmaxLaunch(rows, cols string, log bool, shape []int, axis int, ptrs ...alloc.Ptr) error {
	o, n, in := axisSplit(shape, axis)
	outer, nn, inner := int64(o), int64(n), int64(in)
	if outer*nn*inner == 0 {
		return nil
	}
	args := make([]any, 0, len(ptrs)+4)
	for _, p := range ptrs {
		args = append(args, p)
	}
	if inner == 1 {
		block := rowBlock(nn)
		return k.launch(rows, rowGrid(outer, block, 1), block, append(args, outer, nn, boolInt(log))...)
	}
	return k.flat(cols, outer*inner, append(args, outer, nn, inner, boolInt(log))...)
}

// normGeometry views x as [rows, d] over its trailing NormDims axes and
// checks the optional [d]-sized parameters, of x's dtype.
func normGeometry(a *graph.Attrs, x operand, params ...*operand) (rows, d int64, err error) {
	if a.NormDims < 1 || a.NormDims > len(x.shape) {
		return 0, 0, graph.Errorf(graph.ErrAttr, "layer_norm over %d trailing dims of a rank-%d input", a.NormDims, len(x.shape))
	}
	rows, d = normRows(x.shape, a.NormDims)
	for _, p := range params {
		if p == nil {
			continue
		}
		if _, err := floatsOf(x, *p); err != nil {
			return 0, 0, err
		}
		if p.n() != d {
			return 0, 0, graph.Errorf(graph.ErrShape, "layer_norm parameter %v does not match normalised dims %v", p.shape, x.shape[len(x.shape)-a.NormDims:])
		}
	}
	return rows, d, nil
}

// normRows views x as [rows, d] with d the product of its trailing k dims.
func normRows(x []int, k int) (rows, d int64) {
	if k < 1 || k > len(x) {
		return 0, 0
	}
	d = int64(graph.Numel(x[len(x)-k:]))
	if d > 0 {
		rows = int64(graph.Numel(x)) / d
	}
	return rows, d
}

// A 16-bit out from float32 x, w and b (graph.OpLayerNorm's Attrs.Target)
// runs layer_norm_f32_bf16 or _f16: layer_norm_f32 storing 16-bit values,
// each rounded once, as a cast of layer_norm_f32's result would round it.
func (k *kctx) layerNorm(a *graph.Attrs, x operand, w, b *operand, out operand) error {
	dt, err := floatsOf(x)
	if err != nil {
		return err
	}
	name := typed(kLayerNorm, dt)
	if out.dt != dt {
		if dt != graph.Float32 || !out.dt.IsHalf() {
			return graph.Errorf(graph.ErrDType, "layer_norm of %s into %s (its dtype, or 16-bit from float32)", dt, floatName(out.dt))
		}
		name = typed(kLayerNorm, dt, out.dt)
	}
	rows, d, err := normGeometry(a, x, w, b)
	if err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "layer_norm: input %v, output %v", x.shape, out.shape)
	}
	if rows == 0 || d == 0 {
		return nil
	}
	block := rowBlock(d)
	return k.launch(name, rowGrid(rows, block, 1), block, x.p, ptrOf(w), ptrOf(b), out.p, rows, d, a.Eps)
}

func (k *kctx) layerNormGradX(dt graph.DType, a *graph.Attrs, g, x operand, w *operand, out operand) error {
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	rows, d, err := normGeometry(a, x, w)
	if err != nil {
		return err
	}
	if g.n() != x.n() || out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "layer_norm_grad_x: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	if rows == 0 || d == 0 {
		return nil
	}
	block := rowBlock(d)
	return k.launch(typed(kLayerNormGradX, dt), rowGrid(rows, block, 1), block, g.p, x.p, ptrOf(w), out.p, rows, d, a.Eps)
}

// statsBytes is the workspace of n (mean, rstd) pairs in double.
func statsBytes(n int64) int64 { return 16 * n }

// lnSplitRows is the rows each split of layer_norm_grad_w covers, at least.
const lnSplitRows = 1 << 7

// lnGradWBytes is layer_norm_grad_w's workspace for rows rows of d elements
// in splits splits: the per-row statistics (double), then the splits'
// partial sums (float32, whatever the node's dtype).
func lnGradWBytes(rows, d, splits int64) int64 {
	if splits > 1 {
		return statsBytes(rows) + splitBytes(splits, d)
	}
	return statsBytes(rows)
}

// lnGradWWorkspace: room for the most splits when the node may split.
func lnGradWWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	rows, d := normRows(inputAt(g, nd, 1, b), nd.Attrs.NormDims)
	splits := int64(1)
	if lnSplittable(g, nd) {
		splits = maxSplits
	}
	return lnGradWBytes(rows, d, splits)
}

// lnSplittable reports whether layer_norm_grad_w may split its column
// reduction: many rows at the full batch.
func lnSplittable(g *graph.Graph, nd *graph.Node) bool {
	rows, _ := normRows(g.Node(nd.Inputs[1]).Type.Shape, nd.Attrs.NormDims)
	return rows >= 2*lnSplitRows
}

// layerNormGradW is Σ over rows of g·x̂: per-row statistics into the
// workspace, then a column reduction, split over rows when the node may
// split (lnSplittable) and the chunk has many rows.
func (k *kctx) layerNormGradW(dt graph.DType, nd *graph.Node, g, x, out operand) error {
	a := &nd.Attrs
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	rows, d, err := normGeometry(a, x)
	if err != nil {
		return err
	}
	if g.n() != x.n() || out.n() != d {
		return graph.Errorf(graph.ErrShape, "layer_norm_grad_w: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	if d == 0 {
		return nil
	}
	splits := int64(1)
	if lnSplittable(k.g, nd) {
		splits = splitsFor(rows, lnSplitRows)
	}
	w, err := k.workspace(lnGradWBytes(rows, d, splits))
	if err != nil {
		return err
	}
	stats := w
	var part alloc.Ptr // the splits' partials; none when unsplit
	if rows > 0 {
		block := rowBlock(d)
		if err := k.launch(typed(kLayerNormStats, dt), rowGrid(rows, block, 1), block, x.p, stats, rows, d, a.Eps); err != nil {
			return err
		}
	}
	if splits > 1 {
		part = w + alloc.Ptr(statsBytes(rows))
	}
	grid := [3]uint32{tileGridX(d), uint32(splits), 1}
	if err := k.launch(typed(kLayerNormGradW, dt), grid, tileBlock, g.p, x.p, stats, out.p, part, rows, d); err != nil || splits == 1 {
		return err
	}
	return k.combineSplits(dt, part, out.p, splits, d, rSum, 1)
}

// channels views x [N, C, ...] as [n, c, inner].
func channels(op string, x operand) (n, c, inner int64, err error) {
	if len(x.shape) < 2 {
		return 0, 0, 0, graph.Errorf(graph.ErrShape, "%s needs [N, C, ...], got %v", op, x.shape)
	}
	return int64(x.shape[0]), int64(x.shape[1]), int64(graph.Numel(x.shape[2:])), nil
}
