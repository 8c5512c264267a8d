package batchfit

import (
	"context"
	"fmt"
	"sync"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Options configures a Session.
type Options struct {
	// Budget is the device memory a step may reserve, in bytes; 0 means no
	// limit (the whole batch runs at once). With a budget the batch runs in
	// the balanced chunks the planner picks, with results identical to the
	// whole batch, and the CPU executor accounts on a simulated device of
	// exactly that capacity.
	Budget int64
	// Headroom is kept back from Budget (planner.DefaultHeadroom if 0).
	Headroom int64
	// TraceEntries keeps the allocator's last TraceEntries events, so its
	// snapshots carry their history (memviz exports them); 0 keeps none.
	TraceEntries int
	// Timeline records the allocator's state after every program step of
	// a run in LastUsage().Timeline: the measured per-op profile.
	Timeline bool
}

// Session runs steps of lazy graphs. Everything derivable from a graph's
// signature (its analysis, its program and its plan) is computed once.
type Session struct {
	opts  Options
	cpu   *cpu.Executor
	plans planner.Cache

	mu       sync.Mutex
	programs map[programKey]*planner.Program
	hits     int
	last     *planner.Plan
	lastProg *planner.Program
	usage    planner.Usage
}

type programKey struct {
	sig           uint64
	outputs, kept string
	trained       string
	slots         int
}

// NewSession returns a session with the given options.
func NewSession(opts Options) *Session {
	capacity := int64(cpu.Unlimited)
	if opts.Budget > 0 {
		capacity = opts.Budget
	}
	return &Session{opts: opts, programs: map[programKey]*planner.Program{},
		cpu: cpu.NewOn(alloc.New(alloc.NewSimBackend(capacity), alloc.Options{TraceEntries: opts.TraceEntries}))}
}

// Device names the executor the session runs on and why.
func (s *Session) Device() string {
	return "cpu: reference executor (gorgonia tensors + gonum BLAS)"
}

// CacheHits counts runs that reused a compiled program.
func (s *Session) CacheHits() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.hits
}

// LastPlan is the plan of the latest Step or Eval.
func (s *Session) LastPlan() *planner.Plan {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

// LastProgram is the program the latest Step or Eval ran: what memviz
// names allocator blocks and profiles steps with.
func (s *Session) LastProgram() *planner.Program {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastProg
}

// LastUsage is the allocator's measured peak during the latest Step or
// Eval, and its timeline when Options.Timeline is set.
func (s *Session) LastUsage() planner.Usage {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.usage
}

// Allocator is the allocator the session's executor accounts in: its
// Stats are the familiar memory_stats.
func (s *Session) Allocator() *alloc.Allocator { return s.cpu.Allocator() }

// Yield gives the session's device memory back between steps, as
// pytorch_memlab's Courtesy does, for another job to use: the executor
// frees every block it keeps resident (parameters, constants, optimizer
// state) and empties its allocator's cache, so its reserved bytes drop to
// zero. Values survive in host memory: on the CPU executor they are the
// parameters' own tensors and the optimizer's state, which never leave
// the host; a GPU executor downloads them before freeing.
//
// Restore takes the memory back explicitly. Without it, the next Step or
// Eval restores by itself before it runs (and returns Restore's error if
// it cannot), so a training loop that yields between steps needs no other
// change. Either way the step that follows
// runs as if Yield had never happened: the same parameters and optimizer
// state, bit for bit, and the peaks the plan predicts.
func (s *Session) Yield() error { return s.cpu.Yield() }

// Restore re-allocates and refills what Yield gave back, in the order it
// was first allocated. When the device cannot hold it (another process
// kept the memory) it returns the allocator's out-of-memory error and the
// session stays yielded, holding nothing; it may be called again. Restore
// without a Yield does nothing.
func (s *Session) Restore() error { return s.cpu.Restore() }

// Yielded reports whether the session's memory is given back.
func (s *Session) Yielded() bool { return s.cpu.Yielded() }

// program returns the compiled program of g for outputs, computing the
// analysis and schedule once per graph signature.
func (s *Session) program(g *graph.Graph, outputs, kept, trained []int, slots int) (*planner.Program, error) {
	key := programKey{sig: g.Signature(), outputs: fmt.Sprint(outputs), kept: fmt.Sprint(kept),
		trained: fmt.Sprint(trained), slots: slots}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.programs[key]; ok {
		s.hits++
		return p.Rebind(g), nil
	}
	info, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		return nil, err
	}
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Kept: kept, Trained: trained,
		StateSlots: slots, Workspace: cpu.Workspace})
	if err != nil {
		return nil, err
	}
	s.programs[key] = p
	return p, nil
}

// run plans p within the budget and executes it.
func (s *Session) run(ctx context.Context, p *planner.Program, update func([][]float32) error) ([]*tensor.Dense, error) {
	budget := s.opts.Budget
	if budget == 0 {
		budget = cpu.Unlimited
	}
	pl, err := s.plans.Plan(p, planner.Options{Budget: budget, Headroom: s.opts.Headroom})
	if err != nil {
		return nil, err
	}
	res, err := s.cpu.Execute(ctx, p, pl.Chunks, cpu.ExecOptions{Resident: true, Update: update, Timeline: s.opts.Timeline})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.last, s.lastProg, s.usage = pl, p, res.Usage
	s.mu.Unlock()
	return res.Outputs, nil
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
	p, err := s.program(g.IR(), ids, nil, nil, 0)
	if err != nil {
		return nil, err
	}
	return s.run(ctx, p, nil)
}

// Step runs one training step: forward and backward of the scalar loss,
// then one optimizer update of params. It returns the loss. With a budget
// the batch runs in chunks whose gradients add up to the whole batch's.
func (s *Session) Step(ctx context.Context, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) (float32, error) {
	if err := loss.Err(); err != nil {
		return 0, err
	}
	if opt == nil {
		return 0, &graph.OpError{Op: "step", Err: graph.Errorf(graph.ErrNilTensor, "nil optimizer")}
	}
	grads := lazy.Grad(loss, params...)
	outs := append([]*lazy.Tensor{loss}, grads...)
	g, err := sameGraph("step", outs)
	if err != nil {
		return 0, err
	}
	data := make([][]float32, len(params))
	for i, p := range params {
		if data[i], err = paramData(p); err != nil {
			return 0, err
		}
	}
	ids := make([]int, len(outs))
	for i, t := range outs {
		ids[i] = t.ID()
	}
	trained := make([]int, len(params))
	for i, p := range params {
		trained[i] = g.NodeOf(p)
	}
	prog, err := s.program(g.IR(), ids, ids[1:], trained, opt.StateSlots())
	if err != nil {
		return 0, err
	}
	update := func(kept [][]float32) error {
		upd := make([]optim.Param, len(params))
		for i, p := range params {
			upd[i] = optim.Param{Key: p.Value(), Name: p.Name(), Data: data[i], Grad: kept[i]}
		}
		return opt.Step(upd)
	}
	vals, err := s.run(ctx, prog, update)
	if err != nil {
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
