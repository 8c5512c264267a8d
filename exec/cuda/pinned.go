package cuda

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Page-locked host memory for a caller's own buffers (a data loader's
// batches). An upload that need not wait (an Execute's input) from
// memory AllocHost gave is one cuMemcpyHtoDAsync straight from it: no
// staging copy (staging.go), the DMA engine reading the caller's buffer
// while the host goes on. The caller must then leave the buffer alone
// until stream 0 has passed the copy: a resident Execute has when it
// returns without an error (its inputs precede the loss it reads back),
// and Synchronize waits for it otherwise. Like the staging buffers,
// pinned host memory is no device memory: plans do not see it.

// pinnedSet is the device's live AllocHost allocations, sorted by start.
type pinnedSet struct {
	mu     sync.Mutex
	ranges []hostRange
	// direct counts the uploads that went straight from pinned memory.
	direct atomic.Int64
}

type hostRange struct {
	p          unsafe.Pointer // as cuMemHostAlloc gave it
	start, end uintptr
}

// holds reports whether [p, p+n) lies inside one allocation.
func (s *pinnedSet) holds(p unsafe.Pointer, n uintptr) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.ranges) == 0 {
		return false
	}
	a := uintptr(p)
	i, _ := slices.BinarySearchFunc(s.ranges, a, func(r hostRange, a uintptr) int {
		switch {
		case r.end <= a:
			return -1
		case r.start > a:
			return 1
		}
		return 0
	})
	return i < len(s.ranges) && s.ranges[i].start <= a && a+n <= s.ranges[i].end
}

func (s *pinnedSet) add(r hostRange) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, _ := slices.BinarySearchFunc(s.ranges, r.start, func(x hostRange, a uintptr) int {
		if x.start < a {
			return -1
		} else if x.start > a {
			return 1
		}
		return 0
	})
	s.ranges = slices.Insert(s.ranges, i, r)
}

// remove forgets the allocation starting at start; false when there is none.
func (s *pinnedSet) remove(start uintptr) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := slices.IndexFunc(s.ranges, func(r hostRange) bool { return r.start == start })
	if i < 0 {
		return false
	}
	s.ranges = slices.Delete(s.ranges, i, i+1)
	return true
}

// ErrNotPinned is FreeHost's error for memory AllocHost did not give.
var ErrNotPinned = errors.New("cuda: not memory AllocHost gave")

// AllocHost allocates n bytes of page-locked host memory
// (cuMemHostAlloc), page-aligned. Uploads from it skip the staging copy.
// FreeHost frees it; Close frees what is left.
func (d *Device) AllocHost(n int) ([]byte, error) {
	if n <= 0 {
		return nil, errors.New("cuda: AllocHost of no bytes")
	}
	var p unsafe.Pointer
	err := d.do(func() error {
		return d.drv.check("cuMemHostAlloc", d.drv.cuMemHostAlloc(&p, uintptr(n), 0))
	})
	if err != nil {
		return nil, err
	}
	d.pinned.add(hostRange{p: p, start: uintptr(p), end: uintptr(p) + uintptr(n)})
	return unsafe.Slice((*byte)(p), n), nil
}

// FreeHost frees memory AllocHost gave, once the device has finished
// the work queued before (an upload from it may still be moving). After
// Close, which freed it, it does nothing.
func (d *Device) FreeHost(b []byte) error {
	if len(b) == 0 {
		return ErrNotPinned
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	if !d.pinned.remove(uintptr(p)) {
		return ErrNotPinned
	}
	err := d.do(func() error {
		return errors.Join(d.drv.check("cuCtxSynchronize", d.drv.cuCtxSynchronize()),
			d.drv.check("cuMemFreeHost", d.drv.cuMemFreeHost(p)))
	})
	if errors.Is(err, ErrClosed) {
		return nil
	}
	return err
}

// freePinned frees every live AllocHost allocation, on the device thread,
// after the device has finished (Close).
func (d *Device) freePinned() error {
	d.pinned.mu.Lock()
	ranges := d.pinned.ranges
	d.pinned.ranges = nil
	d.pinned.mu.Unlock()
	var errs []error
	for _, r := range ranges {
		errs = append(errs, d.drv.check("cuMemFreeHost", d.drv.cuMemFreeHost(r.p)))
	}
	return errors.Join(errs...)
}

// PinnedUploads counts the uploads that went straight from AllocHost
// memory, without the staging copy.
func (d *Device) PinnedUploads() int64 { return d.pinned.direct.Load() }
