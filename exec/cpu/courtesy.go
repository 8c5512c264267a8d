package cpu

import (
	"errors"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/planner"
)

// residentBuf is a persistent buffer kept across Execute calls: its block
// (nil while yielded) and its value. On the CPU the value is host memory
// already, a parameter's own storage, so it doubles as the host copy Yield
// keeps; optimizer state has no value here (the optimizer holds it).
type residentBuf struct {
	blk  *alloc.Block
	size int64     // requested bytes
	tag  alloc.Tag // the tag of the program that first allocated it
	val  *buf
}

// keep records a persistent buffer just allocated and filled. Called with
// e.mu held.
func (e *Executor) keep(k residentKey, pb planner.Buffer, blk *alloc.Block, v *buf) {
	if rb := e.resident[k]; rb != nil { // cannot happen: Resident found none
		rb.blk, rb.val = blk, v
		return
	}
	rb := &residentBuf{blk: blk, size: pb.Bytes(0), tag: pb.Tag, val: v}
	e.resident[k] = rb
	e.residentList = append(e.residentList, rb)
}

// Yield gives the executor's device memory back between steps, as
// pytorch_memlab's Courtesy does: every resident block (parameters,
// constants, the optimizer state's accounting) is freed and the
// allocator's cache emptied, so with nothing else allocated its reserved
// bytes drop to zero. The values stay in host memory: on the CPU they are
// the parameters' own tensors, and the optimizer keeps its state itself.
// (An executor whose parameters or state live in device memory must
// download them to host before freeing the blocks.) Yielding twice is a
// no-op. The next Restore, or the next resident Execute, takes the memory
// back.
func (e *Executor) Yield() error {
	a := e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.yielded = true
	for _, rb := range e.residentList {
		if rb.blk == nil {
			continue
		}
		if err := a.Free(rb.blk); err != nil {
			return err
		}
		rb.blk = nil
	}
	return a.EmptyCache()
}

// Restore allocates the resident buffers Yield freed again, in the order
// they were first allocated, and fills them from their host copies (on the
// CPU the values never left, so there is nothing to copy). The allocator
// then holds what a first step's persistent allocations leave, so the next
// step's peaks are the planner's prediction again. If the device cannot
// hold them (another process took the memory), Restore frees what it
// allocated, stays yielded and returns the allocator's error (wrapping
// alloc.ErrOutOfMemory). Restore without a Yield is a no-op.
func (e *Executor) Restore() error {
	e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.restore()
}

// Yielded reports whether the resident buffers are given back.
func (e *Executor) Yielded() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.yielded
}

// restore is Restore with e.mu held.
func (e *Executor) restore() error {
	if !e.yielded {
		return nil
	}
	a := e.allocator()
	var got []*residentBuf
	for _, rb := range e.residentList {
		if rb.blk != nil {
			continue
		}
		blk, err := a.Malloc(rb.size, rb.tag)
		if err != nil {
			for _, g := range got {
				_ = a.Free(g.blk) // undoing allocations just made; the Malloc error is the one to report
				g.blk = nil
			}
			// Still yielded: give back the segments the attempt reserved.
			if cerr := a.EmptyCache(); cerr != nil {
				return errors.Join(err, cerr)
			}
			return err
		}
		rb.blk = blk
		got = append(got, rb)
	}
	e.yielded = false
	return nil
}
