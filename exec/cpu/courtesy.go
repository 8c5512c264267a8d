package cpu

import (
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/planner"
)

// Yield gives the executor's device memory back between steps, as
// pytorch_memlab's Courtesy does: every resident block (parameters,
// constants, the optimizer state's accounting) is freed and the
// allocator's cache emptied, so with nothing else allocated its reserved
// bytes drop to zero. The values stay in host memory: on the CPU they are
// the parameters' own tensors, and the optimizer keeps its state itself.
// Yielding twice frees nothing more. The next Restore, or the next
// resident Execute, takes the memory back.
func (e *Executor) Yield() error {
	a := e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.Yield(a, nil)
}

// Restore allocates the resident buffers Yield freed again, in the order
// they were first allocated (on the CPU the values never left, so there is
// nothing to copy). The allocator then holds what a first step's
// persistent allocations leave, so the next step's peaks are the planner's
// prediction again. If the device cannot hold them (another process took
// the memory), Restore frees what it allocated, stays yielded and returns
// the allocator's error (wrapping alloc.ErrOutOfMemory). Restore without a
// Yield is a no-op.
func (e *Executor) Restore() error {
	a := e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.Restore(a, nil)
}

// Yielded reports whether the resident buffers are given back.
func (e *Executor) Yielded() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.Yielded()
}

// Close frees the resident buffers and empties the allocator's cache.
// The executor stays usable: a later run starts with nothing resident.
func (e *Executor) Close() error {
	a := e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.resident.Release(a); err != nil {
		return err
	}
	if err := e.offload.Release(); err != nil {
		return err
	}
	return a.EmptyCache()
}

// Held lists the resident buffers, in allocation order (exec.Executor).
func (e *Executor) Held() []exec.Held {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.Held()
}

// ReleaseUnread frees the resident constants p does not read
// (exec.Executor).
func (e *Executor) ReleaseUnread(p *planner.Program) (bool, error) {
	a := e.allocator()
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.resident.ReleaseUnread(a, p, nil, nil)
}
