package cuda

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// operand is a value on the device: its address, shape (at the chunk's
// size) and dtype.
type operand struct {
	p     alloc.Ptr
	shape []int
	dt    graph.DType
}

func (o operand) n() int64 { return int64(graph.Numel(o.shape)) }

// at is the address of element i.
func (o operand) at(i int64) alloc.Ptr { return o.p + alloc.Ptr(i*int64(o.dt.Size())) }

func optional(in []operand, i int) *operand {
	if i < len(in) {
		return &in[i]
	}
	return nil
}

// ptrOf is an optional operand's address, 0 (a null pointer) when absent.
func ptrOf(o *operand) alloc.Ptr {
	if o == nil {
		return 0
	}
	return o.p
}

// floats fails unless every operand is float32.
func floats(ops ...operand) error {
	for _, o := range ops {
		if o.dt != graph.Float32 {
			return graph.Errorf(graph.ErrDType, "operand %v is %s, want float32", o.shape, o.dt)
		}
	}
	return nil
}

func (r *runner) launch(name string, grid, block [3]uint32, args ...any) error {
	k, err := r.e.ks.get(name)
	if err != nil {
		return err
	}
	return k.m.Launch(k.f, grid, block, 0, args...)
}

// flat launches a kernel of the flat layout over work elements; no work, no
// launch.
func (r *runner) flat(name string, work int64, args ...any) error {
	if work <= 0 {
		return nil
	}
	return r.launch(name, flatGrid(work), flatBlockDim, args...)
}

// quads launches a kernel with a four-wide path (kernels/common.cuh
// QUAD_LOOP: unary, scalar, binary and the elementwise gradients) over n
// elements with one thread per 4 of them; no work, no launch.
func (r *runner) quads(name string, n int64, args ...any) error {
	if n <= 0 {
		return nil
	}
	return r.launch(name, flatGrid(ceilDiv(n, 4)), flatBlockDim, args...)
}

// perChannel launches a batchnorm kernel with one block per channel.
func (r *runner) perChannel(name string, c int64, args ...any) error {
	if c <= 0 {
		return nil
	}
	return r.launch(name, [3]uint32{uint32(min(c, maxGridYZ)), 1, 1}, [3]uint32{256, 1, 1}, args...)
}

// workspace is the first bytes of a node's workspace block.
func workspace(ws *alloc.Block, bytes int64) (alloc.Ptr, error) {
	if bytes == 0 {
		return 0, nil
	}
	if ws == nil || ws.Requested() < bytes {
		var got int64
		if ws != nil {
			got = ws.Requested()
		}
		return 0, graph.Errorf(ErrWorkspace, "%d bytes planned, the kernels need %d", got, bytes)
	}
	return ws.Ptr(), nil
}

// Op codes of unary_f32, scalar_f32 and binary_f32 (elementwise.cu).
var (
	unaryCodes = map[graph.Op]int64{graph.OpNeg: 0, graph.OpExp: 1, graph.OpLog: 2, graph.OpSqrt: 3, graph.OpAbs: 4,
		graph.OpTanh: 5, graph.OpSigmoid: 6, graph.OpRelu: 7, graph.OpGelu: 8, graph.OpSign: 10}
	scalarCodes = map[graph.Op]int64{graph.OpAddScalar: 0, graph.OpSubScalar: 1, graph.OpRSubScalar: 2,
		graph.OpMulScalar: 3, graph.OpDivScalar: 4, graph.OpRDivScalar: 5, graph.OpPowScalar: 6, graph.OpMaximumScalar: 7}
	binaryCodes = map[graph.Op]int64{graph.OpAdd: 0, graph.OpSub: 1, graph.OpMul: 2, graph.OpDiv: 3, graph.OpPow: 4, graph.OpMaximum: 5}
)

// eval dispatches one node to its kernels. The switch names every op; its
// default is an error, so a new op cannot run unimplemented.
func (r *runner) eval(nd *graph.Node, in []operand, out operand, ws *alloc.Block, c planner.Chunk) error {
	if err := deviceDType(nd); err != nil {
		return err
	}
	a := &nd.Attrs
	switch nd.Op {
	case graph.OpDropout:
		return r.dropout(a, nd.Type, c.Start, in[0], out)
	case graph.OpCausalMask:
		return r.causalMask(a, in[0], out)
	}
	switch nd.Op.Category() {
	case graph.CatUnary:
		return r.unary(nd.Op, a, in[0], out)
	case graph.CatScalar:
		return r.scalar(nd.Op, a, in[0], out)
	case graph.CatBinary:
		return r.binary(nd.Op, in[0], in[1], out)
	case graph.CatGrad:
		return r.grad(nd, in, out, ws)
	}
	switch nd.Op {
	case graph.OpMatMul:
		return r.matmul(a.TransA, a.TransB, in[0], in[1], out)
	case graph.OpLinear:
		return r.linear(in[0], in[1], optional(in, 2), out)
	case graph.OpSum, graph.OpMean, graph.OpMax:
		return r.reduce(nd, in[0], out, ws)
	case graph.OpSoftmax, graph.OpLogSoftmax:
		return r.softmax(nd.Op == graph.OpLogSoftmax, a.Axis, in[0], out)
	case graph.OpLayerNorm:
		return r.layerNorm(a, in[0], optional(in, 1), optional(in, 2), out)
	case graph.OpBatchNorm:
		return r.batchNorm(a, in, out, ws)
	case graph.OpReshape:
		return r.reshape(in[0], out)
	case graph.OpPermute:
		return r.permute(a.Perm, in[0], out)
	case graph.OpSlice:
		return r.slice(a, in[0], out)
	case graph.OpConcat:
		return r.concat(a.Axis, in, out)
	case graph.OpEmbedding:
		return r.embedding(in[0], in[1], out, ws)
	case graph.OpConv2d:
		return r.conv2d(a, in[0], in[1], optional(in, 2), out, ws)
	case graph.OpMaxPool2d:
		return r.maxPool2d(a, in[0], out)
	case graph.OpAvgPool2d:
		return r.avgPool2d(a, in[0], out)
	case graph.OpCrossEntropy:
		return r.crossEntropy(a, in[0], in[1], out, ws)
	case graph.OpMSE:
		return r.mse(a, in[0], in[1], out, ws)
	case graph.OpFill:
		if out.dt == graph.Int64 {
			return r.flat(kFillI64, out.n(), out.p, out.n(), int64(a.Scalar))
		}
		return r.flat(kFillF32, out.n(), out.p, out.n(), float32(a.Scalar))
	}
	return graph.Errorf(graph.ErrAttr, "cuda executor has no kernel for op %s", nd.Op)
}

// grad runs the vector-Jacobian ops that autodiff appends; in[0] is always
// the upstream gradient g.
func (r *runner) grad(nd *graph.Node, in []operand, out operand, ws *alloc.Block) error {
	a := &nd.Attrs
	g := in[0]
	if err := floats(g, out); err != nil {
		return err
	}
	n := out.n()
	same := func(ops ...operand) error {
		for _, o := range ops {
			if o.n() != n {
				return graph.Errorf(graph.ErrShape, "%s: operand %v, output %v", nd.Op, o.shape, out.shape)
			}
		}
		return floats(ops...)
	}
	switch nd.Op {
	case graph.OpReluGrad:
		if err := same(g, in[1]); err != nil {
			return err
		}
		return r.quads(kReluGrad, n, g.p, in[1].p, out.p, n)
	case graph.OpGeluGrad:
		if err := same(g, in[1]); err != nil {
			return err
		}
		return r.quads(kGeluGrad, n, g.p, in[1].p, out.p, n, boolInt(a.Approx))
	case graph.OpMaximumScalarGrad:
		if err := same(g, in[1]); err != nil {
			return err
		}
		return r.quads(kMaximumScGrad, n, g.p, in[1].p, out.p, n, float32(a.Scalar))
	case graph.OpMaximumGrad:
		if err := same(g); err != nil {
			return err
		}
		if err := floats(in[1], in[2]); err != nil {
			return err
		}
		geo, err := broadcastGeom(in[1].shape, in[2].shape, out.shape)
		if err != nil {
			return err
		}
		return r.flat(kMaximumGrad, n, g.p, in[1].p, in[2].p, out.p, n, int64(a.Axis), geo)
	case graph.OpExpand:
		return r.expand(g, out)
	case graph.OpMaxGrad:
		return r.maxGrad(a, g, in[1], in[2], out)
	case graph.OpSoftmaxGrad, graph.OpLogSoftmaxGrad:
		if err := same(g, in[1]); err != nil {
			return err
		}
		return r.softmaxGrad(nd.Op == graph.OpLogSoftmaxGrad, a.Axis, g, in[1], out)
	case graph.OpLayerNormGradX:
		return r.layerNormGradX(a, g, in[1], optional(in, 2), out)
	case graph.OpLayerNormGradW:
		return r.layerNormGradW(nd, g, in[1], out, ws)
	case graph.OpBatchNormGradX:
		return r.batchNormGradX(a, g, in[1], optional(in, 2), out, ws)
	case graph.OpBatchNormGradW:
		return r.batchNormGradW(a, in, out, ws)
	case graph.OpSliceGrad:
		return r.sliceGrad(a, g, out)
	case graph.OpEmbeddingGrad:
		return r.embeddingGrad(g, in[1], out, ws)
	case graph.OpConv2dGradInput:
		return r.conv2dGradInput(a, g, in[1], out, ws)
	case graph.OpConv2dGradWeight:
		return r.conv2dGradWeight(a, g, in[1], out, ws)
	case graph.OpMaxPool2dGrad:
		return r.maxPool2dGrad(a, g, in[1], out, ws)
	case graph.OpAvgPool2dGrad:
		return r.avgPool2dGrad(a, g, out)
	case graph.OpCrossEntropyGrad:
		return r.crossEntropyGrad(a, g, in[1], in[2], out, ws)
	case graph.OpMSEGrad:
		if err := same(in[1], in[2]); err != nil {
			return err
		}
		if g.n() != 1 {
			return graph.Errorf(graph.ErrShape, "mse_grad needs a scalar upstream gradient, got %v", g.shape)
		}
		return r.flat(kMSEGrad, n, g.p, in[1].p, in[2].p, out.p, n, a.Scalar)
	}
	return graph.Errorf(graph.ErrAttr, "cuda executor has no kernel for gradient op %s", nd.Op)
}

// Elementwise ops.

func (r *runner) unary(op graph.Op, a *graph.Attrs, x, out operand) error {
	code, ok := unaryCodes[op]
	if !ok {
		return graph.Errorf(graph.ErrAttr, "%s is not an elementwise unary op", op)
	}
	if op == graph.OpGelu && a.Approx {
		code = 9
	}
	if err := floats(x, out); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", op, x.shape, out.shape)
	}
	return r.quads(kUnary, out.n(), x.p, out.p, out.n(), code)
}

func (r *runner) scalar(op graph.Op, a *graph.Attrs, x, out operand) error {
	code, ok := scalarCodes[op]
	if !ok {
		return graph.Errorf(graph.ErrAttr, "%s is not a scalar op", op)
	}
	if err := floats(x, out); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", op, x.shape, out.shape)
	}
	return r.quads(kScalar, out.n(), x.p, out.p, out.n(), code, a.Scalar)
}

func (r *runner) binary(op graph.Op, x, y, out operand) error {
	code, ok := binaryCodes[op]
	if !ok {
		return graph.Errorf(graph.ErrAttr, "%s is not a binary elementwise op", op)
	}
	if err := floats(x, y, out); err != nil {
		return err
	}
	n := out.n()
	if slices.Equal(x.shape, out.shape) && slices.Equal(y.shape, out.shape) {
		return r.quads(kBinary, n, x.p, y.p, out.p, n, code)
	}
	geo, err := broadcastGeom(x.shape, y.shape, out.shape)
	if err != nil {
		return err
	}
	return r.flat(kBinaryBcast, n, x.p, y.p, out.p, n, code, geo)
}

// dropout keys each element by its global row along the batch axis (chunk
// start · PerSample onwards) and its index within the row, as exec/cpu.
func (r *runner) dropout(a *graph.Attrs, t graph.Type, chunkStart int, x, out operand) error {
	if err := floats(x, out); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "dropout of %v into %v", x.shape, out.shape)
	}
	p := a.Scalar
	scale := float32(1 / (1 - p))
	outer, rows, inner := int64(1), int64(1), x.n()
	rowOff := int64(0)
	if ax := t.BatchAxis; ax >= 0 {
		outer, rows, inner = int64(graph.Numel(x.shape[:ax])), int64(x.shape[ax]), int64(graph.Numel(x.shape[ax+1:]))
		rowOff = int64(chunkStart * t.PerSample)
	}
	return r.flat(kDropout, x.n(), x.p, out.p, outer, rows, inner, rowOff, a.Seed, a.Counter, p, scale)
}

func (r *runner) causalMask(a *graph.Attrs, x, out operand) error {
	if err := floats(x, out); err != nil {
		return err
	}
	rk := len(x.shape)
	if rk < 2 || x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "causal_mask of %v into %v", x.shape, out.shape)
	}
	t, s := int64(x.shape[rk-2]), int64(x.shape[rk-1])
	return r.flat(kCausalMask, x.n(), x.p, out.p, x.n(), t, s, float32(a.Scalar))
}

// Contractions.

// broadcastStrides gives, for each axis of lead, the element stride of an
// operand whose leading shape is s (right-aligned to lead) and whose inner
// block holds inner elements; broadcast axes get stride 0.
func broadcastStrides(s, lead []int, inner int) ([]int, error) {
	if len(s) > len(lead) {
		return nil, graph.Errorf(graph.ErrShape, "leading axes %v do not broadcast to %v", s, lead)
	}
	st := make([]int, len(lead))
	acc := inner
	off := len(lead) - len(s)
	for d := len(s) - 1; d >= 0; d-- {
		switch s[d] {
		case lead[d+off]:
			st[d+off] = acc
		case 1:
		default:
			return nil, graph.Errorf(graph.ErrShape, "leading axes %v do not broadcast to %v", s, lead)
		}
		acc *= s[d]
	}
	return st, nil
}

// gemmCall is one strided-batched GEMM of a matmul: count products whose
// operands start at element offsets x, y, out and step by sx, sy, so
// (stride 0 where an operand is broadcast).
type gemmCall struct {
	x, y, out  int
	sx, sy, so int
	count      int
}

// matmulPlan is how a matmul runs on cuBLAS: op(x) is m×k, op(y) is k×n,
// lda and ldb are the stored row strides. tall means one GEMM of
// [rows·m, k] by op(y) (y is one matrix and x is not transposed);
// otherwise calls lists the strided-batched GEMMs.
type matmulPlan struct {
	m, n, k, lda, ldb int
	tall              bool
	rows              int
	calls             []gemmCall
}

// planMatmul lays out the product of the last two axes of op(x) [..., m, k]
// and op(y) [..., k, n] into out [..., m, n], broadcasting the leading
// axes. The leading axes are merged; the innermost merged axis runs as one
// strided-batched GEMM and the others loop, so any broadcast pattern works
// without copies. An empty product (out or k zero) has no calls.
func planMatmul(ta, tb bool, xs, ys, os []int) (matmulPlan, error) {
	rx, ry, ro := len(xs), len(ys), len(os)
	if rx < 2 || ry < 2 || ro < 2 {
		return matmulPlan{}, graph.Errorf(graph.ErrShape, "matmul needs rank ≥ 2 operands, got %v and %v", xs, ys)
	}
	pl := matmulPlan{lda: xs[rx-1], ldb: ys[ry-1]}
	pl.m, pl.k = xs[rx-2], pl.lda
	if ta {
		pl.m, pl.k = pl.k, pl.m
	}
	k2 := ys[ry-2]
	pl.n = pl.ldb
	if tb {
		k2, pl.n = pl.n, k2
	}
	if pl.k != k2 || os[ro-2] != pl.m || os[ro-1] != pl.n {
		return matmulPlan{}, graph.Errorf(graph.ErrShape, "matmul of %v and %v cannot give %v", xs, ys, os)
	}
	lead := os[:ro-2]
	xst, err := broadcastStrides(xs[:rx-2], lead, pl.m*pl.k)
	if err != nil {
		return matmulPlan{}, err
	}
	yst, err := broadcastStrides(ys[:ry-2], lead, pl.k*pl.n)
	if err != nil {
		return matmulPlan{}, err
	}
	if graph.Numel(os) == 0 || pl.k == 0 {
		return pl, nil
	}
	if graph.Numel(ys[:ry-2]) == 1 && !ta {
		// y is one matrix: x's matrices stack into one tall [batches·m, k].
		pl.tall, pl.rows = true, graph.Numel(lead)*pl.m
		return pl, nil
	}
	dims, st := mergeAxes(lead, xst, yst, contiguousMul(lead, pl.m*pl.n))
	inner := gemmCall{count: 1}
	if last := len(dims) - 1; last >= 0 {
		inner = gemmCall{count: dims[last], sx: st[0][last], sy: st[1][last], so: st[2][last]}
		dims = dims[:last]
	}
	idx := make([]int, len(dims))
	for range graph.Numel(dims) {
		c := inner
		for d, i := range idx {
			c.x += i * st[0][d]
			c.y += i * st[1][d]
			c.out += i * st[2][d]
		}
		pl.calls = append(pl.calls, c)
		for d := len(idx) - 1; d >= 0; d-- { // odometer over the outer axes
			if idx[d]++; idx[d] < dims[d] {
				break
			}
			idx[d] = 0
		}
	}
	return pl, nil
}

// matmul runs planMatmul's GEMMs on cuBLAS, which reads the transposes from
// the stored layout.
func (r *runner) matmul(ta, tb bool, x, y, out operand) error {
	if err := floats(x, y, out); err != nil {
		return err
	}
	pl, err := planMatmul(ta, tb, x.shape, y.shape, out.shape)
	if err != nil {
		return err
	}
	switch {
	case out.n() == 0:
		return nil
	case pl.k == 0: // empty sums
		return r.e.d.Memzero(out.p, 4*out.n())
	case pl.tall:
		return r.e.blas.Gemm(false, tb, pl.rows, pl.n, pl.k, 1, x.p, pl.lda, y.p, pl.ldb, 0, out.p, pl.n)
	}
	for _, c := range pl.calls {
		if err := r.e.blas.GemmStridedBatched(ta, tb, pl.m, pl.n, pl.k, 1, x.at(int64(c.x)), pl.lda, int64(c.sx),
			y.at(int64(c.y)), pl.ldb, int64(c.sy), 0, out.at(int64(c.out)), pl.n, int64(c.so), c.count); err != nil {
			return err
		}
	}
	return nil
}

// contiguousMul is the row-major strides of shape scaled by inner.
func contiguousMul(shape []int, inner int) []int {
	s := graph.ContiguousStrides(shape)
	for i := range s {
		s[i] *= inner
	}
	return s
}

// linear computes out = x·wᵀ + b with x [..., in], w [out, in] and an
// optional b [out]: the bias is broadcast into out and one GEMM over x
// flattened to [rows, in] adds the product (beta = 1), as on the CPU.
func (r *runner) linear(x, w operand, b *operand, out operand) error {
	if err := floats(x, w, out); err != nil {
		return err
	}
	rk := len(x.shape)
	if rk < 1 || len(w.shape) != 2 || len(out.shape) != rk {
		return graph.Errorf(graph.ErrShape, "linear of %v with weight %v cannot give %v", x.shape, w.shape, out.shape)
	}
	nOut, nIn := w.shape[0], w.shape[1]
	if x.shape[rk-1] != nIn || out.shape[rk-1] != nOut || !slices.Equal(x.shape[:rk-1], out.shape[:rk-1]) {
		return graph.Errorf(graph.ErrShape, "linear of %v with weight %v cannot give %v", x.shape, w.shape, out.shape)
	}
	rows := graph.Numel(x.shape[:rk-1])
	var beta float32
	if b != nil {
		if err := floats(*b); err != nil {
			return err
		}
		if !slices.Equal(b.shape, []int{nOut}) {
			return graph.Errorf(graph.ErrShape, "linear bias %v, want [%d]", b.shape, nOut)
		}
		if err := r.flat(kBiasFill, out.n(), out.p, b.p, int64(rows), int64(nOut), int64(1)); err != nil {
			return err
		}
		beta = 1
	}
	if rows == 0 || nOut == 0 {
		return nil
	}
	if nIn == 0 {
		if b == nil {
			return r.e.d.Memzero(out.p, 4*out.n())
		}
		return nil
	}
	return r.e.blas.Gemm(false, true, rows, nOut, nIn, 1, x.p, nIn, w.p, nIn, beta, out.p, nOut)
}

// Reductions and normalisation.

// reduce computes sum, mean or max over a.Axes: rows, middle-axis or
// strided layout, split into partial reductions when the node may split
// (reduceSplittable) and the chunk's reductions are long.
func (r *runner) reduce(nd *graph.Node, x, out operand, ws *alloc.Block) error {
	a := &nd.Attrs
	if err := floats(x, out); err != nil {
		return err
	}
	l, err := planReduce(x.shape, a.Axes)
	if err != nil {
		return err
	}
	if l.nout != out.n() {
		return graph.Errorf(graph.ErrShape, "%s over axes %v of %v cannot give %v", nd.Op, a.Axes, x.shape, out.shape)
	}
	op, scale := int64(0), 1.0
	switch nd.Op {
	case graph.OpMax:
		op = 1
	case graph.OpMean:
		scale = a.Scalar
	}
	switch {
	case l.nout == 0:
		return nil
	case l.nred == 0: // empty reductions: the sum's 0, the max's −inf, as on the CPU
		v := float32(0)
		if op == 1 {
			v = float32(math.Inf(-1))
		}
		return r.flat(kFillF32, l.nout, out.p, l.nout, v)
	}
	splits := int64(1)
	if reduceSplittable(r.p.Graph, nd) {
		splits = splitsFor(l.nred, splitLen)
	}
	dst, first := out.p, scale
	if splits > 1 {
		if dst, err = workspace(ws, 4*splits*l.nout); err != nil {
			return err
		}
		first = 1
	}
	switch l.kind {
	case reduceRows:
		block := rowBlock(l.n)
		err = r.launch(kReduceRows, rowGrid(l.outer, block, splits), block, x.p, dst, l.outer, l.n, op, first)
	case reduceMid:
		grid := [3]uint32{tileGridX(l.inner), uint32(min(l.outer, maxGridYZ)), uint32(splits)}
		err = r.launch(kReduceMid, grid, tileBlock, x.p, dst, l.outer, l.n, l.inner, op, first)
	default:
		block := rowBlock(l.nred)
		err = r.launch(kReduceStrided, rowGrid(l.nout, block, splits), block, x.p, dst, l.geom, l.nout, l.nred, op, first)
	}
	if err != nil || splits == 1 {
		return err
	}
	return r.launch(kReduceMid, [3]uint32{tileGridX(l.nout), 1, 1}, tileBlock, dst, out.p, int64(1), splits, l.nout, op, scale)
}

// maxGrad shares each reduced gradient evenly among the tied maxima.
func (r *runner) maxGrad(a *graph.Attrs, g, x, y, out operand) error {
	if err := floats(x, y); err != nil {
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
	return r.launch(kMaxGrad, rowGrid(l.nout, block, 1), block, g.p, x.p, y.p, out.p, l.geom, l.nout, l.nred)
}

func (r *runner) softmax(log bool, axis int, x, out operand) error {
	if err := floats(x, out); err != nil {
		return err
	}
	if axis < 0 || axis >= len(x.shape) {
		return graph.Errorf(graph.ErrAttr, "softmax axis %d out of range for rank %d", axis, len(x.shape))
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "softmax: input %v, output %v", x.shape, out.shape)
	}
	return r.softmaxLaunch(kSoftmaxRows, kSoftmaxCols, log, x.shape, axis, x.p, out.p)
}

func (r *runner) softmaxGrad(log bool, axis int, g, y, out operand) error {
	if axis < 0 || axis >= len(y.shape) {
		return graph.Errorf(graph.ErrAttr, "softmax axis %d out of range for rank %d", axis, len(y.shape))
	}
	return r.softmaxLaunch(kSoftmaxGradRows, kSoftmaxGradCols, log, y.shape, axis, g.p, y.p, out.p)
}

// softmaxLaunch views shape as [outer, n, inner] around axis: the rows
// kernel when inner = 1, the columns kernel otherwise; ptrs are the
// kernel's buffers in order.
func (r *runner) softmaxLaunch(rows, cols string, log bool, shape []int, axis int, ptrs ...alloc.Ptr) error {
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
		return r.launch(rows, rowGrid(outer, block, 1), block, append(args, outer, nn, boolInt(log))...)
	}
	return r.flat(cols, outer*inner, append(args, outer, nn, inner, boolInt(log))...)
}

// normGeometry views x as [rows, d] over its trailing NormDims axes and
// checks the optional [d]-sized parameters.
func normGeometry(a *graph.Attrs, x operand, params ...*operand) (rows, d int64, err error) {
	if a.NormDims < 1 || a.NormDims > len(x.shape) {
		return 0, 0, graph.Errorf(graph.ErrAttr, "layer_norm over %d trailing dims of a rank-%d input", a.NormDims, len(x.shape))
	}
	rows, d = normRows(x.shape, a.NormDims)
	for _, p := range params {
		if p == nil {
			continue
		}
		if err := floats(*p); err != nil {
			return 0, 0, err
		}
		if p.n() != d {
			return 0, 0, graph.Errorf(graph.ErrShape, "layer_norm parameter %v does not match normalised dims %v", p.shape, x.shape[len(x.shape)-a.NormDims:])
		}
	}
	return rows, d, nil
}

func (r *runner) layerNorm(a *graph.Attrs, x operand, w, b *operand, out operand) error {
	if err := floats(x, out); err != nil {
		return err
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
	return r.launch(kLayerNorm, rowGrid(rows, block, 1), block, x.p, ptrOf(w), ptrOf(b), out.p, rows, d, a.Eps)
}

func (r *runner) layerNormGradX(a *graph.Attrs, g, x operand, w *operand, out operand) error {
	if err := floats(x); err != nil {
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
	return r.launch(kLayerNormGradX, rowGrid(rows, block, 1), block, g.p, x.p, ptrOf(w), out.p, rows, d, a.Eps)
}

// layerNormGradW is Σ over rows of g·x̂: per-row statistics into the
// workspace, then a column reduction, split over rows when the node may
// split (lnSplittable) and the chunk has many rows.
func (r *runner) layerNormGradW(nd *graph.Node, g, x, out operand, ws *alloc.Block) error {
	a := &nd.Attrs
	if err := floats(x); err != nil {
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
	if lnSplittable(r.p.Graph, nd) {
		splits = splitsFor(rows, lnSplitRows)
	}
	need := 16 * rows
	if splits > 1 {
		need += 4 * splits * d
	}
	w, err := workspace(ws, need)
	if err != nil {
		return err
	}
	stats, dst := w, out.p
	if rows > 0 {
		block := rowBlock(d)
		if err := r.launch(kLayerNormStats, rowGrid(rows, block, 1), block, x.p, stats, rows, d, a.Eps); err != nil {
			return err
		}
	}
	if splits > 1 {
		dst = w + alloc.Ptr(16*rows)
	}
	grid := [3]uint32{tileGridX(d), uint32(splits), 1}
	if err := r.launch(kLayerNormGradW, grid, tileBlock, g.p, x.p, stats, dst, rows, d); err != nil || splits == 1 {
		return err
	}
	return r.launch(kReduceMid, [3]uint32{tileGridX(d), 1, 1}, tileBlock, dst, out.p, int64(1), splits, d, int64(0), 1.0)
}
