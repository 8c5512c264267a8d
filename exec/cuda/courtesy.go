package cuda

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/planner"
)

// residentBuf is a buffer kept on the device across Execute calls: its
// block (nil while yielded) and, while yielded, the host copy of its bytes.
type residentBuf struct {
	blk  *alloc.Block
	size int64     // requested bytes
	tag  alloc.Tag // the tag of the program that first allocated it
	host []float32 // the block's bytes while yielded, as float32 words
	// newer is the host tensor's storage of a trained parameter whose
	// device copy a device-side update has changed since it was last
	// downloaded; SyncParams writes it and clears it.
	newer []float32
}

// keep records a resident buffer just allocated and filled. Called with
// e.mu held.
func (e *Executor) keep(k residentKey, pb planner.Buffer, blk *alloc.Block) {
	rb := &residentBuf{blk: blk, size: blk.Requested(), tag: pb.Tag}
	e.resident[k] = rb
	e.residentList = append(e.residentList, rb)
}

// Yield gives the executor's device memory back between steps, as
// pytorch_memlab's Courtesy does (exec.Yielder): every resident block
// (parameters, constants and the device-side optimizer's state) is
// downloaded to host memory of the executor's own, byte for byte, and
// freed, and the allocator's cache is emptied. The cuBLAS workspace stays:
// its segment, Overhead bytes, is all the allocator still reserves, so the
// cuBLAS handle need not be re-created. Trained parameters' host tensors
// are not touched (ExecOptions.SyncParams is what updates them). Yielding
// twice is a no-op; Restore, or the next resident Execute, takes the memory
// back.
func (e *Executor) Yield() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("%w: executor", ErrClosed)
	}
	if e.yielded {
		return nil
	}
	return e.d.do(func() error {
		for _, rb := range e.residentList {
			if rb.blk == nil {
				continue
			}
			// Every device value is float32 or int64, so its size is a
			// whole number of 4-byte words.
			host := make([]float32, (rb.size+3)/4)
			if err := CopyDtoH(e.d, host, rb.blk.Ptr()); err != nil {
				return err
			}
			if err := e.a.Free(rb.blk); err != nil {
				return err
			}
			rb.blk, rb.host = nil, host
		}
		e.yielded = true
		return e.a.EmptyCache()
	})
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
	return e.d.do(func() error {
		for _, rb := range e.residentList {
			if rb.newer == nil {
				continue
			}
			if rb.blk == nil { // yielded
				copy(rb.newer, rb.host)
			} else if err := CopyDtoH(e.d, rb.newer, rb.blk.Ptr()); err != nil {
				return err
			}
			rb.newer = nil
		}
		return nil
	})
}

// Yielded reports whether the resident buffers are given back.
func (e *Executor) Yielded() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.yielded
}

// restore is Restore with e.mu held, on the device thread.
func (e *Executor) restore() error {
	if !e.yielded {
		return nil
	}
	var got []*residentBuf
	undo := func(err error) error {
		for _, g := range got {
			err = errors.Join(err, e.a.Free(g.blk))
			g.blk = nil
		}
		// Still yielded: give back the segments the attempt reserved.
		return errors.Join(err, e.a.EmptyCache())
	}
	for _, rb := range e.residentList {
		blk, err := e.a.Malloc(rb.size, rb.tag)
		if err != nil {
			return undo(err)
		}
		rb.blk = blk
		got = append(got, rb)
		if err := CopyHtoD(e.d, blk.Ptr(), rb.host); err != nil {
			return undo(err)
		}
	}
	for _, rb := range e.residentList {
		rb.host = nil
	}
	e.yielded = false
	return nil
}
