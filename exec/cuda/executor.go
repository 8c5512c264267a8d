package cuda

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
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
// Execute runs a whole step on the device's thread in one call: every
// launch, copy and allocation of the step happens there, with no hop per
// kernel.
type Executor struct {
	d    *Device
	a    *alloc.Allocator
	blas *BLAS
	ks   *kernelSet

	mu           sync.Mutex
	resident     map[residentKey]*residentBuf
	residentList []*residentBuf // in allocation order
	yielded      bool
	closed       bool
}

// residentKey identifies a persistent buffer across calls: a parameter or
// constant by its host tensor, an optimizer state slot by its parameter's
// tensor and slot.
type residentKey struct {
	data any
	kind planner.BufferKind
	slot int
}

var (
	_ exec.Executor = (*Executor)(nil)
	_ exec.Yielder  = (*Executor)(nil)
)

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
	a := alloc.New(d.Backend(), alloc.Options{TraceEntries: o.TraceEntries})
	b, err := d.NewBLAS(a, ws)
	if err != nil {
		return nil, errors.Join(err, ks.close())
	}
	if o.TF32 {
		if err := b.SetTF32(true); err != nil {
			return nil, errors.Join(err, b.Close(), ks.close(), a.EmptyCache())
		}
	}
	return &Executor{d: d, a: a, blas: b, ks: ks, resident: map[residentKey]*residentBuf{}}, nil
}

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
	var errs []error
	for _, rb := range e.residentList {
		if rb.blk != nil {
			errs = append(errs, e.a.Free(rb.blk))
		}
	}
	e.resident, e.residentList = nil, nil
	errs = append(errs, e.blas.Close(), e.ks.close(), e.a.EmptyCache())
	return errors.Join(errs...)
}

// ExecOptions configures Execute.
type ExecOptions struct {
	// Feed supplies the data of a source node (the whole batch for an
	// input); where it returns nil, or is nil, the node's own value is used.
	Feed func(id int) tensor.Tensor
	// Resident keeps parameters, constants and optimizer state on the device
	// across calls, keyed by their host tensors, as a training loop does;
	// otherwise they are freed when the call ends. A resident parameter is
	// not uploaded again: after a device-side update the device holds its
	// current value and the host tensor is stale unless SyncParams is set.
	Resident bool
	// Optimizer, when set, updates the program's trained parameters from
	// their gradients (p.Trained[i] from p.Kept[i]) after the last chunk.
	// *optim.SGD and *optim.Adam run on the device with the sgd_f32 and
	// adam_f32 kernels: parameters and their state stay there (state in the
	// program's BufState buffers; the optimizer's host State stays empty),
	// and the optimizer's step count advances through Step(nil), which
	// checks its hyperparameters and updates nothing. Other optimizers run
	// on the host: gradients and parameters are downloaded, Step updates the
	// host tensors, and the parameters are uploaded again.
	Optimizer optim.Optimizer
	// Update is called with host copies of the final kept outputs (summed
	// over chunks), as exec/cpu's Update: the trained parameters' host
	// tensors are brought up to date first, Update may change them in
	// place, and they are uploaded again after it. It takes precedence over
	// Optimizer.
	Update func(kept [][]float32) error
	// SyncParams downloads the trained parameters into their host tensors
	// after a device-side update, so host and device agree. Without it a
	// resident parameter's device copy is newer than its host tensor until
	// Executor.SyncParams.
	SyncParams bool
	// KeptOnDevice leaves the kept outputs (the gradients) on the device
	// when nothing on the host needs them (no Update, and no optimizer or
	// one that runs on the device): Result.Outputs holds nil in their
	// places. A
	// training loop sets it, since downloading every gradient every step
	// costs as much as the step itself on a large model.
	KeptOnDevice bool
	// OpTime, when set, reports every node's device time per chunk, after
	// the step: CUDA events recorded around its launches time them on the
	// device, with no synchronisation between nodes. A node whose kernels
	// wait for the host to launch them (a host-bound step) is charged that
	// wait too.
	OpTime func(nd *graph.Node, c planner.Chunk, d time.Duration)
	// Timeline records the allocator's state after every program step in
	// Result.Usage.Timeline.
	Timeline bool
}

// Result is what Execute returns.
type Result struct {
	// Outputs holds the program's outputs combined over chunks: per-sample
	// values concatenated along their batch axis, sums added, maxima
	// maxed; kept outputs are their final sums.
	Outputs []*tensor.Dense
	// Usage is the allocator's measured peak over the call (Overhead
	// included), and its timeline when ExecOptions.Timeline is set.
	Usage planner.Usage
}

// Execute runs program p for chunks through the executor's allocator: the
// same planner.Replay the planner simulates, with hooks that upload, launch
// kernels and download, all in one call on the device thread. Program p
// must be compiled with Workspace.
func (e *Executor) Execute(ctx context.Context, p *planner.Program, chunks []planner.Chunk, o ExecOptions) (*Result, error) {
	if len(chunks) > 1 && p.Info != nil && p.Info.NotChunkable != nil {
		return nil, p.Info.NotChunkable
	}
	keptOf, err := keptOutputs(p)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, fmt.Errorf("%w: executor", ErrClosed)
	}
	r := &runner{e: e, ctx: ctx, p: p, o: o, keptOf: keptOf, persist: map[persistKey]*alloc.Block{},
		inputs: map[int]*hostBuf{}, outs: make([]*hostBuf, len(p.Outputs))}
	var u planner.Usage
	err = e.d.do(func() error {
		if o.Resident && e.yielded { // the step restores what Yield gave back
			if err := e.restore(); err != nil {
				return err
			}
		}
		var err error
		u, err = planner.Replay(p, chunks, e.a, r, o.Timeline)
		if !o.Resident {
			for _, blk := range r.allocated {
				if ferr := e.a.Free(blk); err == nil && ferr != nil {
					err = ferr
				}
			}
		}
		if err == nil { // launch errors surface here at the latest
			err = e.d.Synchronize()
		}
		return errors.Join(err, r.reportTimes(err == nil))
	})
	if err != nil {
		return nil, err
	}
	res := &Result{Usage: u, Outputs: make([]*tensor.Dense, len(p.Outputs))}
	for i, b := range r.outs {
		if b == nil { // a kept output left on the device (KeptOnDevice)
			continue
		}
		if graph.Numel(b.shape) == 0 {
			// gorgonia.org/tensor builds a Dense with a size-0 axis but
			// panics on Data(), so such an output is refused.
			return nil, graph.Errorf(graph.ErrShape, "output node %d has size-0 shape %v, which gorgonia.org/tensor cannot hold", p.Outputs[i], b.shape)
		}
		res.Outputs[i] = b.dense()
	}
	return res, nil
}

// keptOutputs maps each output to the kept entry it carries (−1 for
// none): kept entry j goes to the first output of its node not yet taken.
func keptOutputs(p *planner.Program) ([]int, error) {
	keptOf := make([]int, len(p.Outputs))
	for i := range keptOf {
		keptOf[i] = -1
	}
	for j, k := range p.Kept {
		i := -1
		for cand, o := range p.Outputs {
			if o == k && keptOf[cand] < 0 {
				i = cand
				break
			}
		}
		if i < 0 {
			return nil, graph.Errorf(graph.ErrArity, "kept node %d is not among the program's outputs %v", k, p.Outputs)
		}
		keptOf[i] = j
	}
	return keptOf, nil
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
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Workspace: Workspace})
	if err != nil {
		return nil, err
	}
	n := g.Batch()
	if n == 0 { // no batched input: one run of the constants
		n, b = 1, 1
	}
	p.Batch = n
	res, err := e.Execute(ctx, p, []planner.Chunk{{Size: b}}, ExecOptions{Feed: feed})
	if err != nil {
		return nil, err
	}
	return res.Outputs, nil
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
	e         *Executor
	ctx       context.Context
	p         *planner.Program
	o         ExecOptions
	keptOf    []int
	persist   map[persistKey]*alloc.Block // this call's persistent blocks
	allocated []*alloc.Block              // persistent blocks made by this call and not kept resident
	inputs    map[int]*hostBuf            // whole-batch input data, converted once
	outs      []*hostBuf                  // combined outputs
	timed     []nodeTiming                // ExecOptions.OpTime's events, in launch order
}

func (r *runner) node(id int) *graph.Node { return r.p.Graph.Node(id) }

func (r *runner) source(id int) tensor.Tensor {
	if r.o.Feed != nil {
		if t := r.o.Feed(id); t != nil {
			return t
		}
	}
	return r.node(id).Value
}

func (r *runner) key(buf planner.Buffer) (residentKey, bool) {
	if !r.o.Resident || (buf.Kind != planner.BufParam && buf.Kind != planner.BufState) {
		return residentKey{}, false
	}
	t := r.source(buf.Node)
	if t == nil {
		return residentKey{}, false
	}
	return residentKey{data: t, kind: buf.Kind, slot: buf.Slot}, true
}

func (r *runner) Resident(buf planner.Buffer) *alloc.Block {
	if k, ok := r.key(buf); ok {
		if rb := r.e.resident[k]; rb != nil && rb.blk != nil {
			r.persist[keyOf(buf)] = rb.blk
			return rb.blk
		}
	}
	return nil
}

func (r *runner) Fill(pb planner.Buffer, blk *alloc.Block) error {
	var err error
	if pb.Kind == planner.BufParam {
		nd := r.node(pb.Node)
		var v *hostBuf
		if v, err = hostData(nd, r.source(pb.Node), nd.Type.Shape); err == nil {
			err = r.upload(blk.Ptr(), v)
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
	if k, ok := r.key(pb); ok {
		r.e.keep(k, pb, blk)
	} else if pb.Kind != planner.BufAccumulator {
		r.allocated = append(r.allocated, blk)
	}
	return nil
}

func (r *runner) Run(nd *graph.Node, c planner.Chunk, out *alloc.Block, ins []*alloc.Block, ws *alloc.Block) (err error) {
	if err := r.ctx.Err(); err != nil {
		return err
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
		return r.loadInput(nd, c, out)
	}
	in := make([]operand, len(ins))
	for i, b := range ins {
		in[i] = r.operand(nd.Inputs[i], b, c.Size)
	}
	y := r.operand(nd.ID, out, c.Size)
	if err := r.eval(nd, in, y, ws, c); err != nil {
		shapes := make([][]int, len(in))
		for i, x := range in {
			shapes[i] = x.shape
		}
		return &graph.OpError{Op: nd.Op.String(), Shapes: shapes, Site: nd.Site, Err: err}
	}
	return nil
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
// downloads the others, combining them on the host.
func (r *runner) ChunkDone(c planner.Chunk, outs []*alloc.Block, acc []*alloc.Block) error {
	for i, o := range r.p.Outputs {
		if j := r.keptOf[i]; j >= 0 {
			if acc != nil { // a single chunk's kept outputs go to Finish as they are
				nd := r.node(o)
				if nd.Type.DType != graph.Float32 {
					return graph.Errorf(graph.ErrDType, "kept output %d is %s, want float32", o, nd.Type.DType)
				}
				n := int64(nd.Type.Numel())
				if err := r.flat(kAccumulate, n, acc[j].Ptr(), outs[i].Ptr(), n); err != nil {
					return err
				}
			}
			continue
		}
		v, err := r.download(o, outs[i], c.Size)
		if err != nil {
			return err
		}
		r.outs[i] = combine(r.outs[i], v, r.p, o, c)
	}
	return nil
}

// Finish runs the optimizer update and keeps the kept outputs' sums as
// results: downloaded, unless ExecOptions.KeptOnDevice leaves them where
// they are and nothing on the host needs them.
func (r *runner) Finish(kept []*alloc.Block) error {
	for j := range kept {
		if nd := r.node(r.p.Kept[j]); nd.Type.DType != graph.Float32 {
			return graph.Errorf(graph.ErrDType, "kept output %d is %s, want float32", nd.ID, nd.Type.DType)
		}
	}
	if r.o.Optimizer != nil && r.o.Update == nil && len(kept) > 0 && len(r.p.Trained) != len(kept) {
		return graph.Errorf(graph.ErrArity, "the optimizer updates %d trained parameters from %d kept outputs; they must pair up",
			len(r.p.Trained), len(kept))
	}
	onDevice := r.o.Update == nil && (r.o.Optimizer == nil || deviceOptimizer(r.o.Optimizer))
	var grads [][]float32
	if !r.o.KeptOnDevice || !onDevice {
		var err error
		if grads, err = r.downloadKept(kept, !onDevice); err != nil {
			return err
		}
	}
	switch {
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
			if err := r.deviceStep(kept); err != nil {
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

// downloadKept copies the final kept outputs to the host as the call's
// results; with private set the results are copies, since an update on the
// host gets the downloaded gradients to use as it likes.
func (r *runner) downloadKept(kept []*alloc.Block, private bool) ([][]float32, error) {
	grads := make([][]float32, len(kept))
	for j, blk := range kept {
		grads[j] = make([]float32, r.node(r.p.Kept[j]).Type.Numel())
		if err := CopyDtoH(r.e.d, grads[j], blk.Ptr()); err != nil {
			return nil, err
		}
	}
	for i, o := range r.p.Outputs {
		if j := r.keptOf[i]; j >= 0 {
			f := grads[j]
			if private {
				f = slices.Clone(f)
			}
			r.outs[i] = &hostBuf{shape: r.node(o).Type.Shape, f: f}
		}
	}
	return grads, nil
}

// combine merges chunk c's value v of output node o into the running
// result, as exec/cpu does: per-sample values are concatenated along the
// batch axis, sums added, maxima maxed; the first chunk's value stands for
// constants.
func combine(acc, v *hostBuf, p *planner.Program, o int, c planner.Chunk) *hostBuf {
	nd := p.Graph.Node(o)
	if acc == nil {
		if nd.Type.BatchAxis < 0 {
			return v
		}
		acc = newHostBuf(nd.Type.DType, nd.Type.AtBatch(p.Batch))
	}
	switch {
	case nd.Type.BatchAxis >= 0:
		moveChunk(v, acc, nd.Type.BatchAxis, c.Start*nd.Type.PerSample, true)
	case p.Info.Combine[o] == shapeinfer.CombineSum:
		for j, x := range v.f {
			acc.f[j] += x
		}
	case p.Info.Combine[o] == shapeinfer.CombineMax:
		for j, x := range v.f {
			acc.f[j] = max(acc.f[j], x) // Go's max is math.Max's: NaN wins, +0 beats −0
		}
	}
	return acc
}
