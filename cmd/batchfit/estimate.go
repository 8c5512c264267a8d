package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
)

// report is what estimate found, printed as text or JSON. Byte counts are
// exact; the text output rounds them.
type report struct {
	Model      string `json:"model"`
	About      string `json:"about"`
	Input      string `json:"input"`            // dtype and shape of the model's input
	Labels     string `json:"labels,omitempty"` // and of the loss's targets, in training mode
	Mode       string `json:"mode"`
	DType      string `json:"dtype"`
	Precision  string `json:"precision"` // --precision's policy
	Optimizer  string `json:"optimizer,omitempty"`
	StateSlots int    `json:"state_slots"`
	Batch      int    `json:"batch"`
	MicroBatch int    `json:"micro_batch,omitempty"` // --micro-batch: the largest chunk allowed
	Seq        int    `json:"seq,omitempty"`
	Params     int64  `json:"params"`
	ParamBytes int64  `json:"param_bytes"`
	StateBytes int64  `json:"optimizer_state_bytes"`
	// Offload is where the plan's optimizer runs: "optimizer" when it is
	// offloaded (--offload optimizer, or auto's choice), empty otherwise;
	// OffloadAsked is --offload's mode when it is auto.
	Offload      string `json:"offload,omitempty"`
	OffloadAsked string `json:"offload_asked,omitempty"`
	// Levers are the lever settings the session weighed (loss chunk,
	// optimizer placement, recompute, batch chunks), the one planned
	// marked chosen (--levers); empty without, or when there was no
	// choice.
	Levers []leverRow `json:"levers,omitempty"`
	// LoRA is --lora's adapters; nil without.
	LoRA  *loraReport `json:"lora,omitempty"`
	Nodes int         `json:"nodes"`
	Steps int         `json:"program_steps"`
	// Device is the card planned for (--gpu, --gpu-memory), whose budget is
	// Budget; nil for --budget, planned with the CPU executor's workspaces.
	Device    *device `json:"device,omitempty"`
	Budget    int64   `json:"budget"`
	Headroom  int64   `json:"headroom"`
	Available int64   `json:"available"`
	// BuildSeconds times building the model's graph; the plan's
	// PlanningSeconds the Session's Plan: the step compiled and planned.
	BuildSeconds float64     `json:"build_seconds"`
	Plan         *planReport `json:"plan,omitempty"`
	DoesNotFit   *fitReport  `json:"does_not_fit,omitempty"`
	Timeline     []opRow     `json:"timeline,omitempty"`
	Largest      []bufferRow `json:"largest,omitempty"`
	// Recompute is the recompute search (--recompute auto): every
	// candidate's plan and predicted step time; Plan is the chosen one's.
	Recompute *recomputeReport `json:"recompute,omitempty"`
	// NotChunkable says why the batch cannot run in chunks (a
	// training-mode batch norm mixes its samples), naming the node; empty
	// when it can.
	NotChunkable string `json:"not_chunkable,omitempty"`
	// BatchStats is which statistics the planned step's training-mode
	// batch norm normalises with (planner.Plan.BatchStats: "whole-batch"
	// or "per-chunk"), BatchNorm the sentence saying so; empty for a
	// model without training-mode batch norm.
	BatchStats string `json:"batch_stats,omitempty"`
	BatchNorm  string `json:"batch_norm,omitempty"`
	// Passes is what each graph pass of the pipeline did to the step, in
	// order (--passes; package compile).
	Passes []compile.Report `json:"passes,omitempty"`
	// ZeRO is one data-parallel rank's holdings (--ranks, --zero), whose
	// plan Plan is; nil without those flags.
	ZeRO *zeroReport `json:"zero,omitempty"`
}

// loraReport is a LoRA fine-tune's split of the parameters: the frozen
// base (16-bit linear weights and embeddings, float32 norms: no gradient,
// no optimizer state) and the trained float32 adapters, whose gradients
// and optimizer state the plan holds.
type loraReport struct {
	Rank          int      `json:"rank"`
	Alpha         float64  `json:"alpha"`
	Targets       []string `json:"targets"`
	Adapters      int      `json:"adapters"` // adapted layers
	AdapterParams int64    `json:"adapter_params"`
	AdapterBytes  int64    `json:"adapter_bytes"`
	FrozenParams  int64    `json:"frozen_params"`
	FrozenBytes   int64    `json:"frozen_bytes"`
	GradientBytes int64    `json:"gradient_bytes"` // the adapters' gradients
}

// planReport is planner.Plan with its chunks as runs of equal sizes.
type planReport struct {
	WholeBatch    bool       `json:"whole_batch"` // the batch runs in one chunk
	Chunk         int        `json:"chunk"`
	NumChunks     int        `json:"num_chunks"`
	Chunks        []chunkRun `json:"chunks"` // at most two runs, in run order: larger chunks first
	PeakReserved  int64      `json:"peak_reserved"`
	PeakAllocated int64      `json:"peak_allocated"`
	Fixed         int64      `json:"fixed"`      // affine fit of a chunked run's peak reserved:
	PerSample     int64      `json:"per_sample"` // fixed + per_sample·chunk
	Persistent    int64      `json:"persistent"` // parameters and optimizer state
	// HostPinned is the pinned host memory of an offloaded optimizer
	// (--offload optimizer: float32 masters, Adam's moments and a
	// bfloat16 staging buffer per parameter), 0 without.
	HostPinned int64 `json:"host_pinned"`
	// WholePeakReserved is what the whole batch in one chunk would reserve,
	// when it does not fit (PeakReserved otherwise); −1 when more than
	// planner.Unlimited.
	WholePeakReserved int64 `json:"whole_peak_reserved"`
	// Accumulators are the gradient sums across chunks, held only when the
	// batch runs in several.
	Accumulators int64 `json:"accumulators"`
	// LossChunk is the tokens per logits chunk of the fused head and loss
	// (planner.Plan.LossChunk), 0 when the step has none.
	LossChunk       int     `json:"loss_chunk,omitempty"`
	Replays         int     `json:"replays"`
	PlanningSeconds float64 `json:"planning_seconds"`
}

// chunkRun is Count chunks of Size samples (planner.Run).
type chunkRun struct {
	Count int `json:"count"`
	Size  int `json:"size"`
}

// fitReport is planner.DoesNotFitError.
type fitReport struct {
	Message   string      `json:"message"`
	Chunk     int         `json:"chunk"`
	Needed    int64       `json:"needed"`
	Whole     int64       `json:"whole"`
	Available int64       `json:"available"`
	Fixed     int64       `json:"fixed"`
	Reason    string      `json:"reason,omitempty"`
	Largest   []bufferRow `json:"largest"`
	// LargestWholeBatch is, when the batch cannot run in chunks, the
	// largest batch that fits in one piece (0 when not even one sample
	// does, or with --recompute auto, which does not search it).
	LargestWholeBatch int `json:"largest_whole_batch,omitempty"`
}

// opRow is one node run of the first chunk: what it allocates, and the
// allocator's state right after it ran (its output and workspace held).
type opRow struct {
	Step      int    `json:"step"`
	Node      int    `json:"node"`
	Op        string `json:"op"`
	Module    string `json:"module"`
	Shape     []int  `json:"shape"`
	Bytes     int64  `json:"bytes"`
	Workspace int64  `json:"workspace"`
	Allocated int64  `json:"allocated"`
	Reserved  int64  `json:"reserved"`
}

// bufferRow is one buffer of the program at the planned chunk size.
type bufferRow struct {
	Bytes  int64  `json:"bytes"`
	Kind   string `json:"kind"`
	Node   int    `json:"node"`
	Op     string `json:"op"`
	Module string `json:"module"`
	Shape  []int  `json:"shape,omitempty"`
}

// step is a zoo model's training or inference step as a dry-run Session
// plans it (session): built, compiled and planned.
type step struct {
	module  nn.Module
	graph   *graph.Graph     // the plain step's graph (no recompute copies), without data
	program *planner.Program // the program the plan runs (a recompute transform when one was chosen)
	rstep   recompute.Step   // the plain training step, for the recompute search's listing
	// plan is the Session's plan (its timeline through the first chunk, no
	// chunk list); nil when the step does not fit, planErr saying why.
	plan       *planner.Plan
	planErr    error
	recomputed batchfit.Recomputed
	passes     []compile.Report       // what the pipeline's passes did (StepPlan.Passes)
	levers     []batchfit.LeverChoice // the lever settings weighed (StepPlan.Levers)
	offloaded  bool                   // the plan's optimizer is offloaded (chosen by --offload auto or asked)
	// buildSeconds times building the model's graph, planSeconds the
	// Session's Plan (compiling the step and planning it).
	buildSeconds, planSeconds float64
}

// session is the dry-run Session c's steps are planned in: c's precision,
// micro-batch, recompute mode and cost profile, within c's budget and
// headroom, with the CUDA executor's workspaces and its cuBLAS workspace
// outside every plan for a card (--gpu, --gpu-memory), the CPU
// executor's otherwise.
func session(c *estimateConfig) *batchfit.Session {
	o := batchfit.Options{Precision: string(c.policy), Budget: c.budget, Headroom: c.headroom, MaxChunk: c.microBatch,
		NoChannelsLast: c.nchw, Recompute: c.recompute, Offload: c.offload, Profile: c.profile, DryRun: &batchfit.DryRun{Workspace: cpu.Workspace},
		DisablePasses: c.disable, LossChunk: c.lossChunk, NoFusedLoss: c.noFusedLoss}
	if c.device != nil {
		// The card's budget is what its plans may use: the cuBLAS
		// workspace is held besides it.
		o.Budget += c.device.Workspace
		o.DryRun.Workspace, o.DryRun.Overhead = cuda.Workspace, c.device.Workspace
	}
	return batchfit.NewSession(o)
}

// buildStep builds c's model shape-only over placeholders and plans one
// step with session(c), as a Session on the device would run it: in
// training mode Session.Plan (forward, loss, and the gradients of every
// parameter with the optimizer's state), in inference mode
// Session.PlanEval of the forward output. A step that does not fit comes
// back with planErr set; an error building or compiling it is returned.
func buildStep(c *estimateConfig) (*step, error) {
	sess := session(c)
	if err := sess.Err(); err != nil {
		return nil, err
	}
	defer sess.Close()
	start := time.Now()
	b := c.model.build(nn.Options{ShapeOnly: true, DType: c.dtype, PerChunkStats: c.perChunk}, c.batch, c.seq, c.train, nil, c.adapt())
	if err := nn.Check(b.module); err != nil {
		return nil, err
	}
	st := &step{module: b.module, buildSeconds: time.Since(start).Seconds()}
	start = time.Now()
	var (
		sp  *batchfit.StepPlan
		err error
	)
	if c.train {
		sp, err = sess.Plan(b.loss, nn.ParamTensors(b.module), stateOf(c))
	} else {
		sp, err = sess.PlanEval(b.output)
	}
	st.planSeconds = time.Since(start).Seconds()
	if sp == nil {
		return nil, err
	}
	st.graph, st.program, st.rstep, st.recomputed, st.passes = sp.Program.Graph, sp.Program, sp.Search, sp.Recompute, sp.Passes
	st.levers, st.offloaded = sp.Levers, sp.Program.Offloaded
	if c.train {
		st.graph = sp.Search.Graph // the plain step's, before any recompute copies
	}
	st.plan, st.planErr = sp.Plan, err
	return st, nil
}

// stateOf is an optimizer holding c's state slots per parameter (the
// --optimizer's).
func stateOf(c *estimateConfig) optim.Optimizer { return makeOptimizer(c.optimizer) }

// planOptions are the planner options of c: the Session's (budget,
// headroom, micro-batch), for plans made outside it.
func planOptions(c *estimateConfig) planner.Options {
	return planner.Options{Budget: c.budget, Headroom: c.headroom, NoHeadroom: c.headroom == 0, Timeline: c.table, MaxChunk: c.microBatch}
}

// estimate plans c. On a planning failure it returns the report so far
// (with DoesNotFit filled in when the step does not fit) and the error.
func estimate(c *estimateConfig) (*report, error) {
	st, err := buildStep(c)
	if err != nil {
		return nil, fmt.Errorf("building %s: %w", c.model.name, err)
	}
	r := &report{Model: c.model.name, About: c.model.about, Mode: "infer", DType: c.dtype.String(), Precision: string(c.policy),
		Optimizer: c.optimizer, StateSlots: c.slots, Batch: c.batch, MicroBatch: c.microBatch, Seq: c.seq,
		Params: int64(nn.NumParams(st.module)), Nodes: st.graph.Len(), Steps: len(st.program.Steps),
		Device: c.device, Budget: c.budget, Headroom: c.headroom, Available: c.budget - c.headroom,
		BuildSeconds: st.buildSeconds}
	if c.train {
		r.Mode = "train"
	}
	if c.passes {
		r.Passes = st.passes
	}
	if st.offloaded {
		r.Offload = string(batchfit.OffloadOptimizer)
	}
	if c.offload == batchfit.OffloadAuto {
		r.OffloadAsked = string(c.offload)
	}
	if c.levers {
		r.Levers = leverRows(st.levers)
	}
	var inputs []string // the model's input, then the labels (built in that order)
	for _, nd := range st.graph.Nodes() {
		if nd.Op == graph.OpInput {
			inputs = append(inputs, fmt.Sprintf("%s%v", nd.Type.DType, nd.Type.Shape))
		}
	}
	r.Input = inputs[0]
	if c.train {
		r.Labels = inputs[1]
	}
	var trainedBytes int64
	for _, p := range st.module.Params() {
		b := p.Tensor().Type().Bytes()
		r.ParamBytes += b
		if !p.Frozen() {
			trainedBytes += b
		}
	}
	if l := c.lora; l != nil {
		lr := &loraReport{Rank: l.Rank, Alpha: l.AlphaOrDefault(), Targets: l.Targets,
			Adapters: len(nn.LoRAAdapters(st.module)), GradientBytes: trainedBytes}
		for _, p := range st.module.Params() {
			n, b := int64(graph.Numel(p.Shape())), p.Tensor().Type().Bytes()
			if p.Frozen() {
				lr.FrozenParams, lr.FrozenBytes = lr.FrozenParams+n, lr.FrozenBytes+b
			} else {
				lr.AdapterParams, lr.AdapterBytes = lr.AdapterParams+n, lr.AdapterBytes+b
			}
		}
		r.LoRA = lr
	}
	if nc := st.program.Info.NotChunkable; nc != nil {
		r.NotChunkable = nc.Error()
	}
	if c.train {
		r.StateBytes = int64(c.slots) * trainedBytes // frozen parameters hold none
	}

	if err := estimateRecompute(c, st, r); err != nil {
		return r, err
	}
	if c.zero != nil {
		return estimateZeRO(c, st, r)
	}
	pl, err := st.plan, st.planErr
	var dnf *planner.DoesNotFitError
	if errors.As(err, &dnf) {
		r.DoesNotFit = &fitReport{Message: dnf.Error(), Chunk: dnf.Chunk, Needed: dnf.Needed, Whole: dnf.Whole,
			Available: dnf.Available, Fixed: dnf.Fixed}
		if dnf.Reason != nil {
			r.DoesNotFit.Reason = dnf.Reason.Error()
		}
		for _, u := range dnf.Largest {
			r.DoesNotFit.Largest = append(r.DoesNotFit.Largest, bufferRow{Bytes: u.Bytes, Kind: u.Kind.String(),
				Node: u.Tag.Node, Op: u.Tag.Op, Module: u.Tag.Scope})
		}
		if errors.Is(err, graph.ErrNotChunkable) && c.train && c.recompute != recompute.Auto {
			n, serr := largestWholeBatch(c)
			if serr != nil {
				return r, serr
			}
			r.DoesNotFit.LargestWholeBatch = n
			if n > 0 {
				err = fmt.Errorf("%w; at most %d %s run in one piece", err, n, plural(n, "sample"))
			}
		}
		return r, err
	}
	if err != nil {
		return r, err
	}
	pr := &planReport{WholeBatch: pl.Split.Len() == 1, Chunk: pl.Chunk, NumChunks: pl.Split.Len(),
		PeakReserved: pl.PeakReserved, PeakAllocated: pl.PeakAllocated, Fixed: pl.Fixed, PerSample: pl.PerSample,
		Persistent: pl.Persistent, HostPinned: pl.HostPinned, Replays: pl.Replays, PlanningSeconds: st.planSeconds, LossChunk: pl.LossChunk}
	for _, run := range pl.Split.Runs() {
		pr.Chunks = append(pr.Chunks, chunkRun(run))
	}
	pr.WholePeakReserved = pl.PeakReserved
	if !pr.WholeBatch {
		for _, bi := range st.program.Accumulators {
			pr.Accumulators += st.program.Buffers[bi].Bytes(0)
		}
		whole, err := wholeBatchPeak(st.program, c.batch)
		if err != nil {
			return r, err
		}
		pr.WholePeakReserved = whole
	}
	r.Plan = pr
	r.BatchStats, r.BatchNorm = pl.BatchStats, pl.StatsNote()
	if c.table {
		r.Timeline = timeline(st.program, pl)
	}
	if c.top > 0 {
		r.Largest = largest(st.program, pl, c.top)
	}
	return r, nil
}

// largestWholeBatch finds, for a step that cannot run in chunks and whose
// batch does not fit, the largest batch that fits in one piece:
// Session.MaxBatch over the model built at smaller batches, up to c's
// batch. 0 when one sample does not fit.
func largestWholeBatch(c *estimateConfig) (int, error) {
	sess := session(c)
	if err := sess.Err(); err != nil {
		return 0, err
	}
	defer sess.Close()
	build := func(n int) (*lazy.Tensor, []*lazy.Tensor) {
		b := c.model.build(nn.Options{ShapeOnly: true, DType: c.dtype, PerChunkStats: c.perChunk}, n, c.seq, true, nil, c.adapt())
		return b.loss, nn.ParamTensors(b.module)
	}
	fit, err := sess.MaxBatch(build, stateOf(c), batchfit.MaxBatchOptions{Limit: c.batch})
	if err != nil {
		return 0, err
	}
	return fit.Batch, nil
}

// timeline lists the node runs of the plan's first chunk.
func timeline(p *planner.Program, pl *planner.Plan) []opRow {
	size := pl.Chunk
	var rows []opRow
	for _, pt := range pl.Timeline {
		if pt.Chunk != 0 || pt.Kind != planner.StepRun {
			continue
		}
		nd := p.Graph.Node(pt.Node)
		out := p.Buffers[p.OutputBuf[pt.Node]]
		row := opRow{Step: pt.Step, Node: pt.Node, Op: nd.Op.String(), Module: out.Tag.Scope,
			Shape: nd.Type.AtBatch(size), Bytes: out.Bytes(size), Allocated: pt.Allocated, Reserved: pt.Reserved}
		if prev := pt.Step - 1; prev >= 0 {
			if s := p.Steps[prev]; s.Kind == planner.StepAlloc && p.Buffers[s.Buf].Kind == planner.BufWorkspace {
				row.Workspace = p.Buffers[s.Buf].Bytes(size)
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// largest lists the n largest buffers at the plan's chunk size; gradient
// accumulators count only when the batch runs in several chunks.
func largest(p *planner.Program, pl *planner.Plan, n int) []bufferRow {
	var rows []bufferRow
	for _, b := range p.Buffers {
		if b.Kind == planner.BufAccumulator && pl.Split.Len() == 1 {
			continue
		}
		row := bufferRow{Bytes: b.Bytes(pl.Chunk), Kind: b.Kind.String(), Node: b.Node, Op: b.Tag.Op, Module: b.Tag.Scope}
		if b.Kind != planner.BufWorkspace && b.Tag.Scope != planner.ShardScope { // a flat shard or bucket has no node's shape
			row.Shape = p.Graph.Node(b.Node).Type.AtBatch(pl.Chunk)
		}
		rows = append(rows, row)
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].Bytes > rows[j].Bytes })
	return rows[:min(n, len(rows))]
}

func writeJSON(w io.Writer, r *report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func exact(n int64) string { return fmt.Sprintf("%s (%s B)", alloc.FormatBytes(n), thousands(n)) }

// writeText prints the report for people; planned is false when planning
// failed (the error follows on stderr).
func writeText(w io.Writer, r *report, planned bool) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	line := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t%s\n", k, fmt.Sprintf(format, args...)) }
	line("model", "%s: %s", r.Model, r.About)
	if r.Labels != "" {
		line("input", "%s, labels %s", r.Input, r.Labels)
	} else {
		line("input", "%s", r.Input)
	}
	kind := r.DType
	if r.Precision != "" && r.Precision != string(precision.FP32) {
		kind = r.Precision
	}
	if r.Optimizer != "" {
		line("mode", "%s, %s, %s (%d state tensors per parameter)", r.Mode, kind, r.Optimizer, r.StateSlots)
	} else {
		line("mode", "%s, %s", r.Mode, kind)
	}
	line("parameters", "%s (%s)", thousands(r.Params), alloc.FormatBytes(r.ParamBytes))
	if l := r.LoRA; l != nil {
		line("lora", "rank %d, alpha %g on %s: %d adapted layers, %s adapter parameters (%s float32, gradients %s)",
			l.Rank, l.Alpha, strings.Join(l.Targets, ","), l.Adapters, thousands(l.AdapterParams),
			alloc.FormatBytes(l.AdapterBytes), alloc.FormatBytes(l.GradientBytes))
		line("frozen base", "%s parameters (%s: 16-bit linear weights and embeddings, float32 norms; no gradients or optimizer state)",
			thousands(l.FrozenParams), alloc.FormatBytes(l.FrozenBytes))
	}
	if r.Mode == "train" && r.Offload != "" {
		how := "--offload " + r.Offload
		if r.OffloadAsked != "" {
			how = "--offload " + r.OffloadAsked + " chose it"
		}
		line("optimizer state", "%s, in host memory (%s)", alloc.FormatBytes(r.StateBytes), how)
	} else if r.Mode == "train" && r.OffloadAsked != "" {
		line("optimizer state", "%s, on the device (--offload %s chose it)", alloc.FormatBytes(r.StateBytes), r.OffloadAsked)
	} else if r.Mode == "train" {
		line("optimizer state", "%s", alloc.FormatBytes(r.StateBytes))
	}
	line("graph", "%s nodes, %s program steps", thousands(int64(r.Nodes)), thousands(int64(r.Steps)))
	if r.Device != nil {
		line("device", "%s", r.Device.describe())
	}
	line("budget", "%s − headroom %s = %s available", alloc.FormatBytes(r.Budget), alloc.FormatBytes(r.Headroom),
		alloc.FormatBytes(r.Available))
	if p := r.Plan; planned && p != nil {
		switch {
		case p.WholeBatch:
			line("fits", "yes: the whole batch of %d runs in one chunk", r.Batch)
		case r.MicroBatch > 0 && p.WholePeakReserved >= 0 && p.WholePeakReserved <= r.Available:
			line("fits", "in micro-batches of at most %d (--micro-batch): %s; the whole batch of %d would fit in one chunk (%s)",
				r.MicroBatch, planner.Split{N: r.Batch, K: p.NumChunks}, r.Batch, planner.FormatPeak(p.WholePeakReserved))
		default:
			line("fits", "in chunks: the whole batch of %d would need %s; it runs as %s", r.Batch,
				planner.FormatPeak(p.WholePeakReserved), planner.Split{N: r.Batch, K: p.NumChunks})
		}
		if r.NotChunkable != "" {
			line("chunking", "none: %s", r.NotChunkable)
		}
		line("chunk", "%d %s", p.Chunk, plural(p.Chunk, "sample"))
		if p.LossChunk > 0 {
			line("loss chunk", "%d tokens per logits chunk (fused head and cross-entropy)", p.LossChunk)
		}
		if r.BatchNorm != "" {
			line("batch norm", "%s", r.BatchNorm)
		}
		line("peak reserved", "%s", exact(p.PeakReserved))
		line("peak allocated", "%s", exact(p.PeakAllocated))
		if r.NotChunkable != "" {
			line("affine fit", "none (the batch cannot run in chunks)")
		} else if p.PerSample > 0 {
			line("affine fit", "peak reserved ≈ %s + %s × chunk", alloc.FormatBytes(p.Fixed), alloc.FormatBytes(p.PerSample))
		} else {
			line("affine fit", "none (needs a batch of 3 or more)")
		}
		what := "parameters"
		switch {
		case r.Offload != "":
			what = "bfloat16 parameters; their optimizer state is on the host"
		case r.Mode == "train":
			what = "parameters, optimizer state"
		}
		if p.WholeBatch {
			line("persistent", "%s (%s)", alloc.FormatBytes(p.Persistent), what)
		} else {
			line("persistent", "%s (%s) + %s gradient accumulators", alloc.FormatBytes(p.Persistent), what,
				alloc.FormatBytes(p.Accumulators))
		}
		if r.Offload != "" {
			line("host pinned", "%s (float32 masters, optimizer state, bfloat16 staging)", exact(p.HostPinned))
		}
		line("planning", "compiled and %d replays in %s (graph built in %s)", p.Replays,
			round(p.PlanningSeconds), round(r.BuildSeconds))
	}
	if f := r.DoesNotFit; f != nil && r.NotChunkable != "" {
		line("fits", "no: the whole batch of %d needs %s and cannot run in chunks: %s", r.Batch,
			planner.FormatPeak(f.Whole), r.NotChunkable)
		switch {
		case f.LargestWholeBatch > 0:
			line("largest batch", "%d %s in one piece", f.LargestWholeBatch, plural(f.LargestWholeBatch, "sample"))
		case r.Recompute == nil:
			line("largest batch", "none: not even one sample fits")
		}
	}
	tw.Flush()
	writePasses(w, r)
	writeLevers(w, r)
	writeRecompute(w, r)
	writeZeRO(w, r)
	if len(r.Timeline) > 0 {
		fmt.Fprintf(w, "\nmemory timeline of chunk 0 (%d samples), after each op runs:\n", r.Plan.Chunk)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "STEP\tNODE\tOP\tMODULE\tSHAPE\t    OUTPUT\t WORKSPACE\t ALLOCATED\t  RESERVED")
		for _, o := range r.Timeline {
			ws := "-"
			if o.Workspace > 0 {
				ws = alloc.FormatBytes(o.Workspace)
			}
			fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%v\t%10s\t%10s\t%10s\t%10s\n", o.Step, o.Node, o.Op, dash(o.Module), o.Shape,
				alloc.FormatBytes(o.Bytes), ws, alloc.FormatBytes(o.Allocated), alloc.FormatBytes(o.Reserved))
		}
		tw.Flush()
	}
	if len(r.Largest) > 0 {
		fmt.Fprintf(w, "\n%d largest buffers at chunk %d:\n", len(r.Largest), r.Plan.Chunk)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "     BYTES\tKIND\tNODE\tOP\tMODULE\tSHAPE")
		for _, b := range r.Largest {
			fmt.Fprintf(tw, "%10s\t%s\t%d\t%s\t%s\t%v\n", alloc.FormatBytes(b.Bytes), b.Kind, b.Node, b.Op, dash(b.Module), b.Shape)
		}
		tw.Flush()
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// round prints seconds to three significant digits or 0.1 ms. A time
// past what a time.Duration holds (292 years; the cost model's rates are
// bounded, so only an absurd model gets there) prints as seconds in
// floating point rather than as a wrapped negative duration.
func round(s float64) string {
	const maxSeconds = float64(math.MaxInt64/time.Second) - 1
	switch {
	case math.IsInf(s, 0) || math.IsNaN(s):
		return fmt.Sprintf("%+v s", s)
	case math.Abs(s) > maxSeconds:
		return strconv.FormatFloat(s, 'g', 3, 64) + "s"
	}
	d := time.Duration(s * float64(time.Second))
	unit := 100 * time.Microsecond
	for unit < d/100 {
		unit *= 10
	}
	return d.Round(unit).String()
}

func plural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}

// wholeBatchPeak is the peak reserved bytes of program p run as one chunk
// of batch samples on an unlimited device (what estimate reports a chunked
// plan's whole batch would need), −1 when even that runs out of memory.
func wholeBatchPeak(p *planner.Program, batch int) (int64, error) {
	sim := alloc.New(alloc.NewSimBackend(planner.Unlimited), alloc.Options{})
	u, err := planner.Replay(p, planner.ChunksOf(batch, batch), sim, nil, false)
	switch {
	case errors.Is(err, alloc.ErrOutOfMemory):
		return -1, nil
	case err != nil:
		return 0, err
	}
	return u.PeakReserved, nil
}
