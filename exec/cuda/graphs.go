package cuda

import (
	"errors"
	"fmt"
	"sync"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// CUDA graphs (on unless ExecutorOptions.NoCUDAGraphs). A step launches thousands of
// small kernels, and the host's cost per launch, not the GPU, bounds a
// small model's step. With graphs on, the runner does not launch a node's
// kernels when the replay reaches it: it notes the node with its operands'
// addresses (a pendingOp) and appends them to the segment's fingerprint.
// The next host step (an upload, a download, a node whose kernels read a
// device flag on the host, ChunkDone, Finish, a segment the allocator
// gives back to the driver) flushes the segment first:
//
//   - a segment whose fingerprint matches one captured before, word for
//     word, is launched as that graph (cuGraphLaunch on stream 0, where
//     every other launch, copy and event of the executor goes, so the
//     ordering against uploads, downloads and NCCL is what eager launching
//     gives);
//   - a fingerprint seen for the first time is noted and its nodes
//     launched eagerly: one that changes every step (dropout's counter)
//     never costs a capture;
//   - a fingerprint seen for the second time is captured: the nodes'
//     launches run on a capture stream (cuStreamBeginCapture_v2, relaxed
//     mode; cuBLAS and cuDNN set to that stream for the capture and back to
//     stream 0 after), the graph is instantiated and launched;
//   - a capture that fails (a call that needs the host, such as a device to
//     host copy, returns ErrHostInCapture inside a capture; or the driver
//     refuses) leaves its fingerprint marked eager: those nodes then launch
//     one by one, as without graphs.
//
// The fingerprint holds everything a node's launches depend on that the
// program's signature does not fix: the node, the chunk (start and size),
// the node's random seed and counter (dropout), and the addresses of its
// output, inputs, workspace (with its size) and companion outputs with
// their inputs. Kernel
// arguments come from these and from the node's attributes, which the
// signature fixes; data (parameters, inputs, the loss scale) is read from
// device memory, which uploads fill outside the graphs. So a replay launches
// exactly the kernels, with exactly the arguments, that eager launching
// would, and an allocator that hands out other addresses (another chunk
// size, a re-plan after an OOM retry or a budget change, a cache emptied)
// gets a new capture rather than a stale replay. Loss scaling's unscale
// (which reads its flag on the host) and the chunks' accumulation run
// eagerly. The optimizer's update is a segment of its own (segment,
// optimizer.go): its kernels read the learning rates, the bias
// corrections and the clip factor from device scalars, which an eager
// launch before the segment writes each step, so their arguments, and the
// segment's fingerprint, stay the same from step to step and the update
// replays as one graph under any schedule.
//
// Graphs are kept per program signature (a Session rebinds the same
// program to each step's graph, so the Program pointer changes every
// step): at most graphPrograms signatures, least recently used destroyed
// first, and within one, graphs not launched in the last graphKeep Execute
// calls of that signature are destroyed after each call, so the graphs of
// an old plan go once a new plan (a re-plan) has run a few steps. Close
// destroys them all. A node's companion decision (whether its kernels
// wrote its companion output too) is learned from its first eager run,
// which also builds cuDNN's plans before any capture: the first two steps
// of a program run eagerly, the third captures, later ones replay.
//
// Capture and replay allocate nothing from the allocator: the nodes'
// workspaces are planned as without graphs, and every block is the one the
// replay hands out, so a step's peaks are its plan's, to the byte, graphs
// or not. The driver takes memory of its own to instantiate a graph,
// outside the allocator: cuMemGetInfo before and after each instantiation
// measures it (on the H100, driver 580: 2 MiB for the test models' graphs
// together, 4 MiB for GPT-2 small's two at seq 1024), GraphStats reports
// it, and Reserve adds what the live graphs hold, so the plans made after
// a capture leave it free. The plan of the step that captures cannot know
// it yet: an instantiation the driver has no memory for fails, and its
// segment runs eagerly (GraphStats.Failed) rather than the step.

// Bounds of the graph cache (see above).
const (
	graphPrograms = 8   // program signatures with graphs
	graphKeep     = 3   // Execute calls a graph may go unused before it is destroyed
	graphSegments = 512 // graphs per signature; beyond, segments run eagerly
	minGraphOps   = 2   // shorter segments launch eagerly
)

// ErrHostInCapture is returned by a call that needs the host (a copy to or
// from host memory, a synchronisation) made while a CUDA graph is being
// captured: the segment is then run eagerly, and from then on.
var ErrHostInCapture = errors.New("cuda: host-synchronous call during CUDA graph capture")

// GraphStats counts the executor's CUDA graph work (ExecutorOptions.NoCUDAGraphs).
type GraphStats struct {
	// Captures is the graphs captured and instantiated; Failed the
	// captures that failed (their segments run eagerly from then on).
	Captures, Failed int
	// Replays is the segments launched as a graph (captures included);
	// Eager the segments launched node by node (seen for the first time,
	// too short, failed, or over graphSegments).
	Replays, Eager int
	// OptimizerReplays is how many of Replays were optimizer updates
	// (optimizer.go), OptimizerCaptures how many of Captures.
	OptimizerReplays, OptimizerCaptures int
	// Live is the graphs held now, DriverBytes the device memory their
	// instantiation took from the driver (cuMemGetInfo before and after),
	// outside the allocator.
	Live        int
	DriverBytes int64
	// LastFailure is why the latest capture failed, nil when none has.
	LastFailure error
}

// CUDAGraphs reports whether the executor captures and replays CUDA graphs
// (unless ExecutorOptions.NoCUDAGraphs, or as BATCHFIT_CUDA_GRAPHS says).
func (e *Executor) CUDAGraphs() bool { return e.graphs.on }

// GraphStats reports the executor's CUDA graph counts.
func (e *Executor) GraphStats() GraphStats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.graphs.stats
	s.Live, s.DriverBytes = 0, 0
	for _, pg := range e.graphs.progs {
		for _, segs := range pg.segs {
			for _, sg := range segs {
				if sg.exec != 0 {
					s.Live++
					s.DriverBytes += sg.bytes
				}
			}
		}
	}
	return s
}

// graphDriver holds the driver's stream capture and graph entry points,
// bound on first use; C signatures in the comments.
type graphDriver struct {
	// CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
	cuStreamCreate func(s *uintptr, flags uint32) cuResult
	// CUresult cuStreamDestroy_v2(CUstream hStream)
	cuStreamDestroy func(s uintptr) cuResult
	// CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
	cuStreamBeginCapture func(s uintptr, mode int32) cuResult
	// CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
	cuStreamEndCapture func(s uintptr, g *uintptr) cuResult
	// CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
	//     unsigned long long flags)
	cuGraphInstantiate func(x *uintptr, g uintptr, flags uint64) cuResult
	// CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
	cuGraphLaunch func(x, s uintptr) cuResult
	// CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
	cuGraphExecDestroy func(x uintptr) cuResult
	// CUresult cuGraphDestroy(CUgraph hGraph)
	cuGraphDestroy func(g uintptr) cuResult
	// CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
	cuMemsetD8Async func(dst CUdeviceptr, v uint8, n uintptr, s uintptr) cuResult
}

// cuStreamCaptureModeRelaxed is CU_STREAM_CAPTURE_MODE_RELAXED: the
// allocator may still call cuMemAlloc while a segment is captured (it does
// not: the segment's blocks are handed out before it is flushed, but
// another thread's call must not fail the capture).
const cuStreamCaptureModeRelaxed = 2

var graphDriverOnce struct {
	sync.Once
	g   *graphDriver
	err error
}

// loadGraphDriver binds the graph entry points of libcuda.so.1 (CUDA
// 12.0 on), once.
func loadGraphDriver() (*graphDriver, error) {
	graphDriverOnce.Do(func() {
		lib, err := dlopen("libcuda.so.1")
		if err != nil {
			graphDriverOnce.err = fmt.Errorf("%w: %v", ErrNoGPU, err)
			return
		}
		g := new(graphDriver)
		if err := bind(lib, []symbol{
			sym(&g.cuStreamCreate, "cuStreamCreate"),
			sym(&g.cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy"),
			sym(&g.cuStreamBeginCapture, "cuStreamBeginCapture_v2"),
			sym(&g.cuStreamEndCapture, "cuStreamEndCapture"),
			sym(&g.cuGraphInstantiate, "cuGraphInstantiateWithFlags"),
			sym(&g.cuGraphLaunch, "cuGraphLaunch"),
			sym(&g.cuGraphExecDestroy, "cuGraphExecDestroy"),
			sym(&g.cuGraphDestroy, "cuGraphDestroy"),
			sym(&g.cuMemsetD8Async, "cuMemsetD8Async"),
		}); err != nil {
			graphDriverOnce.err = fmt.Errorf("%w: libcuda.so.1: %v", ErrNoLibrary, err)
			return
		}
		graphDriverOnce.g = g
	})
	return graphDriverOnce.g, graphDriverOnce.err
}

// wsView is a node's workspace as its kernels see it: the block's address
// and requested size, copied when the node runs, since a pending node's
// launches come after the replay has freed (and the allocator may have
// merged) its block.
type wsView struct {
	p alloc.Ptr
	n int64
}

// Ptr is the workspace's address.
func (w *wsView) Ptr() alloc.Ptr { return w.p }

// Requested is the workspace's size in bytes.
func (w *wsView) Requested() int64 { return w.n }

func viewOf(b *alloc.Block) *wsView {
	if b == nil {
		return nil
	}
	return &wsView{p: b.Ptr(), n: b.Requested()}
}

// pendingOp is a node whose launches wait for its segment's flush.
type pendingOp struct {
	nd  *graph.Node
	c   planner.Chunk
	in  []operand
	y   operand
	ws  *wsView
	cos []coOut
	// coDone is what the node's first eager run said of its companions,
	// which the replay has already acted on.
	coDone coSet
}

// hostReads is whether op's kernels read a device value on the host
// during the node (the bad-index flags of launch.go's badFlag): such
// nodes end a segment and run eagerly.
func hostReads(op graph.Op) bool {
	switch op {
	case graph.OpCrossEntropy, graph.OpCrossEntropyGrad, graph.OpEmbedding, graph.OpEmbeddingGrad,
		graph.OpLinearCrossEntropy, graph.OpLinearCrossEntropyGradH, graph.OpLinearCrossEntropyGradW:
		return true
	}
	return false
}

// appendFingerprint appends op's words to a segment's fingerprint.
func appendFingerprint(fp []uint64, op *pendingOp) []uint64 {
	a := &op.nd.Attrs
	fp = append(fp, uint64(op.nd.ID), uint64(op.c.Start), uint64(op.c.Size), a.Seed, a.Counter,
		uint64(op.y.p), uint64(len(op.in)))
	for _, x := range op.in {
		fp = append(fp, uint64(x.p))
	}
	var ws, wsn uint64
	if op.ws != nil {
		ws, wsn = uint64(op.ws.p), uint64(op.ws.n)
	}
	fp = append(fp, ws, wsn, uint64(len(op.cos)))
	for _, co := range op.cos {
		fp = append(fp, uint64(co.v.p), uint64(len(co.in)))
		for _, x := range co.in {
			fp = append(fp, uint64(x.p))
		}
	}
	return fp
}

// hashWords is FNV-1a over a fingerprint's words.
func hashWords(w []uint64) uint64 {
	h := uint64(14695981039346656037)
	for _, x := range w {
		h = (h ^ x) * 1099511628211
	}
	return h
}

// segGraph is one captured segment: its fingerprint and graph, or exec 0
// when its capture failed and it runs eagerly.
type segGraph struct {
	fp     []uint64
	exec   uintptr
	failed bool   // its capture failed: it runs eagerly from then on
	bytes  int64  // driver memory its instantiation took
	used   uint64 // progGraphs.calls when last seen
}

// decide looks up the segment of fingerprint fp (of n nodes) and says
// whether to capture it now. A segment is captured the second time it
// comes: one seen once is only noted (and runs eagerly), so a segment
// whose fingerprint changes every step (dropout's counter advancing, say)
// costs no capture per step, only its words. Segments shorter than
// minGraphOps, failed captures and segments beyond graphSegments run
// eagerly; sg is nil for the last.
func (pg *progGraphs) decide(fp []uint64, n int) (sg *segGraph, capture bool) {
	sg = pg.find(fp)
	if sg == nil {
		if pg.n >= graphSegments {
			return nil, false
		}
		sg = &segGraph{fp: append([]uint64(nil), fp...)}
		pg.add(sg)
		sg.used = pg.calls
		return sg, false
	}
	sg.used = pg.calls
	return sg, sg.exec == 0 && !sg.failed && n >= minGraphOps
}

// coKey is a node at a chunk size, whose companion decisions are memoised.
type coKey struct{ node, size int }

// progGraphs is the graphs of one program signature.
type progGraphs struct {
	segs   map[uint64][]*segGraph // by hashWords of the fingerprint
	n      int                    // segGraphs held
	coDone map[coKey]coSet        // from each node's first eager run
	calls  uint64                 // Execute calls of this signature
	last   uint64                 // graphCache.calls of the latest
}

func newProgGraphs() *progGraphs {
	return &progGraphs{segs: map[uint64][]*segGraph{}, coDone: map[coKey]coSet{}}
}

// find is the segment with fingerprint fp, nil when none.
func (pg *progGraphs) find(fp []uint64) *segGraph {
	for _, sg := range pg.segs[hashWords(fp)] {
		if equalWords(sg.fp, fp) {
			return sg
		}
	}
	return nil
}

// add keeps sg (whose fingerprint is its own copy).
func (pg *progGraphs) add(sg *segGraph) {
	h := hashWords(sg.fp)
	pg.segs[h] = append(pg.segs[h], sg)
	pg.n++
}

// prune destroys the segments not launched in the last keep calls, and
// returns the first error of destroy.
func (pg *progGraphs) prune(keep uint64, destroy func(*segGraph) error) error {
	var errs []error
	for h, segs := range pg.segs {
		kept := segs[:0]
		for _, sg := range segs {
			if pg.calls-sg.used >= keep {
				errs = append(errs, destroy(sg))
				pg.n--
				continue
			}
			kept = append(kept, sg)
		}
		if len(kept) == 0 {
			delete(pg.segs, h)
		} else {
			pg.segs[h] = kept
		}
	}
	return errors.Join(errs...)
}

// destroyAll destroys every segment.
func (pg *progGraphs) destroyAll(destroy func(*segGraph) error) error {
	var errs []error
	for _, segs := range pg.segs {
		for _, sg := range segs {
			errs = append(errs, destroy(sg))
		}
	}
	clear(pg.segs)
	pg.n = 0
	return errors.Join(errs...)
}

func equalWords(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// graphCache is an executor's CUDA graphs; used on the device thread
// under Executor.mu.
type graphCache struct {
	on     bool
	stream uintptr // the capture stream, made on first capture
	progs  map[uint64]*progGraphs
	calls  uint64
	stats  GraphStats
}

// forProgram is sig's graphs for a new Execute call, made (and the least
// recently used signature's destroyed beyond graphPrograms) as needed.
func (gc *graphCache) forProgram(sig uint64, destroy func(*segGraph) error) (*progGraphs, error) {
	if gc.progs == nil {
		gc.progs = map[uint64]*progGraphs{}
	}
	gc.calls++
	pg := gc.progs[sig]
	var err error
	if pg == nil {
		if len(gc.progs) >= graphPrograms {
			var old uint64
			var oldest *progGraphs
			for s, p := range gc.progs {
				if oldest == nil || p.last < oldest.last {
					old, oldest = s, p
				}
			}
			err = oldest.destroyAll(destroy)
			delete(gc.progs, old)
		}
		pg = newProgGraphs()
		gc.progs[sig] = pg
	}
	pg.calls++
	pg.last = gc.calls
	return pg, err
}

// destroySeg destroys a segment's graph. On the device thread.
func (e *Executor) destroySeg(sg *segGraph) error {
	if sg.exec == 0 {
		return nil
	}
	gd, err := loadGraphDriver()
	if err != nil {
		return err
	}
	x := sg.exec
	sg.exec = 0
	e.graphBytes.Add(-sg.bytes)
	return e.d.drv.check("cuGraphExecDestroy", gd.cuGraphExecDestroy(x))
}

// closeGraphs destroys every graph and the capture stream. On the device
// thread.
func (e *Executor) closeGraphs() error {
	var errs []error
	for _, pg := range e.graphs.progs {
		errs = append(errs, pg.destroyAll(e.destroySeg))
	}
	clear(e.graphs.progs)
	if s := e.graphs.stream; s != 0 {
		e.graphs.stream = 0
		if gd, err := loadGraphDriver(); err == nil {
			errs = append(errs, e.d.drv.check("cuStreamDestroy", gd.cuStreamDestroy(s)))
		}
	}
	return errors.Join(errs...)
}

// deferOp queues node nd's launches for the segment's flush.
func (r *runner) deferOp(op pendingOp) {
	r.pend = append(r.pend, op)
	r.fp = appendFingerprint(r.fp, &r.pend[len(r.pend)-1])
}

// flush launches the pending nodes: as a graph captured before, as a new
// capture, or eagerly. On the device thread.
func (r *runner) flush() error {
	if len(r.pend) == 0 {
		return nil
	}
	ops, fp := r.pend, r.fp
	defer func() {
		clear(ops)
		r.pend, r.fp = ops[:0], fp[:0]
	}()
	gc, pg := &r.e.graphs, r.g
	sg, capture := pg.decide(fp, len(ops))
	if capture {
		r.capture(sg, ops)
	}
	if sg != nil {
		if sg.exec != 0 {
			gd, err := loadGraphDriver()
			if err != nil {
				return err
			}
			gc.stats.Replays++
			return r.e.d.drv.check("cuGraphLaunch", gd.cuGraphLaunch(sg.exec, 0))
		}
	}
	gc.stats.Eager++
	return r.evalOps(ops)
}

// evalOps launches the pending nodes' kernels on the device's current
// stream.
func (r *runner) evalOps(ops []pendingOp) error {
	for i := range ops {
		op := &ops[i]
		coDone, err := r.eval(op.nd, op.in, op.y, op.ws, op.c, op.cos)
		if err != nil {
			return r.opError(op.nd, op.c, op.in, err)
		}
		if coDone != op.coDone {
			return fmt.Errorf("%w: node %d (%s) computed its companions %b, its first run %b",
				ErrGraphCompanion, op.nd.ID, op.nd.Op, coDone, op.coDone)
		}
	}
	return nil
}

// ErrGraphCompanion means a node's kernels decided differently whether
// to compute its companion output than on their first run, which a
// deferred launch relies on.
var ErrGraphCompanion = errors.New("cuda: a deferred node's companion decision changed")

// segment launches a segment of the host side's own launches (the
// optimizer's update, optimizer.go) of fingerprint fp and n launches as
// flush launches the pending nodes' segments: as a graph captured before,
// as a new capture, or eagerly. launch makes the launches on the device's
// current stream. The pending nodes go first. On the device thread.
func (r *runner) segment(fp []uint64, n int, launch func() error) error {
	if err := r.flush(); err != nil {
		return err
	}
	gc := &r.e.graphs
	sg, capture := r.g.decide(fp, n)
	if capture {
		r.captureFunc(sg, launch)
		if sg.exec != 0 {
			gc.stats.OptimizerCaptures++
		}
	}
	if sg != nil && sg.exec != 0 {
		gd, err := loadGraphDriver()
		if err != nil {
			return err
		}
		gc.stats.Replays++
		gc.stats.OptimizerReplays++
		return r.e.d.drv.check("cuGraphLaunch", gd.cuGraphLaunch(sg.exec, 0))
	}
	gc.stats.Eager++
	return launch()
}

// capture captures ops as sg's graph and instantiates it; a failure marks
// sg failed and is kept in GraphStats. On the device thread.
func (r *runner) capture(sg *segGraph, ops []pendingOp) {
	r.captureFunc(sg, func() error { return r.evalOps(ops) })
}

// captureFunc captures launch's launches as sg's graph (capture's work).
func (r *runner) captureFunc(sg *segGraph, launch func() error) {
	e := r.e
	exec, bytes, err := e.captureOps(launch)
	if err != nil {
		sg.failed = true
		e.graphs.stats.Failed++
		e.graphs.stats.LastFailure = err
		return
	}
	e.graphs.stats.Captures++
	sg.exec, sg.bytes = exec, bytes
	e.graphBytes.Add(bytes)
}

// captureOps runs launch with every launch of the executor going to the
// capture stream, and instantiates what it captured: the graph's exec and
// the driver memory the instantiation took. On the device thread.
func (e *Executor) captureOps(launch func() error) (exec uintptr, bytes int64, err error) {
	gd, err := loadGraphDriver()
	if err != nil {
		return 0, 0, err
	}
	d, drv := e.d, e.d.drv
	if e.graphs.stream == 0 {
		var s uintptr
		if err := drv.check("cuStreamCreate", gd.cuStreamCreate(&s, cuStreamNonBlocking)); err != nil {
			return 0, 0, err
		}
		e.graphs.stream = s
	}
	s := e.graphs.stream
	if err := e.setStreams(s); err != nil {
		return 0, 0, errors.Join(err, e.setStreams(0))
	}
	if err := drv.check("cuStreamBeginCapture_v2", gd.cuStreamBeginCapture(s, cuStreamCaptureModeRelaxed)); err != nil {
		return 0, 0, errors.Join(err, e.setStreams(0))
	}
	d.capture = s
	lerr := launch()
	d.capture = 0
	var g uintptr
	eerr := drv.check("cuStreamEndCapture", gd.cuStreamEndCapture(s, &g))
	if err := errors.Join(lerr, eerr, e.setStreams(0)); err != nil {
		if g != 0 {
			err = errors.Join(err, drv.check("cuGraphDestroy", gd.cuGraphDestroy(g)))
		}
		return 0, 0, err
	}
	var free0, free1, total uintptr
	ierr := drv.check("cuMemGetInfo_v2", drv.cuMemGetInfo(&free0, &total))
	if ierr == nil {
		ierr = drv.check("cuGraphInstantiateWithFlags", gd.cuGraphInstantiate(&exec, g, 0))
	}
	if ierr == nil {
		ierr = drv.check("cuMemGetInfo_v2", drv.cuMemGetInfo(&free1, &total))
	}
	ierr = errors.Join(ierr, drv.check("cuGraphDestroy", gd.cuGraphDestroy(g)))
	if ierr != nil {
		if exec != 0 {
			ierr = errors.Join(ierr, drv.check("cuGraphExecDestroy", gd.cuGraphExecDestroy(exec)))
		}
		return 0, 0, ierr
	}
	return exec, max(0, int64(free0)-int64(free1)), nil
}

// setStreams points cuBLAS and cuDNN at stream s (0: the legacy default
// stream, where they run outside a capture). On the device thread.
func (e *Executor) setStreams(s uintptr) error {
	err := e.blas.setStream(s)
	if e.dnn != nil {
		err = errors.Join(err, e.dnn.setStream(s))
	}
	return err
}

// graphBackend is the executor's allocator backend: before a segment goes
// back to the driver it flushes the pending launches, which may still use
// its memory.
type graphBackend struct {
	*Backend
	e *Executor
}

// Free flushes the running step's pending launches, then frees p.
func (b graphBackend) Free(p alloc.Ptr) error {
	var err error
	if ferr := b.d.do(func() error {
		if r := b.e.cur; r != nil {
			return r.flush()
		}
		return nil
	}); ferr != nil {
		err = ferr
	}
	return errors.Join(err, b.Backend.Free(p))
}
