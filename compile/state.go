package compile

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// state is a step being built: the graph so far and what maps the
// caller's graph into it.
type state struct {
	o    *Options
	mode Mode
	src  *graph.Graph // the caller's graph, never changed
	g    *graph.Graph // the forward graph so far (src until a pass rewrites it)
	ids  []int        // src's node i → its id in g (−1: removed)
	// Train: the caller's loss and parameters; st from the first Backward
	// entry on. Eval: the caller's outputs.
	loss    int
	params  []int
	outputs []int
	st      *precision.Step
	reports []Report
	// last is the latest measurement, of graph lastGraph at lastLen
	// nodes against lastOut.
	last      *sizes
	lastOut   []int
	lastGraph *graph.Graph
	lastLen   int
}

// sizes are a graph's measured bytes (Report).
type sizes struct{ bytes, peak int64 }

func start(g *graph.Graph, m Mode, o Options) (*state, error) {
	if _, err := precision.Parse(string(o.Policy)); err != nil {
		return nil, err
	}
	if err := Check(o.Disable); err != nil {
		return nil, err
	}
	s := &state{o: &o, mode: m, src: g, g: g, ids: make([]int, g.Len())}
	for i := range s.ids {
		s.ids[i] = i
	}
	return s, nil
}

// rebind makes ng the forward graph, ids[i] being the current graph's
// node i's id in it.
func (s *state) rebind(ng *graph.Graph, ids []int) {
	for i, id := range s.ids {
		if id >= 0 {
			s.ids[i] = ids[id]
		}
	}
	s.g = ng
}

// graph is the graph the passes work on now.
func (s *state) graph() *graph.Graph {
	if s.st != nil {
		return s.st.Graph
	}
	return s.g
}

// outs are the values a measurement keeps: the step's outputs from the
// backward stage on, the forward graph's before.
func (s *state) outs() []int {
	var outs []int
	switch {
	case s.st != nil:
		outs = s.st.Outputs()
	case s.mode == EvalStep:
		for _, id := range s.outputs {
			outs = append(outs, s.ids[id])
		}
	default:
		outs = []int{s.ids[s.loss]}
	}
	return slices.DeleteFunc(outs, func(id int) bool { return id < 0 })
}

// begin starts the training step on the forward graph: on a copy of the
// caller's graph when no pass rewrote it (the passes after append to it).
func (s *state) begin() error {
	if s.g == s.src {
		s.g = s.src.Clone()
	}
	loss := s.ids[s.loss]
	if loss < 0 {
		return graph.Errorf(graph.ErrArity, "compile: loss node %d was fused into attention_qkv", s.loss)
	}
	st := &precision.Step{Graph: s.g, Loss: loss, Params: make([]int, len(s.params)), Scale: -1, Scaled: loss, IDs: s.ids}
	for i, id := range s.params {
		if st.Params[i] = s.ids[id]; st.Params[i] < 0 {
			return graph.Errorf(graph.ErrArity, "compile: parameter id %d does not name a node of the step", id)
		}
	}
	s.st = st
	return nil
}

// runAll runs the table's Forward and Backward entries in order.
func (s *state) runAll() error {
	for _, p := range table {
		if p.Stage == Program {
			continue
		}
		if p.Stage == Backward && s.mode == TrainStep && s.st == nil {
			if err := s.begin(); err != nil {
				return err
			}
		}
		g := s.graph()
		r := Report{Name: p.Name, NodesBefore: g.Len(), NodesAfter: g.Len()}
		if ok, why := p.Applies(s.mode, *s.o); !ok {
			r.Why = why
			s.reports = append(s.reports, r)
			continue
		}
		var before sizes
		if !s.o.NoMeasure {
			b, err := s.measure()
			if err != nil {
				return err
			}
			before = b
		}
		if err := p.run(s); err != nil {
			return err
		}
		r.Ran, r.NodesAfter = true, s.graph().Len()
		if !s.o.NoMeasure {
			after, err := s.measure()
			if err != nil {
				return err
			}
			r.Measured = true
			r.BytesBefore, r.PeakBefore, r.BytesAfter, r.PeakAfter = before.bytes, before.peak, after.bytes, after.peak
		}
		s.reports = append(s.reports, r)
	}
	return nil
}

// measure is the current graph's sizes against outs, from the last
// measurement when neither changed since.
func (s *state) measure() (sizes, error) {
	outs := s.outs()
	if s.last != nil && slices.Equal(outs, s.lastOut) && s.lastLen == s.graph().Len() && s.lastGraph == s.graph() {
		return *s.last, nil
	}
	m, err := measure(s.graph(), outs)
	if err != nil {
		return sizes{}, err
	}
	s.last, s.lastOut, s.lastGraph, s.lastLen = &m, outs, s.graph(), s.graph().Len()
	return m, nil
}

// measure sums g's values that outputs need, sources aside, and finds its
// live peak in node order, at g's full batch (shapeinfer).
func measure(g *graph.Graph, outputs []int) (sizes, error) {
	r, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		return sizes{}, fmt.Errorf("compile: measuring the graph: %w", err)
	}
	b := max(g.Batch(), 1)
	var m sizes
	for id, last := range r.LastUse {
		if last >= 0 && g.Node(id).Op.Category() != graph.CatSource {
			m.bytes += r.Bytes(id, b)
		}
	}
	for _, v := range r.Timeline(g, b) {
		m.peak = max(m.peak, v)
	}
	return m, nil
}
