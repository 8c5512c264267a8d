package cuda

import (
	"fmt"
	"unsafe"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// residentBuf is the executor's record of a buffer kept on the device
// across Execute calls (exec.Resident's Val).
type residentBuf struct {
	host []float32 // the block's bytes while yielded, as float32 words
	// newer is the host tensor's storage of a trained parameter whose
	// device copy a device-side update has changed since it was last
	// downloaded; SyncParams writes it and clears it.
	newer []float32
	// owner is the optimizer whose state an optimizer state buffer holds
	// (optimizer.go), nil before one steps with it.
	owner devOptimizer
	// src is a parameter's or constant's source node (its type and host
	// tensor, no inputs), for UploadParams.
	src *graph.Node
}

// Held lists the resident buffers, in allocation order (exec.Executor).
func (e *Executor) Held() []exec.Held {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.Held()
}

// ReleaseUnread frees the resident constants p does not read
// (exec.Executor). When one lay between residents that stay, those are
// moved together through host memory, as Yield and Restore move them.
func (e *Executor) ReleaseUnread(p *planner.Program) (bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return false, fmt.Errorf("%w: executor", ErrClosed)
	}
	if !e.resident.HoldsConstants() {
		// Nothing to free: no hop to the device thread, which costs tens
		// of µs of every training step's host time.
		if !e.resident.Yielded() {
			e.dropHostCopies()
		}
		return false, nil
	}
	var released bool
	err := e.d.do(func() error {
		var err error
		released, err = e.resident.ReleaseUnread(e.a, p, e.save, e.load)
		if err == nil && !e.resident.Yielded() {
			e.dropHostCopies()
		}
		return err
	})
	return released, err
}

// dropHostCopies forgets the host copies once every resident is back on
// the device. Without any (no Yield since the last drop) it walks nothing:
// a steady training loop calls it every step.
func (e *Executor) dropHostCopies() {
	if !e.hostCopies {
		return
	}
	for _, rb := range e.resident.List() {
		rb.Val.host = nil
	}
	e.hostCopies = false
}

// save keeps a host copy of a resident block's bytes (Yield).
func (e *Executor) save(rb *exec.Resident[*residentBuf]) error {
	// Every device value is float32 or int64, so its size is a whole
	// number of 4-byte words.
	host := make([]float32, (rb.Size+3)/4)
	if err := CopyDtoH(e.d, host, rb.Blk.Ptr()); err != nil {
		return err
	}
	rb.Val.host = host
	e.hostCopies = true
	return nil
}

// load uploads a resident block's host copy (Restore).
func (e *Executor) load(rb *exec.Resident[*residentBuf]) error {
	return CopyHtoD(e.d, rb.Blk.Ptr(), rb.Val.host)
}

// Yield gives the executor's device memory back between steps, as
// pytorch_memlab's Courtesy does (exec.Yielder): every resident block
// (parameters, constants and the device-side optimizer's state) is
// downloaded to host memory of the executor's own, byte for byte, and
// freed, and the allocator's cache is emptied. The cuBLAS workspace stays:
// its segment, Overhead bytes, is all the allocator still reserves, so the
// cuBLAS handle need not be re-created. Trained parameters' host tensors
// are not touched (ExecOptions.SyncParams is what updates them). Yielding
// twice frees nothing more; Restore, or the next resident Execute, takes
// the memory back.
func (e *Executor) Yield() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("%w: executor", ErrClosed)
	}
	return e.d.do(func() error { return e.resident.Yield(e.a, e.save) })
}

// Restore allocates the resident buffers Yield freed again, in the order
// they were first allocated, and uploads their host copies, so the next
// step runs bit for bit as if Yield had never happened, with the planned
// peaks. If the device cannot hold them (another process took the memory)
// it frees what it allocated, stays yielded and returns the allocator's
// error (wrapping alloc.ErrOutOfMemory). Restore without a Yield is a
// no-op.
func (e *Executor) Restore() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("%w: executor", ErrClosed)
	}
	return e.d.do(e.restore)
}

// SyncParams downloads every resident parameter that a device-side update
// changed since its last download into its host tensor, so the host
// tensors hold the values the next step will use. While yielded it copies
// the executor's host copies instead.
func (e *Executor) SyncParams() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("%w: executor", ErrClosed)
	}
	e.offload.SyncHost() // an offloaded optimizer's masters are the parameters
	return e.d.do(func() error {
		for _, rb := range e.resident.List() {
			if rb.Val.newer == nil {
				continue
			}
			if rb.Blk == nil { // yielded
				copy(rb.Val.newer, rb.Val.host)
			} else if err := CopyDtoH(e.d, rb.Val.newer, rb.Blk.Ptr()); err != nil {
				return err
			}
			rb.Val.newer = nil
		}
		return nil
	})
}

// UploadParams copies every resident parameter's and constant's host
// tensor to its device copy (or, while yielded, into the host copy
// Restore uploads), for host tensors written between steps: a checkpoint
// loaded into a session that has already stepped. Without it the device
// copy stays the parameter, and SyncParams would overwrite the host
// tensor with it. The copies are ordered after the work queued before.
func (e *Executor) UploadParams() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("%w: executor", ErrClosed)
	}
	e.offload.MarkStale() // the masters are read from the host tensors again
	return e.d.do(func() error {
		for _, rb := range e.resident.List() {
			nd := rb.Val.src
			if rb.Key().Kind() != planner.BufParam || nd == nil {
				continue
			}
			v, err := hostData(nd, nd.Value, nd.Type.Shape)
			if err != nil {
				return err
			}
			var words []float32 // the block's bytes as 4-byte words, as save keeps them
			switch dt := nd.Type.DType; {
			case v.F == nil:
				words = unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(v.I))), 2*len(v.I))
			case dt.IsHalf():
				bits := encodeHalf(dt, v.F)
				words = make([]float32, (len(bits)+1)/2)
				copy(unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(words))), 2*len(words)), bits)
			default:
				words = v.F
			}
			words = words[:min(int64(len(words)), (rb.Size+3)/4)]
			if rb.Blk == nil { // yielded
				copy(rb.Val.host, words)
			} else if err := CopyHtoD(e.d, rb.Blk.Ptr(), words); err != nil {
				return err
			}
			rb.Val.newer = nil
		}
		return nil
	})
}

// Yielded reports whether the resident buffers are given back.
func (e *Executor) Yielded() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.Yielded()
}

// restore is Restore with e.mu held, on the device thread.
func (e *Executor) restore() error {
	if !e.resident.Yielded() {
		return nil
	}
	if err := e.resident.Restore(e.a, e.load); err != nil {
		return err
	}
	e.dropHostCopies()
	return nil
}
