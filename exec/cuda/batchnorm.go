package cuda

import (
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Batch norm (kernels/batchnorm.cu) over x [N, C, ...] viewed as rows
// [N·C, inner]: one pass of per-row double sums spread over all rows, a
// per-channel pass that turns them into the map's coefficients, and one
// elementwise pass. x, g and the outputs share a dtype; the weight, bias
// and running statistics have it too, or are float32 beside 16-bit x
// (mixed precision). Where cuDNN's batch norm takes them (float32
// per-channel values), the forward pass and the input gradient run there
// instead (dnn_bn.go), unless ExecutorOptions.NoCuDNNBatchNorm.
// Channels-last x [N, H, W, C] (graph.Attrs.ChannelsLast) runs here on
// every executor: where C is a multiple of 16 bytes' worth of elements
// and the operands are 16-byte aligned, on the vector path (bnVecGeom:
// 16-byte loads, each thread's channels fixed, the sums in row chunks of
// the N·H·W positions); otherwise its row sums (batch_norm_rows_nhwc) fill
// the same [N·C, 4] workspace as NCHW's and the element-wise passes have
// scalar channels-last twins. The per-channel kernels serve every path.
//
// batch_norm_grad_x also gives its companions' outputs, when the planner
// made them (planner.Program.Companions): batch_norm_grad_w's Σ g·x̂
// (graph.BatchNormGradWProducer) and the bias gradient Σ g
// (graph.BatchNormBiasGradProducer), both from the sums its statistics
// pass takes anyway.

// bnWorkspace is the workspace of batch_norm, its gradients and
// batch_norm_stats: the partial sums [rows, C, 4] (double), then three
// doubles of coefficients per channel, and cuDNN's ones and zeros
// (dnnBNBytes). rows is N (NCHW row sums), or for channels-last x that may
// take the vector path its row chunks' bound (bnVecGeom.rowsBound, at
// least N). Affine in the chunk: both are.
func bnWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	i := 1
	if nd.Op == graph.OpBatchNorm || nd.Op == graph.OpBatchNormStats {
		i = 0
	}
	x := inputAt(g, nd, i, b)
	if nd.Attrs.ChannelsLast && len(x) == 4 {
		n, hw, c := int64(x[0]), int64(x[1])*int64(x[2]), int64(x[3])
		rows := n
		if q, ok := bnVecGeometry(g.Node(nd.Inputs[i]).Type.DType, c); ok {
			rows = q.rowsBound(n, hw)
		}
		return bnRowsBytes(rows*c) + bnCoefBytes(c) + dnnBNBytes(c)
	}
	x = nchwShape(&nd.Attrs, x)
	if len(x) < 2 {
		return 0
	}
	return bnRowsBytes(int64(x[0])*int64(x[1])) + bnCoefBytes(int64(x[1])) + dnnBNBytes(int64(x[1]))
}

// bnRowsBytes is the partial sums of sums (rows × channels) entries;
// bnCoefBytes the coefficients of c channels, 256-aligned so that what
// follows them is too.
func bnRowsBytes(sums int64) int64 { return 32 * sums }
func bnCoefBytes(c int64) int64    { return align256(24 * c) }

// bnLayout is a batch norm's workspace: the partial sums at 0, the
// coefficients after them.
type bnLayout struct {
	part, coef alloc.Ptr
}

func (k *kctx) bnLayout(sums, c int64) (bnLayout, error) {
	ws, err := k.workspace(bnRowsBytes(sums) + bnCoefBytes(c))
	if err != nil {
		return bnLayout{}, err
	}
	return bnLayout{part: ws, coef: ws + alloc.Ptr(bnRowsBytes(sums))}, nil
}

// The channels-last vector path's launch rules (kernels/batchnorm.cu,
// BN_VEC_*).
const (
	bnVecBlock  = 256 // threads a block (BN_VEC_BLOCK)
	bnVecUnroll = 4   // positions a thread maps a pass (BN_VEC_UNROLL)
	// bnVecPPT is the most positions a thread sums into one row chunk:
	// the float32 sums' bound (the kernels' accuracy note).
	bnVecPPT = 32
	// bnVecBlocks is how many blocks the sums aim for, four an SM of an
	// H100, before a thread takes more than one position: small batches
	// fill the device too.
	bnVecBlocks = 528
)

// bnVecGeom is the vector path's geometry for c channels: v elements a
// 16-byte vector, groups = c/v channel groups (one a thread), blocks of bx
// groups (a power of two ≤ 32, the smallest covering groups up to 32) by
// by = bnVecBlock/bx positions, tiles blocks across the channels.
type bnVecGeom struct {
	v, groups, bx, by, tiles int64
}

// bnVecGeometry is the vector path's geometry for c channels of dt, ok
// false where it does not apply (c not a multiple of 16 bytes' worth).
func bnVecGeometry(dt graph.DType, c int64) (q bnVecGeom, ok bool) {
	if !dt.IsFloat() || c <= 0 {
		return q, false
	}
	v := int64(16 / dt.Size())
	if c%v != 0 {
		return q, false
	}
	groups := c / v
	bx := int64(1)
	for bx < groups && bx < 32 {
		bx *= 2
	}
	tiles := ceilDiv(groups, bx)
	if tiles > maxGridYZ {
		return q, false
	}
	return bnVecGeom{v: v, groups: groups, bx: bx, by: bnVecBlock / bx, tiles: tiles}, true
}

// ppt is how many positions a thread sums into a row chunk for p
// positions: enough chunks for bnVecBlocks blocks, at most bnVecPPT.
func (q bnVecGeom) ppt(p int64) int64 {
	return min(max(ceilDiv(p*q.tiles, q.by*bnVecBlocks), 1), bnVecPPT)
}

// rows is the row chunks of p positions: the partial sums' rows.
func (q bnVecGeom) rows(p int64) int64 { return ceilDiv(p, q.by*q.ppt(p)) }

// rowsBound bounds rows(n·hw) by an affine function of n, at least n (the
// scalar path's rows, its fallback): below bnVecPPT positions a thread,
// rows ≤ ⌈bnVecBlocks/tiles⌉ (ppt ≥ p·tiles/(by·bnVecBlocks)); at it,
// rows = ⌈n·hw/(by·bnVecPPT)⌉ ≤ n·⌈hw/(by·bnVecPPT)⌉.
func (q bnVecGeom) rowsBound(n, hw int64) int64 {
	return ceilDiv(bnVecBlocks, q.tiles) + n*max(ceilDiv(hw, q.by*bnVecPPT), 1)
}

// bnPass is how a batch norm's kernels cover x: n images of c channels of
// inner values each, channels last or not, on the vector path or not;
// rows is the partial sums' rows that the per-channel kernels add up.
type bnPass struct {
	dt          graph.DType
	nhwc, vec   bool
	q           bnVecGeom
	n, c, inner int64
	rows        int64
}

// bnPassOf is the pass over x (channels last when nhwc) whose element
// kernels read and write ops: the vector path where the geometry applies
// and every operand is 16-byte aligned.
func bnPassOf(dt graph.DType, nhwc bool, n, c, inner int64, ops ...operand) bnPass {
	ps := bnPass{dt: dt, nhwc: nhwc, n: n, c: c, inner: inner, rows: n}
	if !nhwc {
		return ps
	}
	q, ok := bnVecGeometry(dt, c)
	if !ok {
		return ps
	}
	for _, o := range ops {
		if o.p%16 != 0 {
			return ps
		}
	}
	ps.vec, ps.q, ps.rows = true, q, q.rows(n*inner)
	return ps
}

// m is the values per channel.
func (ps bnPass) m() int64 { return ps.n * ps.inner }

// layout is the pass's workspace.
func (ps bnPass) layout(k *kctx) (bnLayout, error) { return k.bnLayout(ps.rows*ps.c, ps.c) }

// bnVecPasses counts the vector path's statistics and map launches (the
// tests' check that it ran); bnBiasGrads counts batch_norm_grad_x passes
// that gave their companion bias gradient.
var bnVecPasses, bnBiasGrads atomic.Int64

// bnDTypeCode is the kernels' run-time dtype code of a per-channel array.
func bnDTypeCode(dt graph.DType) int64 {
	switch dt {
	case graph.BFloat16:
		return 1
	case graph.Float16:
		return 2
	}
	return 0
}

// bnParams checks the per-channel operands of a batch norm over x (nil
// ones absent): [c] each, of x's dtype or float32 beside 16-bit x, one
// dtype for all. It returns their dtype code.
func bnParams(op string, x operand, c int64, ps ...*operand) (int64, error) {
	pdt := graph.InvalidDType
	for _, p := range ps {
		if p == nil {
			continue
		}
		if p.n() != c || len(p.shape) != 1 {
			return 0, graph.Errorf(graph.ErrShape, "%s per-channel input %v, want [%d]", op, p.shape, c)
		}
		if p.dt != x.dt && !(x.dt.IsHalf() && p.dt == graph.Float32) || pdt != graph.InvalidDType && p.dt != pdt {
			return 0, graph.Errorf(graph.ErrDType, "%s of %s x with %s per-channel inputs (want %s, or float32 for 16-bit x, one dtype for all)", op, x.dt, p.dt, x.dt)
		}
		pdt = p.dt
	}
	return bnDTypeCode(pdt), nil
}

// bnRows launches batch_norm_rows: the row sums of x (and g, when not nil)
// into part.
func (k *kctx) bnRows(dt graph.DType, x operand, g *operand, part alloc.Ptr, rows, inner int64) error {
	block := rowBlock(inner)
	return k.launch(typed(kBatchNormRows, dt), rowGrid(rows, block, 1), block, x.p, ptrOf(g), part, rows, inner)
}

// bnSums fills part with the partial sums of x (and g) that the pass's
// per-channel kernels add up: bnRows over NCHW data, the vector path's row
// chunks, or batch_norm_rows_nhwc over channels-last data [n, inner, c].
func (k *kctx) bnSums(ps bnPass, x operand, g *operand, part alloc.Ptr) error {
	n, c, inner := ps.n, ps.c, ps.inner
	switch {
	case ps.rows == 0 || c == 0:
		return nil // no sums (the scalar kernels write zeros for empty rows)
	case ps.vec:
		p := ps.m()
		bnVecPasses.Add(1)
		grid := [3]uint32{uint32(min(ps.rows, maxGridX)), uint32(ps.q.tiles), 1}
		return k.launch(typed(kBatchNormRowsNHWCVec, ps.dt), grid, ps.q.block(), x.p, ptrOf(g), part, p, c, ps.q.ppt(p))
	case ps.nhwc:
		grid := [3]uint32{uint32(min(ceilDiv(c, 32), maxGridX)), uint32(min(n, maxGridYZ)), 1}
		return k.launch(typed(kBatchNormRowsNHWC, ps.dt), grid, [3]uint32{32, 16, 1}, x.p, ptrOf(g), part, n, inner, c)
	}
	return k.bnRows(ps.dt, x, g, part, n*c, inner)
}

// block is the vector path's block.
func (q bnVecGeom) block() [3]uint32 { return [3]uint32{uint32(q.bx), uint32(q.by), 1} }

// bnMap launches the pass's element-wise kernel: vec (over the positions,
// args then P and c), the scalar channels-last one (flat, args then the
// element count and c) or the NCHW one (bnElems, args then rows, c and
// inner).
func (k *kctx) bnMap(ps bnPass, vec, nhwc, nchw string, args ...any) error {
	n, c, inner := ps.n, ps.c, ps.inner
	switch {
	case n*c*inner == 0:
		return nil
	case ps.vec:
		p := ps.m()
		bnVecPasses.Add(1)
		grid := [3]uint32{uint32(min(ceilDiv(p, ps.q.by*bnVecUnroll), maxGridX)), uint32(ps.q.tiles), 1}
		return k.launch(typed(vec, ps.dt), grid, ps.q.block(), append(args, p, c)...)
	case ps.nhwc:
		return k.flat(typed(nhwc, ps.dt), n*c*inner, append(args, n*c*inner, c)...)
	}
	return k.bnElems(typed(nchw, ps.dt), n*c, inner, append(args, n*c, c, inner)...)
}

// perChannel launches a per-channel kernel (batch_norm_coef,
// batch_norm_grad_coef, batch_norm_moments): one warp a channel, eight a
// block.
func (k *kctx) perChannel(name string, c int64, args ...any) error {
	if c <= 0 {
		return nil
	}
	return k.launch(name, [3]uint32{uint32(min(ceilDiv(c, 8), maxGridX)), 1, 1}, [3]uint32{32, 8, 1}, args...)
}

// bnElems launches an elementwise batch norm kernel over rows of inner
// elements: grid.y over the rows, grid.x over a row.
func (k *kctx) bnElems(name string, rows, inner int64, args ...any) error {
	if rows == 0 || inner == 0 {
		return nil
	}
	bx := int64(256)
	for bx > 32 && bx/2 >= inner {
		bx /= 2
	}
	grid := [3]uint32{uint32(min(ceilDiv(inner, bx), maxGridX)), uint32(min(rows, maxGridYZ)), 1}
	return k.launch(name, grid, [3]uint32{uint32(bx), 1, 1}, args...)
}

func (k *kctx) batchNorm(a *graph.Attrs, in []operand, out operand) error {
	if done, err := k.dnnBatchNorm(a, in, out); done || err != nil {
		return err
	}
	x := in[0]
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	n, c, inner, err := bnChannels("batch_norm", x, a.ChannelsLast)
	if err != nil {
		return err
	}
	if out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "batch_norm: input %v, output %v", x.shape, out.shape)
	}
	aff := graph.BatchNormAffine(a.Training)
	w, b := optional(in, aff), optional(in, aff+1)
	var runMean, runVar *operand
	if !a.Training {
		runMean, runVar = optional(in, 1), optional(in, 2)
		if runMean == nil || runVar == nil {
			return graph.Errorf(graph.ErrArity, "batch_norm in evaluation mode needs running statistics of [%d]", c)
		}
	}
	pdt, err := bnParams("batch_norm", x, c, w, b, runMean, runVar)
	if err != nil {
		return err
	}
	ps := bnPassOf(dt, a.ChannelsLast, n, c, inner, x, out)
	l, err := ps.layout(k)
	if err != nil {
		return err
	}
	if a.Training {
		if err := k.bnSums(ps, x, nil, l.part); err != nil {
			return err
		}
	}
	if err := k.perChannel(kBatchNormCoef, c, l.part, ptrOf(w), ptrOf(b), ptrOf(runMean), ptrOf(runVar), pdt, l.coef, ps.rows, c, ps.m(), a.Eps); err != nil {
		return err
	}
	return k.bnMap(ps, kBatchNormNHWCVec, kBatchNormNHWC, kBatchNorm, x.p, l.coef, out.p)
}

// bnGradOuts are the outputs of batch_norm_grad_x's companions that its
// pass may give (planner.Program.Companions): batch_norm_grad_w's Σ g·x̂
// and the bias gradient's Σ g, each [c] of a float dtype, or nil; done
// marks each computed.
type bnGradOuts struct {
	dw, db         *operand
	dwDone, dbDone *bool
}

// bnCompanions is the node's companions that a batch_norm_grad_x pass
// over c channels can give.
func (k *kctx) bnCompanions(c int64) bnGradOuts {
	var o bnGradOuts
	o.dw, o.dwDone = k.companionOf(graph.OpBatchNormGradW)
	o.db, o.dbDone = k.companionOf(graph.OpSum)
	if o.dw != nil && (o.dw.n() != c || !o.dw.dt.IsFloat()) {
		o.dw = nil
	}
	if o.db != nil && (o.db.n() != c || !o.db.dt.IsFloat()) {
		o.db = nil
	}
	return o
}

// done marks the companions given.
func (o bnGradOuts) done() {
	if o.dw != nil {
		*o.dwDone = true
	}
	if o.db != nil {
		*o.dbDone = true
		bnBiasGrads.Add(1)
	}
}

// batchNormGradX is the training-mode gradient of batch_norm's input. It
// also gives Σ g·x̂ into its companion batch_norm_grad_w's output and Σ g
// into its companion bias gradient's, when the planner made them
// (graph.BatchNormGradWProducer, graph.BatchNormBiasGradProducer).
func (k *kctx) batchNormGradX(dt graph.DType, a *graph.Attrs, g, x operand, w *operand, out operand) error {
	if done, err := k.dnnBatchNormGradX(a, g, x, w, out); done || err != nil {
		return err
	}
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	if !a.Training {
		return graph.Errorf(graph.ErrAttr, "batch_norm_grad_x exists in training mode only")
	}
	n, c, inner, err := bnChannels("batch_norm_grad_x", x, a.ChannelsLast)
	if err != nil {
		return err
	}
	if g.n() != x.n() || out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "batch_norm_grad_x: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	pdt, err := bnParams("batch_norm_grad_x", x, c, w)
	if err != nil {
		return err
	}
	ps := bnPassOf(dt, a.ChannelsLast, n, c, inner, g, x, out)
	l, err := ps.layout(k)
	if err != nil {
		return err
	}
	if err := k.bnSums(ps, x, &g, l.part); err != nil {
		return err
	}
	co := k.bnCompanions(c)
	var dwT, dbT int64
	if co.dw != nil {
		dwT = bnDTypeCode(co.dw.dt)
	}
	if co.db != nil {
		dbT = bnDTypeCode(co.db.dt)
	}
	if err := k.perChannel(kBatchNormGradCoef, c, l.part, ptrOf(w), alloc.Ptr(0), alloc.Ptr(0), pdt, l.coef,
		ptrOf(co.dw), dwT, ptrOf(co.db), dbT, ps.rows, c, ps.m(), a.Eps); err != nil {
		return err
	}
	co.done()
	return k.bnMap(ps, kBatchNormGradXNHWCVec, kBatchNormGradXNHWC, kBatchNormGradX, g.p, x.p, l.coef, out.p)
}

// batchNormGradW is Σ g·x̂ per channel, x̂ normalised as the forward op did
// (the batch's statistics, or the running ones in evaluation mode).
func (k *kctx) batchNormGradW(dt graph.DType, a *graph.Attrs, in []operand, out operand) error {
	g, x := in[0], in[1]
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	n, c, inner, err := bnChannels("batch_norm_grad_w", x, a.ChannelsLast)
	if err != nil {
		return err
	}
	if g.n() != x.n() || out.n() != c {
		return graph.Errorf(graph.ErrShape, "batch_norm_grad_w: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	var runMean, runVar *operand
	if !a.Training {
		runMean, runVar = optional(in, 2), optional(in, 3)
		if runMean == nil || runVar == nil {
			return graph.Errorf(graph.ErrArity, "batch_norm_grad_w in evaluation mode needs running statistics of [%d]", c)
		}
	}
	pdt, err := bnParams("batch_norm_grad_w", x, c, runMean, runVar)
	if err != nil {
		return err
	}
	ps := bnPassOf(dt, a.ChannelsLast, n, c, inner, g, x)
	l, err := ps.layout(k)
	if err != nil {
		return err
	}
	if err := k.bnSums(ps, x, &g, l.part); err != nil {
		return err
	}
	return k.perChannel(kBatchNormGradCoef, c, l.part, alloc.Ptr(0), ptrOf(runMean), ptrOf(runVar), pdt, alloc.Ptr(0),
		out.p, bnDTypeCode(dt), alloc.Ptr(0), int64(0), ps.rows, c, ps.m(), a.Eps)
}

// batchNormMoments is batch_norm_stats: x [N, C, ...]'s per-channel mean
// and unbiased variance as out [2, C]. A chunk's value; the host merges
// chunks (graph.CombineMoments).
func (k *kctx) batchNormMoments(x, out operand) error {
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	n, c, inner, err := channels("batch_norm_stats", x)
	if err != nil {
		return err
	}
	if out.n() != 2*c {
		return graph.Errorf(graph.ErrShape, "batch_norm_stats: input %v, output %v", x.shape, out.shape)
	}
	if n*inner <= 1 {
		return graph.Errorf(graph.ErrShape, "batch_norm_stats needs more than one value per channel, got x %v", x.shape)
	}
	ps := bnPassOf(dt, false, n, c, inner)
	l, err := ps.layout(k)
	if err != nil {
		return err
	}
	if err := k.bnSums(ps, x, nil, l.part); err != nil {
		return err
	}
	return k.perChannel(kBatchNormMoment, c, l.part, out.p, bnDTypeCode(dt), ps.rows, c, ps.m())
}

// bnChannels is channels for x in a batch norm's layout: images, channels
// and values per image and channel, from [N, H, W, C] when nhwc.
func bnChannels(op string, x operand, nhwc bool) (n, c, inner int64, err error) {
	if !nhwc {
		return channels(op, x)
	}
	if len(x.shape) != 4 {
		return 0, 0, 0, graph.Errorf(graph.ErrShape, "%s channels last needs [N, H, W, C], got %v", op, x.shape)
	}
	return int64(x.shape[0]), int64(x.shape[3]), int64(x.shape[1] * x.shape[2]), nil
}
