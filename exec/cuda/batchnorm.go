package cuda

import (
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
// every executor: its row sums (batch_norm_rows_nhwc) fill the same [N·C,
// 4] workspace, the per-channel kernels are shared, and the element-wise
// passes have channels-last twins.

// bnWorkspace is the workspace of batch_norm, its gradients and
// batch_norm_stats: the row sums [N·C, 4] (double), then three doubles of
// coefficients per channel, and cuDNN's ones and zeros (dnnBNBytes). Affine
// in the chunk: the rows are.
func bnWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	i := 1
	if nd.Op == graph.OpBatchNorm || nd.Op == graph.OpBatchNormStats {
		i = 0
	}
	x := inputAt(g, nd, i, b)
	if nd.Attrs.ChannelsLast {
		x = nchwShape(&nd.Attrs, x)
	}
	if len(x) < 2 {
		return 0
	}
	return bnRowsBytes(int64(x[0])*int64(x[1])) + bnCoefBytes(int64(x[1])) + dnnBNBytes(int64(x[1]))
}

// bnRowsBytes is the row sums of rows rows; bnCoefBytes the coefficients
// of c channels, 256-aligned so that what follows them is too.
func bnRowsBytes(rows int64) int64 { return 32 * rows }
func bnCoefBytes(c int64) int64    { return align256(24 * c) }

// bnLayout is a batch norm's workspace: the row sums at 0, the
// coefficients after them.
type bnLayout struct {
	part, coef alloc.Ptr
}

func (k *kctx) bnLayout(rows, c int64) (bnLayout, error) {
	ws, err := k.workspace(bnRowsBytes(rows) + bnCoefBytes(c))
	if err != nil {
		return bnLayout{}, err
	}
	return bnLayout{part: ws, coef: ws + alloc.Ptr(bnRowsBytes(rows))}, nil
}

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

// bnSums fills part with the row sums of x (and g) for n images of c
// channels of inner values each: bnRows over NCHW data, or
// batch_norm_rows_nhwc over channels-last data [n, inner, c].
func (k *kctx) bnSums(dt graph.DType, nhwc bool, x operand, g *operand, part alloc.Ptr, n, c, inner int64) error {
	if !nhwc {
		return k.bnRows(dt, x, g, part, n*c, inner)
	}
	grid := [3]uint32{uint32(min(ceilDiv(c, 32), maxGridX)), uint32(min(n, maxGridYZ)), 1}
	return k.launch(typed(kBatchNormRowsNHWC, dt), grid, [3]uint32{32, 16, 1}, x.p, ptrOf(g), part, n, inner, c)
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
	nhwc := a.ChannelsLast
	n, c, inner, err := bnChannels("batch_norm", x, nhwc)
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
	rows := n * c
	l, err := k.bnLayout(rows, c)
	if err != nil {
		return err
	}
	if a.Training && rows > 0 {
		if err := k.bnSums(dt, nhwc, x, nil, l.part, n, c, inner); err != nil {
			return err
		}
	}
	if err := k.flat(kBatchNormCoef, c, l.part, ptrOf(w), ptrOf(b), ptrOf(runMean), ptrOf(runVar), pdt, l.coef, n, c, inner, a.Eps); err != nil {
		return err
	}
	if nhwc {
		return k.flat(typed(kBatchNormNHWC, dt), x.n(), x.p, l.coef, out.p, x.n(), c)
	}
	return k.bnElems(typed(kBatchNorm, dt), rows, inner, x.p, l.coef, out.p, rows, c, inner)
}

// batchNormGradX is the training-mode gradient of batch_norm's input. It
// also gives Σ g·x̂ into its companion batch_norm_grad_w's output, when
// the planner made one (graph.BatchNormGradWProducer).
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
	nhwc := a.ChannelsLast
	n, c, inner, err := bnChannels("batch_norm_grad_x", x, nhwc)
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
	rows := n * c
	l, err := k.bnLayout(rows, c)
	if err != nil {
		return err
	}
	if rows > 0 {
		if err := k.bnSums(dt, nhwc, x, &g, l.part, n, c, inner); err != nil {
			return err
		}
	}
	var dw alloc.Ptr
	var odt int64
	if co := k.co; co != nil && co.n() == c && co.dt.IsFloat() {
		dw, odt = co.p, bnDTypeCode(co.dt)
		k.coDone = true
	}
	if err := k.flat(kBatchNormGradCoef, c, l.part, ptrOf(w), alloc.Ptr(0), alloc.Ptr(0), pdt, l.coef, dw, odt, n, c, inner, a.Eps); err != nil {
		return err
	}
	if nhwc {
		return k.flat(typed(kBatchNormGradXNHWC, dt), x.n(), g.p, x.p, l.coef, out.p, x.n(), c)
	}
	return k.bnElems(typed(kBatchNormGradX, dt), rows, inner, g.p, x.p, l.coef, out.p, rows, c, inner)
}

// batchNormGradW is Σ g·x̂ per channel, x̂ normalised as the forward op did
// (the batch's statistics, or the running ones in evaluation mode).
func (k *kctx) batchNormGradW(dt graph.DType, a *graph.Attrs, in []operand, out operand) error {
	g, x := in[0], in[1]
	if _, err := floatsOf(g, x, out); err != nil {
		return err
	}
	nhwc := a.ChannelsLast
	n, c, inner, err := bnChannels("batch_norm_grad_w", x, nhwc)
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
	rows := n * c
	l, err := k.bnLayout(rows, c)
	if err != nil {
		return err
	}
	if rows > 0 {
		if err := k.bnSums(dt, nhwc, x, &g, l.part, n, c, inner); err != nil {
			return err
		}
	}
	return k.flat(kBatchNormGradCoef, c, l.part, alloc.Ptr(0), ptrOf(runMean), ptrOf(runVar), pdt, alloc.Ptr(0), out.p, bnDTypeCode(dt), n, c, inner, a.Eps)
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
	rows := n * c
	l, err := k.bnLayout(rows, c)
	if err != nil {
		return err
	}
	if err := k.bnRows(dt, x, nil, l.part, rows, inner); err != nil {
		return err
	}
	return k.flat(kBatchNormMoment, c, l.part, out.p, bnDTypeCode(dt), n, c, inner)
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
