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
	wrt, err := paramIDs(func() string { return at }, loss, params)
	if err != nil {
		return fail(err)
	}
	g := loss.g
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

// ParamIDs returns the node ids of params in loss's graph, adding free
// parameters to it as Grad does, with Grad's errors. It is for callers
// that build the backward pass themselves on a rewritten graph (package
// precision's Train).
func ParamIDs(loss *Tensor, params ...*Tensor) ([]int, error) {
	// The caller's site only on an error: a training step calls it every
	// step. site skips this package's frames, so it finds the same one.
	return paramIDs(site, loss, params)
}

func paramIDs(at func() string, loss *Tensor, params []*Tensor) ([]int, error) {
	if err := loss.Err(); err != nil {
		return nil, err
	}
	g := loss.g
	if g == nil {
		return nil, &graph.OpError{Op: "grad", Site: at(), Err: graph.Errorf(graph.ErrArity, "loss is a free parameter, not a computed value")}
	}
	wrt := make([]int, len(params))
	for i, p := range params {
		if err := p.Err(); err != nil {
			return nil, err
		}
		if p.zero() {
			return nil, &graph.OpError{Op: "grad", Site: at(), Shapes: [][]int{loss.Shape()},
				Err: graph.Errorf(graph.ErrNilTensor, "parameter %d is a zero lazy.Tensor", i)}
		}
		if p.g != nil && p.g != g {
			return nil, &graph.OpError{Op: "grad", Site: at(), Shapes: [][]int{loss.Shape(), p.Shape()},
				Err: graph.Errorf(graph.ErrMixedGraphs, "parameter %d belongs to another graph", i)}
		}
		id, err := g.bind(p)
		if err != nil {
			return nil, &graph.OpError{Op: "grad", Site: at(), Err: err}
		}
		wrt[i] = id
	}
	return wrt, nil
}
