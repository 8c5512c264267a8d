package batchfit

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/lru"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Options configures a Session.
type Options struct {
	// Device picks the executor: DeviceAuto ("auto", the default when
	// empty) runs on CUDA when a GPU is usable and on the CPU otherwise,
	// DeviceCPU always on the CPU, DeviceCUDA on CUDA or not at all.
	// Session.Device says which was chosen and why.
	Device string
	// TF32 lets CUDA run float32 matrix products on TF32 tensor cores
	// (10-bit mantissa products, float32 sums). Off by default: CUDA
	// computes in full FP32, as the CPU does. The CPU ignores it.
	// Precision "tf32" sets it too.
	TF32 bool
	// Budget is all the device memory the session may hold, in bytes:
	// its allocator's reserved bytes never exceed it, library workspaces
	// (Session.Overhead) included, so a step is planned within Budget −
	// Overhead. With a budget the batch runs in the balanced chunks the
	// planner picks, with results identical to the whole batch (batch
	// norm that opted in to per-chunk statistics, nn.BatchNorm2d's
	// PerChunkStats, aside: it normalises each chunk with its own, as
	// gradient accumulation does; LastPlan().BatchStats says so), and the
	// CPU executor accounts on a simulated device of exactly that
	// capacity. 0 means: on the CPU no limit (the whole batch runs at
	// once); on CUDA what the device can give, read before every run as
	// cuMemGetInfo's free bytes plus what the session's allocator reserves
	// already, less Overhead. A budget given on CUDA is capped at that. A
	// negative budget is an error (planner.ErrBudget, from Err and every
	// call).
	Budget int64
	// Headroom is kept back from Budget (planner.DefaultHeadroom if 0).
	Headroom int64
	// MaxChunk caps the samples per chunk (0: none): a fixed micro-batch,
	// the batch run as gradient accumulation over chunks of at most
	// MaxChunk samples even where memory holds more (planner.Options.MaxChunk).
	// Results are the whole batch's either way; the order of float sums
	// is the micro-batches'. A graph that cannot be chunked (batch norm
	// with whole-batch statistics) refuses it with planner.ErrBudget.
	MaxChunk int
	// TraceEntries keeps the allocator's last TraceEntries events, so its
	// snapshots carry their history (memviz exports them); 0 keeps none.
	// Outside 0…alloc.MaxTraceEntries the session holds an error wrapping
	// alloc.ErrInvalid.
	TraceEntries int
	// Timeline records the allocator's state after every program step of
	// a run in LastUsage().Timeline: the measured per-op profile.
	Timeline bool
	// NoCUDAGraphs makes the CUDA executor launch every kernel eagerly
	// instead of replaying captured CUDA graphs
	// (cuda.ExecutorOptions.NoCUDAGraphs).
	NoCUDAGraphs bool
	// Precision is the precision policy (package precision): "fp32" (the
	// default when empty), "tf32" (float32 values; on CUDA as TF32 does),
	// "bf16-mixed" or "fp16-mixed" (autocast's semantics: matrix products
	// and convolutions from 16-bit copies, softmax, norms, losses and
	// reductions in float32, parameters, gradients and optimizer state in
	// float32). Step and Eval apply it to the graph they are given before
	// autodiff and planning, so plans count every cast copy. Another name
	// makes the session hold an error wrapping precision.ErrUnknown. Both
	// executors run every policy. "fp16-mixed" scales the loss (LossScale).
	Precision string
	// Recompute is recompute.Off (the default: chunks are the planner's
	// only lever), recompute.SelectiveOnly or recompute.FullCheckpoint (that candidate
	// always, for comparisons), or recompute.Auto: when a training step's whole batch
	// does not fit in one chunk, recompute.Search picks the chunk size and
	// the forward values recomputed in backward (whole-block checkpoints,
	// selective recompute of cheap ops) that maximise predicted samples/s
	// with the replayed peak within the budget; LastRecompute says which.
	// Gradients are those of the plain step. Eval never recomputes.
	Recompute recompute.Mode
	// Profile is the cost model's device for Recompute and the choice of
	// LossChunk and Offload (zero: recompute.DefaultProfile).
	Profile recompute.Profile
	// LossScale configures dynamic loss scaling (precision.LossScale:
	// torch.cuda.amp.GradScaler's semantics), which Step applies under
	// Precision "fp16-mixed" unless LossScale.Off is set, and under no
	// other policy. The zero value is GradScaler's defaults: scale 2¹⁶,
	// halved after a step with an inf or NaN gradient (whose optimizer
	// update is skipped), doubled after 2000 good steps in a row.
	// Session.LossScale reports the scale and the skipped steps. Options
	// out of range make the session hold an error wrapping
	// precision.ErrLossScale.
	LossScale precision.LossScale
	// ChannelsLast stores conv nets' 4-D activations channels last (NHWC)
	// in training steps (package layout, the pipeline's channels-last
	// pass: compile.Options.ChannelsLast), after the precision pass, from
	// their bfloat16 convolutions on (layout.ConvTakes; other graphs are
	// unchanged), for cuDNN's NHWC convolutions and batchfit's vector
	// NHWC batch norm.
	// Shapes the caller sees stay NCHW; the plan counts the conversions.
	// Under "bf16-mixed" it is the default (NoChannelsLast turns it off):
	// on the H100 a ResNet-50 bf16-mixed step at batch 64 measured 23.4 ms
	// channels last against 31.8 in NCHW. No other policy has a bfloat16
	// convolution, so setting it there changes nothing. On CUDA the
	// channels-last convolutions run on cuDNN, or where it refuses one on
	// NCHW copies in the convolution's planned workspace; the CPU computes
	// every channels-last node in NCHW.
	ChannelsLast bool
	// NoChannelsLast keeps conv nets NCHW under "bf16-mixed", where
	// ChannelsLast is otherwise the default.
	NoChannelsLast bool
	// NoPointwiseFusion keeps a training step's elementwise ops one node
	// (one kernel) each, instead of the fused_pointwise nodes
	// graph.FusePointwise makes of their chains, forward and backward:
	// the same as naming "fuse-pointwise" in DisablePasses.
	NoPointwiseFusion bool
	// DryRun, when set, makes a session that plans for the device it
	// describes and runs nothing (Plan, PlanEval, MaxBatch; Step and Eval
	// return ErrDryRun), in place of the executor Device picks.
	DryRun *DryRun
	// Offload keeps optimizer state in host memory (OffloadOptimizer:
	// float32 masters and Adam's moments in page-locked host memory,
	// bfloat16 weights and gradients on the device; Precision
	// "bf16-mixed" only). Every float32 parameter, trained or not, is
	// held on the device in bfloat16, for Step and Eval alike. Plans
	// count both sides: LastPlan().HostPinned is the host bytes,
	// HostPinned what the executor holds. OffloadAuto plans the first
	// training step both ways and keeps the faster that fits
	// (Session.Offload says which, StepPlan.Levers what was weighed). An
	// unknown mode, or OffloadOptimizer under another policy, makes the
	// session hold an error wrapping ErrOffload.
	Offload Offload
	// NoFusedLoss keeps a language model's head and loss as built (the
	// same as naming "fuse-linear-cross-entropy" in DisablePasses). By
	// default a training step runs a linear (or a tied embedding's
	// transposed product) whose logits only a cross_entropy at the loss
	// reads as one linear_cross_entropy (graph.FuseLinearCrossEntropy):
	// the [N, V] logits and their gradient are never stored, only one
	// chunk of LossChunk tokens' logits at a time, and with a constant
	// seed (no loss scaling) the forward pass gives both gradients.
	NoFusedLoss bool
	// LossChunk is the tokens per logits chunk of a fused loss (0: the
	// session's choice among the powers of two from graph.MaxLossChunk
	// down, planner.LossChunkCandidates, each planned with its batch
	// chunks and recompute choice: the shortest step the cost model
	// predicts (Profile) whose plan fits; StepPlan.Levers lists them).
	// LastPlan().LossChunk reports the one planned.
	LossChunk int
	// DisablePasses names graph passes of the pipeline (package compile:
	// compile.Names) that the session's steps skip, to compare a step
	// with and without one; "recompute" turns Recompute off. A name that
	// is no pass, or names a required one (autodiff), makes the session
	// hold a *compile.PassNameError (errors.Is compile.ErrUnknownPass or
	// compile.ErrRequiredPass).
	DisablePasses []string
}

// Session runs steps of lazy graphs. Everything derivable from a graph's
// signature (its analysis, its program and its plan) is computed once and
// cached, at most planner.CacheSize programs and plans, the least recently
// used evicted first; cached programs hold no graph, so no step's data.
// So is a training step's graph (the precision pass and the backward
// pass): a loop that builds the same forward graph every step gets it
// differentiated once and reused with each step's data and random seeds
// (StepGraphHits). A cached entry keeps the structure of the graph it was
// made for (no data) and serves only a graph equal to it
// (graph.SameSignature), so two graphs whose signatures collide never
// share one; a steady loop's step is found by comparing its forward graph
// with the latest step's, without hashing it, and runs that step's program
// and plan.
//
// Between runs the executor keeps residents on the device: parameters,
// optimizer state and constants, in the order first allocated. Every run
// is planned on a device holding them all. A constant is released by the
// first run whose graph does not read it (one made every step lives one
// step), and that run starts from an empty allocator cache, its segments
// given back to the device and taken again: make constants once. A small
// one (up to exec.MaxRekeyBytes) made every step with the value it had is
// the resident one renamed, and costs nothing. Parameters and optimizer
// state stay until Close.
type Session struct {
	opts   Options
	policy precision.Policy
	scaler *precision.Scaler // nil without loss scaling; guarded by mu
	be     exec.Executor     // nil when err is set
	device string
	err    error // why no executor could be made
	closed atomic.Bool
	// life is held for reading by every call that reaches the executor
	// (Step, Eval, Plan, PlanEval, SyncParams, SyncState, Yield, Restore)
	// and for writing by Close, which so waits for the calls in flight
	// once stop has cancelled their contexts (with cause ErrClosed,
	// through stopped).
	life    sync.RWMutex
	stopped context.Context
	stop    context.CancelCauseFunc
	plans   planner.Cache

	mu       sync.Mutex
	programs lru.Cache[programKey, programEntry] // without their graphs' data
	hits     int
	last     *planner.Plan
	lastProg *planner.Program
	usage    planner.Usage
	chosen   lru.Cache[chosenKey, chosen] // recompute choices by step and budget
	// lossChunks are the fused loss's token chunks chosen
	// (chooseLossChunk) by step and budget; guarded by mu.
	lossChunks lru.Cache[chosenKey, lossChoice]
	// offloadChosen is an OffloadAuto session's choice (offloadUndecided,
	// offloadOff, offloadOn), made once under offloadMu (decideOffload).
	offloadChosen atomic.Int32
	offloadMu     sync.Mutex
	steps         lru.Cache[stepKey, *stepTemplate]
	stepHits      int
	lastRe        Recomputed
	// latest is the template of the latest training step: a steady loop's
	// next forward graph is compared with its forward graph, field by
	// field, instead of being hashed.
	latest *stepTemplate
	// checked is the parameter list (and each one's data) the latest step
	// found distinct, so a loop passing the same list is not checked again.
	checked []checkedParam

	times StepTimes // the latest training step's, LastStepTimes

	beforeRun    func() // tests: called between planning and running a step
	stepCacheOff bool   // tests: differentiate every step (no step templates)
}

// chosenKey names a recompute search: the step's program key, the budget
// and the residents it planned with.
type chosenKey struct {
	programKey
	budget int64
	held   string
}

// chosen is a search's answer, without its programs, and the structure
// of the graph it was searched for (without data), which a hit on its key
// must match.
type chosen struct {
	name string
	set  []int
	g    *graph.Graph
}

// programEntry is a cached program (holding no graph) and the structure of
// the graph it was compiled from (no data): a hit on the signature is used
// only when the graph matches it exactly (graph.SameSignature), so a
// signature collision compiles anew instead of running another graph's
// program.
type programEntry struct {
	p *planner.Program
	g *graph.Graph
}

// structure is g without its nodes' data, for a cache to compare later
// graphs with: a copy of its node list, sharing the nodes' slices.
func structure(g *graph.Graph) *graph.Graph {
	c := g.Clone()
	for i := range c.Len() {
		c.Node(i).Value = nil
	}
	return c
}

// checkedParam is a parameter of a list distinctParams accepted, with its
// data then.
type checkedParam struct {
	t *lazy.Tensor
	v tensor.Tensor
}

// Recomputed describes the recompute choice of the latest Step.
type Recomputed struct {
	Strategy string // "none" when nothing is recomputed
	Nodes    int    // forward nodes recomputed
	Copies   int    // nodes the transform appended
}

// stepKey names a training step's forward graph: its signature (shapes,
// ops, attributes and names; not its data), its loss and parameters, and
// whether it is loss-scaled.
type stepKey struct {
	sig    uint64
	seeds  uint64 // 0 for a template that takes each step's seeds; randomSeeds otherwise
	loss   int
	wrt    string
	scaled bool
}

// randomSeeds hashes the random-number attributes (Seed, Counter) of g's
// nodes, which Signature leaves out so that dropout with a new counter
// reuses its program. A step template copies them into its backward pass
// (dropout's gradient replays the forward mask); one whose seeded nodes
// all trace back to one forward node each takes every step's seeds
// (stepTemplate.seeded), any other is keyed by them too.
func randomSeeds(g *graph.Graph) uint64 {
	h := fnv.New64a()
	var buf [24]byte
	for i := range g.Len() {
		a := &g.Node(i).Attrs
		if a.Seed == 0 && a.Counter == 0 {
			continue
		}
		binary.LittleEndian.PutUint64(buf[0:], uint64(i))
		binary.LittleEndian.PutUint64(buf[8:], a.Seed)
		binary.LittleEndian.PutUint64(buf[16:], a.Counter)
		h.Write(buf[:])
	}
	return h.Sum64()
}

// stepTemplate is a training step's graph as backward built it (precision
// pass, loss scaling, backward pass), holding no data of the step that
// built it: the sources of the forward graph, and the loss scale, get the
// data of each step that reuses it (instantiate). A training loop builds
// the same forward graph every step, so the Session differentiates it once.
type stepTemplate struct {
	st      precision.Step // st.Graph without the step's data
	sources []int          // the forward graph's source nodes
	// key is the template's key in Session.steps; fwd is the forward graph
	// it was made from, without data, which a step's forward graph must
	// match exactly (graph.SameSignature, and the random seeds unless
	// seedsKnown) to use the template, with loss, wrt and scaled.
	key    stepKey
	fwd    *graph.Graph
	loss   int
	wrt    []int
	scaled bool
	// prog is the program compiled for st.Graph with the outputs of its
	// latest step (guarded by Session.mu): the next step with the same
	// outputs runs it without a cache key.
	prog *programMemo
	// seeded pairs each node of st.Graph with a Seed or Counter with the
	// forward node it has them from; valid when seedsKnown.
	seeded     [][2]int
	seedsKnown bool
	// sig is st.Graph's signature, which every instance shares (the data
	// and the random seeds it patches in are not part of a signature):
	// the program cache then needs no hash of the step graph per step.
	sig uint64
	// inst is the graph the latest step ran, reused by the next one: a
	// step patches its data and seeds into it instead of copying the
	// template's thousands of nodes. busy (guarded by Session.mu) marks
	// it taken by a step in flight; a second, concurrent step gets a copy.
	// Like Session.LastProgram's graph, it holds the latest step's data
	// until the next step replaces it.
	inst *graph.Graph
	busy bool
	// sites groups st.Graph's nodes by the forward node whose call site
	// they carry (the first with it): instantiate gives each group that
	// node's site in the step's own forward graph, so an error names the
	// lines that built the graph being run.
	sites []siteGroup
	// passes is what the pipeline's graph passes did to the step
	// (compile.Step.Passes).
	passes []compile.Report
}

// siteGroup is a forward node and the step graph's nodes with its site.
type siteGroup struct {
	fwd   int
	nodes []int
}

// programMemo is a step template's program and what it was compiled for.
type programMemo struct {
	p                      *planner.Program
	outputs, kept, trained []int
	slots                  int
	unscale                bool
}

func (m *programMemo) matches(outputs, kept, trained []int, slots int, unscale bool) bool {
	return m != nil && m.slots == slots && m.unscale == unscale &&
		slices.Equal(m.outputs, outputs) && slices.Equal(m.kept, kept) && slices.Equal(m.trained, trained)
}

// matches reports whether a step of forward graph fwd (loss, wrt, scaled
// as stepKey's) is t's: fwd equals t's forward graph in everything its
// signature covers, and in its random seeds unless t takes each step's.
func (t *stepTemplate) matches(fwd *graph.Graph, loss int, wrt []int, scaled bool) bool {
	if t.loss != loss || t.scaled != scaled || !slices.Equal(t.wrt, wrt) || !t.fwd.SameSignature(fwd) {
		return false
	}
	if !t.seedsKnown {
		for i := range fwd.Len() {
			a, b := &fwd.Node(i).Attrs, &t.fwd.Node(i).Attrs
			if a.Seed != b.Seed || a.Counter != b.Counter {
				return false
			}
		}
	}
	return true
}

// newTemplate keeps st without the data of its step; fwd is the structure
// of the step's forward graph as it was before the backward pass, which
// the template keeps.
func newTemplate(st *precision.Step, fwd *graph.Graph) *stepTemplate {
	t := &stepTemplate{st: *st, fwd: fwd}
	t.st.Graph = st.Graph.Clone()
	t.sig = t.st.Graph.Signature()
	seeds := map[[2]uint64]int{} // a forward node's (Seed, Counter) → its id; −1 when two share them
	// The forward graph is st.IDs's domain: without a precision pass the
	// backward pass was appended to it.
	for i := range len(st.IDs) {
		nd := fwd.Node(i)
		if nd.Op.Category() == graph.CatSource {
			t.sources = append(t.sources, i)
			t.st.Graph.Node(st.IDs[i]).Value = nil
		}
		if a := nd.Attrs; a.Seed != 0 || a.Counter != 0 {
			k := [2]uint64{a.Seed, a.Counter}
			if _, dup := seeds[k]; dup {
				seeds[k] = -1
			} else {
				seeds[k] = i
			}
		}
	}
	if st.Scale >= 0 {
		t.st.Graph.Node(st.Scale).Value = nil
	}
	group := map[string]int{} // a forward site → its index in t.sites
	for i := range len(st.IDs) {
		if at := fwd.Node(i).Site; at != "" {
			if _, ok := group[at]; !ok {
				group[at] = len(t.sites)
				t.sites = append(t.sites, siteGroup{fwd: i})
			}
		}
	}
	for j := range t.st.Graph.Len() {
		if k, ok := group[t.st.Graph.Node(j).Site]; ok {
			t.sites[k].nodes = append(t.sites[k].nodes, j)
		}
	}
	t.sites = slices.DeleteFunc(t.sites, func(sg siteGroup) bool { return len(sg.nodes) == 0 })
	t.seedsKnown = true
	for j := range t.st.Graph.Len() {
		a := t.st.Graph.Node(j).Attrs
		if a.Seed == 0 && a.Counter == 0 {
			continue
		}
		i, ok := seeds[[2]uint64{a.Seed, a.Counter}]
		if !ok || i < 0 {
			t.seedsKnown = false
			break
		}
		t.seeded = append(t.seeded, [2]int{j, i})
	}
	return t
}

// instantiate is the template's step over fwd's data and random seeds,
// with scale the loss scale's (nil without loss scaling), in g: t's
// reusable instance or a fresh copy of its graph.
func (t *stepTemplate) instantiate(g *graph.Graph, fwd *graph.Graph, scale tensor.Tensor) *precision.Step {
	st := t.st
	st.Graph = g
	for _, i := range t.sources {
		st.Graph.Node(st.IDs[i]).Value = fwd.Node(i).Value
	}
	if st.Scale >= 0 {
		st.Graph.Node(st.Scale).Value = scale
	}
	for _, p := range t.seeded {
		from, to := &fwd.Node(p[1]).Attrs, &st.Graph.Node(p[0]).Attrs
		to.Seed, to.Counter = from.Seed, from.Counter
	}
	for _, sg := range t.sites { // a group's nodes share one site
		if at := fwd.Node(sg.fwd).Site; st.Graph.Node(sg.nodes[0]).Site != at {
			for _, j := range sg.nodes {
				st.Graph.Node(j).Site = at
			}
		}
	}
	return &st
}

// StepHostTime is the host time of the latest training step before its
// executor started: the checks of Step's arguments, the step graph (from
// its template, or the precision pass and autodiff on a miss), the
// program and the plan (cache lookups in a steady loop). Building the
// forward graph, which the caller does before Step, is not in it; nor is
// the executor's own work (launches, uploads, the optimizer).
func (s *Session) StepHostTime() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.times.Host
}

// StepTimes is where a training step's wall time went, on the host's
// clock. Total less Host and Execute is Step's work after the executor
// returned: the loss's conversion, the loss scaler's update and the
// graph's step updates.
type StepTimes struct {
	Host time.Duration // before the executor started (StepHostTime)
	// Execute is the executor's run: uploads, launches, the loss's
	// download and, on CUDA, the wait for the device's work before it (the
	// step's forward pass, and whatever the last step left running), not
	// for the kernels after it (Step).
	Execute time.Duration
	Total   time.Duration // all of Step, from its call to its return
}

// LastStepTimes is the latest training step's StepTimes (a failed step's
// as far as it went: zero for the parts it did not reach).
func (s *Session) LastStepTimes() StepTimes {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.times
}

// StepGraphHits counts training steps (and Plan calls) whose graph came
// from the step template cache: the forward graph matched an earlier step's, so the
// precision pass and autodiff did not run again.
func (s *Session) StepGraphHits() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stepHits
}

type programKey struct {
	sig           uint64
	outputs, kept string
	trained       string
	slots         int
	unscale       bool // compiled with the loss scaler's finish workspace
}

// NewSession returns a session with the given options, on the executor
// Options.Device picks. If none can be made (Device is "cuda" without a
// usable GPU, or names no device; Precision names no policy; Budget is
// negative; Recompute or Profile is invalid; TraceEntries is out of range)
// the session holds the error: Err returns it, and so does every Step,
// Eval, Yield and Restore.
func NewSession(opts Options) *Session {
	if opts.NoPointwiseFusion && !slices.Contains(opts.DisablePasses, compile.FusePointwise) {
		opts.DisablePasses = append(slices.Clip(opts.DisablePasses), compile.FusePointwise)
	}
	if opts.NoFusedLoss && !slices.Contains(opts.DisablePasses, compile.FuseLinearCrossEntropy) {
		opts.DisablePasses = append(slices.Clip(opts.DisablePasses), compile.FuseLinearCrossEntropy)
	}
	s := &Session{opts: opts, programs: lru.Cache[programKey, programEntry]{Max: planner.CacheSize},
		chosen: lru.Cache[chosenKey, chosen]{Max: planner.CacheSize}, lossChunks: lru.Cache[chosenKey, lossChoice]{Max: planner.CacheSize},
		steps: lru.Cache[stepKey, *stepTemplate]{Max: planner.CacheSize}}
	s.stopped, s.stop = context.WithCancelCause(context.Background())
	if s.policy, s.err = precision.Parse(opts.Precision); s.err != nil {
		s.err = fmt.Errorf("Options.Precision: %w", s.err)
	} else if opts.Budget < 0 {
		s.err = fmt.Errorf("%w: Options.Budget is %d bytes", planner.ErrBudget, opts.Budget)
	} else if opts.MaxChunk < 0 {
		s.err = fmt.Errorf("%w: Options.MaxChunk is %d", planner.ErrBudget, opts.MaxChunk)
	} else if _, err := recompute.ParseMode(string(opts.Recompute)); err != nil {
		s.err = err
	} else if opts.Profile.Bandwidth > 0 && opts.Profile.Validate() != nil {
		s.err = opts.Profile.Validate()
	} else if err := checkOffload(opts.Offload, s.policy); err != nil {
		s.err = err
	} else if err := compile.Check(opts.DisablePasses); err != nil {
		s.err = fmt.Errorf("Options.DisablePasses: %w", err)
	} else if err := s.newScaler(); err != nil {
		s.err = fmt.Errorf("Options.LossScale: %w", err)
	} else if s.err = (alloc.Options{TraceEntries: opts.TraceEntries}).Validate(); s.err == nil {
		s.be, s.device, s.err = chooseExecutor(opts)
	}
	if s.err != nil {
		s.device = "none: " + s.err.Error()
	}
	return s
}

// Err is why the session has no executor, or nil.
func (s *Session) Err() error { return s.err }

// newScaler makes the session's loss scaler when its policy scales.
func (s *Session) newScaler() error {
	if !s.policy.Scaled() || s.opts.LossScale.Off {
		return s.opts.LossScale.Validate()
	}
	var err error
	s.scaler, err = precision.NewScaler(s.opts.LossScale)
	return err
}

// LossScale reports dynamic loss scaling (Options.LossScale): the scale
// the next Step multiplies its loss by, the steps scaled so far and those
// whose update was skipped for an inf or NaN gradient. Its Scale is 0 when
// the session does not scale (a policy other than fp16-mixed, or
// LossScale.Off).
func (s *Session) LossScale() precision.ScalerStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.scaler == nil {
		return precision.ScalerStats{}
	}
	return s.scaler.Stats()
}

// Close releases the session's device: its executor's memory, cuBLAS
// handle and kernels, and the CUDA context. A CPU session holds nothing
// to release. The parameters' host tensors and the optimizers' host state
// get the device's values first (SyncParams, SyncState), so training may
// go on exactly in another session; the session's parameters are free for
// another session to train (ErrParamOwned).
//
// Close stops the calls in flight (Step, Eval, Plan, PlanEval, SyncParams,
// SyncState, Yield, Restore, from other goroutines) and waits for them to
// return before it releases anything, so no kernel runs on a released
// context and the allocator holds nothing once Close returns. A step is
// stopped by cancelling its context: it returns an error wrapping
// ErrClosed (and context.Canceled) and updates nothing, as a step whose
// own context ends does; one that had already finished its run returns
// its loss. A call's own callbacks (an optimizer's Step, a graph's OnStep
// Apply) must not call Close: Close would wait for the call that runs
// them.
// After Close every Step, Eval, Plan, PlanEval, MaxBatch, SyncParams,
// SyncState, Yield and Restore returns ErrClosed; closing again does
// nothing.
func (s *Session) Close() error {
	if s.be == nil {
		return nil
	}
	s.stop(ErrClosed) // before closed is set: a call that sees closed sees its context cancelled
	if s.closed.Swap(true) {
		return nil
	}
	s.life.Lock()
	defer s.life.Unlock()
	defer releaseParams(s)
	// The host tensors and state get the trained values before the device
	// copies go.
	return errors.Join(s.be.SyncParams(), s.be.SyncState(), s.be.Close())
}

// SyncState brings the host copies of the optimizers' state up to date
// with the device's, so that each optimizer's State (and ParamStep, Keys,
// Steps, which the host always has) is what a checkpoint saves. On CUDA,
// optim.SGD's and optim.Adam's state stays on the device across steps and
// the host holds none until SyncState; it downloads the state of every
// optimizer that has stepped the session's parameters (2 tensors per
// parameter for Adam). On the CPU the state is the host's, and SyncState
// does nothing. A state restored on the host (optim's SetState) is
// uploaded by the next Step.
func (s *Session) SyncState() error {
	be, done, err := s.hold()
	if err != nil {
		return err
	}
	defer done()
	return be.SyncState()
}

// SetLossScale restores dynamic loss scaling's state (LossScale's stats,
// as a checkpoint saved them), so the next Step scales its loss and grows
// or backs off its scale as the saved run's next step would. It fails with
// precision.ErrLossScale when the session does not scale its loss or the
// stats are out of range.
func (s *Session) SetLossScale(st precision.ScalerStats) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.scaler == nil {
		return fmt.Errorf("%w: the session does not scale its loss (Precision fp16-mixed, LossScale not Off)", precision.ErrLossScale)
	}
	return s.scaler.SetStats(st)
}

// ErrParamOwned is returned by Step for a parameter that another session
// trains. A parameter (its host tensor) belongs to the session whose Step
// trained it first, until that session is closed: two sessions updating one
// tensor would race in the optimizer's update on the host, and on CUDA
// each would train its own device copy. Reading it (Eval, or as a frozen
// parameter) from another session is not refused; the caller orders such
// reads against the owner's steps.
var ErrParamOwned = errors.New("parameter is trained by another session")

// paramOwners maps each trained parameter's host tensor to the session
// that owns it (ErrParamOwned).
var paramOwners struct {
	sync.Mutex
	m     map[tensor.Tensor]*Session
	owned map[*Session][]tensor.Tensor
}

// claimParams makes s the owner of params' host tensors, or fails with
// ErrParamOwned, naming the first that another session owns, and claims
// none.
func claimParams(s *Session, params []*lazy.Tensor) error {
	paramOwners.Lock()
	defer paramOwners.Unlock()
	for i, p := range params {
		if o, ok := paramOwners.m[p.Value()]; ok && o != s {
			return &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()},
				Err: fmt.Errorf("%w: parameter %d (%q) belongs to the session that first trained it, until that session is closed", ErrParamOwned, i, p.Name())}
		}
	}
	if paramOwners.m == nil {
		paramOwners.m, paramOwners.owned = map[tensor.Tensor]*Session{}, map[*Session][]tensor.Tensor{}
	}
	for _, p := range params {
		if v := p.Value(); v != nil && paramOwners.m[v] == nil {
			paramOwners.m[v] = s
			paramOwners.owned[s] = append(paramOwners.owned[s], v)
		}
	}
	return nil
}

// releaseParams frees the parameters s owns for other sessions (Close).
func releaseParams(s *Session) {
	paramOwners.Lock()
	defer paramOwners.Unlock()
	for _, v := range paramOwners.owned[s] {
		delete(paramOwners.m, v)
	}
	delete(paramOwners.owned, s)
}

// hold starts a call that reaches the executor: Close waits for done. It
// returns the executor, or why there is none (ErrClosed after Close).
func (s *Session) hold() (be exec.Executor, done func(), err error) {
	s.life.RLock()
	if be, err = s.executor(); err == nil && s.stopped.Err() != nil {
		err = ErrClosed
	}
	if err != nil {
		s.life.RUnlock()
		return nil, nil, err
	}
	return be, s.life.RUnlock, nil
}

// enter is hold for a call with a context: the context it returns is ctx,
// also cancelled (with cause ErrClosed) when Close begins.
func (s *Session) enter(ctx context.Context) (context.Context, func(), error) {
	_, release, err := s.hold()
	if err != nil {
		return nil, nil, err
	}
	cctx, cancel := context.WithCancelCause(ctx)
	unhook := context.AfterFunc(s.stopped, func() { cancel(ErrClosed) })
	return cctx, func() {
		unhook()
		cancel(nil)
		release()
	}, nil
}

// closedErr is err, a call's failure under ctx (from enter), marked as
// ErrClosed when Close stopped the call.
func closedErr(ctx context.Context, err error) error {
	if err == nil || context.Cause(ctx) != ErrClosed || errors.Is(err, ErrClosed) {
		return err
	}
	return fmt.Errorf("%w: stopped by Close: %w", ErrClosed, err)
}

// ErrClosed is returned by a Session's calls after Close.
var ErrClosed = errors.New("batchfit: session closed")

// ErrDuplicateParam is returned by Step when a parameter is listed twice
// (the same lazy tensor, or two over the same host tensor): it would be
// updated twice.
var ErrDuplicateParam = errors.New("parameter listed twice")

// executor is the session's executor, or why there is none: the error
// NewSession met, or ErrClosed.
func (s *Session) executor() (exec.Executor, error) {
	switch {
	case s.be == nil:
		return nil, s.err
	case s.closed.Load():
		return nil, ErrClosed
	}
	return s.be, nil
}

// SyncParams brings the trained parameters' host tensors up to date. On
// CUDA a step updates parameters on the device only, as a PyTorch model's
// parameters live on the GPU: call SyncParams before reading a parameter's
// host tensor (to save, print or evaluate it elsewhere). Only parameters
// changed since the last SyncParams are downloaded; Close syncs too. On the
// CPU the host tensors are the parameters, and SyncParams does nothing.
func (s *Session) SyncParams() error {
	be, done, err := s.hold()
	if err != nil {
		return err
	}
	defer done()
	return be.SyncParams()
}

// UploadParams makes the next Step and Eval read the parameters' (and
// constants') host tensors as they are now. On CUDA a session keeps its
// parameters on the device between steps, and a host tensor written there
// (a checkpoint loaded after the session has stepped) is not uploaded
// again by itself: UploadParams copies every one it holds to the device
// (checkpoint.Training.Load calls it). Optimizer state restored on the
// host (optim's SetState) needs no call: the next step uploads it. A
// session that has not stepped yet has nothing to upload. On the CPU the
// host tensors are the float32 parameters themselves, but a 16-bit frozen
// parameter (nn.FreezeAs) is held rounded, as on the device: it too needs
// UploadParams to see a write.
func (s *Session) UploadParams() error {
	be, err := s.executor()
	if err != nil {
		return err
	}
	if u, ok := be.(interface{ UploadParams() error }); ok {
		return u.UploadParams()
	}
	return nil
}

// Device names the executor the session runs on and why, on one line:
// "cuda: NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB, driver 13.0)", or
// "cpu: no GPU (cuda: ...)" with the reason CUDA was not usable.
func (s *Session) Device() string { return s.device }

// OnCUDA reports whether the session runs on the CUDA executor.
func (s *Session) OnCUDA() bool {
	_, ok := s.be.(cudaOwner)
	return ok
}

// Overhead is the memory the executor holds outside every plan (CUDA's
// cuBLAS workspace; 0 on the CPU): measured peaks are the plan's plus
// Overhead, and Options.Budget counts it.
func (s *Session) Overhead() int64 {
	if s.be == nil {
		return 0
	}
	return s.be.Overhead()
}

// Workspace is the workspace rule the session compiles its steps with
// (exec.Executor.Workspace): on CUDA, a convolution declares the workspace
// of the algorithm cuDNN's timed search chose for its shape. Programs
// compiled with it plan as the session's steps do. Nil when the session
// has no executor (see Err).
func (s *Session) Workspace() planner.WorkspaceFunc {
	if s.be == nil {
		return nil
	}
	return s.be.Workspace()
}

// CacheHits counts runs (and Plan and PlanEval calls) that reused a
// compiled program.
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
// names allocator blocks and profiles steps with. It holds that run's
// graph, data included, until the next run.
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
// Nil when the session has no executor (see Err).
func (s *Session) Allocator() *alloc.Allocator {
	if s.be == nil {
		return nil
	}
	return s.be.Allocator()
}

// Yield gives the session's device memory back between steps, as
// pytorch_memlab's Courtesy does, for another job to use: the executor
// frees every block it keeps resident (parameters, constants, optimizer
// state) and empties its allocator's cache, so its reserved bytes drop to
// zero (on CUDA to Overhead: the cuBLAS workspace stays, so its handle
// need not be re-created). Values survive in host memory: on the CPU
// executor they are the parameters' own tensors and the optimizer's
// state, which never leave the host; CUDA downloads parameters, constants
// and optimizer state to host copies of its own before freeing, and
// uploads them again on Restore.
//
// Restore takes the memory back explicitly. Without it, the next Step or
// Eval restores by itself before it runs (and returns Restore's error if
// it cannot), so a training loop that yields between steps needs no other
// change. Either way the step that follows
// runs as if Yield had never happened: the same parameters and optimizer
// state, bit for bit, and the peaks the plan predicts.
func (s *Session) Yield() error {
	be, done, err := s.hold()
	if err != nil {
		return err
	}
	defer done()
	return be.Yield()
}

// Restore re-allocates and refills what Yield gave back, in the order it
// was first allocated. When the device cannot hold it (another process
// kept the memory) it returns the allocator's out-of-memory error and the
// session stays yielded, holding nothing; it may be called again. Restore
// without a Yield does nothing.
func (s *Session) Restore() error {
	be, done, err := s.hold()
	if err != nil {
		return err
	}
	defer done()
	return be.Restore()
}

// Yielded reports whether the session's memory is given back.
func (s *Session) Yielded() bool { return s.be != nil && s.be.Yielded() }

// program returns the compiled program of g for outputs, computing the
// analysis and schedule once per graph signature (while it stays cached).
// A loss-scaled step (unscale) gets the finish workspace of its flag.
// With t, g is an instance of t's step graph: the program t compiled for
// the same outputs is g's without a lookup, and t's signature is g's.
// A hit on the signature runs only on a graph equal to the one compiled
// (graph.SameSignature).
func (s *Session) program(g *graph.Graph, t *stepTemplate, outputs, kept, trained []int, slots int, unscale bool) (*planner.Program, error) {
	if t != nil {
		s.mu.Lock()
		if m := t.prog; m.matches(outputs, kept, trained, slots, unscale) {
			s.hits++
			s.mu.Unlock()
			return m.p.Rebind(g), nil
		}
		s.mu.Unlock()
	}
	key := programKey{sig: signatureOf(g, t), outputs: lru.Ints(outputs), kept: lru.Ints(kept),
		trained: lru.Ints(trained), slots: slots, unscale: unscale}
	like := structureOf(g, t)
	s.mu.Lock()
	e, ok := s.programs.Get(key)
	s.mu.Unlock()
	var p *planner.Program
	if ok && (like != nil && e.g == like || e.g.SameSignature(g)) {
		p = e.p.Rebind(g)
		s.mu.Lock()
		s.hits++
		s.mu.Unlock()
	} else {
		info, err := shapeinfer.Analyze(g, outputs...)
		if err != nil {
			return nil, err
		}
		if p, err = planner.Compile(g, info, outputs, s.compileOptions(kept, trained, slots, unscale)); err != nil {
			return nil, err
		}
		if like == nil {
			like = structure(g)
		}
		// The cache keeps the schedule, not the graph: its nodes hold the
		// step's data (inputs, constants), which must not outlive the step.
		s.mu.Lock()
		s.programs.Put(key, programEntry{p: p.Rebind(nil), g: like})
		s.mu.Unlock()
	}
	if t != nil {
		m := &programMemo{p: p.Rebind(nil), outputs: slices.Clone(outputs), kept: slices.Clone(kept),
			trained: slices.Clone(trained), slots: slots, unscale: unscale}
		s.mu.Lock()
		t.prog = m
		s.mu.Unlock()
	}
	return p, nil
}

// structureOf is the structure of g that a cache keeps and compares hits
// with: t's step graph (no data) when g is its instance, nil otherwise
// (structure(g) then, for an entry to keep).
func structureOf(g *graph.Graph, t *stepTemplate) *graph.Graph {
	if t != nil {
		return t.st.Graph
	}
	return nil
}

// signatureOf is g's signature: t's when g is an instance of t's step
// graph, computed otherwise (t nil).
func signatureOf(g *graph.Graph, t *stepTemplate) uint64 {
	if t != nil {
		return t.sig
	}
	return g.Signature()
}

// compileOptions are the planner's options for a step of the session.
func (s *Session) compileOptions(kept, trained []int, slots int, unscale bool) planner.CompileOptions {
	o := planner.CompileOptions{Kept: kept, Trained: trained, StateSlots: slots, Workspace: s.be.Workspace(), OptimizerScalars: true,
		Offload: s.offloading() && len(trained) > 0}
	if unscale {
		o.FinishWorkspace = exec.UnscaleBytes
	}
	return o
}

// run plans p within the budget and executes it; opt is a training step's
// optimizer, nil for Eval. scale is the step's loss scale (0 for none):
// skipped reports that its gradients held an inf or NaN once unscaled, so
// the optimizer did not run.
//
// When the device runs out of memory anyway (another process took memory
// between the plan and the run), the step is planned again within what is
// left and run once more, after the allocator's cache is given back. A
// failed run changes nothing: the optimizer updates only after the last
// chunk, and the executor frees what the run held, so no chunk is lost or
// counted twice.
//
// start is when the training step began (zero for Eval): the time from it
// to the executor's start is the step's host time (StepHostTime).
func (s *Session) run(ctx context.Context, p *planner.Program, opt optim.Optimizer, scale float32,
	reduce exec.Reducer, start time.Time) (outs []*tensor.Dense, skipped bool, err error) {
	var (
		pl *planner.Plan
		u  planner.Usage
	)
	released, err := s.be.ReleaseUnread(p)
	if err != nil {
		return nil, false, err
	}
	// A steady loop's device holds exactly p's persistent buffers, which a
	// plan treats as it treats no residents: nothing to describe.
	var held []planner.Held
	if h := s.be.Held(); !exec.HoldsExactly(p, h) {
		held = exec.PlanResidents(p, h)
	}
	s.mu.Lock()
	prev, prevProg := s.last, s.lastProg
	s.mu.Unlock()
	for attempt := 0; ; attempt++ {
		budget, err := s.budget()
		if err != nil {
			return nil, false, err
		}
		pl = nil
		if attempt == 0 {
			pl = s.keptPlanOf(p, held, prev, prevProg, budget)
		}
		if pl == nil {
			if pl, err = s.plans.Plan(p, s.planOptions(budget, held)); err != nil {
				return nil, false, err
			}
		}
		// The plan was simulated on a device holding only the residents,
		// allocated in order. A run of the same plan as the last one finds
		// the cache its simulated second step finds; any other run starts
		// from the residents alone.
		if pl != prev || released {
			if err := s.be.Allocator().EmptyCache(); err != nil {
				return nil, false, err
			}
		}
		// The plan was judged on a simulated device of pl.Available()
		// bytes; capping the allocator there (plus what it holds outside
		// every plan) makes the real one release its cache where the
		// simulation did, even on a device with room to spare.
		s.be.Allocator().SetLimit(min(pl.Available(), budget-pl.Headroom) + s.be.Overhead())
		if s.beforeRun != nil {
			s.beforeRun()
		}
		began := time.Now()
		if attempt == 0 && !start.IsZero() {
			s.mu.Lock()
			s.times = StepTimes{Host: began.Sub(start)}
			s.mu.Unlock()
		}
		// Parameters, gradients and optimizer state stay on the device;
		// SyncParams brings the host tensors up to date.
		var res *exec.Result
		res, err = s.be.Execute(ctx, p, pl.Chunks, exec.Options{Resident: true, Timeline: s.opts.Timeline,
			Optimizer: opt, KeptOnDevice: opt != nil, LossScale: scale, Reduce: reduce, Offload: opt != nil && p.Offloaded})
		if !start.IsZero() {
			s.mu.Lock()
			s.times.Execute += time.Since(began) // an OOM retry's run counts too
			s.mu.Unlock()
		}
		if err == nil {
			outs, u, skipped = res.Outputs, res.Usage, res.Skipped
			break
		}
		// A partly copied offloaded step has updated its masters: running
		// it again would update them twice.
		if attempt > 0 || !errors.Is(err, alloc.ErrOutOfMemory) || errors.Is(err, optim.ErrPartialStep) {
			return nil, false, err
		}
		// The failed run's blocks went back to the allocator's cache, in
		// segments sized for the plan that failed. The new plan replays from
		// a device holding only the resident buffers, so give the cache back
		// first: the retry then lays out as planned.
		if err := s.be.Allocator().EmptyCache(); err != nil {
			return nil, false, err
		}
	}
	s.mu.Lock()
	s.last, s.lastProg, s.usage = pl, p, u
	s.mu.Unlock()
	return outs, skipped, nil
}

// keptPlan is the plan of program p (with residents held) at budget was,
// the last step's budget, when it is the plan at budget now too, so that
// the step keeps the last step's plan (the cache's, the same pointer when
// p is the last step's program) and its allocator's cache, instead of
// planning again and emptying the cache; nil when it may not be. A budget
// that moves by a few MiB between steps (the driver's memory for a CUDA
// graph captured or released, another process's allocation) would
// otherwise replan a steady loop and send its allocator back to the
// device for every segment: 82 for GPT-2 small, 45 ms steps instead of 21
// on the H100 while its graphs were being captured.
//
// The plans agree when both budgets, less the headroom, hold twice the
// plan's peak reserved bytes: a simulated allocation is refused only when
// the reserved bytes plus its own size, each at most the peak, exceed the
// device, so neither replay released its cache and both ran the same
// allocations. The chunk is the same when the budget did not grow (the
// plan's chunk was the largest that fitted, and still fits) or the plan
// runs the whole batch in one chunk.
func (s *Session) keptPlan(p *planner.Program, held []planner.Held, was, now int64) *planner.Plan {
	pl, err := s.plans.Plan(p, s.planOptions(was, held))
	if err != nil {
		return nil // planned at now instead, which reports its own error
	}
	if !samePlanAt(pl, was, now) {
		return nil
	}
	return pl
}

// keptPlanOf is keptPlan of p at budget now when the last run's plan
// prev (of program prevProg) may stand for it: a plan of the same
// program at another budget. Nil otherwise.
func (s *Session) keptPlanOf(p *planner.Program, held []planner.Held, prev *planner.Plan, prevProg *planner.Program, now int64) *planner.Plan {
	if prev == nil || now == prev.Budget || prevProg.Signature() != p.Signature() {
		return nil
	}
	return s.keptPlan(p, held, prev.Budget, now)
}

// planOptions are the planner's options for a run within budget on a
// device holding held.
func (s *Session) planOptions(budget int64, held []planner.Held) planner.Options {
	return planner.Options{Budget: budget, Headroom: s.opts.Headroom, MaxChunk: s.opts.MaxChunk, Resident: held}
}

// samePlanAt is keptPlan's rule: whether plan pl, made at budget was, is
// the plan at budget now too.
func samePlanAt(pl *planner.Plan, was, now int64) bool {
	twice := 2 * pl.PeakReserved
	chunked := pl.Chunk < pl.Batch
	return now-pl.Headroom >= twice && pl.Available() >= twice && (now <= was || !chunked)
}

// budget is what a step may plan within now: the executor's budget,
// capped by Options.Budget less the executor's overhead.
func (s *Session) budget() (int64, error) {
	budget, err := exec.Budget(s.be)
	if err != nil {
		return 0, err
	}
	if s.opts.Budget > 0 { // the executor's overhead is inside it
		budget = min(budget, s.opts.Budget-s.be.Overhead())
	}
	return budget, nil
}

// LastRecompute is the recompute choice of the latest Step (Strategy
// "none" when it recomputed nothing, or Options.Recompute is off).
func (s *Session) LastRecompute() Recomputed {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastRe
}

// recomputed returns the program a training step runs under
// Options.Recompute auto: the plain one, or a recompute transform of g
// when recompute.Search prefers one within the current budget. ids are
// the step's outputs: the loss, the gradients of trained (kept on the
// device), then the step's updates (lazy.Graph.OnStep). Searches
// are cached by step, budget and residents; the transformed program is
// cached like any program, by its graph's signature. unscale marks a
// loss-scaled step, and t is g's step template (Session.program). It
// returns the recompute pass's report too, its bytes counted with
// measure (a plan's, not every step's).
func (s *Session) recomputed(g *graph.Graph, t *stepTemplate, boundary int, ids, trained []int, slots int, unscale, measure bool) (*planner.Program, Recomputed, compile.Report, error) {
	none := Recomputed{Strategy: "none"}
	plain := func(why string) (*planner.Program, Recomputed, compile.Report, error) {
		p, err := s.program(g, t, ids, ids[1:1+len(trained)], trained, slots, unscale)
		return p, none, compile.NotRun(compile.Recompute, why, g.Len()), err
	}
	var ch chosen
	switch {
	case slices.Contains(s.opts.DisablePasses, compile.Recompute):
		return plain("disabled")
	case s.opts.Recompute == recompute.Auto:
	case s.opts.Recompute == recompute.SelectiveOnly, s.opts.Recompute == recompute.FullCheckpoint:
		c, ok := recompute.Forced(s.opts.Recompute, g, boundary)
		if !ok {
			return plain("no " + string(s.opts.Recompute) + " candidate in this step")
		}
		return s.transformed(g, t, boundary, ids, trained, slots, unscale, chosen{name: c.Name, set: c.Set}, measure)
	default:
		return plain("Options.Recompute is off")
	}
	budget, err := s.budget()
	if err != nil {
		return nil, none, compile.Report{}, err
	}
	held := s.be.Held()
	key := chosenKey{programKey: programKey{sig: signatureOf(g, t), outputs: lru.Ints(ids), trained: lru.Ints(trained), slots: slots, unscale: unscale},
		budget: budget, held: exec.HeldKey(held)}
	like := structureOf(g, t)
	s.mu.Lock()
	ch, ok := s.chosen.Get(key)
	s.mu.Unlock()
	ok = ok && (like != nil && ch.g == like || ch.g.SameSignature(g)) // a signature collision searches anew
	st := recompute.Step{Graph: g, Boundary: boundary, Outputs: ids, Compile: s.compileOptions(ids[1:1+len(trained)], trained, slots, unscale)}
	if !ok {
		res, err := recompute.Search(st, recompute.Options{Profile: s.opts.Profile, TF32: s.opts.TF32 || s.policy.TF32(),
			Planner:  s.planOptions(budget, nil),
			Resident: func(p *planner.Program) []planner.Held { return exec.PlanResidents(p, held) }})
		if err != nil {
			return nil, none, compile.Report{}, err
		}
		ch = chosen{g: like}
		if res.Best != nil { // otherwise the plain plan's error tells why
			ch.name, ch.set = res.Best.Name, res.Best.Recompute
		}
		if ch.g == nil {
			ch.g = structure(g)
		}
		s.mu.Lock()
		s.chosen.Put(key, ch)
		s.mu.Unlock()
	}
	return s.transformed(g, t, boundary, ids, trained, slots, unscale, ch, measure)
}

// transformed compiles g with ch's forward nodes recomputed (the plain
// program when ch recomputes nothing), through the pipeline's recompute
// pass (compile.RunRecompute), and returns its report.
func (s *Session) transformed(g *graph.Graph, t *stepTemplate, boundary int, ids, trained []int, slots int, unscale bool, ch chosen, measure bool) (*planner.Program, Recomputed, compile.Report, error) {
	none := Recomputed{Strategy: "none"}
	if len(ch.set) == 0 {
		p, err := s.program(g, t, ids, ids[1:1+len(trained)], trained, slots, unscale)
		return p, none, compile.NotRun(compile.Recompute, "the search chose none: the plain step is the fastest within the budget", g.Len()), err
	}
	g2, remap, copies, rep, err := compile.RunRecompute(g, boundary, ch.set, ch.name, ids, compile.Options{Disable: s.opts.DisablePasses, NoMeasure: !measure})
	if err != nil {
		return nil, none, rep, err
	}
	ids2, trained2 := make([]int, len(ids)), make([]int, len(trained))
	for i, id := range ids {
		ids2[i] = remap[id]
	}
	for i, id := range trained {
		trained2[i] = remap[id]
	}
	p, err := s.program(g2, nil, ids2, ids2[1:1+len(trained2)], trained2, slots, unscale)
	return p, Recomputed{Strategy: ch.name, Nodes: len(ch.set), Copies: copies}, rep, err
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
	ctx, done, err := s.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	p, _, err := s.evalProgram(outputs, false)
	if err != nil {
		return nil, err
	}
	outs, _, err := s.run(ctx, p, nil, 0, nil, time.Time{})
	return outs, closedErr(ctx, err)
}

// evalProgram compiles the evaluation of outputs (the pipeline's
// evaluation passes, compile.Eval: the precision pass under a mixed
// policy, no gradients) as Eval runs it: the path Eval and PlanEval
// share. With measure the passes' reports count bytes.
func (s *Session) evalProgram(outputs []*lazy.Tensor, measure bool) (*planner.Program, []compile.Report, error) {
	g, err := sameGraph("eval", outputs)
	if err != nil {
		return nil, nil, err
	}
	ids := make([]int, len(outputs))
	for i, t := range outputs {
		ids[i] = t.ID()
	}
	ev, err := compile.Eval(g.IR(), ids, compile.Options{Policy: s.policy, Disable: s.opts.DisablePasses, NoMeasure: !measure,
		OffloadParams: s.offloading()})
	if err != nil {
		return nil, nil, err
	}
	p, err := s.program(ev.Graph, nil, ev.Outputs, nil, nil, 0, false)
	return p, ev.Passes, err
}

// Step runs one training step: forward and backward of the scalar loss,
// then one optimizer update of params. It returns the loss. With a budget
// the batch runs in chunks whose gradients add up to the whole batch's
// (with per-chunk batch statistics, to gradient accumulation's over those
// chunks).
// A parameter listed twice is ErrDuplicateParam; one the loss does not
// depend on is not updated (PyTorch's grad None: no weight decay, no
// momentum, no state, its own step count unchanged). A frozen one
// (lazy.Tensor.SetFrozen, nn.Freeze) is left out: no gradient is computed
// for it, so it takes no gradient buffer and no state. One that another
// session trains is ErrParamOwned.
//
// On CUDA, optim.SGD and optim.Adam run on the device: parameters and
// optimizer state stay there across steps (the optimizer's host State
// stays empty until SyncState), and gradients never leave the device. The
// update follows the optimizer's groups, schedule and per-parameter step
// counts, and clips on the device, with the learning rates and bias
// corrections as device scalars, so the update replays as one CUDA graph
// every step; optim's LastGradNorm reads the norm from the device only when
// called. Each optimizer keeps its own state: Adam, then SGD, then the
// same Adam continues Adam's moments. The parameters'
// host tensors are brought up to date by SyncParams (and Close), not after
// every step, which would copy the whole model each step. Other optimizers
// run on the host between a download and an upload. The device copy is
// the authoritative one: a parameter's host tensor changed by the caller
// between steps is not uploaded again.
//
// With Options.Offload the optimizer runs on the host instead, on every
// core: the device keeps bfloat16 weights and gradients, and after the
// last chunk the gradients go to host memory, the float32 masters and
// Adam's moments are updated there, and the new weights, rounded, come
// back (exec.Options.Offload). A step whose weights reached the device
// only in part returns an *optim.PartialStepError: SyncParams, then
// UploadParams, repair the device's copies from the masters.
//
// On CUDA, Step returns once the loss is on the host: each chunk's loss
// is copied as soon as its forward pass has made it, and the kernels
// after the last chunk's (the rest of its backward pass, the optimizer)
// may still be running. The caller's next graph build and the next Step's
// host work overlap them; the next step's kernels, SyncParams, Yield and
// Close wait for them. A device fault in them is returned by the next call
// that reaches the device.
//
// Values registered on the loss's graph with lazy.Graph.OnStep (the
// running statistics of nn.BatchNorm2d with PerChunkStats) are computed in
// the same run, chunks and plan, and their Apply functions called in
// order once the run has succeeded, before Step returns; an Apply error is
// returned with the loss (the optimizer has updated the parameters by
// then).
//
// Under loss scaling (fp16-mixed, Options.LossScale) the backward pass
// starts from the loss times the current scale and the gradients are
// unscaled after the last chunk; a step whose gradients hold an inf or NaN
// then updates nothing (no error: LossScale counts it) and lowers the
// scale, down to LossScale.MinScale; one skipped at that floor returns an
// error wrapping precision.ErrScaleCollapse (with the loss), since no
// scale can rescue it. The returned loss is the unscaled one either way.
func (s *Session) Step(ctx context.Context, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) (float32, error) {
	return s.StepWith(ctx, loss, params, opt, StepOptions{})
}

// StepOptions are what a step may take beyond Session.Step's arguments.
type StepOptions struct {
	// Reduce, when set, sums the step's gradients over data-parallel
	// ranks on the device before the loss scale's check and the
	// optimizer, overlapping backward when the step runs in one chunk
	// (exec.Options.Reduce): package dist sets it to NCCL's. A CPU session
	// refuses it.
	Reduce exec.Reducer
}

// StepWith is Step with StepOptions.
func (s *Session) StepWith(ctx context.Context, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer, so StepOptions) (float32, error) {
	start := time.Now()
	// The step runs on the caller's own OS thread (the CUDA executor makes
	// the device's context current there for its run), locked for the
	// whole step, so that the thread whose caches hold the caller's data
	// resumes it (and the next step's graph build after it), not whichever
	// thread the scheduler hands the goroutine to. On the H100's host, over 1000 steps of the
	// MLP (1.2 ms each), the caller's graph build went from 36–39 to
	// 23–30 µs and StepHostTime from 13–14 to 7–11 µs. Locks nest: a
	// caller that holds its thread already keeps it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s.mu.Lock()
	s.times = StepTimes{}
	s.mu.Unlock()
	defer func() { // after release, the last of Step's work
		s.mu.Lock()
		s.times.Total = time.Since(start)
		s.mu.Unlock()
	}()
	ctx, done, err := s.enter(ctx)
	if err != nil {
		return 0, err
	}
	defer done()
	cs, err := s.compileStep(loss, params, opt, true)
	if err != nil {
		return 0, err
	}
	defer cs.release()
	vals, skipped, err := s.run(ctx, cs.prog, opt, cs.scale, so.Reduce, start)
	if err != nil {
		return 0, closedErr(ctx, err)
	}
	var collapse error // the loss scale's: a skipped step at its floor
	s.mu.Lock()
	s.lastRe = cs.re
	if cs.unscale {
		collapse = s.scaler.Update(!skipped)
	}
	s.mu.Unlock()
	l, err := scalarOf(vals[0])
	if err != nil {
		return 0, err
	}
	// The run succeeded: its updates apply, a loss-scaled step skipped for
	// an inf or NaN gradient included (PyTorch's forward has updated its
	// running statistics by then too).
	errs := []error{collapse}
	for i, u := range cs.updates {
		if err := u.Apply(vals[cs.first+i]); err != nil {
			errs = append(errs, fmt.Errorf("step update %d (node %d): %w", i, cs.ids[cs.first+i], err))
		}
	}
	return l, errors.Join(errs...)
}

// compiledStep is a training step built and compiled as Step runs it.
type compiledStep struct {
	prog *planner.Program
	re   Recomputed
	// passes is what each pass of the pipeline did (StepPlan.Passes;
	// nil for a step that runs).
	passes []compile.Report
	// levers are the lever settings the step chose among (StepPlan.Levers).
	levers []LeverChoice
	// ids are the step's outputs: the loss, the gradients of trained (kept
	// on the device), then from first on the graph's step updates.
	ids     []int
	first   int
	updates []lazy.StepUpdate
	trained []int
	// g is the step's graph before any recompute transform, whose backward
	// pass starts at node boundary; slots is the optimizer's state slots.
	g        *graph.Graph
	boundary int
	slots    int
	scale    float32 // the run's loss scale; 0 for none
	unscale  bool
	release  func() // once the step's graph is no longer needed (backward's)
}

// compileStep builds the training step of loss, params and opt (the
// precision pass, loss scaling and the backward pass, or the template a
// steady loop reuses) and compiles the program Options.Recompute picks:
// the path Step and Plan share. With runnable it also checks what running
// needs, which a plan does not (float32 parameters holding host data), and
// claims the parameters for s (ErrParamOwned).
func (s *Session) compileStep(loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer, runnable bool) (cs *compiledStep, err error) {
	if err := loss.Err(); err != nil {
		return nil, err
	}
	if opt == nil {
		return nil, &graph.OpError{Op: "step", Err: graph.Errorf(graph.ErrNilTensor, "nil optimizer")}
	}
	weighed, err := s.decideOffload(loss, params, opt)
	if err != nil {
		return nil, err
	}
	if s.offloading() {
		if err := offloadOptimizer(opt); err != nil {
			return nil, err
		}
	}
	if kept := unfrozen(params); len(kept) < len(params) {
		// A non-parameter in the list is refused by its index in the
		// caller's list, which the frozen ones would shift.
		if _, err := lazy.TrainedIDs("step", loss, params...); err != nil {
			return nil, err
		}
		params = kept
	}
	if err := s.distinctParams(params, runnable); err != nil {
		return nil, err
	}
	var (
		scale float32
		data  *tensor.Dense // the scale constant's data; nil without loss scaling
	)
	if s.scaler != nil {
		s.mu.Lock()
		scale, data = s.scaler.Scale(), s.scaler.Data()
		s.mu.Unlock()
	}
	st, tmpl, release, err := s.backward(loss, params, data)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	// A parameter the loss does not depend on gets a zero-filled gradient;
	// like PyTorch's parameters whose grad is None, it is not updated (no
	// weight decay, no momentum) and gets no optimizer state.
	ir := st.Graph
	updates := loss.Graph().StepUpdates()
	ids := make([]int, 1, 1+len(params)+len(updates))
	ids[0] = st.Loss
	trained := make([]int, 0, len(params))
	for i, p := range params {
		id := st.Params[i]
		if id < 0 { // not in the loss's graph
			continue
		}
		if dt := ir.Node(id).Type.DType; runnable && dt != graph.Float32 && !(s.offloading() && dt == graph.BFloat16 && p.DType() == graph.Float32) {
			return nil, &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()}, Err: graph.Errorf(graph.ErrDType,
				"parameter %q is %s: trained parameters stay float32 (master weights); use Options.Precision for 16-bit compute", p.Name(), dt)}
		}
		if _, err := exec.ParamData(ir.Node(id), p.Value()); runnable && err != nil {
			return nil, &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()}, Err: err}
		}
		if gr := ir.Node(st.Grads[i]); gr.Op == graph.OpFill && len(gr.Inputs) == 0 && gr.Attrs.Scalar == 0 {
			continue
		}
		ids = append(ids, st.Grads[i])
		trained = append(trained, id)
	}
	// The graph's step updates are outputs after the gradients: forward
	// nodes, which st.IDs maps into the step's graph.
	first := len(ids)
	for i, u := range updates {
		id := u.Value.ID()
		if id < 0 || id >= len(st.IDs) {
			return nil, &graph.OpError{Op: "step", Err: graph.Errorf(graph.ErrArity, "step update %d is node %d, not a node of the forward graph", i, id)}
		}
		if st.IDs[id] < 0 {
			return nil, &graph.OpError{Op: "step", Err: graph.Errorf(graph.ErrArity, "step update %d reads node %d, which the attention fusion removed", i, id)}
		}
		ids = append(ids, st.IDs[id])
	}
	// Without gradients there is nothing to unscale, and no step to skip.
	unscale := st.Scale >= 0 && len(trained) > 0
	if !unscale {
		scale = 0
	}
	var tmplPasses []compile.Report // the template's pass reports, kept when the chunk choice drops tmpl
	if tmpl != nil {
		tmplPasses = tmpl.passes
	}
	lc, levers, err := s.lossChunked(ir, tmpl, st.Scaled+1, ids, trained, opt.StateSlots(), unscale)
	if err != nil {
		return nil, err
	} else if lc != ir {
		if tmpl != nil {
			// The template's later steps run the chosen chunk as built: no
			// copy of the graph a step.
			if err := s.rechunkTemplate(tmpl, lc); err != nil {
				return nil, err
			}
		}
		ir, tmpl = lc, nil
	}
	prog, re, rr, err := s.recomputed(ir, tmpl, st.Scaled+1, ids, trained, opt.StateSlots(), unscale, !runnable)
	if err != nil {
		return nil, err
	}
	var passes []compile.Report // a plan's (StepPlan.Passes); a step needs none
	if !runnable {
		passes = append(slices.Clip(tmplPasses), rr)
	}
	if weighed != nil { // the step that chose the optimizer's place lists both
		levers = weighed
	}
	return &compiledStep{prog: prog, re: re, passes: passes, levers: levers, ids: ids, first: first, updates: updates, trained: trained, g: ir,
		boundary: st.Scaled + 1, slots: opt.StateSlots(), scale: scale, unscale: unscale, release: release}, nil
}

// lossChunked is step graph g with its fused loss's token chunk set
// (graph.WithLossChunk): Options.LossChunk, or chooseLossChunk's choice
// within the current budget (every setting tried listed in the second
// result), cached by step and budget. g itself when it has no fused loss
// or holds the chunk already.
func (s *Session) lossChunked(g *graph.Graph, t *stepTemplate, boundary int, ids, trained []int, slots int, unscale bool) (*graph.Graph, []LeverChoice, error) {
	_, rows, _, _, ok := graph.LossChunkOf(g)
	if !ok {
		return g, nil, nil
	}
	if s.opts.LossChunk > 0 {
		lc, err := graph.WithLossChunk(g, s.opts.LossChunk)
		return lc, nil, err
	}
	budget, err := s.budget()
	if err != nil {
		return nil, nil, err
	}
	held := s.be.Held()
	key := chosenKey{programKey: programKey{sig: signatureOf(g, t), outputs: lru.Ints(ids), trained: lru.Ints(trained), slots: slots, unscale: unscale},
		budget: budget, held: exec.HeldKey(held)}
	s.mu.Lock()
	c, hit := s.lossChunks.Get(key)
	s.mu.Unlock()
	if !hit {
		// A step over the whole batch plans it; chunks of it hold fewer rows.
		chunk, alts, err := s.chooseLossChunk(g, rows, boundary, ids, trained, slots, unscale)
		if err != nil {
			return nil, nil, err
		}
		c = lossChoice{chunk: chunk, alts: alts}
		s.mu.Lock()
		s.lossChunks.Put(key, c)
		s.mu.Unlock()
	}
	lc, err := graph.WithLossChunk(g, c.chunk)
	return lc, c.alts, err
}

// lossChoice is a fused loss's token chunk chosen for a step and budget,
// with the settings tried.
type lossChoice struct {
	chunk int
	alts  []LeverChoice
}

// rechunkTemplate gives template t's step graph the fused loss's token
// chunk of lc, a step graph of t with it (graph.WithLossChunk keeps every
// node's id, so t's ids, sources and seeds stay valid): its signature,
// and no instance or program of the old chunk.
func (s *Session) rechunkTemplate(t *stepTemplate, lc *graph.Graph) error {
	c, _, _, _, _ := graph.LossChunkOf(lc)
	s.mu.Lock()
	defer s.mu.Unlock()
	g, err := graph.WithLossChunk(t.st.Graph, c)
	if err != nil || g == t.st.Graph {
		return err
	}
	t.st.Graph, t.sig, t.inst, t.prog = g, g.Signature(), nil, nil
	return nil
}

// distinctParams is distinctParams of params, and with claim claims them
// for s (claimParams), or nil at once when params and their data are the
// list the latest step found distinct and claimed. A plan (claim false)
// trains nothing, so it claims nothing.
func (s *Session) distinctParams(params []*lazy.Tensor, claim bool) error {
	if !claim {
		return distinctParams(params)
	}
	s.mu.Lock()
	same := len(s.checked) == len(params)
	for i := 0; same && i < len(params); i++ {
		same = s.checked[i].t == params[i] && s.checked[i].v == params[i].Value()
	}
	s.mu.Unlock()
	if same {
		return nil
	}
	if err := distinctParams(params); err != nil {
		return err
	}
	if err := claimParams(s, params); err != nil {
		return err
	}
	checked := make([]checkedParam, len(params))
	for i, p := range params {
		checked[i] = checkedParam{t: p, v: p.Value()}
	}
	s.mu.Lock()
	s.checked = checked
	s.mu.Unlock()
	return nil
}

// unfrozen is params without the frozen ones (lazy.Tensor.Frozen): the
// same slice when none is.
func unfrozen(params []*lazy.Tensor) []*lazy.Tensor {
	i := slices.IndexFunc(params, (*lazy.Tensor).Frozen)
	if i < 0 {
		return params
	}
	out := slices.Clone(params[:i])
	for _, p := range params[i+1:] {
		if !p.Frozen() {
			out = append(out, p)
		}
	}
	return out
}

// distinctParams refuses a parameter listed twice, as the same tensor or
// over the same data, naming the first such pair. It runs every step, so it
// looks earlier ones up in maps rather than comparing every pair (GPT-2
// small has 148 parameters: 11k comparisons).
func distinctParams(params []*lazy.Tensor) error {
	byTensor := make(map[*lazy.Tensor]int, len(params))
	byData := make(map[tensor.Tensor]int, len(params))
	for i, p := range params {
		j, dup := byTensor[p]
		if v := p.Value(); v != nil {
			if k, seen := byData[v]; !seen {
				byData[v] = i
			} else if !dup || k < j {
				j, dup = k, true
			}
		}
		if dup {
			return &graph.OpError{Op: "step", Shapes: [][]int{p.Shape()},
				Err: fmt.Errorf("%w: parameters %d and %d (%q)", ErrDuplicateParam, j, i, p.Name())}
		}
		byTensor[p] = i
	}
	return nil
}

// backward builds the step's graph through the pipeline's passes
// (differentiate, compile.Train): under fp32 and tf32 the backward pass
// appended to a copy of loss's graph; under a mixed policy the policy's
// rewrite of that graph with its backward pass.
// Either way the caller's graph stays as it was built, so a loop stepping
// one loss tensor again finds the same forward graph (and its step
// template), and steps of one loss may run from several goroutines. With
// scale (the loss scale's data, only under a mixed policy) the backward
// pass starts from the loss times that constant. It also returns the step
// graph's template (whose signature is the step graph's), and a release to
// call once the step no longer runs its graph (a template's instance is
// then free for the next step).
func (s *Session) backward(loss *lazy.Tensor, params []*lazy.Tensor, scale *tensor.Dense) (*precision.Step, *stepTemplate, func(), error) {
	g, err := sameGraph("step", []*lazy.Tensor{loss})
	if err != nil {
		return nil, nil, nil, err
	}
	wrt, err := lazy.TrainedIDs("step", loss, params...) // −1 for a parameter the graph does not hold
	if err != nil {
		return nil, nil, nil, err
	}
	fwd := g.IR()
	scaled := scale != nil
	// A steady loop's step is the latest step's: compared exactly, field
	// by field, it needs no hash. Any other is looked up by signature, and
	// a hit is compared too, so a collision is a miss.
	s.mu.Lock()
	t := s.latest
	s.mu.Unlock()
	ok := t != nil && !s.stepCacheOff && t.matches(fwd, loss.ID(), wrt, scaled)
	var (
		key   stepKey
		seeds uint64
	)
	if !ok {
		key = stepKey{sig: fwd.Signature(), loss: loss.ID(), wrt: lru.Ints(wrt), scaled: scaled}
		seeds = randomSeeds(fwd)
		seeded := key
		seeded.seeds = seeds
		s.mu.Lock()
		t, ok = s.steps.Get(key) // a template taking each step's seeds
		if !ok {
			t, ok = s.steps.Get(seeded)
		}
		s.mu.Unlock()
		ok = ok && !s.stepCacheOff && t.matches(fwd, loss.ID(), wrt, scaled)
	}
	if ok {
		var inst *graph.Graph // t's instance when this step takes it
		s.mu.Lock()
		s.steps.Get(t.key) // marks it used
		s.latest = t
		s.stepHits++
		if !t.busy {
			t.busy = true
			if t.inst == nil {
				t.inst = t.st.Graph.Clone()
			}
			inst = t.inst
		}
		s.mu.Unlock()
		var data tensor.Tensor
		if scale != nil {
			data = scale
		}
		release := func() {}
		g := inst
		if g != nil {
			release = func() {
				s.mu.Lock()
				t.busy = false
				s.mu.Unlock()
			}
		} else {
			g = t.st.Graph.Clone()
		}
		return t.instantiate(g, fwd, data), t, release, nil
	}
	pre := structure(fwd)
	st, passes, err := s.differentiate(loss, wrt, scale)
	if err != nil {
		return nil, nil, nil, err
	}
	t = newTemplate(st, pre)
	t.passes = passes
	if !t.seedsKnown {
		key.seeds = seeds
	}
	t.key, t.loss, t.wrt, t.scaled = key, loss.ID(), wrt, scaled
	s.mu.Lock()
	s.steps.Put(key, t)
	s.latest = t
	s.mu.Unlock()
	return st, t, func() {}, nil
}

// differentiate builds a training step's graph through the pipeline
// (compile.Train) on a copy of loss's graph: the precision and layout
// passes under a mixed policy or channels last, then loss scaling, the
// backward pass and its fusions; a plain step (fp32, tf32 in NCHW) is the
// backward pass appended to the copy (compile.Options.Plain). wrt are the
// parameters' node ids, −1 for one the graph does not hold: its Params
// and Grads entries are −1 too. It returns the passes' reports too.
func (s *Session) differentiate(loss *lazy.Tensor, wrt []int, scale *tensor.Dense) (*precision.Step, []compile.Report, error) {
	fwd := loss.Graph().IR()
	held := make([]int, 0, len(wrt))
	for _, id := range wrt {
		if id >= 0 {
			held = append(held, id)
		}
	}
	o := compile.Options{Policy: s.policy, ChannelsLast: s.channelsLast(), Plain: true, Disable: s.opts.DisablePasses,
		OffloadParams: s.offloading()}
	if scale != nil {
		o.LossScale, o.Scale = true, scale
	}
	cs, err := compile.Train(fwd, loss.ID(), held, o)
	if err != nil {
		if oe := (*graph.OpError)(nil); !errors.As(err, &oe) {
			err = &graph.OpError{Op: "step", Err: err}
		}
		return nil, nil, err
	}
	st := &cs.Step
	if len(held) < len(wrt) { // the parameters' order, −1 where the graph holds none
		ps, gs := make([]int, len(wrt)), make([]int, len(wrt))
		k := 0
		for i, id := range wrt {
			ps[i], gs[i] = -1, -1
			if id >= 0 {
				ps[i], gs[i] = st.Params[k], st.Grads[k]
				k++
			}
		}
		st.Params, st.Grads = ps, gs
	}
	return st, cs.Passes, nil
}

// channelsLast reports whether training steps store conv nets channels
// last: Options.ChannelsLast, or the default under bf16-mixed unless
// Options.NoChannelsLast.
func (s *Session) channelsLast() bool {
	return s.opts.ChannelsLast || s.policy == precision.BF16Mixed && !s.opts.NoChannelsLast
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
