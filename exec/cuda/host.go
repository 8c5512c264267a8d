package cuda

import (
	"fmt"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// hostBuf is a dense row-major value in host memory: f for float32, i for
// int64, as exec/cpu's buf.
type hostBuf struct {
	shape []int
	f     []float32
	i     []int64
}

func newHostBuf(dt graph.DType, shape []int) *hostBuf {
	b := &hostBuf{shape: shape}
	if dt == graph.Int64 {
		b.i = make([]int64, graph.Numel(shape))
	} else {
		b.f = make([]float32, graph.Numel(shape))
	}
	return b
}

func (b *hostBuf) dense() *tensor.Dense {
	if b.f == nil {
		return tensor.New(tensor.WithShape(b.shape...), tensor.WithBacking(b.i))
	}
	return tensor.New(tensor.WithShape(b.shape...), tensor.WithBacking(b.f))
}

// deviceDType fails for dtypes the CUDA kernels do not compute in.
func deviceDType(nd *graph.Node) error {
	if dt := nd.Type.DType; dt != graph.Float32 && dt != graph.Int64 {
		return graph.Errorf(graph.ErrDType, "the CUDA executor runs float32 and int64 values; node %d (%s) is %s", nd.ID, nd.Op, dt)
	}
	return nil
}

// hostData reads a source's data, checking it against the node's type
// (shape nil: any shape, which the caller checks), as exec/cpu's
// fromTensor.
func hostData(nd *graph.Node, t tensor.Tensor, shape []int) (*hostBuf, error) {
	what := fmt.Sprintf("%s %q (node %d)", nd.Op, nd.Name, nd.ID)
	if t == nil {
		return nil, graph.Errorf(graph.ErrNoData, "%s has no data (shape-only graph)", what)
	}
	if err := deviceDType(nd); err != nil {
		return nil, err
	}
	got := []int(t.Shape())
	if t.Shape().IsScalar() {
		got = []int{}
	}
	if shape == nil {
		shape = got
	} else if !slices.Equal(got, shape) {
		return nil, graph.Errorf(graph.ErrShape, "%s: data shape %v, want %v", what, got, shape)
	}
	b := &hostBuf{shape: shape}
	switch data := t.Data().(type) {
	case []float32:
		if nd.Type.DType != graph.Float32 {
			return nil, graph.Errorf(graph.ErrDType, "%s: float32 data for a %s node", what, nd.Type.DType)
		}
		b.f = contiguous(t, data).([]float32)
	case []int64:
		if nd.Type.DType != graph.Int64 {
			return nil, graph.Errorf(graph.ErrDType, "%s: int64 data for a %s node", what, nd.Type.DType)
		}
		b.i = contiguous(t, data).([]int64)
	case float32:
		if nd.Type.DType != graph.Float32 {
			return nil, graph.Errorf(graph.ErrDType, "%s: float32 data for a %s node", what, nd.Type.DType)
		}
		b.f = []float32{data}
	case int64:
		if nd.Type.DType != graph.Int64 {
			return nil, graph.Errorf(graph.ErrDType, "%s: int64 data for a %s node", what, nd.Type.DType)
		}
		b.i = []int64{data}
	default:
		return nil, graph.Errorf(graph.ErrDType, "%s: unsupported data %T", what, data)
	}
	if n := graph.Numel(shape); len(b.f) != n && len(b.i) != n {
		return nil, graph.Errorf(graph.ErrShape, "%s: %d values for shape %v", what, max(len(b.f), len(b.i)), shape)
	}
	return b, nil
}

// contiguous returns row-major data of t; views are materialised.
func contiguous(t tensor.Tensor, data any) any {
	if d, ok := t.(*tensor.Dense); ok && d.IsMaterializable() {
		if m, ok := d.Materialize().(*tensor.Dense); ok {
			return m.Data()
		}
	}
	return data
}

// moveChunk copies between a chunk and the whole along axis: the chunk
// covers whole[..., off:off+k, ...].
func moveChunk(chunk, whole *hostBuf, axis, off int, toWhole bool) {
	outer := graph.Numel(whole.shape[:axis])
	inner := graph.Numel(whole.shape[axis+1:])
	k, n := chunk.shape[axis], whole.shape[axis]
	for o := range outer {
		c, w := o*k*inner, (o*n+off)*inner
		switch {
		case chunk.f != nil && toWhole:
			copy(whole.f[w:w+k*inner], chunk.f[c:c+k*inner])
		case chunk.f != nil:
			copy(chunk.f[c:c+k*inner], whole.f[w:w+k*inner])
		case toWhole:
			copy(whole.i[w:w+k*inner], chunk.i[c:c+k*inner])
		default:
			copy(chunk.i[c:c+k*inner], whole.i[w:w+k*inner])
		}
	}
}

// upload copies v to device memory at p.
func (r *runner) upload(p alloc.Ptr, v *hostBuf) error {
	if v.f != nil {
		return CopyHtoD(r.e.d, p, v.f)
	}
	return CopyHtoD(r.e.d, p, v.i)
}

// download copies node id's value at chunk size b from blk to the host.
func (r *runner) download(id int, blk *alloc.Block, b int) (*hostBuf, error) {
	nd := r.node(id)
	if err := deviceDType(nd); err != nil {
		return nil, err
	}
	v := newHostBuf(nd.Type.DType, nd.Type.AtBatch(b))
	if v.f != nil {
		return v, CopyDtoH(r.e.d, v.f, blk.Ptr())
	}
	return v, CopyDtoH(r.e.d, v.i, blk.Ptr())
}

// loadInput uploads chunk c of an input's data: the whole batch's rows
// along the batch axis are sliced on the host; data holding exactly the
// chunk is used as it is.
func (r *runner) loadInput(nd *graph.Node, c planner.Chunk, out *alloc.Block) error {
	full := r.inputs[nd.ID]
	if full == nil {
		var err error
		if full, err = hostData(nd, r.source(nd.ID), nil); err != nil {
			return err
		}
		r.inputs[nd.ID] = full
	}
	want := nd.Type.AtBatch(c.Size)
	if slices.Equal(full.shape, want) {
		return r.upload(out.Ptr(), full)
	}
	if whole := nd.Type.AtBatch(r.p.Batch); !slices.Equal(full.shape, whole) {
		return graph.Errorf(graph.ErrShape, "input node %d: data shape %v, want %v (chunk) or %v (whole batch)", nd.ID, full.shape, want, whole)
	}
	ax, off := nd.Type.BatchAxis, c.Start*nd.Type.PerSample
	if graph.Numel(full.shape[:ax]) == 1 { // the chunk's rows are contiguous: copy them directly
		inner := graph.Numel(full.shape[ax+1:])
		lo, hi := off*inner, (off+want[ax])*inner
		if full.f != nil {
			return r.upload(out.Ptr(), &hostBuf{f: full.f[lo:hi]})
		}
		return r.upload(out.Ptr(), &hostBuf{i: full.i[lo:hi]})
	}
	chunk := newHostBuf(nd.Type.DType, want)
	moveChunk(chunk, full, ax, off, false)
	return r.upload(out.Ptr(), chunk)
}

// paramData is the float32 storage of trained parameter id's host tensor,
// which host-side updates write in place.
func (r *runner) paramData(id int) ([]float32, error) {
	nd := r.node(id)
	d, ok := r.source(id).(*tensor.Dense)
	switch {
	case !ok || d == nil:
		return nil, graph.Errorf(graph.ErrNoData, "parameter %q (node %d) has no dense host data", nd.Name, id)
	case d.Dtype() != tensor.Float32:
		return nil, graph.Errorf(graph.ErrDType, "parameter %q (node %d) is %v, want float32", nd.Name, id, d.Dtype())
	case d.RequiresIterator():
		return nil, graph.Errorf(graph.ErrAttr, "parameter %q (node %d) is a transposed or strided view; materialize it before training", nd.Name, id)
	}
	f := d.Float32s()
	if len(f) != nd.Type.Numel() {
		return nil, graph.Errorf(graph.ErrShape, "parameter %q (node %d) holds %d values for shape %v", nd.Name, id, len(f), nd.Type.Shape)
	}
	return f, nil
}

// paramBlock is trained parameter id's device block in this call.
func (r *runner) paramBlock(id int) (*alloc.Block, error) {
	blk := r.persist[persistKey{kind: planner.BufParam, node: id}]
	if blk == nil {
		return nil, graph.Errorf(graph.ErrArity, "trained node %d has no parameter buffer on the device (the program does not read it)", id)
	}
	return blk, nil
}

// paramsToHost downloads the trained parameters into their host tensors.
func (r *runner) paramsToHost() error {
	for _, id := range r.p.Trained {
		f, err := r.paramData(id)
		if err != nil {
			return err
		}
		blk, err := r.paramBlock(id)
		if err != nil {
			return err
		}
		if err := CopyDtoH(r.e.d, f, blk.Ptr()); err != nil {
			return err
		}
		if rb := r.residentParam(id); rb != nil {
			rb.newer = nil
		}
	}
	return nil
}

// residentParam is trained parameter id's resident buffer, nil when the
// call keeps nothing resident.
func (r *runner) residentParam(id int) *residentBuf {
	k, ok := r.key(planner.Buffer{Kind: planner.BufParam, Node: id})
	if !ok {
		return nil
	}
	return r.e.resident[k]
}

// paramsToDevice uploads the trained parameters from their host tensors.
func (r *runner) paramsToDevice() error {
	for _, id := range r.p.Trained {
		f, err := r.paramData(id)
		if err != nil {
			return err
		}
		blk, err := r.paramBlock(id)
		if err != nil {
			return err
		}
		if err := CopyHtoD(r.e.d, blk.Ptr(), f); err != nil {
			return err
		}
	}
	return nil
}
