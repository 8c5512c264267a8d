package cpu

import (
	"context"
	"slices"
	"time"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/planner"
)

// ExecOptions configures Execute: the options both executors take.
type ExecOptions = exec.Options

// Result is what Execute returns.
type Result = exec.Result

// Execute runs program p for chunks through the executor's allocator: the
// same planner.Replay the planner simulates, with hooks that run kernels.
// With o.Optimizer set (and no Update) the optimizer steps the trained
// parameters' host tensors after the last chunk; OpTime reports each
// node's wall time, UpdateTime the update's.
func (e *Executor) Execute(ctx context.Context, p *planner.Program, chunks []planner.Chunk, o ExecOptions) (*Result, error) {
	if err := exec.CheckChunks(p, chunks); err != nil {
		return nil, err
	}
	a := e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	if o.Resident { // the step restores what Yield gave back
		if err := e.resident.Restore(a, nil); err != nil {
			return nil, err
		}
	}
	if err := exec.CheckLossScale(p, o.LossScale); err != nil {
		return nil, err
	}
	if o.Reduce != nil {
		return nil, graph.Errorf(graph.ErrAttr, "cpu: ExecOptions.Reduce sums device gradients; the CPU executor has none (reduce the host gradients in the optimizer step)")
	}
	if err := exec.CheckOffload(p, o); err != nil {
		return nil, err
	}
	call, err := exec.NewCall(p, o, &e.resident)
	if err != nil {
		return nil, err
	}
	r := &runner{Call: call, ctx: ctx, vals: map[*alloc.Block]*buf{}, offload: &e.offload}
	u, err := planner.Replay(p, chunks, a, r, o.Timeline)
	if err = call.Free(a, err); err != nil {
		return nil, err
	}
	if o.Offload {
		u.HostPinned = e.offload.Pinned()
	}
	outs, err := exec.Outputs(p, call.Outs)
	if err != nil {
		return nil, err
	}
	return &Result{Usage: u, Outputs: outs, Skipped: call.Skipped}, nil
}

// runner implements planner.Hooks for one Execute call.
type runner struct {
	*exec.Call[*buf]
	ctx     context.Context
	vals    map[*alloc.Block]*buf
	offload *exec.OffloadHost
}

// EveryChunk is true: the runner computes.
func (*runner) EveryChunk() bool { return true }

func (r *runner) Resident(b planner.Buffer) *alloc.Block {
	rb := r.Call.Resident(b)
	if rb == nil {
		return nil
	}
	r.vals[rb.Blk] = rb.Val
	return rb.Blk
}

func (r *runner) Fill(pb planner.Buffer, blk *alloc.Block) error {
	nd := r.P.Graph.Node(pb.Node)
	var v *buf
	switch pb.Kind {
	case planner.BufParam:
		h, err := exec.FromTensor(nd, r.Source(pb.Node), nd.Type.Shape)
		if err != nil {
			r.Made = append(r.Made, blk) // Replay leaves persistent blocks to us
			return err
		}
		v = bufOf(h)
		if nd.Type.DType.IsHalf() {
			v.half = nd.Type.DType
		}
	case planner.BufState:
		// The optimizer keeps its state in host memory of its own; the
		// block accounts for it.
	default: // accumulators start at zero
		v = newBuf(nd.Type, nd.Type.Shape)
	}
	r.vals[blk] = v
	r.Keep(pb, blk, v)
	return nil
}

func (r *runner) Run(nd *graph.Node, c planner.Chunk, out *alloc.Block, ins []*alloc.Block, ws *alloc.Block) error {
	if err := r.ctx.Err(); err != nil {
		return err
	}
	if r.O.OpTime != nil {
		defer func(t0 time.Time) { r.O.OpTime(nd, c, time.Since(t0)) }(time.Now())
	}
	if nd.Op == graph.OpInput {
		full, err := exec.FromTensor(nd, r.Source(nd.ID), nil)
		if err != nil {
			return err
		}
		v, err := exec.ChunkOf(nd, full, c, r.P.Batch)
		if err != nil {
			return err
		}
		r.vals[out] = bufOf(v)
		return nil
	}
	in := make([]*buf, len(ins))
	for i, b := range ins {
		in[i] = r.view(nd.Inputs[i], b, c.Size)
	}
	v := newBuf(nd.Type, nd.Type.AtBatch(c.Size))
	if err := eval(nd, in, v, c.Start); err != nil {
		return &graph.OpError{Op: nd.Op.String(), Shapes: shapesOf(in), Site: nd.Site, Err: exec.InChunk(r.P, nd, c, err)}
	}
	// A float16 or bfloat16 value is stored rounded, as a device kernel
	// stores its float32 result: kernels compute in float32 from rounded
	// inputs (GEMMs accumulate in float32) and round once, here.
	exec.Round(nd.Type.DType, v.f)
	r.vals[out] = v
	return nil
}

func (r *runner) Freed(_ planner.Buffer, blk *alloc.Block) { delete(r.vals, blk) }

// view is node id's value in block blk at chunk size b: the block's data
// with the node's shape. A reshape shares its input's block, so the shape
// comes from the node reading it, not from the block.
func (r *runner) view(id int, blk *alloc.Block, b int) *buf {
	v := r.vals[blk]
	if v == nil {
		return nil
	}
	return &buf{shape: r.P.Graph.Node(id).Type.AtBatch(b), f: v.f, i: v.i}
}

func (r *runner) ChunkDone(c planner.Chunk, outs []*alloc.Block, acc []*alloc.Block) error {
	add := func(o int, acc, out *alloc.Block) error {
		a, v := r.vals[acc], r.view(o, out, c.Size)
		for j, x := range v.f {
			a.f[j] += x
		}
		exec.Round(r.P.Graph.Node(o).Type.DType, a.f)
		return nil
	}
	read := func(o int, blk *alloc.Block, size int) (*exec.HostBuf, error) {
		return hostOf(r.view(o, blk, size)), nil
	}
	return r.Call.ChunkDone(c, outs, acc, add, read)
}

// Finish runs Update, or the optimizer on the host tensors, with the final
// kept outputs, and keeps copies of them as results. Under a loss scale it
// unscales them first, and runs no update if one is not finite; the finish
// workspace (the device's inf/NaN flag) is only accounted for here.
func (r *runner) Finish(kept []*alloc.Block, _ *alloc.Block) error {
	if r.O.UpdateTime != nil {
		defer func(t0 time.Time) { r.O.UpdateTime(time.Since(t0)) }(time.Now())
	}
	final := make([][]float32, len(kept))
	for i, blk := range kept {
		final[i] = r.vals[blk].f
	}
	if r.O.LossScale != 0 && len(kept) > 0 {
		var once [][]float32 // a single chunk's block listed twice is unscaled once
		for i, blk := range kept {
			if !slices.Contains(kept[:i], blk) {
				once = append(once, final[i])
			}
		}
		r.Skipped = !exec.Unscale(once, r.O.LossScale)
	}
	switch {
	case r.Skipped:
	case r.O.Offload && len(kept) > 0:
		if err := r.offloadStep(final); err != nil {
			return err
		}
	case r.O.Update != nil:
		if err := r.O.Update(final); err != nil {
			return err
		}
	case r.O.Optimizer != nil && len(kept) > 0: // no gradients, no step
		ps, err := exec.HostParams(r.P, r.Source, final)
		if err != nil {
			return err
		}
		if err := r.O.Optimizer.Step(ps); err != nil {
			return err
		}
	}
	r.SetKept(final, true)
	return nil
}

// offloadStep is an offloaded optimizer's step (exec.Options.Offload) on
// the CPU, whose device is the host: the final gradients (float32 values
// rounded to bfloat16) are the staging buffers' bits, the new weights go
// into the resident parameters' rounded copies, and the masters into the
// host tensors, which on the CPU are the parameters.
func (r *runner) offloadStep(final [][]float32) error {
	params := make([]*buf, len(r.P.Trained))
	for i, id := range r.P.Trained {
		rb := r.R.Find(exec.ParamKey(r.Source(id)))
		if rb == nil || rb.Val == nil {
			return graph.Errorf(graph.ErrArity, "cpu: offloaded parameter node %d is not resident (run with ExecOptions.Resident)", id)
		}
		params[i] = rb.Val
	}
	down := func(i int, dst []half.BF16) error {
		half.EncodeBF16(dst, final[i])
		return nil
	}
	up := func(i int, src []half.BF16) error {
		half.DecodeBF16(params[i].f, src)
		return nil
	}
	if err := r.offload.Step(r.P, r.Source, r.O.Optimizer, down, up); err != nil {
		return err
	}
	r.offload.SyncHost()
	return nil
}
