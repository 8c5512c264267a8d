package autodiff

import (
	"slices"

	"github.com/batchfit/batchfit/graph"
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
	b := &builder{g: g, grad: make([]int, n), need: need, slices: map[int][]slicePiece{}}
	for i := range b.grad {
		b.grad[i] = -1
	}
	b.fwd = g.Node(loss)
	b.grad[loss] = b.Emit(graph.OpFill, graph.Attrs{Scalar: 1, Target: lt})
	for id := loss; id >= 0 && b.err == nil; id-- {
		b.finishSlices(id) // every consumer of id has contributed by now
		gid := b.grad[id]
		if gid < 0 || g.Node(id).Op.Category().Leaf() {
			continue
		}
		b.fwd = g.Node(id)
		b.vjp(gid)
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
			out[i] = b.Emit(graph.OpFill, graph.Attrs{Target: g.Node(w).Type})
		}
	}
	return out, b.err
}

var _ graph.VJPBuilder = (*builder)(nil)

// builder appends gradient nodes; the first error sticks. It is the
// graph.VJPBuilder the ops' VJPs (in their specs) build with.
type builder struct {
	g    *graph.Graph
	grad []int       // gradient id per forward id, −1 while none
	need []bool      // need[id]: id depends on some node of wrt
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

// Type is node id's type.
func (b *builder) Type(id int) graph.Type { return b.g.Node(id).Type }

// Emit appends op over inputs, tagged with the forward node's module path
// and call site so memory reports can name backward buffers.
func (b *builder) Emit(op graph.Op, a graph.Attrs, inputs ...int) int {
	if b.err != nil {
		return -1
	}
	site, scope := b.fwd.Site, b.fwd.Scope
	id, err := b.g.Append(graph.Node{Op: op, Inputs: inputs, Attrs: a, Site: site, Scope: scope})
	if err != nil {
		shapes := make([][]int, len(inputs))
		for i, in := range inputs {
			if in >= 0 && in < b.g.Len() {
				shapes[i] = b.Type(in).Shape
			}
		}
		b.err = &graph.OpError{Op: op.String() + " (backward of " + b.fwd.Op.String() + ")", Shapes: shapes, Site: site, Err: err}
		return -1
	}
	return id
}

// Accumulate adds contribution c to the gradient of forward node id. A
// gradient has its value's dtype, as PyTorch's autograd keeps it: a
// contribution of another float dtype (from an op that promoted a
// bfloat16 operand to float32) is cast to it first.
func (b *builder) Accumulate(id, c int) {
	if c < 0 || b.err != nil {
		return
	}
	if dt := b.Type(id).DType; dt.IsFloat() && b.Type(c).DType != dt {
		c = b.Emit(graph.OpCast, graph.Attrs{Target: graph.Type{DType: dt}}, c)
	}
	if b.grad[id] < 0 {
		b.grad[id] = c
		return
	}
	b.grad[id] = b.Emit(graph.OpAdd, graph.Attrs{}, b.grad[id], c)
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
			b.Accumulate(id, ps[0].g)
			return
		}
		gs := make([]int, len(order))
		for i, k := range order {
			gs[i] = ps[k].g
		}
		b.Accumulate(id, b.Emit(graph.OpConcat, graph.Attrs{Axis: ps[0].fwd.Attrs.Axis}, gs...))
		return
	}
	for _, p := range ps {
		b.fwd = p.fwd
		a := p.fwd.Attrs
		b.Accumulate(id, b.Emit(graph.OpSliceGrad, graph.Attrs{Axis: a.Axis, Start: a.Start, End: a.End, Step: a.Step, Target: b.Type(id)}, p.g))
	}
}

// tiling returns the order (by start) in which slices ps of node id cover
// one axis other than the batch axis exactly, with unit steps, no overlap
// and no gap; ok is false for any other set.
func (b *builder) tiling(id int, ps []slicePiece) (order []int, ok bool) {
	t := b.Type(id)
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

// SumTo reduces a broadcast gradient back to the shape of forward value id.
func (b *builder) SumTo(gid, id int) int {
	if b.err != nil {
		return -1
	}
	gs, ts := b.Type(gid).Shape, b.Type(id).Shape
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
	s := b.Emit(graph.OpSum, graph.Attrs{Axes: axes, KeepDim: true}, gid)
	if lead > 0 {
		s = b.Emit(graph.OpReshape, graph.Attrs{Shape: slices.Clone(ts)}, s)
	}
	return s
}

// AccumulateSlice keeps gradient g of the forward slice node back until
// every consumer of x has contributed (finishSlices).
func (b *builder) AccumulateSlice(x, g int) {
	b.slices[x] = append(b.slices[x], slicePiece{fwd: b.fwd, g: g})
}

// Wants reports whether input i of the forward node needs a gradient.
func (b *builder) Wants(i int) bool {
	in := b.fwd.Inputs
	return i < len(in) && b.need[in[i]]
}

// vjp accumulates the gradients of the forward node's inputs given its
// upstream gradient g, as the op's spec says.
func (b *builder) vjp(g int) {
	nd := b.fwd
	vjp := nd.Op.Info().VJP
	if vjp == nil {
		b.err = &graph.OpError{Op: "backward", Site: nd.Site,
			Err: graph.Errorf(graph.ErrAttr, "no gradient for op %s (node %d)", nd.Op, nd.ID)}
		return
	}
	vjp(b, nd, g)
}
