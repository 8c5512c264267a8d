package cuda

import (
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// deviceDType fails for dtypes the CUDA kernels do not compute in.
func deviceDType(nd *graph.Node) error {
	if dt := nd.Type.DType; dt != graph.Float32 && dt != graph.Int64 {
		return graph.Errorf(graph.ErrDType, "the CUDA executor runs float32 and int64 values; node %d (%s) is %s", nd.ID, nd.Op, dt)
	}
	return nil
}

// checkDTypes refuses a program before it runs, allocates or uploads
// anything when one of its values is float16 or bfloat16 (a precision
// policy's graph): the CUDA kernels compute float32 and int64 only, and a
// graph they cannot run is an error, never a silent fallback to the CPU or
// to float32. The error wraps graph.ErrDType and names the first such node.
func checkDTypes(g *graph.Graph) error {
	if g == nil {
		return nil
	}
	for i := range g.Len() {
		if nd := g.Node(i); nd.Type.DType.IsHalf() {
			return &graph.OpError{Op: nd.Op.String(), Shapes: [][]int{nd.Type.Shape}, Site: nd.Site,
				Err: graph.Errorf(graph.ErrDType, "cuda executor: %s kernels not yet available (node %d is %s; run this precision on the CPU executor)",
					nd.Type.DType, nd.ID, nd.Type.DType)}
		}
	}
	return nil
}

// hostData reads a source's data as exec.FromTensor does, refusing dtypes
// the kernels do not compute in.
func hostData(nd *graph.Node, t tensor.Tensor, shape []int) (*exec.HostBuf, error) {
	if t != nil {
		if err := deviceDType(nd); err != nil {
			return nil, err
		}
	}
	return exec.FromTensor(nd, t, shape)
}

// upload copies v to device memory at p.
func (r *runner) upload(p alloc.Ptr, v *exec.HostBuf) error {
	if v.F != nil {
		return CopyHtoD(r.e.d, p, v.F)
	}
	return CopyHtoD(r.e.d, p, v.I)
}

// download copies node id's value at chunk size b from blk to the host.
func (r *runner) download(id int, blk *alloc.Block, b int) (*exec.HostBuf, error) {
	nd := r.node(id)
	if err := deviceDType(nd); err != nil {
		return nil, err
	}
	v := exec.NewHostBuf(nd.Type.DType, nd.Type.AtBatch(b))
	if v.F != nil {
		return v, CopyDtoH(r.e.d, v.F, blk.Ptr())
	}
	return v, CopyDtoH(r.e.d, v.I, blk.Ptr())
}

// loadInput uploads chunk c of an input's data (exec.ChunkOf: contiguous
// rows of the whole batch are uploaded without a host copy).
func (r *runner) loadInput(nd *graph.Node, c planner.Chunk, out *alloc.Block) error {
	full := r.inputs[nd.ID]
	if full == nil {
		var err error
		if full, err = hostData(nd, r.source(nd.ID), nil); err != nil {
			return err
		}
		r.inputs[nd.ID] = full
	}
	v, err := exec.ChunkOf(nd, full, c, r.p.Batch)
	if err != nil {
		return err
	}
	return r.upload(out.Ptr(), v)
}

// paramData is the float32 storage of trained parameter id's host tensor,
// which host-side updates write in place.
func (r *runner) paramData(id int) ([]float32, error) {
	return exec.ParamData(r.node(id), r.source(id))
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

// residentParam is trained parameter id's resident record, nil when the
// call keeps nothing resident.
func (r *runner) residentParam(id int) *residentBuf {
	k, ok := r.c.Key(planner.Buffer{Kind: planner.BufParam, Node: id})
	if !ok {
		return nil
	}
	if rb := r.e.resident.Find(k); rb != nil {
		return rb.Val
	}
	return nil
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
