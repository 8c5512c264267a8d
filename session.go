package batchfit

import (
	"context"
	"fmt"
	"sync"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Options configures a Session. The zero value runs on the CPU.
type Options struct{}

// Session runs steps of lazy graphs and caches per-signature analyses.
type Session struct {
	opts Options
	cpu  *cpu.Executor

	mu       sync.Mutex
	analyses map[analysisKey]*shapeinfer.Result
	hits     int
}

type analysisKey struct {
	sig     uint64
	outputs string
}

// NewSession returns a session with the given options.
func NewSession(opts Options) *Session {
	return &Session{opts: opts, cpu: cpu.New(), analyses: map[analysisKey]*shapeinfer.Result{}}
}

// Device names the executor the session runs on and why.
func (s *Session) Device() string {
	return "cpu: reference executor (gorgonia tensors + gonum BLAS)"
}

// CacheHits counts steps that reused a cached analysis.
func (s *Session) CacheHits() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hits
}

// analysis returns the cached analysis of g for outputs, computing it once
// per graph signature.
func (s *Session) analysis(g *graph.Graph, outputs []int) (*shapeinfer.Result, error) {
	key := analysisKey{sig: g.Signature(), outputs: fmt.Sprint(outputs)}
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.analyses[key]; ok {
		s.hits++
		return r, nil
	}
	r, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		return nil, err
	}
	s.analyses[key] = r
	return r, nil
}

// sameGraph returns the graph shared by ts, or a typed error.
func sameGraph(op string, ts []*lazy.Tensor) (*lazy.Graph, error) {
	var g *lazy.Graph
	for i, t := range ts {
		if err := t.Err(); err != nil {
			return nil, err
		}
		switch {
		case t.Graph() == nil:
			return nil, &graph.OpError{Op: op, Err: graph.Errorf(graph.ErrArity, "output %d is a free parameter, not part of a graph", i)}
		case g == nil:
			g = t.Graph()
		case g != t.Graph():
			return nil, &graph.OpError{Op: op, Err: graph.Errorf(graph.ErrMixedGraphs, "output %d belongs to another graph", i)}
		}
	}
	if g == nil {
		return nil, &graph.OpError{Op: op, Err: graph.Errorf(graph.ErrArity, "no outputs")}
	}
	return g, nil
}

// Eval runs the graph of outputs without gradients (inference) and returns
// their values.
func (s *Session) Eval(ctx context.Context, outputs ...*lazy.Tensor) ([]*tensor.Dense, error) {
	g, err := sameGraph("eval", outputs)
	if err != nil {
		return nil, err
	}
	ids := make([]int, len(outputs))
	for i, t := range outputs {
		ids[i] = t.ID()
	}
	info, err := s.analysis(g.IR(), ids)
	if err != nil {
		return nil, err
	}
	return s.cpu.RunAnalyzed(ctx, g.IR(), info, g.IR().Batch(), nil, ids...)
}

// Step runs one training step: forward and backward of the scalar loss,
// then one optimizer update of params. It returns the loss.
func (s *Session) Step(ctx context.Context, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) (float32, error) {
	if err := loss.Err(); err != nil {
		return 0, err
	}
	grads := lazy.Grad(loss, params...)
	outs := append([]*lazy.Tensor{loss}, grads...)
	vals, err := s.Eval(ctx, outs...)
	if err != nil {
		return 0, err
	}
	upd := make([]optim.Param, len(params))
	for i, p := range params {
		data, err := paramData(p)
		if err != nil {
			return 0, err
		}
		// A float32 parameter's gradient is float32 of the same shape;
		// Float32s also covers shape [], where Data is a bare float32.
		upd[i] = optim.Param{Key: p.Value(), Name: p.Name(), Data: data, Grad: vals[i+1].Float32s()}
	}
	if err := opt.Step(upd); err != nil {
		return 0, err
	}
	return scalarOf(vals[0])
}

// scalarOf reads a one-element float32 tensor; gorgonia returns a scalar
// Dense's data as a bare float32 rather than a slice.
func scalarOf(d *tensor.Dense) (float32, error) {
	switch v := d.Data().(type) {
	case float32:
		return v, nil
	case []float32:
		if len(v) == 1 {
			return v[0], nil
		}
	}
	return 0, graph.Errorf(graph.ErrShape, "loss has shape %v, want a scalar", d.Shape())
}

// paramData is the float32 storage of a parameter, which the optimizer
// updates in place.
func paramData(p *lazy.Tensor) ([]float32, error) {
	d, ok := p.Value().(*tensor.Dense)
	if !ok || d == nil {
		return nil, &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()},
			Err: graph.Errorf(graph.ErrNoData, "parameter %q has no data (shape-only)", p.Name())}
	}
	if d.Dtype() != tensor.Float32 {
		return nil, &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()},
			Err: graph.Errorf(graph.ErrDType, "parameter %q is %v, want float32", p.Name(), d.Dtype())}
	}
	// The optimizer writes the backing slice in order, so it must be the
	// row-major layout the gradient has: a transposed or strided view is not.
	if d.RequiresIterator() {
		return nil, &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()},
			Err: graph.Errorf(graph.ErrAttr, "parameter %q is a transposed or strided view; materialize it before training", p.Name())}
	}
	// Float32s is the backing slice, a scalar's included (Data would
	// return a bare float32 for shape []).
	return d.Float32s(), nil
}
