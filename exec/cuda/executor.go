package cuda

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// ExecutorOptions configures NewExecutor.
type ExecutorOptions struct {
	// TF32 lets cuBLAS run float32 GEMMs on TF32 tensor cores (products
	// with a 10-bit mantissa, sums in float32). Off by default: GEMMs are
	// full FP32, as exec/cpu computes them.
	TF32 bool
	// BLASWorkspace is cuBLAS's workspace in bytes, taken from the
	// executor's allocator by NewExecutor and held until Close:
	// DefaultWorkspace when 0, none with NoBLASWorkspace. Other sizes must
	// be multiples of alloc.RoundLarge of at least alloc.MinLargeAlloc, so
	// that the block fills a segment of its own and every other allocation
	// lays out as the planner's simulation of the program does.
	BLASWorkspace int64
	// TraceEntries keeps the allocator's last TraceEntries events.
	TraceEntries int
	// NoCuDNN runs convolutions on the im2col kernels even when cuDNN 9
	// loads (to compare the two, or to leave cuDNN's libraries unloaded).
	NoCuDNN bool
	// ConvHeuristics chooses cuDNN's convolution algorithms by its _v7
	// heuristics within the static workspace formula (Workspace), as
	// before the timed search. By default the executor's Workspace times
	// each plain float32 convolution shape's algorithms (and the im2col
	// path) at compile time (or reads the timings from the disk cache,
	// Options.AlgoCacheDir) and declares the chosen one's exact workspace
	// (convfind.go). BATCHFIT_CUDNN_FIND in the environment overrides
	// this and ConvSearchAll: 0 for the heuristics, 1 for the default, all
	// for ConvSearchAll.
	ConvHeuristics bool
	// ConvSearchAll extends the timed search to 16-bit and TF32
	// convolutions, which keep the heuristics by default: searched, a
	// bf16-mixed channels-last ResNet-50 step measured slower (38.0
	// against 31.7 ms on the H100).
	ConvSearchAll bool
	// NoCuDNNBatchNorm runs batch_norm and batch_norm_grad_x on
	// kernels/batchnorm.cu even where cuDNN's batch norm takes them
	// (cuDNN's measured faster on the H100: ResNet-50 bf16 39.9 against
	// 48.4 ms a step; this is for comparing).
	NoCuDNNBatchNorm bool
	// NoCuDNNAttention runs fused attention on kernels/attention.cu even
	// where cuDNN's fused attention (SDPA, dnn_sdpa.go) takes it: 16-bit,
	// head dim 64 or 128, no mask, grouped-query heads or not. For
	// comparing.
	NoCuDNNAttention bool
	// NoCUDAGraphs launches every kernel eagerly. By default the executor
	// captures a run of a step's launches between host steps as a CUDA
	// graph, keyed by the program's signature, the chunk and the addresses
	// its blocks have, the second time a step comes to it, and replays it
	// (cuGraphLaunch) whenever a later step does (graphs.go).
	// Steps compute what they compute without, bit for bit, from the same
	// allocator blocks; the driver memory of the instantiated graphs is
	// left free by Reserve. Calls with ExecOptions.OpTime, UpdateTime or
	// ExecOptions.Reduce launch eagerly. BATCHFIT_CUDA_GRAPHS=1 (or 0) in
	// the environment turns graphs on (or off) whatever this says, to run a
	// test suite both ways.
	NoCUDAGraphs bool
}

// graphsEnv is the environment variable that overrides
// ExecutorOptions.NoCUDAGraphs.
const graphsEnv = "BATCHFIT_CUDA_GRAPHS"

// graphsOn is whether ExecutorOptions.NoCUDAGraphs, under graphsEnv,
// leaves CUDA graphs on.
func graphsOn(o ExecutorOptions) bool {
	switch os.Getenv(graphsEnv) {
	case "1":
		return true
	case "0":
		return false
	}
	return !o.NoCUDAGraphs
}

// NoBLASWorkspace gives cuBLAS no workspace (ExecutorOptions.BLASWorkspace).
const NoBLASWorkspace = -1

// Executor runs planner programs on a CUDA device. Every device byte it
// uses comes from its caching allocator: parameters, activations, kernel
// workspaces (declared to the planner by Workspace) and cuBLAS's workspace.
// So a program's planned peaks (planner.Make over a program compiled with
// Workspace) are what Execute measures, plus Overhead, the cuBLAS
// workspace's own segment.
//
// Execute runs a whole step on the device thread in one call (the
// caller's own, with the context made current there): every launch, copy
// and allocation of the step happens there, with no hop per kernel.
type Executor struct {
	d    *Device
	a    *alloc.Allocator
	blas *BLAS
	dnn  *DNN      // nil: convolutions on im2col
	why  error     // why dnn is nil: ErrNoLibrary, or NoCuDNN
	find findScope // which conv nodes declare the timed search's workspaces (convfind.go)
	ks   *kernelSet
	// nchwRuns counts channels-last convolutions run on NCHW copies
	// (ChannelsLastOnCopies).
	nchwRuns atomic.Int64
	// earlyReads counts chunks whose host outputs were copied as soon as
	// they were final (readback.go).
	earlyReads atomic.Int64

	mu       sync.Mutex
	resident exec.Residents[*residentBuf]
	// hostCopies is set while some resident's residentBuf.host holds a
	// copy (save, for Yield), so dropHostCopies need not walk them all.
	hostCopies bool
	closed     bool
	// soleOwner is the optimizer that owns every optimizer state buffer
	// with an owner, when one does (optimizer.go's takeState skips its
	// checks for it), nil otherwise.
	soleOwner devOptimizer
	graphs    graphCache // CUDA graphs (graphs.go; ExecutorOptions.NoCUDAGraphs), under mu
	// graphBytes is the driver memory the live graphs' instantiation took
	// (GraphStats.DriverBytes), for Reserve without the lock.
	graphBytes atomic.Int64
	cur        *runner   // the running Execute's runner, on the device thread
	reads      readPlans // each program's early reads (readback.go), under mu
	// warmed holds the programs (signature and chunk sizes) whose
	// generated kernels warmPointwise has compiled, under mu.
	warmed map[uint64]bool
	// offload is an offloaded optimizer's page-locked host memory
	// (ExecOptions.Offload): masters, state and staging (offload.go).
	offload exec.OffloadHost
}

var _ exec.Executor = (*Executor)(nil)

// NewExecutor makes an executor on d: a caching allocator over
// d.Backend(), a cuBLAS handle with its workspace from that allocator, and
// the kernels of kernels/*.cu, compiled by NVRTC or loaded from the cubin
// cache. Close releases them.
func NewExecutor(d *Device, o ExecutorOptions) (*Executor, error) {
	if d == nil {
		return nil, graph.Errorf(graph.ErrAttr, "cuda: NewExecutor needs a device")
	}
	ws := o.BLASWorkspace
	switch {
	case ws == 0:
		ws = DefaultWorkspace
	case ws == NoBLASWorkspace:
		ws = 0
	case ws < alloc.MinLargeAlloc || ws%alloc.RoundLarge != 0:
		return nil, graph.Errorf(graph.ErrAttr, "cuda: a cuBLAS workspace of %d bytes does not fill a segment of its own: use a multiple of %s from %s",
			ws, alloc.FormatBytes(alloc.RoundLarge), alloc.FormatBytes(alloc.MinLargeAlloc))
	}
	ks, err := loadKernels(d)
	if err != nil {
		return nil, err
	}
	e := &Executor{d: d, ks: ks, why: errNoCuDNNAsked}
	e.offload.Alloc, e.offload.Free = d.AllocHost, d.FreeHost
	e.graphs.on = graphsOn(o)
	// The backend flushes pending launches (graphs.go) before it gives a
	// segment back to the driver.
	a := alloc.New(graphBackend{Backend: d.Backend(), e: e}, alloc.Options{TraceEntries: o.TraceEntries})
	e.a = a
	b, err := d.NewBLAS(a, ws)
	if err != nil {
		return nil, errors.Join(err, ks.close())
	}
	if o.TF32 {
		if err := b.SetTF32(true); err != nil {
			return nil, errors.Join(err, b.Close(), ks.close(), a.EmptyCache())
		}
	}
	e.blas = b
	if !o.NoCuDNN {
		// cuDNN is optional: without it (not installed, or its handle
		// failed) convolutions run on im2col, and Convolutions says why.
		e.dnn, e.why = d.newDNN(o.TF32)
		if e.dnn != nil && o.NoCuDNNBatchNorm {
			e.dnn.bn = nil
		}
		if e.dnn != nil {
			e.dnn.noSDPA = o.NoCuDNNAttention
			if e.dnn.lib.find != nil {
				e.find = findScopeOf(o)
			}
			e.dnn.ks, e.dnn.blas = ks, b
		}
	}
	return e, nil
}

// errNoCuDNNAsked is why an executor made with ExecutorOptions.NoCuDNN has
// no cuDNN.
var errNoCuDNNAsked = errors.New("ExecutorOptions.NoCuDNN")

// Convolutions says what runs the executor's convolutions: "cuDNN 9.14.0
// (timed search: float32)", "cuDNN 9.14.0 (timed search: all)" or "cuDNN
// 9.14.0 (heuristics)", or "im2col + cuBLAS (no cuDNN: reason)".
func (e *Executor) Convolutions() string {
	if e.dnn != nil {
		switch e.find {
		case findFP32:
			return "cuDNN " + e.dnn.Version() + " (timed search: float32)"
		case findAll:
			return "cuDNN " + e.dnn.Version() + " (timed search: all)"
		}
		return "cuDNN " + e.dnn.Version() + " (heuristics)"
	}
	return "im2col + cuBLAS (no cuDNN: " + e.why.Error() + ")"
}

// ChannelsLastOnCopies counts the channels-last convolution passes the
// executor ran as their NCHW twins on copies in their workspaces, because
// cuDNN did not take them channels last (or it has no cuDNN): cuDNN
// 9.14's float16 depthwise input gradient, for one. It counts launches
// from the host (eager runs and CUDA graph captures), not graph replays.
func (e *Executor) ChannelsLastOnCopies() int64 { return e.nchwRuns.Load() }

// DNN is the executor's cuDNN handle, nil when its convolutions run on
// im2col (Convolutions says why).
func (e *Executor) DNN() *DNN { return e.dnn }

// Device is the executor's device.
func (e *Executor) Device() *Device { return e.d }

// Allocator is the executor's caching allocator. Its Stats may be read at
// any time; calls that reach the device (Malloc, EmptyCache) must not run
// while an Execute does, which holds the device thread.
func (e *Executor) Allocator() *alloc.Allocator { return e.a }

// Overhead is the bytes the executor holds in its allocator outside any
// program: the cuBLAS workspace, which fills a segment of its own. A
// step's measured peaks are its plan's plus Overhead.
func (e *Executor) Overhead() int64 {
	if ws := e.blas.Workspace(); ws != nil {
		return ws.Size()
	}
	return 0
}

// Reserve is the memory plans leave free (exec.Executor): DriverReserve,
// and the device memory the cuDNN handle and the live CUDA graphs
// (GraphStats.DriverBytes) took outside every allocator.
func (e *Executor) Reserve() int64 {
	r := DriverReserve + e.graphBytes.Load()
	if e.dnn != nil {
		r += e.dnn.Overhead()
	}
	return r
}

// Close frees the resident buffers, destroys the cuBLAS handle (returning
// its workspace), unloads the kernels and gives the allocator's cache back
// to the device. The device stays open.
func (e *Executor) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	var graphs error
	if len(e.graphs.progs) > 0 || e.graphs.stream != 0 {
		graphs = e.d.do(e.closeGraphs)
	}
	var dnn error
	if e.dnn != nil {
		dnn = e.dnn.Close()
	}
	e.dropState()
	// The optimizer gets copies of its state first; FreeHost frees on the
	// device's thread (nothing after the device closed, which freed it).
	offload := e.offload.Release()
	return errors.Join(graphs, offload, e.resident.Release(e.a), e.blas.Close(), dnn, e.ks.close(), e.a.EmptyCache())
}

// Workspace is the kernels' workspace rule (exec.Executor): the package's
// Workspace, except that with the timed search (the default for plain
// float32 convolutions where cuDNN loads; ExecutorOptions.ConvHeuristics,
// ConvSearchAll) a convolution declares the workspace of the algorithm
// the search chose for its shape, searching on first use (convfind.go). A program compiled with it runs on this
// executor (or another on the same device and cuDNN, from the caches);
// on another executor a timed node's block may be smaller than the
// heuristics need, and the node fails with ErrWorkspace rather than take
// more memory than planned.
func (e *Executor) Workspace() planner.WorkspaceFunc {
	if e.find == findNone {
		return Workspace
	}
	return e.timedWorkspace
}

// timedWorkspace is Workspace with the timed search's choices for the
// convolutions.
func (e *Executor) timedWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	switch nd.Op {
	case graph.OpConv2d, graph.OpConv2dGradInput, graph.OpConv2dGradWeight:
		if e.find != findAll && !e.dnn.strict(nd.Type.DType) {
			break
		}
		if ch := e.dnn.choiceFor(g, nd, Workspace, e.searchCap()); ch != nil {
			return ch.fixed + ch.per*int64(b)
		}
	}
	return Workspace(g, nd, b)
}

// searchCap bounds a search's device memory by the headroom under the
// allocator's cap, when it has one.
func (e *Executor) searchCap() int64 {
	c := int64(maxSearchBytes)
	if l := e.a.Limit(); l > 0 {
		c = min(c, l-e.a.Stats().ReservedBytes[alloc.All].Current)
	}
	return c
}

// ExecOptions configures Execute: the options both executors take.
type ExecOptions = exec.Options

// Result is what Execute returns; its Usage includes Overhead.
type Result = exec.Result

// Execute runs program p for chunks through the executor's allocator: the
// same planner.Replay the planner simulates, with hooks that upload, launch
// kernels and download, all in one call, on the caller's thread with the
// device's context current there (the device goroutine waits meanwhile).
// Program p must be compiled with Workspace.
//
// A resident call (ExecOptions.Resident, as a training loop's) returns
// once every launch is queued and its results are on the host, without
// waiting for the kernels after its last host output (the rest of the
// backward pass, the optimizer): the caller's next host work overlaps them
// (tailLeftRunning says when). They run on stream 0 ahead of any later
// work: the next Execute's kernels, uploads and downloads, and any copy
// to or from the host, follow them; Device.Synchronize and giving memory
// back to the driver wait for them. A fault in them (an illegal address)
// is reported by the next call that reaches the driver.
func (e *Executor) Execute(ctx context.Context, p *planner.Program, chunks []planner.Chunk, o ExecOptions) (*Result, error) {
	if err := exec.CheckChunks(p, chunks); err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, fmt.Errorf("%w: executor", ErrClosed)
	}
	if err := exec.CheckLossScale(p, o.LossScale); err != nil {
		return nil, err
	}
	if err := exec.CheckOffload(p, o); err != nil {
		return nil, err
	}
	call, err := exec.NewCall(p, o, &e.resident)
	if err != nil {
		return nil, err
	}
	e.warm(p, chunks)
	r := &runner{e: e, ctx: ctx, p: p, o: o, c: call, persist: map[persistKey]*alloc.Block{}, inputs: map[int]*exec.HostBuf{}}
	if rp := e.reads.of(p, call.KeptOf); rp.after > 0 {
		r.reads = chunkReads{plan: rp, blocks: make([]*alloc.Block, len(rp.bufs)), off: make([]uintptr, len(rp.bufs))}
	}
	if o.Reduce != nil {
		r.oneChunk, r.kept = len(chunks) == 1, map[int]bool{}
		for _, id := range p.Kept {
			r.kept[id] = true
		}
	}
	var u planner.Usage
	// The step runs on the caller's thread (doHere): the next step's host
	// work starts without a thread's wake-up.
	err = e.d.doHere(func() error {
		if o.Resident { // the step restores what Yield gave back
			if err := e.restore(); err != nil {
				return err
			}
		}
		var gerr error
		if e.graphs.on && o.OpTime == nil && o.UpdateTime == nil && o.Reduce == nil {
			r.g, gerr = e.graphs.forProgram(p.Signature(), e.destroySeg)
		}
		e.cur = r
		defer func() { e.cur = nil }()
		var err error
		u, err = planner.Replay(p, chunks, e.a, r, o.Timeline)
		if err == nil { // the launches after the last host step
			err = r.flush()
		}
		if r.g != nil {
			err = errors.Join(err, gerr, r.g.prune(graphKeep, e.destroySeg))
		}
		if len(r.reduced) > 0 && !r.reduceWaited {
			// A step that failed after handing gradients to Reduce waits
			// for their sums (or their failure) before its blocks go back
			// to the allocator for other buffers.
			err = errors.Join(err, o.Reduce.Wait())
		}
		if !o.Resident {
			err = call.Free(e.a, err)
		}
		if err == nil && !tailLeftRunning(o) { // launch errors surface here at the latest
			err = e.d.Synchronize()
		} else {
			// The tail, or what a failed run queued, may still run: a
			// free of device memory waits for it.
			e.d.tail = true
		}
		if err == nil {
			e.d.sampleMemInfo() // the next step's budget (Backend.MemInfo)
		}
		return errors.Join(err, r.reportTimes(err == nil))
	})
	if err != nil {
		return nil, err
	}
	outs, err := exec.Outputs(p, call.Outs)
	if err != nil {
		return nil, err
	}
	if o.Offload {
		u.HostPinned = e.offload.Pinned()
	}
	return &Result{Usage: u, Outputs: outs, Skipped: call.Skipped}, nil
}

// maxWarmed bounds Executor.warmed; past it the memo starts again.
const maxWarmed = 256

// maxWarmSizes bounds the chunk sizes warm compiles for: a balanced split
// has two at most.
const maxWarmSizes = 4

// warm compiles p's generated kernels side by side before its first step
// (kernelSet.warmPointwise), once per program and chunk sizes. Not on the
// device goroutine, whose loads the compiles would wait for.
func (e *Executor) warm(p *planner.Program, chunks []planner.Chunk) {
	if e.d.onThread() {
		return
	}
	var sizes []int
	h := p.Signature()
	for _, c := range chunks {
		if len(sizes) == maxWarmSizes {
			break
		}
		if !slices.Contains(sizes, c.Size) {
			sizes = append(sizes, c.Size)
			h = h*1099511628211 ^ uint64(c.Size)
		}
	}
	if e.warmed[h] {
		return
	}
	if e.warmed == nil || len(e.warmed) >= maxWarmed {
		e.warmed = map[uint64]bool{}
	}
	e.ks.warmPointwise(e.d, p.Graph, sizes)
	e.warmed[h] = true
}

// tailLeftRunning is whether a successful Execute with options o returns
// without waiting for its last kernels: a resident call that neither times
// its nodes or its update (OpTime and UpdateTime read their events after
// the step) nor hands its gradients to a Reducer (whose communication runs
// on its own stream).
func tailLeftRunning(o ExecOptions) bool {
	return o.Resident && o.OpTime == nil && o.UpdateTime == nil && o.Reduce == nil
}

// Run evaluates g over its full batch (exec.Executor).
func (e *Executor) Run(ctx context.Context, g *graph.Graph, outputs ...int) ([]*tensor.Dense, error) {
	return e.RunBatch(ctx, g, g.Batch(), nil, outputs...)
}

// RunBatch evaluates g for b samples, as exec/cpu's RunBatch: feed, when
// non-nil, may supply the data of any source node.
func (e *Executor) RunBatch(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
	info, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		return nil, err
	}
	return exec.RunOnce(ctx, e, g, info, b, feed, outputs)
}

// persistKey names a persistent buffer of one program: its kind, node and
// state slot.
type persistKey struct {
	kind planner.BufferKind
	node int
	slot int
}

func keyOf(b planner.Buffer) persistKey { return persistKey{b.Kind, b.Node, b.Slot} }

// runner implements planner.Hooks for one Execute call. Its methods run on
// the device thread.
type runner struct {
	e       *Executor
	ctx     context.Context
	p       *planner.Program
	o       ExecOptions
	c       *exec.Call[*residentBuf]    // the host side shared with exec/cpu
	persist map[persistKey]*alloc.Block // this call's persistent blocks
	inputs  map[int]*exec.HostBuf       // whole-batch input data, converted once
	timed   []nodeTiming                // ExecOptions.OpTime's and UpdateTime's events, in launch order
	// companions are the blocks the replay handed over for the next Run's
	// companion outputs (planner.CompanionHooks), in the program's order;
	// early holds the companions already computed by their producer, whose
	// own run steps are then skipped.
	companions []handedCo
	early      map[int]bool
	// filledState is set when the call allocated an optimizer state
	// buffer (Fill), which then has no owner yet.
	filledState bool
	// g is the program's CUDA graphs, nil when this call launches eagerly;
	// pend is the nodes whose launches wait for the next host step, fp
	// their fingerprint (graphs.go).
	g    *progGraphs
	pend []pendingOp
	fp   []uint64
	// ExecOptions.Reduce's state: the program runs in one chunk (its kept
	// outputs are final when made), the kept nodes, the blocks handed to
	// Reduce.Add, and whether Reduce.Wait was called.
	oneChunk     bool
	kept         map[int]bool
	reduced      map[alloc.Ptr]bool
	reduceWaited bool
	reads        chunkReads // the host outputs' early reads (readback.go)
}

// handedCo is a companion output block handed over for node's next Run.
type handedCo struct {
	node, m int
	blk     *alloc.Block
	ins     []*alloc.Block // the companion's inputs
}

// Companion takes the block of nd's companion output m for nd's next Run;
// a node with several companions gets one call for each, in order.
func (r *runner) Companion(nd *graph.Node, m int, blk *alloc.Block, ins []*alloc.Block) {
	if len(r.companions) > 0 && r.companions[0].node != nd.ID {
		r.companions = r.companions[:0] // left from a node that did not run
	}
	r.companions = append(r.companions, handedCo{node: nd.ID, m: m, blk: blk, ins: ins})
}

// EveryChunk is true: the runner computes.
func (*runner) EveryChunk() bool { return true }

func (r *runner) node(id int) *graph.Node { return r.p.Graph.Node(id) }

func (r *runner) source(id int) tensor.Tensor { return r.c.Source(id) }

func (r *runner) Resident(buf planner.Buffer) *alloc.Block {
	rb := r.c.Resident(buf)
	if rb == nil {
		return nil
	}
	r.persist[keyOf(buf)] = rb.Blk
	return rb.Blk
}

func (r *runner) Fill(pb planner.Buffer, blk *alloc.Block) error {
	err := r.flush()
	if err != nil {
		return err
	}
	if pb.Kind == planner.BufParam {
		nd := r.node(pb.Node)
		var v *exec.HostBuf
		if v, err = hostData(nd, r.source(pb.Node), nd.Type.Shape); err == nil {
			err = r.upload(blk.Ptr(), v, nd.Type.DType)
		}
	} else { // optimizer state and accumulators start at zero
		err = r.e.d.Memzero(blk.Ptr(), blk.Requested())
	}
	if err != nil {
		if pb.Kind == planner.BufParam || pb.Kind == planner.BufState {
			// Replay frees no parameter or state block of a failed run.
			err = errors.Join(err, r.e.a.Free(blk))
		}
		return err
	}
	r.persist[keyOf(pb)] = blk
	r.filledState = r.filledState || pb.Kind == planner.BufState
	rb := &residentBuf{}
	if pb.Kind == planner.BufParam {
		src := *r.node(pb.Node)
		src.Inputs, src.Attrs, src.Value = nil, graph.Attrs{}, r.source(pb.Node)
		rb.src = &src
	}
	r.c.Keep(pb, blk, rb)
	return nil
}

// Run runs node nd for chunk c, then queues the chunk's early reads when
// nd wrote the last of its host outputs (readback.go).
func (r *runner) Run(nd *graph.Node, c planner.Chunk, out *alloc.Block, ins []*alloc.Block, ws *alloc.Block) error {
	if err := r.runNode(nd, c, out, ins, ws); err != nil {
		return err
	}
	return r.afterRun(nd, c, out)
}

func (r *runner) runNode(nd *graph.Node, c planner.Chunk, out *alloc.Block, ins []*alloc.Block, ws *alloc.Block) (err error) {
	if err := r.ctx.Err(); err != nil {
		return err
	}
	if r.early[nd.ID] { // computed with its producer (Companion)
		delete(r.early, nd.ID)
		return nil
	}
	if r.o.OpTime != nil {
		ev, err := r.startTiming(nd, c)
		if err != nil {
			return err
		}
		defer func() {
			if rerr := r.e.d.record(ev.end); err == nil {
				err = rerr
			}
		}()
	}
	if nd.Op == graph.OpInput {
		if err := r.flush(); err != nil {
			return err
		}
		return r.loadInput(nd, c, out)
	}
	in := make([]operand, len(ins))
	for i, b := range ins {
		in[i] = r.operand(nd.Inputs[i], b, c.Size)
	}
	y := r.operand(nd.ID, out, c.Size)
	var cos []coOut
	for _, h := range r.companions {
		if h.node == nd.ID {
			co := coOut{node: h.m, v: r.operand(h.m, h.blk, c.Size), in: make([]operand, len(h.ins))}
			for i, b := range h.ins {
				co.in[i] = r.operand(r.node(h.m).Inputs[i], b, c.Size)
			}
			cos = append(cos, co)
		}
	}
	clear(r.companions)
	r.companions = r.companions[:0]
	if r.g != nil && !hostReads(nd.Op) {
		// A node that has run eagerly before waits for the segment's
		// flush; its first run told which companions it computes.
		if done, ok := r.g.coDone[coKey{nd.ID, c.Size}]; ok {
			r.deferOp(pendingOp{nd: nd, c: c, in: in, y: y, ws: viewOf(ws), cos: cos, coDone: done})
			r.markEarly(cos, done)
			return nil
		}
	}
	if err := r.flush(); err != nil {
		return err
	}
	coDone, err := r.eval(nd, in, y, viewOf(ws), c, cos)
	r.markEarly(cos, coDone)
	if err != nil {
		return r.opError(nd, c, in, err)
	}
	if r.g != nil {
		r.g.coDone[coKey{nd.ID, c.Size}] = coDone
	}
	return r.reduceReady(nd.ID, out)
}

// markEarly notes the companion outputs of cos that the running node
// computed (done's bits).
func (r *runner) markEarly(cos []coOut, done coSet) {
	for i, co := range cos {
		if done.has(i) {
			if r.early == nil {
				r.early = map[int]bool{}
			}
			r.early[co.node] = true
		}
	}
}

// opError is a node's kernel error with the node's op, shapes and site.
func (r *runner) opError(nd *graph.Node, c planner.Chunk, in []operand, err error) error {
	shapes := make([][]int, len(in))
	for i, x := range in {
		shapes[i] = x.shape
	}
	return &graph.OpError{Op: nd.Op.String(), Shapes: shapes, Site: nd.Site, Err: exec.InChunk(r.p, nd, c, err)}
}

func (r *runner) Freed(planner.Buffer, *alloc.Block) {}

// operand is node id's value in block blk at chunk size b: the block's
// address with the node's shape and dtype. A reshape shares its input's
// block, so the shape comes from the node reading it.
func (r *runner) operand(id int, blk *alloc.Block, b int) operand {
	t := r.node(id).Type
	v := operand{shape: t.AtBatch(b), dt: t.DType}
	if blk != nil {
		v.p = blk.Ptr()
	}
	return v
}

// ChunkDone adds kept outputs into their accumulators on the device and
// reads the others (from their early copies when the chunk made them),
// combining them on the host.
func (r *runner) ChunkDone(c planner.Chunk, outs []*alloc.Block, acc []*alloc.Block) error {
	if err := r.flush(); err != nil {
		return err
	}
	add := func(o int, acc, out *alloc.Block) error {
		nd := r.node(o)
		if !nd.Type.DType.IsFloat() {
			return graph.Errorf(graph.ErrDType, "kept output %d is %s, want a float dtype", o, nd.Type.DType)
		}
		n := int64(nd.Type.Numel())
		// A 16-bit sum adds in float32 and rounds after each add, as the
		// CPU executor's.
		return r.flat(typed(kAccumulate, nd.Type.DType), n, acc.Ptr(), out.Ptr(), n)
	}
	defer r.chunkRead()
	return r.c.ChunkDone(c, outs, acc, add, r.read)
}

// Finish runs the optimizer update and keeps the kept outputs' sums as
// results: downloaded, unless ExecOptions.KeptOnDevice leaves them where
// they are and nothing on the host needs them. Under a loss scale the sums
// are unscaled and checked on the device first (unscale, with its flag in
// ws), and no update runs if one holds an inf or NaN.
func (r *runner) Finish(kept []*alloc.Block, ws *alloc.Block) (err error) {
	if err := r.flush(); err != nil {
		return err
	}
	if r.o.UpdateTime != nil {
		ev, terr := r.startTiming(nil, planner.Chunk{})
		if terr != nil {
			return terr
		}
		defer func() {
			if rerr := r.e.d.record(ev.end); err == nil {
				err = rerr
			}
		}()
	}
	if r.o.Offload && len(kept) > 0 {
		return r.offloadStep(kept)
	}
	for j := range kept {
		// Gradients that update float32 parameters are float32 (a
		// Session's steps always); other kept sums may be 16-bit.
		if nd := r.node(r.p.Kept[j]); nd.Type.DType != graph.Float32 && (r.o.Optimizer != nil || r.o.Update != nil) {
			return graph.Errorf(graph.ErrDType, "kept output %d is %s: an optimizer updates from float32 gradients", nd.ID, nd.Type.DType)
		}
	}
	if r.o.Optimizer != nil && r.o.Update == nil && len(kept) > 0 && len(r.p.Trained) != len(kept) {
		return graph.Errorf(graph.ErrArity, "the optimizer updates %d trained parameters from %d kept outputs; they must pair up",
			len(r.p.Trained), len(kept))
	}
	onDevice := r.o.Update == nil && (r.o.Optimizer == nil || deviceOptimizer(r.o.Optimizer))
	if r.o.Reduce != nil && len(kept) > 0 {
		if err := r.reduce(kept); err != nil {
			return err
		}
	}
	if r.o.LossScale != 0 && len(kept) > 0 {
		finite, err := r.unscale(kept, ws)
		if err != nil {
			return err
		}
		r.c.Skipped = !finite
	}
	var grads [][]float32
	if !r.o.KeptOnDevice || !onDevice {
		var err error
		if grads, err = r.downloadKept(kept, !onDevice); err != nil {
			return err
		}
	}
	switch {
	case r.c.Skipped: // a non-finite gradient: no update
	case r.o.Update != nil:
		if err := r.paramsToHost(); err != nil {
			return err
		}
		if err := r.o.Update(grads); err != nil {
			return err
		}
		return r.paramsToDevice()
	case r.o.Optimizer != nil && len(kept) > 0: // no gradients, no step
		if onDevice {
			if err := r.deviceStep(kept, ws); err != nil {
				return err
			}
			if r.o.SyncParams {
				return r.paramsToHost()
			}
			return nil
		}
		return r.hostStep(grads)
	}
	return nil
}

// reduceReady hands kept output node id's block to ExecOptions.Reduce
// when it is final as soon as its launch is queued: with a single chunk
// (several accumulate at ChunkDone), each block once. It does nothing
// for other nodes.
func (r *runner) reduceReady(id int, blk *alloc.Block) error {
	if r.o.Reduce == nil || !r.oneChunk || !r.kept[id] || r.reduced[blk.Ptr()] {
		return nil
	}
	return r.reduceAdd(id, blk)
}

func (r *runner) reduceAdd(id int, blk *alloc.Block) error {
	nd := r.node(id)
	if nd.Type.DType != graph.Float32 {
		return graph.Errorf(graph.ErrDType, "kept output %d is %s: the gradient reduction sums float32", nd.ID, nd.Type.DType)
	}
	if r.reduced == nil {
		r.reduced = map[alloc.Ptr]bool{}
	}
	r.reduced[blk.Ptr()] = true
	if n := int64(nd.Type.Numel()); n > 0 {
		return r.o.Reduce.Add(blk.Ptr(), n)
	}
	return nil
}

// reduce hands ExecOptions.Reduce the final kept outputs it has not had
// yet and waits for every sum.
func (r *runner) reduce(kept []*alloc.Block) error {
	for j, blk := range kept {
		if r.reduced[blk.Ptr()] {
			continue
		}
		if err := r.reduceAdd(r.p.Kept[j], blk); err != nil {
			return err
		}
	}
	r.reduceWaited = true
	return r.o.Reduce.Wait()
}

// downloadKept copies the final kept outputs to the host as the call's
// results; with private set the results are copies, since an update on the
// host gets the downloaded gradients to use as it likes.
func (r *runner) downloadKept(kept []*alloc.Block, private bool) ([][]float32, error) {
	grads := make([][]float32, len(kept))
	for j, blk := range kept {
		v, err := r.download(r.p.Kept[j], blk, r.p.Batch)
		if err != nil {
			return nil, err
		}
		grads[j] = v.F
	}
	r.c.SetKept(grads, private)
	return grads, nil
}
