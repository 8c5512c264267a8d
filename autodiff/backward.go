package autodiff

import (
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Backward appends to g the gradient of the scalar node loss with respect to
// each node in wrt and returns the gradient node ids, in wrt's order. A
// parameter the loss does not depend on gets a zero-filled gradient.
func Backward(g *graph.Graph, loss int, wrt []int) ([]int, error) {
	if loss < 0 || loss >= g.Len() {
		return nil, graph.Errorf(graph.ErrArity, "backward: loss id %d does not name a node", loss)
	}
	lt := g.Node(loss).Type
	if len(lt.Shape) != 0 || !lt.DType.IsFloat() {
		return nil, &graph.OpError{Op: "backward", Shapes: [][]int{lt.Shape}, Site: g.Node(loss).Site,
			Err: graph.Errorf(graph.ErrShape, "loss must be a floating-point scalar, got %s%v", lt.DType, lt.Shape)}
	}
	n := loss + 1
	need := make([]bool, n) // need[id]: id depends on some node of wrt
	for _, w := range wrt {
		if w < 0 || w >= g.Len() {
			return nil, graph.Errorf(graph.ErrArity, "backward: parameter id %d does not name a node", w)
		}
		if w < n { // a node made after the loss cannot be its ancestor
			need[w] = g.Node(w).Type.DType.IsFloat()
		}
	}
	for id := range n {
		for _, in := range g.Node(id).Inputs {
			need[id] = need[id] || need[in]
		}
	}
	b := &builder{g: g, grad: make([]int, n), slices: map[int][]slicePiece{}}
	for i := range b.grad {
		b.grad[i] = -1
	}
	b.fwd = g.Node(loss)
	b.grad[loss] = b.emit(graph.OpFill, graph.Attrs{Scalar: 1, Target: lt})
	for id := loss; id >= 0 && b.err == nil; id-- {
		b.finishSlices(id) // every consumer of id has contributed by now
		gid := b.grad[id]
		if gid < 0 || g.Node(id).Op.Category().Leaf() {
			continue
		}
		b.fwd = g.Node(id)
		b.vjp(gid, need)
	}
	if b.err != nil {
		return nil, b.err
	}
	out := make([]int, len(wrt))
	for i, w := range wrt {
		out[i] = -1
		if w < n {
			out[i] = b.grad[w]
		}
		if out[i] < 0 {
			b.fwd = g.Node(w)
			out[i] = b.emit(graph.OpFill, graph.Attrs{Target: g.Node(w).Type})
		}
	}
	return out, b.err
}

// builder appends gradient nodes; the first error sticks.
type builder struct {
	g    *graph.Graph
	grad []int       // gradient id per forward id, −1 while none
	fwd  *graph.Node // forward node whose VJP is being built
	err  error
	// slices holds, per forward id, the gradients of slices taken of it,
	// kept back until every consumer has contributed (finishSlices).
	slices map[int][]slicePiece
}

// slicePiece is the upstream gradient g of forward slice node fwd.
type slicePiece struct {
	fwd *graph.Node
	g   int
}

func (b *builder) typ(id int) graph.Type { return b.g.Node(id).Type }

// emit appends op over inputs, tagged with the forward node's module path
// and call site so memory reports can name backward buffers.
func (b *builder) emit(op graph.Op, a graph.Attrs, inputs ...int) int {
	if b.err != nil {
		return -1
	}
	site, scope := b.fwd.Site, b.fwd.Scope
	id, err := shapeinfer.Append(b.g, graph.Node{Op: op, Inputs: inputs, Attrs: a, Site: site, Scope: scope})
	if err != nil {
		shapes := make([][]int, len(inputs))
		for i, in := range inputs {
			if in >= 0 && in < b.g.Len() {
				shapes[i] = b.typ(in).Shape
			}
		}
		b.err = &graph.OpError{Op: op.String() + " (backward of " + b.fwd.Op.String() + ")", Shapes: shapes, Site: site, Err: err}
		return -1
	}
	return id
}

// accumulate adds contribution c to the gradient of forward node id.
func (b *builder) accumulate(id, c int) {
	if c < 0 || b.err != nil {
		return
	}
	if b.grad[id] < 0 {
		b.grad[id] = c
		return
	}
	b.grad[id] = b.emit(graph.OpAdd, graph.Attrs{}, b.grad[id], c)
}

// finishSlices accumulates the gradients of the slices taken of forward
// node id. Slices that tile one axis exactly (q, k and v cut from one
// projection) give one concat of their gradients, which reads each once,
// instead of a zero-filled full-size slice_grad per slice and the adds
// between them; any other set gives a slice_grad each.
func (b *builder) finishSlices(id int) {
	ps := b.slices[id]
	if len(ps) == 0 {
		return
	}
	delete(b.slices, id)
	fwd := b.fwd
	defer func() { b.fwd = fwd }()
	if order, ok := b.tiling(id, ps); ok {
		b.fwd = ps[order[0]].fwd
		if len(order) == 1 { // a slice of the whole axis is the identity
			b.accumulate(id, ps[0].g)
			return
		}
		gs := make([]int, len(order))
		for i, k := range order {
			gs[i] = ps[k].g
		}
		b.accumulate(id, b.emit(graph.OpConcat, graph.Attrs{Axis: ps[0].fwd.Attrs.Axis}, gs...))
		return
	}
	for _, p := range ps {
		b.fwd = p.fwd
		a := p.fwd.Attrs
		b.accumulate(id, b.emit(graph.OpSliceGrad, graph.Attrs{Axis: a.Axis, Start: a.Start, End: a.End, Step: a.Step, Target: b.typ(id)}, p.g))
	}
}

// tiling returns the order (by start) in which slices ps of node id cover
// one axis other than the batch axis exactly, with unit steps, no overlap
// and no gap; ok is false for any other set.
func (b *builder) tiling(id int, ps []slicePiece) (order []int, ok bool) {
	t := b.typ(id)
	ax := ps[0].fwd.Attrs.Axis
	if ax == t.BatchAxis {
		return nil, false
	}
	order = make([]int, len(ps))
	for i, p := range ps {
		if p.fwd.Attrs.Axis != ax || p.fwd.Attrs.Step != 1 {
			return nil, false
		}
		order[i] = i
	}
	slices.SortStableFunc(order, func(i, j int) int { return ps[i].fwd.Attrs.Start - ps[j].fwd.Attrs.Start })
	at := 0
	for _, k := range order {
		if a := ps[k].fwd.Attrs; a.Start != at || a.End <= a.Start {
			return nil, false
		}
		at = ps[k].fwd.Attrs.End
	}
	return order, at == t.Shape[ax]
}

// sumTo reduces a broadcast gradient back to the shape of forward value id.
func (b *builder) sumTo(gid, id int) int {
	if b.err != nil {
		return -1
	}
	gs, ts := b.typ(gid).Shape, b.typ(id).Shape
	lead := len(gs) - len(ts)
	var axes []int
	for i, d := range gs {
		if i < lead || (ts[i-lead] == 1 && d != 1) {
			axes = append(axes, i)
		}
	}
	if len(axes) == 0 {
		return gid
	}
	s := b.emit(graph.OpSum, graph.Attrs{Axes: axes, KeepDim: true}, gid)
	if lead > 0 {
		s = b.emit(graph.OpReshape, graph.Attrs{Shape: slices.Clone(ts)}, s)
	}
	return s
}

func (b *builder) mul(x, y int) int { return b.emit(graph.OpMul, graph.Attrs{}, x, y) }
func (b *builder) div(x, y int) int { return b.emit(graph.OpDiv, graph.Attrs{}, x, y) }
func (b *builder) neg(x int) int    { return b.emit(graph.OpNeg, graph.Attrs{}, x) }
func (b *builder) scalar(op graph.Op, x int, s float64) int {
	return b.emit(op, graph.Attrs{Scalar: s}, x)
}

// keepDims reshapes a reduction's gradient to the keepdim shape so it
// broadcasts against the reduced input.
func (b *builder) keepDims(gid int, x graph.Type, a graph.Attrs) int {
	if a.KeepDim {
		return gid
	}
	s := slices.Clone(x.Shape)
	for _, ax := range a.Axes {
		s[ax] = 1
	}
	return b.emit(graph.OpReshape, graph.Attrs{Shape: s}, gid)
}

// vjp accumulates the gradients of the forward node's inputs given its
// upstream gradient g.
func (b *builder) vjp(g int, need []bool) {
	nd := b.fwd
	y, a := nd.ID, nd.Attrs
	in := nd.Inputs
	x := in[0]
	want := func(i int) bool { return i < len(in) && need[in[i]] }
	switch nd.Op {
	case graph.OpNeg:
		b.accumulate(x, b.neg(g))
	case graph.OpExp:
		b.accumulate(x, b.mul(g, y))
	case graph.OpLog:
		b.accumulate(x, b.div(g, x))
	case graph.OpSqrt:
		b.accumulate(x, b.scalar(graph.OpMulScalar, b.div(g, y), 0.5))
	case graph.OpAbs:
		b.accumulate(x, b.mul(g, b.emit(graph.OpSign, graph.Attrs{}, x)))
	case graph.OpTanh: // g·(1 − y²)
		b.accumulate(x, b.mul(g, b.scalar(graph.OpRSubScalar, b.mul(y, y), 1)))
	case graph.OpSigmoid: // g·y·(1 − y)
		b.accumulate(x, b.mul(g, b.mul(y, b.scalar(graph.OpRSubScalar, y, 1))))
	case graph.OpRelu:
		b.accumulate(x, b.emit(graph.OpReluGrad, graph.Attrs{}, g, y))
	case graph.OpGelu:
		b.accumulate(x, b.emit(graph.OpGeluGrad, graph.Attrs{Approx: a.Approx}, g, x))
	case graph.OpDropout: // the same mask and scale, redrawn from its key
		b.accumulate(x, b.emit(graph.OpDropout, a, g))
	case graph.OpCausalMask: // masked positions pass no gradient
		b.accumulate(x, b.emit(graph.OpCausalMask, graph.Attrs{Scalar: 0}, g))
	case graph.OpSign:
		// zero almost everywhere: no contribution
	case graph.OpAddScalar, graph.OpSubScalar:
		b.accumulate(x, g)
	case graph.OpRSubScalar:
		b.accumulate(x, b.neg(g))
	case graph.OpMulScalar, graph.OpDivScalar:
		b.accumulate(x, b.scalar(nd.Op, g, a.Scalar))
	case graph.OpRDivScalar: // d(s/x) = −y/x
		b.accumulate(x, b.neg(b.div(b.mul(g, y), x)))
	case graph.OpPowScalar: // s·x^(s−1)
		b.accumulate(x, b.mul(g, b.scalar(graph.OpMulScalar, b.scalar(graph.OpPowScalar, x, a.Scalar-1), a.Scalar)))
	case graph.OpMaximumScalar:
		b.accumulate(x, b.emit(graph.OpMaximumScalarGrad, graph.Attrs{Scalar: a.Scalar}, g, x))
	case graph.OpAdd, graph.OpSub, graph.OpMul, graph.OpDiv, graph.OpPow, graph.OpMaximum:
		b.binary(g, want)
	case graph.OpMatMul:
		b.matmul(g, want)
	case graph.OpLinear:
		b.linear(g, want)
	case graph.OpSum, graph.OpMean:
		gk := b.keepDims(g, b.typ(x), a)
		if nd.Op == graph.OpMean {
			gk = b.scalar(graph.OpMulScalar, gk, a.Scalar)
		}
		b.accumulate(x, b.emit(graph.OpExpand, graph.Attrs{Target: b.typ(x)}, gk))
	case graph.OpMax:
		b.accumulate(x, b.emit(graph.OpMaxGrad, graph.Attrs{Axes: a.Axes, KeepDim: a.KeepDim}, g, x, y))
	case graph.OpSoftmax:
		b.accumulate(x, b.emit(graph.OpSoftmaxGrad, graph.Attrs{Axis: a.Axis}, g, y))
	case graph.OpLogSoftmax:
		b.accumulate(x, b.emit(graph.OpLogSoftmaxGrad, graph.Attrs{Axis: a.Axis}, g, y))
	case graph.OpLayerNorm:
		b.layerNorm(g, want)
	case graph.OpBatchNorm:
		b.batchNorm(g, want)
	case graph.OpReshape:
		b.accumulate(x, b.emit(graph.OpReshape, graph.Attrs{Shape: slices.Clone(b.typ(x).Shape)}, g))
	case graph.OpPermute:
		inv := make([]int, len(a.Perm))
		for i, p := range a.Perm {
			inv[p] = i
		}
		b.accumulate(x, b.emit(graph.OpPermute, graph.Attrs{Perm: inv}, g))
	case graph.OpSlice:
		b.slices[x] = append(b.slices[x], slicePiece{fwd: nd, g: g})
	case graph.OpConcat:
		off := 0
		for i, id := range in {
			size := b.typ(id).Shape[a.Axis]
			if want(i) {
				b.accumulate(id, b.emit(graph.OpSlice, graph.Attrs{Axis: a.Axis, Start: off, End: off + size, Step: 1}, g))
			}
			off += size
		}
	case graph.OpEmbedding:
		if want(1) {
			b.accumulate(in[1], b.emit(graph.OpEmbeddingGrad, graph.Attrs{Target: b.typ(in[1])}, g, x))
		}
	case graph.OpConv2d:
		conv := graph.Attrs{Stride: a.Stride, Padding: a.Padding, Dilation: a.Dilation, Groups: a.Groups}
		if want(0) {
			c := conv
			c.Target = b.typ(x)
			b.accumulate(x, b.emit(graph.OpConv2dGradInput, c, g, in[1]))
		}
		if want(1) {
			c := conv
			c.Target = b.typ(in[1])
			b.accumulate(in[1], b.emit(graph.OpConv2dGradWeight, c, g, x))
		}
		if want(2) {
			b.accumulate(in[2], b.emit(graph.OpSum, graph.Attrs{Axes: []int{0, 2, 3}}, g))
		}
	case graph.OpMaxPool2d:
		b.accumulate(x, b.emit(graph.OpMaxPool2dGrad, graph.Attrs{Kernel: a.Kernel, Stride: a.Stride, Padding: a.Padding, Dilation: a.Dilation}, g, x))
	case graph.OpAvgPool2d:
		b.accumulate(x, b.emit(graph.OpAvgPool2dGrad, graph.Attrs{Kernel: a.Kernel, Stride: a.Stride, Padding: a.Padding, Target: b.typ(x)}, g))
	case graph.OpCrossEntropy:
		b.accumulate(x, b.emit(graph.OpCrossEntropyGrad, graph.Attrs{Scalar: a.Scalar}, g, x, in[1]))
	case graph.OpMSE:
		gp := b.emit(graph.OpMSEGrad, graph.Attrs{Scalar: a.Scalar}, g, x, in[1])
		if want(0) {
			b.accumulate(x, gp)
		}
		if want(1) {
			b.accumulate(in[1], b.neg(gp))
		}
	default:
		b.err = &graph.OpError{Op: "backward", Site: nd.Site,
			Err: graph.Errorf(graph.ErrAttr, "no gradient for op %s (node %d)", nd.Op, nd.ID)}
	}
}

func (b *builder) binary(g int, want func(int) bool) {
	nd := b.fwd
	x0, x1, y := nd.Inputs[0], nd.Inputs[1], nd.ID
	var g0, g1 int = -1, -1
	switch nd.Op {
	case graph.OpAdd:
		g0, g1 = g, g
	case graph.OpSub:
		g0 = g
		if want(1) {
			g1 = b.neg(g)
		}
	case graph.OpMul:
		if want(0) {
			g0 = b.mul(g, x1)
		}
		if want(1) {
			g1 = b.mul(g, x0)
		}
	case graph.OpDiv: // d/da = 1/b; d/db = −y/b
		if want(0) {
			g0 = b.div(g, x1)
		}
		if want(1) {
			g1 = b.neg(b.div(b.mul(g, y), x1))
		}
	case graph.OpPow: // d/da = b·a^(b−1); d/db = y·ln a
		if want(0) {
			g0 = b.mul(g, b.mul(x1, b.emit(graph.OpPow, graph.Attrs{}, x0, b.scalar(graph.OpSubScalar, x1, 1))))
		}
		if want(1) {
			g1 = b.mul(g, b.mul(y, b.emit(graph.OpLog, graph.Attrs{}, x0)))
		}
	case graph.OpMaximum:
		if want(0) {
			g0 = b.emit(graph.OpMaximumGrad, graph.Attrs{Axis: 0}, g, x0, x1)
		}
		if want(1) {
			g1 = b.emit(graph.OpMaximumGrad, graph.Attrs{Axis: 1}, g, x0, x1)
		}
	}
	if want(0) {
		b.accumulate(x0, b.sumTo(g0, x0))
	}
	if want(1) {
		b.accumulate(x1, b.sumTo(g1, x1))
	}
}

// matmul: y = op(a)·op(b) with op a transpose when the flag is set.
// d op(a) = g·op(b)ᵀ and d op(b) = op(a)ᵀ·g, re-expressed with transpose
// flags so no transposed copy is made.
func (b *builder) matmul(g int, want func(int) bool) {
	nd := b.fwd
	x0, x1 := nd.Inputs[0], nd.Inputs[1]
	ta, tb := nd.Attrs.TransA, nd.Attrs.TransB
	mm := func(p, q int, tp, tq bool) int {
		return b.emit(graph.OpMatMul, graph.Attrs{TransA: tp, TransB: tq}, p, q)
	}
	if want(0) {
		var ga int
		if !ta {
			ga = mm(g, x1, false, !tb)
		} else {
			ga = mm(x1, g, tb, true)
		}
		b.accumulate(x0, b.sumTo(ga, x0))
	}
	if want(1) {
		var gb int
		if flat := b.flatWeightGrad(g, x0, x1, ta, tb); flat >= 0 {
			gb = flat
		} else if !tb {
			gb = mm(x0, g, !ta, false)
		} else {
			gb = mm(g, x0, true, ta)
		}
		b.accumulate(x1, b.sumTo(gb, x1))
	}
}

// flatWeightGrad handles the common x[..., k] · W[k, n] with W 2-D: the
// gradient of W is one [k, M]·[M, n] product over the flattened leading
// axes, instead of a per-batch product followed by a sum. It returns −1
// when the pattern does not apply.
func (b *builder) flatWeightGrad(g, x0, x1 int, ta, tb bool) int {
	xt, wt := b.typ(x0), b.typ(x1)
	if ta || len(wt.Shape) != 2 || len(xt.Shape) <= 2 {
		return -1
	}
	k, n := xt.Shape[len(xt.Shape)-1], b.typ(g).Shape[len(b.typ(g).Shape)-1]
	xf := b.emit(graph.OpReshape, graph.Attrs{Shape: []int{-1, k}}, x0)
	gf := b.emit(graph.OpReshape, graph.Attrs{Shape: []int{-1, n}}, g)
	if tb { // W is [n, k]: dW = gᵀ·x
		return b.emit(graph.OpMatMul, graph.Attrs{TransA: true}, gf, xf)
	}
	return b.emit(graph.OpMatMul, graph.Attrs{TransA: true}, xf, gf)
}

// linear: y = x·Wᵀ + b.
func (b *builder) linear(g int, want func(int) bool) {
	nd := b.fwd
	x, w := nd.Inputs[0], nd.Inputs[1]
	xt := b.typ(x)
	gt := b.typ(g)
	out := b.typ(w).Shape[0]
	if want(0) {
		if len(xt.Shape) == 1 { // [out] · [out, in] as a row vector
			r := b.emit(graph.OpReshape, graph.Attrs{Shape: []int{1, out}}, g)
			b.accumulate(x, b.emit(graph.OpReshape, graph.Attrs{Shape: slices.Clone(xt.Shape)}, b.emit(graph.OpMatMul, graph.Attrs{}, r, w)))
		} else {
			b.accumulate(x, b.emit(graph.OpMatMul, graph.Attrs{}, g, w))
		}
	}
	if want(1) {
		gf, xf := g, x
		if len(gt.Shape) != 2 {
			gf = b.emit(graph.OpReshape, graph.Attrs{Shape: []int{-1, out}}, g)
			xf = b.emit(graph.OpReshape, graph.Attrs{Shape: []int{-1, xt.Shape[len(xt.Shape)-1]}}, x)
		}
		b.accumulate(w, b.emit(graph.OpMatMul, graph.Attrs{TransA: true}, gf, xf))
	}
	if want(2) {
		axes := make([]int, len(gt.Shape)-1)
		for i := range axes {
			axes[i] = i
		}
		gb := g
		if len(axes) > 0 {
			gb = b.emit(graph.OpSum, graph.Attrs{Axes: axes}, g)
		}
		b.accumulate(nd.Inputs[2], gb)
	}
}

func (b *builder) layerNorm(g int, want func(int) bool) {
	nd := b.fwd
	a := graph.Attrs{NormDims: nd.Attrs.NormDims, Eps: nd.Attrs.Eps}
	x := nd.Inputs[0]
	if want(0) {
		b.accumulate(x, b.emit(graph.OpLayerNormGradX, a, append([]int{g}, nd.Inputs[:min(2, len(nd.Inputs))]...)...))
	}
	if want(1) {
		b.accumulate(nd.Inputs[1], b.emit(graph.OpLayerNormGradW, a, g, x))
	}
	if want(2) {
		lead := len(b.typ(x).Shape) - a.NormDims
		axes := make([]int, lead)
		for i := range axes {
			axes[i] = i
		}
		gb := g
		if lead > 0 {
			gb = b.emit(graph.OpSum, graph.Attrs{Axes: axes}, g)
		}
		b.accumulate(nd.Inputs[2], gb)
	}
}

// batchNorm: y = x̂·w + b per channel, with x̂ = (x − mean)·rstd.
//
// Training mode: mean and rstd are the batch's, so every x moves them and
// dx is batch_norm_grad_x's (1/M)·rstd·(M·ĝ − Σĝ − x̂·Σ(ĝ·x̂)) with ĝ = g·w
// and M values per channel.
//
// Evaluation mode: mean and rstd come from the running statistics, so
// dx = g·w·rstd, a per-channel scale made from the [C] inputs alone (x is
// not saved for it). Gradients for the running statistics themselves, when
// asked for (PyTorch keeps them out of autograd), are
// d mean = −Σ g·w·rstd and d var = −½·Σ(g·x̂)·w·rstd².
// In both modes dw = Σ g·x̂ (batch_norm_grad_w) and db = Σ g over every
// axis but the channel axis.
func (b *builder) batchNorm(g int, want func(int) bool) {
	nd := b.fwd
	in := nd.Inputs
	x := in[0]
	train := nd.Attrs.Training
	a := graph.Attrs{Training: train, Eps: nd.Attrs.Eps}
	aff := graph.BatchNormAffine(train)
	xt := b.typ(x)
	axes := []int{0} // every axis but the channels
	for i := 2; i < len(xt.Shape); i++ {
		axes = append(axes, i)
	}
	var stats []int // running mean and variance, in evaluation mode
	if !train {
		stats = in[1:3]
	}
	w := -1
	if len(in) > aff {
		w = in[aff]
	}
	gw := -1 // Σ g·x̂, made once for whichever inputs need it
	gradW := func() int {
		if gw < 0 {
			gw = b.emit(graph.OpBatchNormGradW, a, append([]int{g, x}, stats...)...)
		}
		return gw
	}
	if train && want(0) {
		xs := []int{g, x}
		if w >= 0 {
			xs = append(xs, w)
		}
		b.accumulate(x, b.emit(graph.OpBatchNormGradX, a, xs...))
	}
	if !train && (want(0) || want(1) || want(2)) {
		// rstd = (var + eps)^−½ and scale = w·rstd, both [C].
		rstd := b.scalar(graph.OpPowScalar, b.scalar(graph.OpAddScalar, stats[1], nd.Attrs.Eps), -0.5)
		scale := rstd
		if w >= 0 {
			scale = b.mul(w, rstd)
		}
		if want(0) { // scale broadcast as [C, 1, …, 1] against x [N, C, …]
			bc := make([]int, len(xt.Shape)-1)
			for i := range bc {
				bc[i] = 1
			}
			bc[0] = xt.Shape[1]
			b.accumulate(x, b.mul(g, b.emit(graph.OpReshape, graph.Attrs{Shape: bc}, scale)))
		}
		if want(1) {
			b.accumulate(stats[0], b.neg(b.mul(b.emit(graph.OpSum, graph.Attrs{Axes: axes}, g), scale)))
		}
		if want(2) {
			b.accumulate(stats[1], b.scalar(graph.OpMulScalar, b.mul(gradW(), b.mul(scale, rstd)), -0.5))
		}
	}
	if want(aff) {
		b.accumulate(in[aff], gradW())
	}
	if want(aff + 1) {
		b.accumulate(in[aff+1], b.emit(graph.OpSum, graph.Attrs{Axes: axes}, g))
	}
}
