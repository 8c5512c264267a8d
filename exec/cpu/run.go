package cpu

import (
	"context"
	"math"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// ExecOptions configures Execute.
type ExecOptions struct {
	// Feed supplies the data of a source node (the whole batch for an
	// input); where it returns nil, or is nil, the node's own value is used.
	Feed func(id int) tensor.Tensor
	// Resident keeps parameters, constants and optimizer state allocated
	// across calls, as a training loop does; otherwise they are freed when
	// the call ends.
	Resident bool
	// Update is called with the final kept outputs (summed over chunks),
	// before they are freed: the optimizer step. The slices alias them.
	Update func(kept [][]float32) error
	// Timeline records the allocator's state after every program step in
	// Result.Usage.Timeline: the measured counterpart of a plan's timeline.
	Timeline bool
}

// Result is what Execute returns.
type Result struct {
	// Outputs holds the program's outputs combined over chunks: per-sample
	// values concatenated along their batch axis, sums added, maxima
	// maxed; kept outputs are their final sums.
	Outputs []*tensor.Dense
	// Usage is the allocator's measured peak over the call, and its
	// timeline when ExecOptions.Timeline is set.
	Usage planner.Usage
}

// Execute runs program p for chunks through the executor's allocator: the
// same planner.Replay the planner simulates, with hooks that run kernels.
func (e *Executor) Execute(ctx context.Context, p *planner.Program, chunks []planner.Chunk, o ExecOptions) (*Result, error) {
	// Chunks of a graph that mixes samples would give wrong numbers
	// silently (training-mode batch_norm would normalise each chunk by its
	// own statistics): refuse them, as the planner does.
	if len(chunks) > 1 && p.Info != nil && p.Info.NotChunkable != nil {
		return nil, p.Info.NotChunkable
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if o.Resident && e.yielded { // the step restores what Yield gave back
		if err := e.restore(); err != nil {
			return nil, err
		}
	}
	r := &runner{e: e, ctx: ctx, p: p, o: o, vals: map[*alloc.Block]*buf{}, chunks: len(chunks),
		outs: make([]*buf, len(p.Outputs))}
	u, err := planner.Replay(p, chunks, e.allocator(), r, o.Timeline)
	for _, blk := range r.allocated {
		if ferr := e.allocator().Free(blk); err == nil && ferr != nil {
			err = ferr
		}
	}
	if err != nil {
		return nil, err
	}
	res := &Result{Usage: u, Outputs: make([]*tensor.Dense, len(p.Outputs))}
	for i, b := range r.outs {
		if graph.Numel(b.shape) == 0 {
			// gorgonia.org/tensor builds a Dense with a size-0 axis but
			// panics on Data(), so such an output is refused.
			return nil, graph.Errorf(graph.ErrShape, "output node %d has size-0 shape %v, which gorgonia.org/tensor cannot hold", p.Outputs[i], b.shape)
		}
		res.Outputs[i] = toDense(b)
	}
	return res, nil
}

// runner implements planner.Hooks for one Execute call.
type runner struct {
	e         *Executor
	ctx       context.Context
	p         *planner.Program
	o         ExecOptions
	vals      map[*alloc.Block]*buf
	allocated []*alloc.Block // persistent blocks made by this call and not kept resident: freed when it ends
	chunks    int
	outs      []*buf // combined outputs
}

// residentKey identifies a persistent buffer across calls: a parameter by
// its data, a state slot by its parameter's data and slot.
type residentKey struct {
	data any
	kind planner.BufferKind
	slot int
}

func (r *runner) source(id int) tensor.Tensor {
	if r.o.Feed != nil {
		if t := r.o.Feed(id); t != nil {
			return t
		}
	}
	return r.p.Graph.Node(id).Value
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
			r.vals[rb.blk] = rb.val
			return rb.blk
		}
	}
	return nil
}

func (r *runner) Fill(pb planner.Buffer, blk *alloc.Block) error {
	nd := r.p.Graph.Node(pb.Node)
	var v *buf
	switch pb.Kind {
	case planner.BufParam:
		var err error
		if v, err = fromTensor(nd, r.source(pb.Node), nd.Type.Shape); err != nil {
			r.allocated = append(r.allocated, blk) // Replay leaves persistent blocks to us
			return err
		}
	case planner.BufState:
		// The optimizer keeps its state in host memory of its own; the
		// block accounts for it.
	default: // accumulators start at zero
		v = newBuf(nd.Type, nd.Type.Shape)
	}
	r.vals[blk] = v
	if k, ok := r.key(pb); ok {
		r.e.keep(k, pb, blk, v)
	} else if pb.Kind != planner.BufAccumulator {
		r.allocated = append(r.allocated, blk)
	}
	return nil
}

func (r *runner) Run(nd *graph.Node, c planner.Chunk, out *alloc.Block, ins []*alloc.Block, ws *alloc.Block) error {
	if err := r.ctx.Err(); err != nil {
		return err
	}
	shape := nd.Type.AtBatch(c.Size)
	if nd.Op == graph.OpInput {
		v, err := loadChunk(nd, r.source(nd.ID), c, r.p.Batch)
		if err != nil {
			return err
		}
		r.vals[out] = v
		return nil
	}
	in := make([]*buf, len(ins))
	for i, b := range ins {
		in[i] = r.view(nd.Inputs[i], b, c.Size)
	}
	v := newBuf(nd.Type, shape)
	if err := eval(nd, in, v, c.Start); err != nil {
		return &graph.OpError{Op: nd.Op.String(), Shapes: shapesOf(in), Site: nd.Site, Err: err}
	}
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
	return &buf{shape: r.p.Graph.Node(id).Type.AtBatch(b), f: v.f, i: v.i}
}

func (r *runner) ChunkDone(c planner.Chunk, outs []*alloc.Block, acc []*alloc.Block) error {
	k := 0
	for i, o := range r.p.Outputs {
		v := r.view(o, outs[i], c.Size)
		if acc != nil && k < len(r.p.Kept) && r.p.Kept[k] == o {
			a := r.vals[acc[k]]
			for j, x := range v.f {
				a.f[j] += x
			}
			k++
			continue
		}
		r.outs[i] = combine(r.outs[i], v, r.p, o, c)
	}
	return nil
}

func (r *runner) Finish(kept []*alloc.Block) error {
	final := make([][]float32, len(kept))
	for i, blk := range kept {
		final[i] = r.vals[blk].f
	}
	if r.o.Update != nil {
		if err := r.o.Update(final); err != nil {
			return err
		}
	}
	for i, o := range r.p.Outputs { // kept outputs are returned as their final sums
		if j := slices.Index(r.p.Kept, o); j >= 0 {
			r.outs[i] = &buf{shape: r.p.Graph.Node(o).Type.Shape, f: slices.Clone(r.vals[kept[j]].f)}
		}
	}
	return nil
}

// combine merges chunk c's value v of output node o into the running
// result: per-sample values are concatenated along the batch axis, sums
// added, maxima maxed; the first chunk's value stands for constants.
func combine(acc, v *buf, p *planner.Program, o int, c planner.Chunk) *buf {
	nd := p.Graph.Node(o)
	if acc == nil {
		if nd.Type.BatchAxis < 0 {
			return &buf{shape: v.shape, f: slices.Clone(v.f), i: slices.Clone(v.i)}
		}
		acc = newBuf(nd.Type, nd.Type.AtBatch(p.Batch))
	}
	switch {
	case nd.Type.BatchAxis >= 0:
		placeChunk(acc, v, nd.Type.BatchAxis, c.Start*nd.Type.PerSample)
	case p.Info.Combine[o] == shapeinfer.CombineSum:
		for j, x := range v.f {
			acc.f[j] += x
		}
	case p.Info.Combine[o] == shapeinfer.CombineMax:
		for j, x := range v.f {
			acc.f[j] = float32(math.Max(float64(acc.f[j]), float64(x)))
		}
	}
	return acc
}

// loadChunk takes chunk c of an input's data: the whole batch of n samples
// is sliced along the batch axis; data already holding exactly the chunk is
// used as it is.
func loadChunk(nd *graph.Node, t tensor.Tensor, c planner.Chunk, n int) (*buf, error) {
	ax, per := nd.Type.BatchAxis, nd.Type.PerSample
	full, err := fromTensor(nd, t, nil)
	if err != nil {
		return nil, err
	}
	want := nd.Type.AtBatch(c.Size)
	if slices.Equal(full.shape, want) {
		return full, nil
	}
	if whole := nd.Type.AtBatch(n); !slices.Equal(full.shape, whole) {
		return nil, graph.Errorf(graph.ErrShape, "input node %d: data shape %v, want %v (chunk) or %v (whole batch)", nd.ID, full.shape, want, whole)
	}
	out := newBuf(nd.Type, want)
	takeChunk(out, full, ax, c.Start*per)
	return out, nil
}

// takeChunk copies dst's extent of src along axis, starting at off.
func takeChunk(dst, src *buf, axis, off int) { moveChunk(dst, src, axis, off, false) }

// placeChunk copies src into dst along axis, starting at off.
func placeChunk(dst, src *buf, axis, off int) { moveChunk(src, dst, axis, off, true) }

// moveChunk copies between a chunk and the whole along axis: the chunk
// covers whole[..., off:off+k, ...].
func moveChunk(chunk, whole *buf, axis, off int, toWhole bool) {
	outer := graph.Numel(whole.shape[:axis])
	inner := graph.Numel(whole.shape[axis+1:])
	k, n := chunk.shape[axis], whole.shape[axis]
	for o := range outer {
		c := chunk.rangeOf(o*k*inner, k*inner)
		w := whole.rangeOf((o*n+off)*inner, k*inner)
		if toWhole {
			c.copyTo(w)
		} else {
			w.copyTo(c)
		}
	}
}

// dataRange is a range of a buffer's data, float or int.
type dataRange struct {
	f []float32
	i []int64
}

func (b *buf) rangeOf(off, n int) dataRange {
	if b.f != nil {
		return dataRange{f: b.f[off : off+n]}
	}
	return dataRange{i: b.i[off : off+n]}
}

// copyTo copies s's elements into dst (of the same kind and length).
func (s dataRange) copyTo(dst dataRange) {
	if s.f != nil {
		copy(dst.f, s.f)
		return
	}
	copy(dst.i, s.i)
}
