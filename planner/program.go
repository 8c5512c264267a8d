package planner

import (
	"iter"
	"slices"
	"strconv"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/lru"
	"github.com/batchfit/batchfit/shapeinfer"
)

// StepKind is what a program step does.
type StepKind uint8

const (
	StepAlloc StepKind = iota // allocate a buffer
	StepRun                   // run a node
	StepFree                  // free a buffer
)

func (k StepKind) String() string { return [...]string{"alloc", "run", "free"}[k] }

// Step is one entry of a program. Buf indexes Program.Buffers.
type Step struct {
	Kind StepKind
	Node int
	Buf  int // −1 for StepRun
}

// BufferKind says what a buffer holds.
type BufferKind uint8

const (
	BufOutput      BufferKind = iota // a node's value for one chunk
	BufWorkspace                     // scratch memory of a node's kernel
	BufParam                         // a parameter or constant, persistent
	BufState                         // optimizer state of a parameter, persistent
	BufAccumulator                   // sum of a kept output over chunks, persistent
	BufShard                         // a rank's flat parameter or gradient shard (Shard), persistent
	BufGather                        // a gathered parameter or a gradient bucket of a sharded program (Shard)
)

func (k BufferKind) String() string {
	return [...]string{"output", "workspace", "param", "state", "accumulator", "shard", "gather"}[k]
}

// Buffer is one allocation of the program; its size at chunk size b is
// Fixed + PerSample·b, at most Max when Max is positive.
type Buffer struct {
	Kind      BufferKind
	Node      int // the node it belongs to
	Slot      int // which optimizer state tensor, for BufState
	Fixed     int64
	PerSample int64
	// Max, when positive, bounds the size at every chunk size: a
	// workspace that stops growing (WorkspaceBound).
	Max int64
	Tag alloc.Tag
}

// Bytes is the buffer's size when b samples run at once.
func (b Buffer) Bytes(chunk int) int64 {
	n := b.Fixed + b.PerSample*int64(chunk)
	if b.Max > 0 && n > b.Max {
		return b.Max
	}
	return n
}

// WorkspaceBound is the chunk size a WorkspaceFunc is asked at, for the
// nodes of a fused loss (graph.IsLinearCrossEntropy) only, for the most
// bytes the node's workspace takes at any chunk size (0: no bound): one
// logits chunk of at most Attrs.LossChunk tokens, however many samples
// run. Its workspace at chunk size b is then min(Fixed + PerSample·b,
// that bound) (Buffer.Max).
const WorkspaceBound = -1

// Program is the compiled schedule of one graph.
type Program struct {
	Graph   *graph.Graph
	Info    *shapeinfer.Result
	Batch   int      // N
	Buffers []Buffer // persistent buffers first
	// Persistent lists, in allocation order, the buffers that outlive a
	// step: parameters, then optimizer state, then constants.
	Persistent []int
	// Accumulators hold the kept outputs' sums, one per kept output in
	// Kept order; a step allocates them after Persistent when its batch
	// runs in several chunks, and frees them at its end.
	Accumulators []int
	Steps        []Step
	Outputs      []int // graph outputs, in the order the caller asked
	Kept         []int // outputs that stay on the device (parameter gradients)
	// Trained are the parameters the optimizer updates, as compiled; when
	// Kept has the same length, Kept[i] is the gradient of Trained[i], the
	// order batchfit.Session.Step compiles them in.
	Trained   []int
	OutputBuf []int // buffer of each node's output, −1 if none
	// Companion[id] is the node whose output node id's kernel may compute
	// in the same pass, −1 for none (graph.CompanionProducer): the
	// log-sum-exp an attention_lse node recomputes for attention's
	// backward comes out of the attention forward pass over the same q, k
	// and mask, and batch_norm_grad_w's Σ g·x̂ out of batch_norm_grad_x's
	// pass over the same g and x (cuDNN's backward gives both). The
	// companion's output is allocated with id's, before id runs, so every
	// plan counts it from there; Replay hands its block to hooks that
	// implement CompanionHooks, and the companion's own run step stays, for
	// executors that compute it there (exec/cpu). Companion holds a
	// producer's first companion; NextCompanion[m] is the one after
	// companion m of the same producer, −1 for none (layer_norm_grad_x's
	// and batch_norm_grad_x's passes give both their weight's and their
	// bias's gradients). Companions
	// walks them in order.
	Companion     []int
	NextCompanion []int
	// FinishWorkspace is the scratch buffer Replay allocates after the
	// last chunk, hands to Hooks.Finish and frees after it
	// (CompileOptions.FinishWorkspace); its Fixed is 0 when there is none.
	// It is not in Buffers, and no timeline point marks it. With
	// CompileOptions.OptimizerScalars it ends with the optimizer's device
	// scalars, from byte OptimizerScalars on.
	FinishWorkspace Buffer
	// OptimizerScalars is the offset in the finish workspace of the
	// optimizer update's device scalars (OptimizerScalarBytes), and the
	// bytes before it the caller's CompileOptions.FinishWorkspace rounded
	// up to 8; 0 with none (HasOptimizerScalars).
	OptimizerScalars int64
	// HostPinned is the pinned host memory an offloaded step holds
	// (CompileOptions.Offload): for each trained parameter of n elements
	// its float32 master weights, its StateSlots float32 state tensors
	// and one 16-bit staging buffer, n·(4 + 4·StateSlots + 2) bytes. 0
	// without offload. It is no device memory: plans do not replay it.
	HostPinned int64
	// Offloaded reports that the program was compiled with
	// CompileOptions.Offload: its trained parameters' state is on the host.
	Offloaded bool
	scalars   bool   // the finish workspace holds them
	sig       uint64 // Signature, computed by Compile
	keptKey   string // lru.Ints(Kept), the plan cache's key for it, made by Compile
}

// Companions yields node id's companions in order (Companion, then
// NextCompanion): the nodes whose outputs id's kernel may compute in its
// pass.
func (p *Program) Companions(id int) iter.Seq[int] {
	return func(yield func(int) bool) {
		if id < 0 || id >= len(p.Companion) {
			return
		}
		for m := p.Companion[id]; m >= 0; m = p.NextCompanion[m] {
			if !yield(m) {
				return
			}
		}
	}
}

// WorkspaceFunc declares the scratch bytes a node's kernel needs when b
// samples run at once. Executors declare theirs; the planner allocates them
// around the run step so they are counted like any buffer.
type WorkspaceFunc func(g *graph.Graph, nd *graph.Node, b int) int64

// CompileOptions configures Compile.
type CompileOptions struct {
	// Kept are outputs that stay on the device across chunks and are summed
	// there (parameter gradients); other outputs are read back per chunk.
	Kept []int
	// Trained are the parameter nodes the optimizer updates; each gets
	// StateSlots state buffers of its size.
	Trained    []int
	StateSlots int
	Workspace  WorkspaceFunc
	// FinishWorkspace is the scratch bytes the executor's Finish hook needs
	// beside the kept outputs: dynamic loss scaling's inf/NaN flag
	// (exec.UnscaleBytes), which the unscale kernels set on the device.
	// Replay allocates it after the last chunk, once the chunk buffers are
	// freed, and frees it after Finish, so plans count it like any buffer.
	// Ignored without kept outputs (no Finish work).
	FinishWorkspace int64
	// OptimizerScalars adds the optimizer update's device scalars
	// (OptimizerScalarBytes of the trained parameters) to the finish
	// workspace, after FinishWorkspace's bytes (Program.OptimizerScalars):
	// the CUDA executor's SGD and Adam read their learning rates, bias
	// corrections and clip factor there, and need them. A batchfit.Session
	// sets it for every training step, so its plans count them on every
	// executor. Ignored without trained parameters and kept outputs.
	OptimizerScalars bool
	// Offload puts the optimizer on the host (ZeRO-Offload): the trained
	// parameters' StateSlots state tensors get no device buffers; they,
	// the float32 master weights and a 16-bit staging buffer per
	// parameter live in pinned host memory (Program.HostPinned). The
	// trained parameters must be 16-bit (their device copies) and so
	// their gradients; Compile refuses others with graph.ErrDType.
	Offload bool
}

// OffloadElementBytes is the pinned host bytes an offloaded step holds per
// element of a trained parameter with slots state tensors: the float32
// master, the float32 state and a 16-bit staging buffer (the gradient
// copied in, the new weights copied out).
func OffloadElementBytes(slots int) int64 { return 4 + 4*int64(slots) + 2 }

// Compile makes the program of g for outputs. info must be
// shapeinfer.Analyze(g, outputs...).
func Compile(g *graph.Graph, info *shapeinfer.Result, outputs []int, o CompileOptions) (*Program, error) {
	n := g.Len()
	p := &Program{Graph: g, Info: info, Batch: g.Batch(), Outputs: append([]int(nil), outputs...), Offloaded: o.Offload,
		Kept: append([]int(nil), o.Kept...), Trained: append([]int(nil), o.Trained...), OutputBuf: make([]int, n)}
	p.keptKey = lru.Ints(p.Kept)
	for i := range p.OutputBuf {
		p.OutputBuf[i] = -1
	}
	nodes := g.Nodes()
	tag := func(nd *graph.Node) alloc.Tag {
		return alloc.Tag{Node: nd.ID, Op: nd.Op.String(), Scope: scopeOrName(nd)}
	}
	add := func(b Buffer) int {
		p.Buffers = append(p.Buffers, b)
		return len(p.Buffers) - 1
	}
	// Persistent: parameters and constants that the program reads, then
	// optimizer state, then the constants: an executor keeps them resident
	// in this order, so constants, which are released first, come last.
	var consts []int
	for id := range nodes {
		nd := &nodes[id]
		if (nd.Op == graph.OpParam || nd.Op == graph.OpConst) && info.LastUse[id] >= 0 {
			b := add(Buffer{Kind: BufParam, Node: id, Fixed: info.Fixed[id], Tag: tag(nd)})
			p.OutputBuf[id] = b
			if nd.Op == graph.OpConst {
				consts = append(consts, b)
			} else {
				p.Persistent = append(p.Persistent, b)
			}
		}
	}
	for _, id := range o.Trained {
		if id < 0 || id >= n {
			return nil, graph.Errorf(graph.ErrArity, "planner: trained node %d is not a node of the graph", id)
		}
		if nd := &nodes[id]; nd.Op != graph.OpParam {
			return nil, &graph.OpError{Op: "compile", Site: nd.Site, Err: graph.Errorf(graph.ErrNotParam,
				"planner: trained node %d (%s %q) is not a parameter", id, nd.Op, nd.Name)}
		}
		if o.Offload {
			if dt := nodes[id].Type.DType; dt != graph.BFloat16 && dt != graph.Float16 {
				return nil, &graph.OpError{Op: "compile", Site: nodes[id].Site, Err: graph.Errorf(graph.ErrDType,
					"planner: offloaded parameter %d (%q) is %s: its device copy must be 16-bit", id, nodes[id].Name, dt)}
			}
			p.HostPinned += int64(nodes[id].Type.Numel()) * OffloadElementBytes(o.StateSlots)
			continue
		}
		for slot := range o.StateSlots {
			t := tag(&nodes[id])
			t.Op = StateOp(slot)
			p.Persistent = append(p.Persistent, add(Buffer{Kind: BufState, Node: id, Slot: slot, Fixed: nodes[id].Type.Bytes(), Tag: t}))
		}
	}
	p.Persistent = append(p.Persistent, consts...)
	for _, id := range o.Kept {
		if id < 0 || id >= n || info.Class[id] == shapeinfer.PerSample {
			return nil, graph.Errorf(graph.ErrArity, "planner: kept output %d must be a node without a batch axis", id)
		}
		t := tag(&nodes[id])
		t.Op = "grad_accumulator"
		b := add(Buffer{Kind: BufAccumulator, Node: id, Fixed: info.Fixed[id], Tag: t})
		p.Accumulators = append(p.Accumulators, b)
	}
	// The chunk program, in node order. A reshape is a view: it shares its
	// input's buffer (every buffer is contiguous, so only the shape
	// changes), and a buffer is freed after the last use of any node that
	// shares it.
	bufLast := make([]int, len(p.Buffers), len(p.Buffers)+n)
	p.Companion, p.NextCompanion = make([]int, n), make([]int, n)
	early := make([]bool, n) // allocated with its producer's output
	last := make([]int, n)   // each producer's last companion so far
	for id := range nodes {
		p.Companion[id], p.NextCompanion[id] = -1, -1
		pr := graph.CompanionProducer(g, id)
		if pr < 0 || pr >= id || info.LastUse[id] < 0 || info.LastUse[pr] < 0 {
			continue
		}
		if p.Companion[pr] < 0 {
			p.Companion[pr] = id
		} else {
			p.NextCompanion[last[pr]] = id
		}
		last[pr] = id
	}
	for id := range nodes {
		nd := &nodes[id]
		if info.LastUse[id] < 0 || p.OutputBuf[id] >= 0 && !early[id] {
			continue // unused, or persistent
		}
		if nd.Op == graph.OpReshape {
			p.OutputBuf[id] = p.OutputBuf[nd.Inputs[0]]
			bi := p.OutputBuf[id]
			bufLast[bi] = max(bufLast[bi], info.LastUse[id])
			continue
		}
		output := func(id int) {
			out := add(Buffer{Kind: BufOutput, Node: id, Fixed: info.Fixed[id], PerSample: info.PerSample[id], Tag: tag(&nodes[id])})
			p.OutputBuf[id] = out
			bufLast = append(bufLast[:len(p.Buffers)-1], info.LastUse[id])
			p.Steps = append(p.Steps, Step{Kind: StepAlloc, Node: id, Buf: out})
		}
		if !early[id] {
			output(id)
		}
		for m := range p.Companions(id) {
			output(m)
			early[m] = true
		}
		ws := -1
		if o.Workspace != nil && nd.Op.Category() != graph.CatSource {
			fixed := o.Workspace(g, nd, 0)
			per := o.Workspace(g, nd, 1) - fixed
			var bound int64
			if graph.IsLinearCrossEntropy(nd.Op) {
				bound = o.Workspace(g, nd, WorkspaceBound)
			}
			if fixed > 0 || per > 0 {
				t := tag(nd)
				t.Op += ".workspace"
				ws = add(Buffer{Kind: BufWorkspace, Node: id, Fixed: fixed, PerSample: per, Max: bound, Tag: t})
				bufLast = append(bufLast, id)
				p.Steps = append(p.Steps, Step{Kind: StepAlloc, Node: id, Buf: ws})
			}
		}
		p.Steps = append(p.Steps, Step{Kind: StepRun, Node: id, Buf: -1})
		if ws >= 0 {
			p.Steps = append(p.Steps, Step{Kind: StepFree, Node: id, Buf: ws})
		}
	}
	// Free steps: after node id, every chunk buffer whose last use is id.
	// Inserted in a second pass because a view made later can extend the
	// life of a buffer allocated earlier.
	steps := p.Steps
	p.Steps = make([]Step, 0, len(steps)+len(p.Buffers))
	for _, st := range steps {
		p.Steps = append(p.Steps, st)
		if st.Kind != StepRun {
			continue
		}
		for _, in := range uniqueBuffers(p, nodes[st.Node].Inputs) {
			if p.Buffers[in].Kind == BufOutput && bufLast[in] == st.Node {
				p.Steps = append(p.Steps, Step{Kind: StepFree, Node: p.Buffers[in].Node, Buf: in})
			}
		}
	}
	if o.FinishWorkspace < 0 {
		return nil, graph.Errorf(graph.ErrAttr, "planner: finish workspace of %d bytes", o.FinishWorkspace)
	}
	fixed := o.FinishWorkspace
	if o.OptimizerScalars && len(o.Trained) > 0 && len(o.Kept) > 0 {
		// The optimizer's device scalars follow the caller's bytes.
		p.scalars = true
		p.OptimizerScalars = (fixed + 7) &^ 7
		fixed = p.OptimizerScalars + OptimizerScalarBytes(len(o.Trained))
	}
	if k := len(o.Kept); fixed > 0 && k > 0 {
		nd := &nodes[o.Kept[k-1]]
		t := tag(nd)
		t.Op = FinishOp
		p.FinishWorkspace = Buffer{Kind: BufWorkspace, Node: nd.ID, Fixed: fixed, Tag: t}
	}
	p.sig = p.signature()
	return p, nil
}

// FinishOp is the tag op of a program's finish workspace (the loss
// scaler's inf/NaN flag, the optimizer's device scalars): it belongs to
// the last kept output's node.
const FinishOp = "unscale_flag"

// Device scalars of the optimizer update (exec/cuda's optimizer.go lays
// them out, in float64 words): a header, a table of group
// hyperparameters, two words per trained parameter, and the partial sums
// of the gradient-norm kernels, OptimizerNormBlocks per launch of
// OptimizerTensors parameters. A training program compiled with
// CompileOptions.OptimizerScalars holds them in its finish workspace, so
// that the kernels read the learning rate, the bias corrections and the
// clip factor from device memory and a captured update replays for every
// step; the CPU executor accounts for them as CUDA's uses them, so plans
// agree.
const (
	OptimizerTensors    = 64  // parameters per multi-tensor launch
	OptimizerGroups     = 64  // parameter groups one update may use
	OptimizerNormBlocks = 256 // blocks (and partial sums) per norm launch
	optimizerHeader     = 4   // words: max norm, norm, clip factor, spare
	optimizerGroupWords = 8   // words per group
	optimizerParamWords = 2   // words per parameter
)

// HasOptimizerScalars reports whether p's finish workspace ends with the
// optimizer's device scalars (CompileOptions.OptimizerScalars).
func (p *Program) HasOptimizerScalars() bool { return p.scalars }

// CallerFinish is the bytes of p's finish workspace before the optimizer's
// scalars: the caller's CompileOptions.FinishWorkspace (rounded up to 8
// when scalars follow).
func (p *Program) CallerFinish() int64 {
	if p.HasOptimizerScalars() {
		return p.OptimizerScalars
	}
	return p.FinishWorkspace.Fixed
}

// OptimizerScalarBytes is the bytes of device scalars an update of
// trained parameters uses.
func OptimizerScalarBytes(trained int) int64 {
	if trained <= 0 {
		return 0
	}
	lists := (trained + OptimizerTensors - 1) / OptimizerTensors
	words := optimizerHeader + optimizerGroupWords*min(trained, OptimizerGroups) +
		optimizerParamWords*trained + OptimizerNormBlocks*lists
	return 8 * int64(words)
}

// StateOp is the tag op of optimizer state slot k, so that allocator
// snapshots tell a parameter's slots apart (Adam's exp_avg is slot 0,
// exp_avg_sq slot 1).
func StateOp(slot int) string { return "optimizer_state." + strconv.Itoa(slot) }

func scopeOrName(nd *graph.Node) string {
	if nd.Name != "" {
		return nd.Name
	}
	return nd.Scope
}

// uniqueBuffers lists the buffers of the given nodes once each (x·x, or a
// view beside its source, frees one buffer once).
func uniqueBuffers(p *Program, ids []int) []int {
	var u []int
	for _, id := range ids {
		if bi := p.OutputBuf[id]; bi >= 0 && !slices.Contains(u, bi) {
			u = append(u, bi)
		}
	}
	return u
}

// Rebind returns p for g, a graph with p's signature built anew (a training
// loop rebuilds its graph every step): the schedule carries over, the node
// data comes from g.
func (p *Program) Rebind(g *graph.Graph) *Program {
	q := *p
	q.Graph = g
	return &q
}
