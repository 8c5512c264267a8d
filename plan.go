package batchfit

import (
	"context"
	"errors"
	"fmt"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// StepPlan is a step as the session would run it now, planned and not
// run (Session.Plan, PlanEval, MaxBatch).
type StepPlan struct {
	// Plan is the planner's answer: the batch, its chunks (Plan.Split;
	// Plan.Chunks is nil, so that a plan's memory does not grow with the
	// batch), the predicted peak reserved and allocated bytes, the budget
	// and headroom planned within, and the allocator's timeline through
	// the persistent allocations and the first chunk. Nil when the step
	// does not fit (the error says why).
	Plan *planner.Plan
	// Program is the compiled step the plan runs: a recompute transform
	// of the plain step when Options.Recompute chose one. Its graph is a
	// copy without data (node values nil), so it keeps none of the
	// caller's tensors alive.
	Program *planner.Program
	// Recompute is the recompute choice, as LastRecompute reports a
	// step's (Strategy "none" for Eval and when nothing is recomputed).
	Recompute Recomputed
	// Search is the plain training step as recompute.Search takes it
	// (its graph without data), for callers that compare recompute
	// candidates themselves; zero for PlanEval.
	Search recompute.Step
	// Overhead is the executor's memory outside every plan
	// (Session.Overhead): a run's measured peak reserved bytes are the
	// plan's plus Overhead.
	Overhead int64
	// Passes is what each pass of the pipeline did to the step, in the
	// pipeline's order (package compile): whether it ran or why not, the
	// graph's nodes and bytes before and after. A training step's last
	// is the recompute pass's.
	Passes []compile.Report
	// Levers are the settings of the memory levers the session chose
	// among for this step, in the order tried, the one planned marked
	// Chosen: a fused loss's token chunks (Options.LossChunk 0), and with
	// Options.Offload OffloadAuto both placements of the optimizer. Nil
	// when there was no choice to make.
	Levers []LeverChoice
}

// Plan builds and plans the training step Step(ctx, loss, params, opt)
// would run now, without running it: the same precision pass, loss
// scaling, backward pass, recompute choice, program, residents and
// budget, through the same code, so Step's LastPlan is this plan (a
// device whose free memory moved between the two aside). Nothing is
// allocated or released on the device; the session's caches (step
// graphs, programs, plans, recompute choices) keep what Plan made, so a
// Step of the same graph after it finds them.
//
// Plan needs no data: parameters and inputs may be shape-only
// (lazy.ParamSpec, lazy.Placeholder, nn.Options.ShapeOnly), and
// parameters of any float dtype plan as the graph says. Step checks what
// running needs besides (float32 parameters holding host data). Plan
// trains nothing, so it claims no parameter: a dry-run session may plan
// the step of a model another session trains (ErrParamOwned is Step's).
//
// Like Step, Plan builds the backward pass on a copy of loss's graph:
// the caller's graph stays as it was built. When the step does not fit
// the budget, Plan returns the compiled step (Program, Search; Plan nil)
// with the planner's error, a *planner.DoesNotFitError (errors.Is
// planner.ErrDoesNotFit).
func (s *Session) Plan(loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) (*StepPlan, error) {
	_, done, err := s.hold() // it reads the executor's residents and allocator, which Close releases
	if err != nil {
		return nil, err
	}
	defer done()
	cs, err := s.compileStep(loss, params, opt, false)
	if err != nil {
		return nil, err
	}
	defer cs.release()
	sp := &StepPlan{Program: cs.prog.Rebind(structure(cs.prog.Graph)), Recompute: cs.re, Overhead: s.Overhead(), Passes: cs.passes, Levers: cs.levers}
	plain := sp.Program.Graph
	if cs.prog.Graph != cs.g {
		plain = structure(cs.g)
	}
	sp.Search = recompute.Step{Graph: plain, Boundary: cs.boundary, Outputs: cs.ids,
		Compile: s.compileOptions(cs.ids[1:1+len(cs.trained)], cs.trained, cs.slots, cs.unscale)}
	sp.Plan, err = s.planNext(cs.prog)
	return sp, err
}

// PlanEval builds and plans the evaluation Eval(ctx, outputs...) would
// run now, without running it, as Plan does for a training step.
func (s *Session) PlanEval(outputs ...*lazy.Tensor) (*StepPlan, error) {
	_, done, err := s.hold()
	if err != nil {
		return nil, err
	}
	defer done()
	p, passes, err := s.evalProgram(outputs, true)
	if err != nil {
		return nil, err
	}
	sp := &StepPlan{Program: p.Rebind(structure(p.Graph)), Recompute: Recomputed{Strategy: "none"}, Overhead: s.Overhead(), Passes: passes}
	sp.Plan, err = s.planNext(p)
	return sp, err
}

// planNext is the plan the next run of p takes, as run plans it (the
// residents once ReleaseUnread has run, the budget, keptPlanOf's rule),
// without releasing or running anything, with the timeline of the
// persistent allocations and the first chunk and no chunk list.
func (s *Session) planNext(p *planner.Program) (*planner.Plan, error) {
	var held []planner.Held
	if h := exec.Unreleased(p, s.be.Held()); !exec.HoldsExactly(p, h) {
		held = exec.PlanResidents(p, h)
	}
	budget, err := s.budget()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	prev, prevProg := s.last, s.lastProg
	s.mu.Unlock()
	if kept := s.keptPlanOf(p, held, prev, prevProg, budget); kept != nil {
		budget = kept.Budget // the plan the run keeps is the one made at that budget
	}
	// Timeline and NoChunkList change what a plan records, never the
	// chunks it picks: this is the plan run gets from the cache.
	o := s.planOptions(budget, held)
	o.Timeline, o.TimelineChunks, o.NoChunkList = true, 1, true
	return planner.Make(p, o)
}

// BatchBuilder builds a training step's loss over batch samples and
// lists the parameters the step trains, for Session.MaxBatch. Build over
// shape-only inputs (lazy.Placeholder) and parameters (nn.Options
// ShapeOnly, or the model's own: nothing runs), each call a new graph;
// a builder that fails returns a loss carrying its error
// (lazy.ErrorTensor).
type BatchBuilder func(batch int) (loss *lazy.Tensor, params []*lazy.Tensor)

// MaxBatchOptions configures Session.MaxBatch.
type MaxBatchOptions struct {
	// Limit is the largest batch the search tries (0: DefaultBatchLimit).
	// A step that fits at Limit is reported as Limit, with AtLimit set.
	Limit int
	// Target, when positive, is a batch to plan as Step would run it
	// (BatchFit.Target): in one chunk when it fits, in the chunks (and
	// with the recompute choice) the session picks otherwise.
	Target int
}

// DefaultBatchLimit is MaxBatch's largest batch when
// MaxBatchOptions.Limit is 0.
const DefaultBatchLimit = 1 << 20

// BatchFit is MaxBatch's answer.
type BatchFit struct {
	// Batch is the largest batch whose training step runs in one chunk
	// within the session's budget (up to Limit); 0 when one sample does
	// not fit.
	Batch   int
	AtLimit bool      // Batch is the search's Limit: larger batches may fit too
	Plan    *StepPlan // the plan at Batch; nil when Batch is 0
	// Target is the plan at MaxBatchOptions.Target (nil without one, or
	// when it does not fit: MaxBatch's error then says why).
	Target *StepPlan
	// Plans counts the steps built and planned, the target's included.
	Plans int
}

// MaxBatch finds the largest batch whose training step (build's loss and
// parameters, opt's state) runs in one chunk within the session's budget,
// as Step would run it: every candidate is built and planned by Plan, the
// Session's own compile path, with its budget, residents, Options
// (precision, MaxChunk, Recompute) and its executor's workspaces. It
// doubles the batch from 1 until a step does not fit in one chunk, then
// bisects, which assumes a larger batch never needs less memory; about
// 2·log₂(Batch) plans. Plans are exact replays through the allocator, so
// Batch fits and Batch+1 does not (below Limit).
//
// With Target it also plans the step at Target samples (BatchFit.Target):
// the chunks that batch runs in. When even that does not fit, MaxBatch
// returns the fit so far with the planner's error (errors.Is
// planner.ErrDoesNotFit). Any other error of a build or a plan ends the
// search and is returned.
//
// Under Options.Offload OffloadAuto, before the session has chosen, the
// search runs with the optimizer on the device and offloaded (on dry-run
// probes), and the session keeps the place whose largest batch the cost
// model predicts trains the most samples a second (a tie: the device's),
// then searches there; Plans counts the probes' plans too.
func (s *Session) MaxBatch(build BatchBuilder, opt optim.Optimizer, o MaxBatchOptions) (*BatchFit, error) {
	if _, err := s.executor(); err != nil {
		return nil, err
	}
	if build == nil {
		return nil, &graph.OpError{Op: "max_batch", Err: graph.Errorf(graph.ErrNilTensor, "nil builder")}
	}
	limit := o.Limit
	if limit == 0 {
		limit = DefaultBatchLimit
	}
	if limit < 0 || o.Target < 0 {
		return nil, &graph.OpError{Op: "max_batch", Err: graph.Errorf(graph.ErrShape, "limit %d and target %d: want positive batches (0: the defaults)", o.Limit, o.Target)}
	}
	fit := &BatchFit{}
	// An OffloadAuto session that has not chosen yet keeps the optimizer's
	// place whose largest batch trains the most samples a second.
	if err := s.chooseOffload(opt, func(probe func(Offload) *Session) (int32, error) {
		best, most := offloadOff, 0.0
		for _, place := range []Offload{OffloadNone, OffloadOptimizer} {
			f, err := probe(place).MaxBatch(build, opt, MaxBatchOptions{Limit: limit})
			if f != nil {
				fit.Plans += f.Plans
			}
			if err != nil {
				if place == OffloadNone {
					return 0, err
				}
				continue // a step the offloaded optimizer cannot run
			}
			if f.Batch == 0 {
				continue
			}
			seconds, _ := s.predicted(f.Plan.Program, f.Plan.Plan)
			if rate := float64(f.Batch) / seconds; rate > most { // a tie keeps the device's
				best, most = offloadOff, rate
				if place == OffloadOptimizer {
					best = offloadOn
				}
			}
		}
		return best, nil
	}); err != nil {
		return nil, err
	}
	plan := func(n int) (*StepPlan, error) {
		fit.Plans++
		loss, params := build(n)
		if loss == nil {
			return nil, &graph.OpError{Op: "max_batch", Err: graph.Errorf(graph.ErrNilTensor, "the builder returned no loss for batch %d", n)}
		}
		sp, err := s.Plan(loss, params, opt)
		if err == nil && sp.Plan.Batch != n {
			err = &graph.OpError{Op: "max_batch", Err: graph.Errorf(graph.ErrShape, "the builder's step for batch %d has a batch of %d", n, sp.Plan.Batch)}
		}
		return sp, err
	}
	// whole reports whether the step at n runs in one chunk.
	whole := func(n int) (bool, error) {
		sp, err := plan(n)
		if errors.Is(err, planner.ErrDoesNotFit) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("batch %d: %w", n, err)
		}
		if sp.Plan.Split.Len() > 1 {
			return false, nil
		}
		fit.Batch, fit.Plan = n, sp // probes that fit only grow
		return true, nil
	}
	lo, hi := 0, limit+1 // lo fits in one chunk (0 trivially), hi does not
	for n := 1; ; n = min(2*n, limit) {
		ok, err := whole(n)
		if err != nil {
			return nil, err
		}
		if !ok {
			hi = n
			break
		}
		if lo = n; n == limit {
			break
		}
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		ok, err := whole(mid)
		if err != nil {
			return nil, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	fit.AtLimit = lo == limit
	if o.Target > 0 {
		if o.Target == fit.Batch {
			fit.Target = fit.Plan
		} else {
			sp, err := plan(o.Target)
			if err != nil {
				return fit, fmt.Errorf("target batch %d: %w", o.Target, err)
			}
			fit.Target = sp
		}
	}
	return fit, nil
}

// DryRun makes a session that plans for a device without running on it
// (Options.DryRun): Plan, PlanEval and MaxBatch work as on that device,
// and Step and Eval return ErrDryRun once planned. Its simulated device
// holds Options.Budget bytes (0: planner.Unlimited), Overhead of them
// outside every plan, as a CUDA executor holds its cuBLAS workspace; steps
// compile with Workspace, the kernels' workspace rule of the device
// planned for (nil: the CPU executor's, cpu.Workspace; cuda.Workspace
// plans as programs compiled for CUDA without a device do).
type DryRun struct {
	Workspace planner.WorkspaceFunc
	Overhead  int64
}

// ErrDryRun is returned by Step and Eval on a session made with
// Options.DryRun: it plans and never runs.
var ErrDryRun = errors.New("batchfit: a dry-run session plans and does not run")

// dryExecutor is the executor of a DryRun session: the CPU executor's
// residents and allocator on a simulated device, the device's workspace
// rule and overhead, and no runs.
type dryExecutor struct {
	*cpu.Executor
	ws       planner.WorkspaceFunc
	overhead int64
}

// newDry makes o.DryRun's executor, or says why its options are wrong.
func newDry(o Options) (exec.Executor, string, error) {
	d := o.DryRun
	if d.Overhead < 0 || o.Budget > 0 && d.Overhead >= o.Budget {
		return nil, "", fmt.Errorf("%w: Options.DryRun.Overhead is %d bytes of a budget of %d", planner.ErrBudget, d.Overhead, o.Budget)
	}
	capacity := int64(planner.Unlimited)
	if o.Budget > 0 {
		capacity = o.Budget
	}
	e := dryExecutor{Executor: cpu.NewOn(alloc.New(alloc.NewSimBackend(capacity), alloc.Options{TraceEntries: o.TraceEntries})),
		ws: d.Workspace, overhead: d.Overhead}
	if e.ws == nil {
		e.ws = cpu.Workspace
	}
	return e, "dry run: plans only (Options.DryRun)", nil
}

func (e dryExecutor) Workspace() planner.WorkspaceFunc { return e.ws }
func (e dryExecutor) Overhead() int64                  { return e.overhead }

func (dryExecutor) Run(context.Context, *graph.Graph, ...int) ([]*tensor.Dense, error) {
	return nil, ErrDryRun
}

func (dryExecutor) Execute(context.Context, *planner.Program, []planner.Chunk, exec.Options) (*exec.Result, error) {
	return nil, ErrDryRun
}
