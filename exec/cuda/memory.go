package cuda

import (
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
)

// Backend serves the caching allocator segments of device memory through
// cuMemAlloc_v2 and cuMemFree_v2. Out-of-memory failures wrap
// alloc.ErrDeviceOOM.
type Backend struct{ d *Device }

var _ alloc.Backend = (*Backend)(nil)

// Backend returns the device's alloc.Backend. Use it only through an
// alloc.Allocator: every device byte goes through the caching allocator.
func (d *Device) Backend() *Backend { return &Backend{d} }

// Malloc reserves size bytes of device memory.
func (b *Backend) Malloc(size int64) (alloc.Ptr, error) {
	if size <= 0 {
		return 0, fmt.Errorf("%w: cuda malloc of %d bytes", alloc.ErrInvalid, size)
	}
	drv := b.d.drv
	var p CUdeviceptr
	err := b.d.do(func() error { return drv.check("cuMemAlloc_v2", drv.cuMemAlloc(&p, uintptr(size))) })
	return alloc.Ptr(p), err
}

// Free releases memory returned by Malloc, after the kernels a resident
// Execute left running (Executor.Execute), which may still use it.
func (b *Backend) Free(p alloc.Ptr) error {
	drv := b.d.drv
	return b.d.do(func() error {
		if b.d.tail {
			if err := b.d.syncOnThread(); err != nil {
				return err
			}
		}
		return drv.check("cuMemFree_v2", drv.cuMemFree(CUdeviceptr(p)))
	})
}

// MemInfo reports the device's free and total bytes (cuMemGetInfo_v2).
// While the sample the last Execute took at its end is current (no
// driver call of this process since, taken less than memSampleFresh ago)
// it returns that sample instead of a hop to the device thread: a steady
// training loop plans each step without one. Memory another process
// takes in that window is the out-of-memory retry's (batchfit.Session).
func (b *Backend) MemInfo() (free, total int64, err error) {
	if s := b.d.sample.Load(); s != nil && s.jobs == deviceJobs.Load() && time.Since(s.at) < memSampleFresh && !b.d.onThread() {
		return s.free, s.total, nil
	}
	drv := b.d.drv
	var f, t uintptr
	err = b.d.do(func() error { return drv.check("cuMemGetInfo_v2", drv.cuMemGetInfo(&f, &t)) })
	return int64(f), int64(t), err
}

// memSample is the device's free and total bytes at time at, after jobs
// requests (do and doHere calls) of the process's devices had run
// (deviceJobs).
type memSample struct {
	free, total int64
	jobs        uint64
	at          time.Time
}

// memSampleFresh is how long a memSample stands in for cuMemGetInfo: the
// gap between one training step's end and the next one's plan (the
// caller's graph build and the Session's host work, well under a
// millisecond for GPT-2 small), not a data loader's wait.
const memSampleFresh = 5 * time.Millisecond

// deviceJobs counts the requests every Device's goroutine has run and the
// doHere calls. Every driver call, and so every allocation and free of
// device memory by this process, runs inside one; a memSample taken in the
// latest is current.
var deviceJobs atomic.Uint64

// sampleMemInfo records the device's free memory for MemInfo. It runs on
// the device thread, at the end of the request it is part of, after
// the request's last allocation or free.
func (d *Device) sampleMemInfo() {
	var f, t uintptr
	if d.drv.check("cuMemGetInfo_v2", d.drv.cuMemGetInfo(&f, &t)) != nil {
		d.sample.Store(nil)
		return
	}
	d.sample.Store(&memSample{free: int64(f), total: int64(t), jobs: deviceJobs.Load(), at: time.Now()})
}

// Elem is an element type that host↔device copies accept (~uint16: the
// bits of bfloat16 and float16 values, package half).
type Elem interface{ ~float32 | ~int64 | ~uint16 }

// CopyHtoD copies src to device memory at dst. An empty slice copies
// nothing. The copy is complete when CopyHtoD returns, so src may be
// reused at once.
func CopyHtoD[T Elem](d *Device, dst alloc.Ptr, src []T) error {
	return copyHtoD(d, dst, src, true)
}

// copyHtoD is CopyHtoD; without wait, the copy (stageHtoD) may still be
// moving when it returns, ahead of the work queued on stream 0 after it:
// for uploads that only stream-0 work reads.
func copyHtoD[T Elem](d *Device, dst alloc.Ptr, src []T, wait bool) error {
	if len(src) == 0 {
		return nil
	}
	n := uintptr(len(src)) * unsafe.Sizeof(src[0])
	return d.do(func() error {
		if d.capture != 0 {
			return ErrHostInCapture
		}
		if !wait && d.pinned.holds(unsafe.Pointer(&src[0]), n) { // AllocHost's memory: a DMA from it (pinned.go)
			d.pinned.direct.Add(1)
			return d.drv.check("cuMemcpyHtoDAsync_v2", d.drv.cuMemcpyHtoDAsync(CUdeviceptr(dst), unsafe.Pointer(&src[0]), n, 0))
		}
		if n >= stageMin || !wait {
			return d.stageHtoD(dst, unsafe.Pointer(&src[0]), n, wait)
		}
		d.waits.Add(1)
		return d.drv.check("cuMemcpyHtoD_v2", d.drv.cuMemcpyHtoD(CUdeviceptr(dst), unsafe.Pointer(&src[0]), n))
	})
}

// CopyDtoH copies len(dst) elements from device memory at src into dst,
// after the work queued before it has finished.
func CopyDtoH[T Elem](d *Device, dst []T, src alloc.Ptr) error {
	if len(dst) == 0 {
		return nil
	}
	n := uintptr(len(dst)) * unsafe.Sizeof(dst[0])
	return d.do(func() error {
		if d.capture != 0 {
			return ErrHostInCapture
		}
		d.waits.Add(1)
		return d.drv.check("cuMemcpyDtoH_v2", d.drv.cuMemcpyDtoH(unsafe.Pointer(&dst[0]), CUdeviceptr(src), n))
	})
}

// Memzero sets n bytes at dst to zero.
func (d *Device) Memzero(dst alloc.Ptr, n int64) error { return d.memset(dst, 0, n) }

// memset sets n bytes at dst to v: on stream 0, or on the capture stream
// while the executor captures a CUDA graph (graphs.go).
func (d *Device) memset(dst alloc.Ptr, v uint8, n int64) error {
	if n < 0 {
		return fmt.Errorf("%w: memset of %d bytes", alloc.ErrInvalid, n)
	}
	if n == 0 {
		return nil
	}
	return d.do(func() error {
		if s := d.capture; s != 0 {
			gd, err := loadGraphDriver()
			if err != nil {
				return err
			}
			return d.drv.check("cuMemsetD8Async", gd.cuMemsetD8Async(CUdeviceptr(dst), v, uintptr(n), s))
		}
		return d.drv.check("cuMemsetD8_v2", d.drv.cuMemsetD8(CUdeviceptr(dst), v, uintptr(n)))
	})
}
