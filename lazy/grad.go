package lazy

import (
	"errors"
	"fmt"

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

// TrainedIDs returns the node ids of params in loss's graph for a training
// step, which updates them: each must be a parameter (Param, ParamSpec,
// nn's modules' parameters), not an input, a constant or a computed value.
// A parameter the graph does not hold (the loss does not read it) gets −1.
// Unlike ParamIDs it adds no node: the caller's graph stays as it was, so
// steps of one loss may run from several goroutines. Errors are
// *graph.OpError naming op, the parameter's index and what it is, at the
// caller's site.
func TrainedIDs(op string, loss *Tensor, params ...*Tensor) ([]int, error) {
	if err := loss.Err(); err != nil {
		return nil, err
	}
	g := loss.g
	if g == nil {
		return nil, &graph.OpError{Op: op, Site: site(), Err: graph.Errorf(graph.ErrArity, "loss is a free parameter, not a computed value")}
	}
	wrt := make([]int, len(params))
	for i, p := range params {
		if err := p.Err(); err != nil {
			return nil, err
		}
		bad := func(sentinel error, format string, args ...any) error {
			return &graph.OpError{Op: op, Site: site(), Shapes: [][]int{p.Shape()}, Err: graph.Errorf(sentinel, "params[%d]: "+format, append([]any{i}, args...)...)}
		}
		notParam := func() error {
			return bad(graph.ErrNotParam, "%s is not a parameter: a step trains only parameters (lazy.Param)", p.describe())
		}
		switch {
		case p.zero():
			return nil, bad(graph.ErrNilTensor, "a zero lazy.Tensor, not a parameter")
		case p.g != nil && p.g != g:
			return nil, bad(graph.ErrMixedGraphs, "%s belongs to another graph", p.describe())
		case p.leaf != nil:
			if p.leaf.op != graph.OpParam {
				return nil, notParam()
			}
			id, ok := g.leaves[p.leaf]
			if !ok {
				id = -1
			}
			wrt[i] = id
		default:
			if g.ir.Node(p.id).Op != graph.OpParam {
				return nil, notParam()
			}
			wrt[i] = p.id
		}
	}
	return wrt, nil
}

// describe names t for an error: its op, its name when it has one, and
// for a node its id and the site that made it.
func (t *Tensor) describe() string {
	var op graph.Op
	var name, at string
	id := -1
	switch {
	case t.leaf != nil:
		op, name = t.leaf.op, t.leaf.name
	case t.g != nil:
		nd := t.g.ir.Node(t.id)
		op, name, at, id = nd.Op, nd.Name, nd.Site, t.id
	}
	s := "the " + op.String()
	if name != "" {
		s += fmt.Sprintf(" %q", name)
	}
	if id >= 0 {
		s += fmt.Sprintf(" (node %d", id)
		if at != "" {
			s += " made at " + at
		}
		s += ")"
	}
	return s
}
