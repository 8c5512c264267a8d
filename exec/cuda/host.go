package cuda

import (
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/planner"
)

// deviceDType fails for dtypes the CUDA kernels do not compute in: they
// run float32, bfloat16, float16 and int64 values.
func deviceDType(nd *graph.Node) error {
	if dt := nd.Type.DType; !dt.IsFloat() && dt != graph.Int64 {
		return graph.Errorf(graph.ErrDType, "the CUDA executor runs float32, bfloat16, float16 and int64 values; node %d (%s) is %s", nd.ID, nd.Op, dt)
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

// upload copies v, a value of dtype dt, to device memory at p. Host data
// of a 16-bit value is float32 (exec.HostBuf); it is rounded to nearest
// even as it is encoded, as the CPU executor rounds it on entry.
//
// Only stream-0 work reads what it uploads, so a large upload returns
// once the host data is staged, its last pieces still moving (copyHtoD).
func (r *runner) upload(p alloc.Ptr, v *exec.HostBuf, dt graph.DType) error {
	switch {
	case v.F == nil:
		return copyHtoD(r.e.d, p, v.I, false)
	case dt.IsHalf():
		return copyHtoD(r.e.d, p, encodeHalf(dt, v.F), false)
	}
	return copyHtoD(r.e.d, p, v.F, false)
}

// download copies node id's value at chunk size b from blk to the host; a
// 16-bit value comes back widened to float32, exactly.
func (r *runner) download(id int, blk *alloc.Block, b int) (*exec.HostBuf, error) {
	nd := r.node(id)
	if err := deviceDType(nd); err != nil {
		return nil, err
	}
	v := exec.NewHostBuf(nd.Type.DType, nd.Type.AtBatch(b))
	switch dt := nd.Type.DType; {
	case v.F == nil:
		return v, CopyDtoH(r.e.d, v.I, blk.Ptr())
	case dt.IsHalf():
		bits := make([]uint16, len(v.F))
		if err := CopyDtoH(r.e.d, bits, blk.Ptr()); err != nil {
			return nil, err
		}
		decodeHalf(dt, v.F, bits)
		return v, nil
	}
	return v, CopyDtoH(r.e.d, v.F, blk.Ptr())
}

// encodeHalf rounds src to the bits of 16-bit dtype dt (package half).
func encodeHalf(dt graph.DType, src []float32) []uint16 {
	enc := func(f float32) uint16 { return uint16(half.F16From(f)) }
	if dt == graph.BFloat16 {
		enc = func(f float32) uint16 { return uint16(half.BF16From(f)) }
	}
	bits := make([]uint16, len(src))
	for i, f := range src {
		bits[i] = enc(f)
	}
	return bits
}

// decodeHalf widens the bits of 16-bit dtype dt into dst.
func decodeHalf(dt graph.DType, dst []float32, bits []uint16) {
	dec := func(h uint16) float32 { return half.F16(h).Float32() }
	if dt == graph.BFloat16 {
		dec = func(h uint16) float32 { return half.BF16(h).Float32() }
	}
	for i, h := range bits {
		dst[i] = dec(h)
	}
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
	return r.upload(out.Ptr(), v, nd.Type.DType)
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
