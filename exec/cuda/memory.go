package cuda

import (
	"fmt"
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

// Free releases memory returned by Malloc.
func (b *Backend) Free(p alloc.Ptr) error {
	drv := b.d.drv
	return b.d.do(func() error { return drv.check("cuMemFree_v2", drv.cuMemFree(CUdeviceptr(p))) })
}

// MemInfo reports the device's free and total bytes (cuMemGetInfo_v2).
func (b *Backend) MemInfo() (free, total int64, err error) {
	drv := b.d.drv
	var f, t uintptr
	err = b.d.do(func() error { return drv.check("cuMemGetInfo_v2", drv.cuMemGetInfo(&f, &t)) })
	return int64(f), int64(t), err
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

// copyHtoD is CopyHtoD; without wait, a large copy (stageHtoD) may still be
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
		if n >= stageMin {
			return d.stageHtoD(dst, unsafe.Pointer(&src[0]), n, wait)
		}
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
