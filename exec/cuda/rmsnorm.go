package cuda

import (
	"math"
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// RMS norm family (kernels/rmsnorm.cu): rms_norm, the residual add it
// pairs with (graph.AddRMSNormProducer, run from the add's entry), and its
// gradients, all from one backward kernel. Every operand of a node has one
// float dtype but a 16-bit output of float32 x (Attrs.Target); the
// arithmetic is float32.
//
// The backward pass is one kernel, rms_norm_grad_*: dx (rms_norm_grad_x),
// dx plus the residual stream's gradient (rms_norm_grad_x_add), the
// weight gradient's partials per row group (rms_norm_grad_w, its
// companion: graph.RMSNormGradWProducer) and the 16-bit cast of the
// result (graph.LayerNormGradCastProducer), in one read of g and x; then
// layer_norm_grad_wb_* adds the partials. Run alone, rms_norm_grad_w is
// the same kernel writing no dx.
var rmsNormKernels = family{
	graph.OpRMSNorm: {run: func(k *kctx, in []operand, out operand) error {
		return k.rmsNorm(k.attrs(), in[0], optional(in, 1), out)
	}},
	graph.OpRMSNormGradX: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.rmsNormGradX(dt, k.attrs(), g, in[1], optional(in, 2), nil, out)
	}), ws: rmsGradXWorkspace},
	graph.OpRMSNormGradXAdd: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.rmsNormGradX(dt, k.attrs(), g, in[1], optional(in, 3), &in[2], out)
	}), ws: rmsGradXWorkspace},
	graph.OpRMSNormGradW: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.rmsNormGradW(dt, k.attrs(), g, in[1], out)
	}), ws: rmsGradWWorkspace},
}

const (
	rmsVPacks    = 8    // RMS_VPACKS: packs of 8 a forward thread keeps
	rmsMaxGroups = 1024 // bounds the backward pass's partials
	rmsRows      = 8    // rows each backward row group takes, at least
)

// rmsVec reports whether the vector paths take rows of d values with
// these arrays: d a multiple of 8, every array 16-byte aligned (null ones
// pass), and d within what the forward (fwd) or backward threads of a
// 1024-thread row group hold.
func rmsVec(d int64, fwd bool, ptrs ...alloc.Ptr) bool {
	limit := int64(8 * 1024)
	if fwd {
		limit *= rmsVPacks
	}
	if d%8 != 0 || d > limit {
		return false
	}
	for _, p := range ptrs {
		if p%16 != 0 {
			return false
		}
	}
	return true
}

// rmsFwdBlock is the forward kernels' block for rows of d values: on the
// vector path the fewest 32-thread columns whose threads hold a row in
// rmsVPacks packs each, rows stacked to 256 threads; else rowBlock's.
func rmsFwdBlock(d int64, vec bool) [3]uint32 {
	if !vec {
		return rowBlock(d)
	}
	bx := max(ceilDiv(ceilDiv(d/8, rmsVPacks), 32)*32, 32)
	return [3]uint32{uint32(bx), uint32(max(256/bx, 1)), 1}
}

// rmsBwdBlock is the backward kernel's block for rows of d values, on
// either path: one pack of 8 a thread (bx = d/8 rounded up to 32, at most
// 1024), rows stacked to 256 threads.
func rmsBwdBlock(d int64) [3]uint32 {
	bx := min(max(ceilDiv(ceilDiv(d, 8), 32)*32, 32), 1024)
	return [3]uint32{uint32(bx), uint32(max(256/bx, 1)), 1}
}

// rmsGroups is the backward kernel's grid and its row groups for rows
// rows of d values on a device holding resident blocks of it at once: one
// wave, at most rmsMaxGroups groups of at least rmsRows rows each.
func rmsGroups(rows, d, resident int64) (grid, groups int64) {
	by := int64(rmsBwdBlock(d)[1])
	grid = max(min(ceilDiv(rows, by*rmsRows), rmsMaxGroups/by, resident), 1)
	return grid, grid * by
}

// rmsPartBytes is the backward kernel's workspace: the float partials of
// Σ g·x̂ of each row group.
func rmsPartBytes(groups, d int64) int64 { return splitBytes(groups, d) }

// rmsGradWWorkspace: rms_norm_grad_w's partials for the most groups its
// full batch may run in (a chunk's, or a device's holding fewer blocks,
// are no more).
func rmsGradWWorkspace(g *graph.Graph, nd *graph.Node, _ int) int64 {
	if len(nd.Inputs) < 2 {
		return 0
	}
	rows, d := normRows(g.Node(nd.Inputs[1]).Type.Shape, nd.Attrs.NormDims)
	if rows == 0 || d == 0 {
		return 0
	}
	_, groups := rmsGroups(rows, d, math.MaxInt64)
	return rmsPartBytes(groups, d)
}

// rmsGradXWorkspace: an rms_norm_grad_x (or _add) that has an
// rms_norm_grad_w companion takes its partials; else nothing.
func rmsGradXWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	if len(nd.Inputs) < 2 || !rmsHasCompanion(g, nd) {
		return 0
	}
	return rmsGradWWorkspace(g, nd, b)
}

// rmsHasCompanion reports whether rms_norm_grad_x node nd is the producer
// of an rms_norm_grad_w in g. Candidates read nd's g, so only the later
// nodes that do are checked.
func rmsHasCompanion(g *graph.Graph, nd *graph.Node) bool {
	for m := nd.ID + 1; m < g.Len(); m++ {
		n := g.Node(m)
		if n.Op == graph.OpRMSNormGradW && n.Inputs[0] == nd.Inputs[0] && graph.RMSNormGradWProducer(g, m) == nd.ID {
			return true
		}
	}
	return false
}

// rmsNorm runs rms_norm: y of x's dtype, or 16 bits from float32 x
// (graph.OpRMSNorm's Attrs.Target), w of x's dtype or absent.
func (k *kctx) rmsNorm(a *graph.Attrs, x operand, w *operand, out operand) error {
	dt, err := floatsOf(x)
	if err != nil {
		return err
	}
	name := typed(kRMSNorm, dt)
	if out.dt != dt {
		if dt != graph.Float32 || !out.dt.IsHalf() {
			return graph.Errorf(graph.ErrDType, "rms_norm of %s into %s (its dtype, or 16-bit from float32)", dt, floatName(out.dt))
		}
		name = typed(kRMSNorm, dt, out.dt)
	}
	rows, d, err := normGeometry(a, x, w)
	if err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "rms_norm: input %v, output %v", x.shape, out.shape)
	}
	if rows == 0 || d == 0 {
		return nil
	}
	vec := rmsVec(d, true, x.p, ptrOf(w), out.p)
	block := rmsFwdBlock(d, vec)
	return k.launch(name, rowGrid(rows, block, 1), block, x.p, ptrOf(w), out.p, rows, d, float32(a.Eps), boolInt(vec))
}

// addRMSNormKernels lists add_rms_norm_<b>_<y>'s instantiations: b and y
// of every float dtype.
func addRMSNormKernels() []string {
	var out []string
	for _, b := range floatDTypes {
		for _, y := range floatDTypes {
			out = append(out, typed(kAddRMSNorm, b, y))
		}
	}
	return out
}

// addRMSNorm runs an add whose companion is the rms_norm of its result
// (graph.AddRMSNormProducer) as one add_rms_norm pass, and reports whether
// it did: the add's output s and the norm's y from one read of a and b. A
// float32 a of s's shape and a float b broadcast over whole rows, the
// norm's weight float32 [d] or absent; anything else leaves the add and
// the norm to their own kernels. BATCHFIT_ADD_LAYER_NORM=0 turns it off
// as it does add_layer_norm.
func (k *kctx) addRMSNorm(a, b, s operand) (bool, error) {
	rn, a, b, rows, d, ok := k.addNormOperands(graph.OpRMSNorm, a, b, s)
	if !ok {
		return false, nil
	}
	at := &rn.nd.Attrs
	w := optional(rn.in, 1)
	if w != nil && (w.dt != graph.Float32 || w.n() != d) {
		return false, nil
	}
	vec := rmsVec(d, true, a.p, b.p, ptrOf(w), s.p, rn.v.p)
	block := rmsFwdBlock(d, vec)
	err := k.launch(typed(kAddRMSNorm, b.dt, rn.v.dt), rowGrid(rows, block, 1), block,
		a.p, b.p, b.n()/d, ptrOf(w), s.p, rn.v.p, rows, d, float32(at.Eps), boolInt(vec))
	if err == nil {
		*rn.done = true
		addRMSNorms.Add(1)
	}
	return err == nil, err
}

// addRMSNorms counts the adds that normalised their result too;
// fusedRMSNorms the rms_norm_grad_x launches that gave their weight's
// gradient too (tests read both).
var addRMSNorms, fusedRMSNorms atomic.Int64

// rmsNormGradX is rms_norm_grad_x, or rms_norm_grad_x_add with res (the
// gradient added) non-nil: one rms_norm_grad_* pass, which also gives the
// rms_norm_grad_w companion when one was handed over with its workspace
// planned, and the 16-bit cast companion of a float32 result.
func (k *kctx) rmsNormGradX(dt graph.DType, a *graph.Attrs, g, x operand, w, res *operand, out operand) error {
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
	dw, dwDone := k.companionOf(graph.OpRMSNormGradW)
	if dw != nil && (dw.dt != dt || dw.n() != d) {
		dw = nil
	}
	narrow, narrowDone := k.companionOf(graph.OpCast) // graph.LayerNormGradCastProducer
	var bf, hf alloc.Ptr
	if narrow != nil && dt == graph.Float32 && narrow.n() == out.n() {
		switch narrow.dt {
		case graph.BFloat16:
			bf = narrow.p
		case graph.Float16:
			hf = narrow.p
		}
	}
	var part alloc.Ptr
	grid, groups, err := k.rmsGrid(dt, rows, d)
	if err != nil {
		return err
	}
	if dw != nil && k.ws != nil && k.ws.Requested() >= rmsPartBytes(groups, d) {
		part = k.ws.Ptr()
	}
	if err := k.rmsGrad(dt, grid, g, x, w, &out, part, rows, d, a.Eps, res, bf, hf); err != nil {
		return err
	}
	if bf != 0 || hf != 0 {
		*narrowDone = true
	}
	if part == 0 {
		return nil
	}
	if err := k.rmsWeightSum(dt, part, dw.p, groups, d); err != nil {
		return err
	}
	*dwDone = true
	fusedRMSNorms.Add(1)
	return nil
}

// rmsNormGradW runs rms_norm_grad_w where no rms_norm_grad_x gave it: the
// backward kernel writing the partials only, then their sum.
func (k *kctx) rmsNormGradW(dt graph.DType, a *graph.Attrs, g, x, out operand) error {
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	rows, d, err := normGeometry(a, x)
	if err != nil {
		return err
	}
	if g.n() != x.n() || out.n() != d {
		return graph.Errorf(graph.ErrShape, "rms_norm_grad_w: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	if d == 0 {
		return nil
	}
	if rows == 0 {
		return k.d.memset(out.p, 0, out.n()*int64(dt.Size()))
	}
	grid, groups, err := k.rmsGrid(dt, rows, d)
	if err != nil {
		return err
	}
	part, err := k.workspace(rmsPartBytes(groups, d))
	if err != nil {
		return err
	}
	if err := k.rmsGrad(dt, grid, g, x, nil, nil, part, rows, d, a.Eps, nil, 0, 0); err != nil {
		return err
	}
	return k.rmsWeightSum(dt, part, out.p, groups, d)
}

// rmsGrid is the backward kernel's grid and row groups on this device.
func (k *kctx) rmsGrid(dt graph.DType, rows, d int64) (grid, groups int64, err error) {
	block := rmsBwdBlock(d)
	resident, err := k.ks.residentBlocks(k.d, typed(kRMSNormGrad, dt), int(block[0]*block[1]))
	if err != nil {
		return 0, 0, err
	}
	grid, groups = rmsGroups(rows, d, resident)
	return grid, groups, nil
}

// rmsGrad launches rms_norm_grad_*; out, w, res and part may be absent.
func (k *kctx) rmsGrad(dt graph.DType, grid int64, g, x operand, w, out *operand, part alloc.Ptr, rows, d int64, eps float64,
	res *operand, bf, hf alloc.Ptr) error {
	vec := rmsVec(d, false, g.p, x.p, ptrOf(w), ptrOf(out), part, ptrOf(res), bf, hf)
	return k.launch(typed(kRMSNormGrad, dt), [3]uint32{uint32(grid), 1, 1}, rmsBwdBlock(d),
		g.p, x.p, ptrOf(w), ptrOf(out), part, rows, d, float32(eps), ptrOf(res), bf, hf, boolInt(vec))
}

// rmsWeightSum adds the groups' partials into dw (layer_norm_grad_wb_*,
// no bias gradient).
func (k *kctx) rmsWeightSum(dt graph.DType, part, dw alloc.Ptr, groups, d int64) error {
	return k.launch(typed(kLayerNormGradWB, dt), [3]uint32{tileGridX(d), 1, 1}, [3]uint32{32, 32, 1},
		part, dw, alloc.Ptr(0), groups, d)
}
