package lazy

import (
	"errors"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
)

// Grad appends the backward pass of the scalar loss to its graph and returns
// d loss / d p for each p in params, in order. Params the loss does not use
// get zero gradients. On error every returned tensor carries it.
func Grad(loss *Tensor, params ...*Tensor) []*Tensor {
	at := site()
	out := make([]*Tensor, len(params))
	fail := func(err error) []*Tensor {
		for i := range out {
			out[i] = &Tensor{id: -1, err: err}
		}
		return out
	}
	if err := loss.Err(); err != nil {
		return fail(err)
	}
	g := loss.g
	if g == nil {
		return fail(&graph.OpError{Op: "grad", Site: at, Err: graph.Errorf(graph.ErrArity, "loss is a free parameter, not a computed value")})
	}
	wrt := make([]int, len(params))
	for i, p := range params {
		if err := p.Err(); err != nil {
			return fail(err)
		}
		if p.zero() {
			return fail(&graph.OpError{Op: "grad", Site: at, Shapes: [][]int{loss.Shape()},
				Err: graph.Errorf(graph.ErrNilTensor, "parameter %d is a zero lazy.Tensor", i)})
		}
		if p.g != nil && p.g != g {
			return fail(&graph.OpError{Op: "grad", Site: at, Shapes: [][]int{loss.Shape(), p.Shape()},
				Err: graph.Errorf(graph.ErrMixedGraphs, "parameter %d belongs to another graph", i)})
		}
		id, err := g.bind(p)
		if err != nil {
			return fail(&graph.OpError{Op: "grad", Site: at, Err: err})
		}
		wrt[i] = id
	}
	ids, err := autodiff.Backward(g.ir, loss.id, wrt)
	if err != nil {
		if oe := (*graph.OpError)(nil); !errors.As(err, &oe) { // every error of the API is an *OpError
			err = &graph.OpError{Op: "grad", Site: at, Err: err}
		}
		return fail(err)
	}
	for i, id := range ids {
		out[i] = &Tensor{g: g, id: id}
	}
	return out
}
