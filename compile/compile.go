package compile

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
)

// Mode is the kind of step a pass applies to: a training step, an
// evaluation (no gradients), or both (TrainStep | EvalStep).
type Mode uint8

// The modes.
const (
	TrainStep Mode = 1 << iota // a training step: forward, loss, backward
	EvalStep                   // an evaluation: the forward graph's outputs
)

func (m Mode) String() string {
	switch m {
	case TrainStep:
		return "train"
	case EvalStep:
		return "eval"
	case TrainStep | EvalStep:
		return "train, eval"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// Stage is where in a step a pass runs.
type Stage uint8

// The stages, in order.
const (
	// Forward passes rewrite the forward graph: ids map each node of the
	// caller's graph to its value in the new one.
	Forward Stage = iota
	// Backward passes build and rewrite the training graph: the loss
	// scale, autodiff, then the fusions of the backward pass, each
	// keeping the step's outputs (precision.Step.Outputs). An entry of
	// this stage that applies to evaluations too runs there on the
	// forward graph, keeping the evaluation's outputs.
	Backward
	// Program passes run when the step is planned, on the compiled
	// step's graph at a budget: recompute (the Session runs it, by
	// RunRecompute; Train and Eval do not report them).
	Program
)

func (s Stage) String() string {
	switch s {
	case Forward:
		return "forward"
	case Backward:
		return "backward"
	case Program:
		return "program"
	}
	return fmt.Sprintf("Stage(%d)", uint8(s))
}

// Condition is a pass's precondition on a step's Options, with the words
// the docs and skip reasons use for it.
type Condition struct {
	Text  string
	holds func(*Options) bool
}

// Pass is one entry of the pipeline's table (Passes).
type Pass struct {
	Name  string
	Stage Stage
	Modes Mode      // the steps it applies to
	When  Condition // and when, given the step's Options
	// Required passes cannot be disabled (autodiff: a training step
	// without its backward pass has no gradients).
	Required bool
	Doc      string // what it does, one line
	run      func(*state) error
}

// Applies reports whether p runs in a step of mode m with options o, and
// why not when it does not: the wrong mode, Options.Disable, or its
// precondition.
func (p Pass) Applies(m Mode, o Options) (ok bool, why string) {
	switch {
	case p.Modes&m == 0:
		return false, p.Modes.String() + " steps only"
	case o.Disabled(p.Name):
		return false, "disabled"
	case !p.When.holds(&o):
		why := "needs " + p.When.Text
		if p.When.Text == mixedPolicy.Text {
			why += "; the policy is " + string(o.policy())
		}
		return false, why
	}
	return true, ""
}

// Passes is the pipeline's table: every pass, in the order a step runs
// them. The slice is a copy.
func Passes() []Pass { return slices.Clone(table) }

// Names lists the passes' names in order.
func Names() []string {
	names := make([]string, len(table))
	for i, p := range table {
		names[i] = p.Name
	}
	return names
}

// Recompute is the name of the recompute pass, the table's last entry,
// which the Session runs at plan time (RunRecompute).
const Recompute = "recompute"

// FusePointwise is the name of the pointwise fusion pass
// (graph.FusePointwise), which Options.NoPointwiseFusion of a Session
// leaves out.
const FusePointwise = "fuse-pointwise"

// FuseLinearCrossEntropy is the name of the fused head and loss pass
// (graph.FuseLinearCrossEntropy), which Options.NoFusedLoss of a Session
// leaves out.
const FuseLinearCrossEntropy = "fuse-linear-cross-entropy"

// Options are what decides which passes a step runs.
type Options struct {
	// Policy is the precision policy ("" is fp32).
	Policy precision.Policy
	// ChannelsLast stores conv nets' 4-D activations channels last
	// (package layout), after the policy's rewrite and before the
	// backward pass; graphs without a conv2d are unchanged. Step.IDs then
	// names a channels-last value for a node inside such a region.
	ChannelsLast bool
	// LossScale appends dynamic loss scaling (precision.Step.ScaleLoss)
	// before the backward pass; Scale is the scale constant's data
	// (precision.Scaler.Data), nil in a shape-only graph.
	LossScale bool
	Scale     tensor.Tensor
	// Plain keeps a step that needs no rewrite of its forward graph (a
	// policy of float32 values, fp32 or tf32, without ChannelsLast) the
	// plain backward pass appended to a copy of it: the passes whose
	// precondition is "a rewritten step" skip it. A Session's steps set
	// it; without it every policy fuses layer-norm gradients.
	Plain bool
	// Disable names passes not to run (Passes' names). A name that is no
	// pass, or names a required one, is a *PassNameError (Check).
	Disable []string
	// OffloadParams holds every float32 parameter in bfloat16 (the
	// "offload-params" pass): an offloaded optimizer's device copies
	// (batchfit.Options.Offload), whose float32 masters are on the host.
	OffloadParams bool
	// LossChunk is the fused loss's tokens per logits chunk
	// (graph.Attrs.LossChunk; 0: graph.DefaultLossChunk, which a Session
	// replaces by its choice, batchfit.Options.LossChunk).
	LossChunk int
	// NoMeasure leaves the reports' byte counts zero (Report.Measured
	// false): Session.Eval sets it, as it runs the passes on every call.
	NoMeasure bool
}

func (o *Options) policy() precision.Policy {
	if o.Policy == "" {
		return precision.FP32
	}
	return o.Policy
}

// Disabled reports whether Disable names the pass.
func (o Options) Disabled(name string) bool { return slices.Contains(o.Disable, name) }

// ErrUnknownPass and ErrRequiredPass are wrapped by a *PassNameError.
var (
	ErrUnknownPass  = errors.New("unknown pass")
	ErrRequiredPass = errors.New("required pass")
)

// PassNameError is a name in Options.Disable that no pass has
// (ErrUnknownPass), or that names a pass a step cannot do without
// (ErrRequiredPass).
type PassNameError struct {
	Name string
	Err  error
}

func (e *PassNameError) Error() string {
	if errors.Is(e.Err, ErrRequiredPass) {
		return fmt.Sprintf("compile: %v %q cannot be disabled", e.Err, e.Name)
	}
	return fmt.Sprintf("compile: %v %q (passes: %s)", e.Err, e.Name, strings.Join(Names(), ", "))
}

func (e *PassNameError) Unwrap() error { return e.Err }

// Check returns a *PassNameError for the first of names that names no
// pass or a required one, nil when every name may be disabled.
func Check(names []string) error {
	for _, n := range names {
		i := slices.IndexFunc(table, func(p Pass) bool { return p.Name == n })
		switch {
		case i < 0:
			return &PassNameError{Name: n, Err: ErrUnknownPass}
		case table[i].Required:
			return &PassNameError{Name: n, Err: ErrRequiredPass}
		}
	}
	return nil
}

// Report is what one pass did to a step: whether it ran (and why not),
// the graph's node count before and after, and, when measured, the bytes
// of its tensors before and after, from shapeinfer at the graph's full
// batch: Bytes sums the values the step's outputs need (sources, which
// their owners hold, aside), Peak is the largest sum of values live at
// once in node order (shapeinfer's Timeline: before the allocator's
// rounding and caching, sources included). A forward pass is measured
// against the forward graph's outputs, a backward one against the step's
// (precision.Step.Outputs), so "autodiff" reports the backward pass's
// whole cost.
type Report struct {
	Name        string `json:"name"`
	Ran         bool   `json:"ran"`
	Why         string `json:"why,omitempty"` // why it did not run
	NodesBefore int    `json:"nodes_before,omitempty"`
	NodesAfter  int    `json:"nodes_after,omitempty"`
	Measured    bool   `json:"measured,omitempty"`
	BytesBefore int64  `json:"bytes_before,omitempty"`
	BytesAfter  int64  `json:"bytes_after,omitempty"`
	PeakBefore  int64  `json:"peak_before,omitempty"`
	PeakAfter   int64  `json:"peak_after,omitempty"`
	Detail      string `json:"detail,omitempty"` // what the pass says of itself (recompute: the strategy)
}

// Saved is the bytes the pass saved (BytesBefore − BytesAfter; negative
// when it added tensors).
func (r Report) Saved() int64 { return r.BytesBefore - r.BytesAfter }

// PeakSaved is the live peak the pass saved (PeakBefore − PeakAfter).
func (r Report) PeakSaved() int64 { return r.PeakBefore - r.PeakAfter }

// Step is a training step built by the pipeline (Train): the
// precision.Step, and what each pass did, in table order (Program passes
// aside).
type Step struct {
	precision.Step
	Passes []Report
}

// Evaluation is an evaluation built by the pipeline (Eval): the
// graph, the caller's node i's id in it (IDs[i]; the identity, and Graph
// the caller's own graph, when no pass ran), the outputs' ids in it, and
// what each pass did.
type Evaluation struct {
	Graph   *graph.Graph
	IDs     []int
	Outputs []int
	Passes  []Report
}

// Train builds the training step of g: the passes of mode TrainStep, in
// table order, then the gradient of the scalar loss with respect to
// params (node ids of g) appended by autodiff. g itself stays as it was:
// the step is built on a copy. A Session's Step, Plan and MaxBatch, the
// CLI's estimate and the benchmarks all build steps here, so they plan
// the same graph.
func Train(g *graph.Graph, loss int, params []int, o Options) (*Step, error) {
	if loss < 0 || loss >= g.Len() {
		return nil, graph.Errorf(graph.ErrArity, "compile: loss id %d does not name a node", loss)
	}
	for _, id := range params {
		if id < 0 || id >= g.Len() {
			return nil, graph.Errorf(graph.ErrArity, "compile: parameter id %d does not name a node of the step", id)
		}
	}
	s, err := start(g, TrainStep, o)
	if err != nil {
		return nil, err
	}
	s.loss, s.params = loss, params
	if err := s.runAll(); err != nil {
		return nil, err
	}
	return &Step{Step: *s.st, Passes: s.reports}, nil
}

// Eval builds the evaluation of outputs (node ids of g): the passes
// of mode EvalStep, in table order. g stays as it was.
func Eval(g *graph.Graph, outputs []int, o Options) (*Evaluation, error) {
	for _, id := range outputs {
		if id < 0 || id >= g.Len() {
			return nil, graph.Errorf(graph.ErrArity, "compile: output id %d does not name a node", id)
		}
	}
	s, err := start(g, EvalStep, o)
	if err != nil {
		return nil, err
	}
	s.outputs = outputs
	if err := s.runAll(); err != nil {
		return nil, err
	}
	ev := &Evaluation{Graph: s.g, IDs: s.ids, Outputs: make([]int, len(outputs)), Passes: s.reports}
	for i, id := range outputs {
		ev.Outputs[i] = s.ids[id]
	}
	return ev, nil
}

// RunRecompute runs the recompute pass on a compiled training step's
// graph g, whose backward pass starts at node boundary: the forward nodes
// of set are recomputed in backward (recompute.Apply), strategy naming
// the choice. It returns the new graph, old node i's id in it (remap[i]),
// the nodes it appended and the pass's report, measured against outputs
// (ids in g) unless o.NoMeasure. An empty set, or o disabling the pass,
// returns g as it is.
func RunRecompute(g *graph.Graph, boundary int, set []int, strategy string, outputs []int, o Options) (*graph.Graph, []int, int, Report, error) {
	r := Report{Name: Recompute, NodesBefore: g.Len(), NodesAfter: g.Len()}
	if o.Disabled(Recompute) {
		r.Why = "disabled"
		return g, nil, 0, r, nil
	}
	if len(set) == 0 {
		r.Why = "nothing chosen to recompute"
		return g, nil, 0, r, nil
	}
	mark := make([]bool, boundary)
	for _, id := range set {
		if id < 0 || id >= boundary {
			return nil, nil, 0, r, graph.Errorf(graph.ErrArity, "compile: recompute node %d is not a forward node (the backward pass starts at %d)", id, boundary)
		}
		mark[id] = true
	}
	ng, remap, copies, err := recompute.Apply(g, boundary, mark)
	if err != nil {
		return nil, nil, 0, r, err
	}
	r.Ran, r.NodesAfter = true, ng.Len()
	r.Detail = fmt.Sprintf("%s: %d forward nodes, %d copies", strategy, len(set), copies)
	if !o.NoMeasure {
		outs := make([]int, len(outputs))
		for i, id := range outputs {
			outs[i] = remap[id]
		}
		before, err := measure(g, outputs)
		if err != nil {
			return nil, nil, 0, r, err
		}
		after, err := measure(ng, outs)
		if err != nil {
			return nil, nil, 0, r, err
		}
		r.Measured = true
		r.BytesBefore, r.PeakBefore, r.BytesAfter, r.PeakAfter = before.bytes, before.peak, after.bytes, after.peak
	}
	return ng, remap, copies, r, nil
}

// NotRun is the report of a pass that did not run on a graph of nodes
// nodes, why saying why (the Session's recompute report when it chose
// nothing).
func NotRun(name, why string, nodes int) Report {
	return Report{Name: name, Why: why, NodesBefore: nodes, NodesAfter: nodes}
}

// Markdown is the table as a Markdown table, one row per pass in order:
// docs/ARCHITECTURE.md shows it (a test holds the two alike).
func Markdown() string {
	var b strings.Builder
	b.WriteString("| # | pass | stage | steps | runs when | what it does |\n|---|---|---|---|---|---|\n")
	esc := strings.NewReplacer("|", `\|`).Replace
	for i, p := range table {
		when := p.When.Text
		if p.Required {
			when += " (required)"
		}
		fmt.Fprintf(&b, "| %d | `%s` | %s | %s | %s | %s |\n", i+1, p.Name, p.Stage, p.Modes, esc(when), esc(p.Doc))
	}
	return b.String()
}
