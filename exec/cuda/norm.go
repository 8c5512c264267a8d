package cuda

import (
	"math"
	"os"
	"slices"
	"sync"
	"sync/atomic"

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
		return k.layerNormGradX(dt, k.attrs(), g, in[1], optional(in, 2), nil, out)
	}), ws: lnFusedWorkspace},
	graph.OpLayerNormGradXAdd: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.layerNormGradX(dt, k.attrs(), g, in[1], optional(in, 3), &in[2], out)
	}), ws: lnFusedWorkspace},
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

// layerNormGradX is layer_norm_grad_x, or layer_norm_grad_x_add with res
// (the gradient added) non-nil.
func (k *kctx) layerNormGradX(dt graph.DType, a *graph.Attrs, g, x operand, w, res *operand, out operand) error {
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	rows, d, err := normGeometry(a, x, w)
	if err != nil {
		return err
	}
	if g.n() != x.n() || out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "%s: g %v, x %v, output %v", k.nd.Op, g.shape, x.shape, out.shape)
	}
	if res != nil && (res.dt != out.dt || res.n() != out.n()) {
		return graph.Errorf(graph.ErrShape, "%s: added gradient %s%v, output %s%v", k.nd.Op, res.dt, res.shape, out.dt, out.shape)
	}
	if rows == 0 || d == 0 {
		return nil
	}
	if done, err := k.layerNormGradFused(dt, a, g, x, w, res, out, rows, d); done || err != nil {
		return err
	}
	block := rowBlock(d)
	if err := k.launch(typed(kLayerNormGradX, dt), rowGrid(rows, block, 1), block, g.p, x.p, ptrOf(w), out.p, rows, d, a.Eps); err != nil {
		return err
	}
	if res == nil {
		return nil
	}
	// The unfused pass's sum, as the add it replaces: out + res, in place.
	return binary(binaryCodes.Code(graph.OpAdd, "")).run(k, []operand{out, *res}, out)
}

// The fused backward pass of layer_norm (kernels/layernorm.cu,
// layer_norm_grad_fused_*): layer_norm_grad_x computes its companions,
// layer_norm_grad_w (graph.LayerNormGradWProducer) and the bias gradient
// (graph.LayerNormBiasGradProducer, a sum of g over the leading axes), from
// the one read of g and x that dx needs, instead of three more passes over
// them (statistics, Σ g·x̂, Σ g). Each row group leaves the float partials
// of both sums in the workspace, and layer_norm_grad_wb_* adds them up.
// The grid is what the device holds at once (one wave: a group's rows are
// a sequence, so a second wave would double the time), at most
// lnFusedMaxGroups groups of at least lnFusedRows rows each.
const (
	lnFusedVPT       = 8    // row elements a thread keeps (LN_FUSED_VPT)
	lnFusedMaxD      = 2048 // the longest row (LN_FUSED_MAXD)
	lnFusedMaxGroups = 1024 // bounds the partials
	lnFusedRows      = 8    // rows each row group takes, at least
)

// lnFusedBlock is the fused pass's block for rows of d elements: the
// fewest 32-thread columns that hold a row in lnFusedVPT values each, and
// rows stacked up to 128 threads. d must fit (lnFusedFits).
func lnFusedBlock(d int64) [3]uint32 {
	bx := max(ceilDiv(ceilDiv(d, lnFusedVPT), 32)*32, 32)
	return [3]uint32{uint32(bx), uint32(max(128/bx, 1)), 1}
}

// lnFusedFits reports whether rows of d elements fit the fused pass.
func lnFusedFits(d int64) bool { return d > 0 && d <= lnFusedMaxD }

// lnFusedGroups is the fused pass's grid and its row groups, one partial
// row each, for rows rows of d elements when the device holds resident
// blocks of it at once.
func lnFusedGroups(rows, d, resident int64) (grid, groups int64) {
	by := int64(lnFusedBlock(d)[1])
	grid = max(min(ceilDiv(rows, by*lnFusedRows), lnFusedMaxGroups/by, resident), 1)
	return grid, grid * by
}

// lnFusedBytes is the fused pass's workspace: the float partials of Σ g·x̂
// and Σ g of each row group.
func lnFusedBytes(groups, d int64) int64 { return 2 * splitBytes(groups, d) }

// lnFusedWorkspace: a layer_norm_grad_x that has a companion and rows that
// fit takes the partials of the most groups its full batch may run in (a
// chunk's, or a device's holding fewer blocks, are no more), else nothing.
func lnFusedWorkspace(g *graph.Graph, nd *graph.Node, _ int) int64 {
	if len(nd.Inputs) < 2 {
		return 0
	}
	rows, d := normRows(g.Node(nd.Inputs[1]).Type.Shape, nd.Attrs.NormDims)
	if rows == 0 || !lnFusedFits(d) || !lnHasCompanion(g, nd) {
		return 0
	}
	_, groups := lnFusedGroups(rows, d, math.MaxInt64) // any device's
	return lnFusedBytes(groups, d)
}

// lnHasCompanion reports whether layer_norm_grad_x node nd is the
// producer of a layer_norm_grad_w or a bias gradient in g. Candidates read
// nd's g, so only the later nodes that do are checked.
func lnHasCompanion(g *graph.Graph, nd *graph.Node) bool {
	for m := nd.ID + 1; m < g.Len(); m++ {
		n := g.Node(m)
		if len(n.Inputs) == 0 || n.Inputs[0] != nd.Inputs[0] {
			continue
		}
		if n.Op == graph.OpLayerNormGradW && graph.LayerNormGradWProducer(g, m) == nd.ID ||
			n.Op == graph.OpSum && graph.LayerNormBiasGradProducer(g, m) == nd.ID {
			return true
		}
	}
	return false
}

// layerNormGradFused runs the fused pass when the node was handed a
// companion of the right size and dtype, its rows fit and the planner gave
// the workspace (lnFusedWorkspace); it reports whether it ran. Otherwise
// layer_norm_grad_x runs alone, and its companions at their own steps.
// The pass adds res (layer_norm_grad_x_add) as it writes each value, and
// writes the gradient's 16-bit cast too when that is a companion
// (graph.LayerNormGradCastProducer).
func (k *kctx) layerNormGradFused(dt graph.DType, a *graph.Attrs, g, x operand, w, res *operand, out operand, rows, d int64) (bool, error) {
	dw, dwDone := k.companionOf(graph.OpLayerNormGradW)
	db, dbDone := k.companionOf(graph.OpSum)
	narrow, narrowDone := k.companionOf(graph.OpCast) // graph.LayerNormGradCastProducer
	if dw != nil && (dw.dt != dt || dw.n() != d) {
		dw = nil
	}
	if db != nil && (db.dt != dt || db.n() != d) {
		db = nil
	}
	var bf, hf alloc.Ptr // the narrowed copy, by its dtype
	if narrow != nil && dt == graph.Float32 && narrow.n() == out.n() {
		switch narrow.dt {
		case graph.BFloat16:
			bf = narrow.p
		case graph.Float16:
			hf = narrow.p
		}
	}
	if dw == nil && db == nil || !lnFusedFits(d) {
		return false, nil
	}
	name, block := typed(kLayerNormFused, dt), lnFusedBlock(d)
	resident, err := k.ks.residentBlocks(k.d, name, int(block[0]*block[1]))
	if err != nil {
		return false, err
	}
	grid, groups := lnFusedGroups(rows, d, resident)
	bytes := lnFusedBytes(groups, d)
	if k.ws == nil || k.ws.n < bytes {
		return false, nil
	}
	part := k.ws.p
	if err := k.launch(name, [3]uint32{uint32(grid), 1, 1}, block,
		g.p, x.p, ptrOf(w), out.p, part, rows, d, a.Eps, ptrOf(res), bf, hf); err != nil {
		return true, err
	}
	if bf != 0 || hf != 0 {
		*narrowDone = true
	}
	if err := k.launch(typed(kLayerNormGradWB, dt), [3]uint32{tileGridX(d), 2, 1}, [3]uint32{32, 32, 1},
		part, ptrOf(dw), ptrOf(db), groups, d); err != nil {
		return true, err
	}
	if dw != nil {
		*dwDone = true
	}
	if db != nil {
		*dbDone = true
	}
	fusedLayerNorms.Add(1)
	return true, nil
}

// fusedLayerNorms counts layer_norm_grad_x launches that computed a
// companion too (the tests' check that the fused pass ran).
var fusedLayerNorms atomic.Int64

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

// addLayerNormKernels lists add_layer_norm_<b>_<y>'s instantiations: b and
// y of every float dtype.
func addLayerNormKernels() []string {
	var out []string
	for _, b := range floatDTypes {
		for _, y := range floatDTypes {
			out = append(out, typed(kAddLayerNorm, b, y), typed(kAddLayerNormW4, b, y))
		}
	}
	return out
}

// addLayerNorm runs an add whose companion is the layer norm of its result
// (graph.AddLayerNormProducer) as one add_layer_norm pass, and reports
// whether it did: the add's output s and the layer norm's y from one read
// of a and b. A float32 a of s's shape and a float b broadcast over whole
// rows, the layer norm's weight and bias float32 [d] or absent; anything
// else leaves the add and the layer norm to their own kernels. Rows of a
// multiple of 128 values up to 1024 (a transformer's width) run one warp a
// row (add_layer_norm_w4_*), others add_layer_norm_*'s row layout.
func (k *kctx) addLayerNorm(a, b, s operand) (bool, error) {
	ln, a, b, rows, d, ok := k.addNormOperands(graph.OpLayerNorm, a, b, s)
	if !ok {
		return false, nil
	}
	at := &ln.nd.Attrs
	w, bias := optional(ln.in, 1), optional(ln.in, 2)
	for _, p := range []*operand{w, bias} {
		if p != nil && (p.dt != graph.Float32 || p.n() != d) {
			return false, nil
		}
	}
	var err error
	if addLNWarpFits(d, a.p, b.p, ptrOf(w), ptrOf(bias), s.p, ln.v.p) {
		// One warp a row, 4 values a load (add_layer_norm_w4_*).
		grid := [3]uint32{uint32(min(ceilDiv(rows, addLNWarps), maxGridX)), 1, 1}
		err = k.launch(typed(kAddLayerNormW4, b.dt, ln.v.dt), grid, [3]uint32{32 * addLNWarps, 1, 1},
			a.p, b.p, b.n()/d, ptrOf(w), ptrOf(bias), s.p, ln.v.p, rows, d, at.Eps)
	} else {
		block := rowBlock(d)
		err = k.launch(typed(kAddLayerNorm, b.dt, ln.v.dt), rowGrid(rows, block, 1), block,
			a.p, b.p, b.n()/d, ptrOf(w), ptrOf(bias), s.p, ln.v.p, rows, d, at.Eps)
	}
	if err == nil {
		*ln.done = true
		addLayerNorms.Add(1)
	}
	return err == nil, err
}

// addNormOperands is what an add fuses with the norm of its result s,
// its companion of op (layer_norm or rms_norm): the companion, the add's
// operands as a (float32, of s's shape) and b (a float broadcast over whole
// rows), and the norm's rows and row width. ok is false when they do not
// have that form, or BATCHFIT_ADD_LAYER_NORM=0: the add and the norm then
// run their own kernels.
func (k *kctx) addNormOperands(op graph.Op, a, b, s operand) (co companion, _, _ operand, rows, d int64, ok bool) {
	co = k.companionWith(op)
	if co.v == nil || noAddLayerNorm() || len(co.in) < 1 || co.in[0].p != s.p || s.dt != graph.Float32 {
		return co, a, b, 0, 0, false
	}
	if a.dt != graph.Float32 || !slices.Equal(a.shape, s.shape) {
		a, b = b, a
	}
	rows, d = normRows(s.shape, co.nd.Attrs.NormDims)
	if a.dt != graph.Float32 || !slices.Equal(a.shape, s.shape) || !b.dt.IsFloat() || !co.v.dt.IsFloat() ||
		co.v.n() != s.n() || rows == 0 || d == 0 || b.n() == 0 || b.n()%d != 0 || rows%(b.n()/d) != 0 {
		return co, a, b, 0, 0, false
	}
	return co, a, b, rows, d, true
}

// addLNWarps is add_layer_norm_w4_*'s rows (warps) a block.
const addLNWarps = 8

// addLNWarpFits reports whether add_layer_norm_w4_* takes rows of d values
// (d a multiple of 128, at most 1024) with these arrays: 16-byte aligned
// (8 bytes would do for 16-bit ones; 16 asks the same of every array and
// the allocator's blocks give it); null ones (no weight or bias) pass.
func addLNWarpFits(d int64, ptrs ...alloc.Ptr) bool {
	if d%128 != 0 || d > 1024 {
		return false
	}
	for _, p := range ptrs {
		if p%16 != 0 {
			return false
		}
	}
	return true
}

// addLayerNorms counts the adds that normalised their result too (tests
// read it).
var addLayerNorms atomic.Int64

// noAddLayerNorm reports BATCHFIT_ADD_LAYER_NORM=0, which runs the add and
// its layer norm as two kernels again (a diagnostic switch: the fused pass
// is on by default).
var noAddLayerNorm = sync.OnceValue(func() bool { return os.Getenv("BATCHFIT_ADD_LAYER_NORM") == "0" })
