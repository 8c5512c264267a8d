package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
	"github.com/batchfit/batchfit/shapeinfer"
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
	Nodes      int    `json:"nodes"`
	Steps      int    `json:"program_steps"`
	// Device is the card planned for (--gpu, --gpu-memory), whose budget is
	// Budget; nil for --budget, planned with the CPU executor's workspaces.
	Device    *device `json:"device,omitempty"`
	Budget    int64   `json:"budget"`
	Headroom  int64   `json:"headroom"`
	Available int64   `json:"available"`
	// BuildSeconds times building, analysing and compiling the graph.
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
	// WholePeakReserved is what the whole batch in one chunk would reserve,
	// when it does not fit (PeakReserved otherwise); −1 when more than
	// planner.Unlimited.
	WholePeakReserved int64 `json:"whole_peak_reserved"`
	// Accumulators are the gradient sums across chunks, held only when the
	// batch runs in several.
	Accumulators    int64   `json:"accumulators"`
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

// step is a built, compiled training or inference step.
type step struct {
	module  nn.Module
	graph   *graph.Graph
	program *planner.Program
	rstep   recompute.Step // the training step, for the recompute search
}

// buildStep builds c's model shape-only over placeholders and compiles one
// step: forward, loss, and the gradients of every parameter (kept on the
// device, summed over chunks) with the optimizer's state in training mode;
// the forward output alone in inference mode. Workspaces are the CUDA
// executor's for a device, the CPU executor's otherwise.
func buildStep(c *estimateConfig) (*step, error) {
	b := c.model.build(nn.Options{ShapeOnly: true, DType: c.dtype, PerChunkStats: c.perChunk}, c.batch, c.seq, c.train, nil)
	if err := nn.Check(b.module); err != nil {
		return nil, err
	}
	out := b.output
	if c.train {
		out = b.loss
	}
	if err := out.Err(); err != nil {
		return nil, err
	}
	outputs := []int{out.ID()}
	var kept, trained []int
	g := out.Graph().IR()
	// A training step computes its graph's step updates too (the running
	// statistics of per-chunk batch norm), after the gradients, as a
	// Session's Step does: forward is the map into the step's graph.
	updates := func(forward []int) []int {
		var ids []int
		for _, u := range out.Graph().StepUpdates() {
			id := u.Value.ID()
			if forward != nil {
				id = forward[id]
			}
			ids = append(ids, id)
		}
		return ids
	}
	boundary := out.ID() + 1 // the first backward node, after any precision rewrite
	var finish int64         // the loss scaler's flag
	switch {
	case c.train && c.policy.Mixed(): // as a Session with that precision builds its step
		wrt, err := lazy.ParamIDs(b.loss, nn.ParamTensors(b.module)...)
		if err != nil {
			return nil, err
		}
		// fp16-mixed scales its loss, as a Session does by default.
		st, err := precision.TrainWith(g, c.policy, b.loss.ID(), wrt, precision.TrainOptions{LossScale: c.policy.Scaled(),
			ChannelsLast: c.policy == precision.BF16Mixed && !c.nchw})
		if err != nil {
			return nil, err
		}
		g, outputs = st.Graph, append(append([]int{st.Loss}, st.Grads...), updates(st.IDs)...)
		kept, trained, boundary = st.Grads, st.Params, st.Scaled+1
		if st.Scale >= 0 {
			finish = exec.UnscaleBytes
		}
	case c.train:
		params := nn.ParamTensors(b.module)
		for i, gr := range lazy.Grad(b.loss, params...) {
			if err := gr.Err(); err != nil {
				return nil, err
			}
			outputs = append(outputs, gr.ID())
			kept = append(kept, gr.ID())
			trained = append(trained, out.Graph().NodeOf(params[i]))
		}
		outputs = append(outputs, updates(nil)...)
	case c.policy.Mixed(): // Session.Eval's rewrite
		ng, ids, err := precision.Apply(g, c.policy)
		if err != nil {
			return nil, err
		}
		g, outputs = ng, []int{ids[out.ID()]}
	}
	info, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		return nil, err
	}
	ws := cpu.Workspace
	if c.device != nil {
		ws = cuda.Workspace
	}
	co := planner.CompileOptions{Kept: kept, Trained: trained, StateSlots: c.slots, Workspace: ws, FinishWorkspace: finish}
	p, err := planner.Compile(g, info, outputs, co)
	if err != nil {
		return nil, err
	}
	rs := recompute.Step{Graph: g, Boundary: boundary, Outputs: outputs, Compile: co}
	return &step{module: b.module, graph: g, program: p, rstep: rs}, nil
}

// planOptions are the planner options of c.
func planOptions(c *estimateConfig) planner.Options {
	return planner.Options{Budget: c.budget, Headroom: c.headroom, NoHeadroom: c.headroom == 0, Timeline: c.table, MaxChunk: c.microBatch}
}

// estimate plans c. On a planning failure it returns the report so far
// (with DoesNotFit filled in when the step does not fit) and the error.
func estimate(c *estimateConfig) (*report, error) {
	start := time.Now()
	st, err := buildStep(c)
	if err != nil {
		return nil, fmt.Errorf("building %s: %w", c.model.name, err)
	}
	r := &report{Model: c.model.name, About: c.model.about, Mode: "infer", DType: c.dtype.String(), Precision: string(c.policy),
		Optimizer: c.optimizer, StateSlots: c.slots, Batch: c.batch, MicroBatch: c.microBatch, Seq: c.seq,
		Params: int64(nn.NumParams(st.module)), Nodes: st.graph.Len(), Steps: len(st.program.Steps),
		Device: c.device, Budget: c.budget, Headroom: c.headroom, Available: c.budget - c.headroom,
		BuildSeconds: time.Since(start).Seconds()}
	if c.train {
		r.Mode = "train"
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
	for _, p := range st.module.Params() {
		r.ParamBytes += p.Tensor().Type().Bytes()
	}
	if nc := st.program.Info.NotChunkable; nc != nil {
		r.NotChunkable = nc.Error()
	}
	if c.train {
		r.StateBytes = int64(c.slots) * r.ParamBytes
	}

	if err := estimateRecompute(c, st, r); err != nil {
		return r, err
	}
	start = time.Now()
	o := planOptions(c)
	o.NoChunkList = true // nothing runs: the plan's memory must not grow with the batch
	o.TimelineChunks = 1 // the table shows the first chunk
	pl, err := planner.Make(st.program, o)
	elapsed := time.Since(start)
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
		if errors.Is(err, graph.ErrNotChunkable) && c.recompute != recompute.Auto {
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
		Persistent: pl.Persistent, Replays: pl.Replays, PlanningSeconds: elapsed.Seconds()}
	for _, run := range pl.Split.Runs() {
		pr.Chunks = append(pr.Chunks, chunkRun(run))
	}
	pr.WholePeakReserved = pl.PeakReserved
	if !pr.WholeBatch {
		for _, bi := range st.program.Accumulators {
			pr.Accumulators += st.program.Buffers[bi].Bytes(0)
		}
		sim := alloc.New(alloc.NewSimBackend(planner.Unlimited), alloc.Options{})
		u, err := planner.Replay(st.program, planner.ChunksOf(c.batch, c.batch), sim, nil, false)
		switch {
		case errors.Is(err, alloc.ErrOutOfMemory):
			pr.WholePeakReserved = -1
		case err != nil:
			return r, err
		default:
			pr.WholePeakReserved = u.PeakReserved
		}
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
// batch does not fit, the largest batch that fits in one piece: it builds
// and plans the step at smaller batches, bisecting. 0 when one sample
// does not fit.
func largestWholeBatch(c *estimateConfig) (int, error) {
	fits := func(n int) (bool, error) {
		cn := *c
		cn.batch = n
		st, err := buildStep(&cn)
		if err != nil {
			return false, err
		}
		o := planOptions(&cn)
		o.NoChunkList = true
		_, err = planner.Make(st.program, o)
		if errors.Is(err, planner.ErrDoesNotFit) {
			return false, nil
		}
		return err == nil, err
	}
	lo, hi := 0, c.batch // lo fits (0 trivially), hi does not
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		ok, err := fits(mid)
		if err != nil {
			return 0, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
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
		if b.Kind != planner.BufWorkspace {
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
	if r.Mode == "train" {
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
		if r.Mode == "train" {
			what = "parameters, optimizer state"
		}
		if p.WholeBatch {
			line("persistent", "%s (%s)", alloc.FormatBytes(p.Persistent), what)
		} else {
			line("persistent", "%s (%s) + %s gradient accumulators", alloc.FormatBytes(p.Persistent), what,
				alloc.FormatBytes(p.Accumulators))
		}
		line("planning", "%d replays in %s (graph built and compiled in %s)", p.Replays,
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
	writeRecompute(w, r)
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
