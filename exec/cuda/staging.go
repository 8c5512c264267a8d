package cuda

import (
	"errors"
	"sync"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
)

// Uploads through pinned staging buffers.
//
// cuMemcpyHtoD from pageable Go memory runs at a few GB/s: the driver
// copies through its own small pinned buffers on one thread. A ResNet-50
// batch of 64 images (38.5 MB of float32) took 6.1 ms a step that way. A
// large upload instead goes through two pinned buffers of stagePiece
// bytes in turn: several goroutines copy the next piece into one buffer
// while the DMA engine moves the previous one (cuMemcpyHtoDAsync on the
// executor's stream), so the upload runs near the slower of the host's
// memory bandwidth and PCIe's. Pinned host memory is no device memory: the
// allocator and the plans do not see it.
const (
	stagePiece = 4 << 20 // bytes per pinned buffer
	// stageMin is the smallest upload that waits for its copy (CopyHtoD)
	// and still goes through the pinned buffers; smaller ones go straight
	// through cuMemcpyHtoD. Uploads that need not wait (an Execute's) all
	// go through them: from pageable memory cuMemcpyHtoD first waits for
	// all the work queued on the stream, the last kernels of the step
	// before included.
	stageMin = 1 << 20
)

// stageCopiers is the number of goroutines copying one piece (a variable
// for BenchmarkUpload's comparisons).
var stageCopiers = 4

// stager is a device's two pinned buffers and the events that say when
// the DMA reading each is done. Only the device thread uses it.
type stager struct {
	buf  [2]unsafe.Pointer
	ev   [2]CUevent
	busy [2]bool // a DMA was queued from buf[i] since ev[i] was last waited on
	next int     // the buffer the next piece goes through
}

// stageHtoD copies n bytes at src to dst through the pinned buffers, on
// the device thread. With wait it returns when the bytes are on the
// device, as cuMemcpyHtoD does; without, when src may be reused: the last
// pieces may still be moving, ahead of whatever is queued on stream 0
// next.
func (d *Device) stageHtoD(dst alloc.Ptr, src unsafe.Pointer, n uintptr, wait bool) error {
	s, err := d.stagerOnThread()
	if err != nil {
		return err
	}
	drv := d.drv
	last := -1
	for off := uintptr(0); off < n; off += stagePiece {
		// Pieces alternate across calls too: a step's second upload does
		// not wait for its first, which may be queued behind the last
		// kernels of the step before (Executor.Execute).
		i := s.next
		s.next = 1 - i
		if s.busy[i] {
			d.waits.Add(1)
			if err := drv.check("cuEventSynchronize", drv.cuEventSynchronize(s.ev[i])); err != nil {
				return err
			}
			s.busy[i] = false
		}
		m := min(stagePiece, n-off)
		parallelCopy(unsafe.Slice((*byte)(s.buf[i]), m), unsafe.Slice((*byte)(unsafe.Add(src, off)), m))
		if err := drv.check("cuMemcpyHtoDAsync_v2", drv.cuMemcpyHtoDAsync(CUdeviceptr(dst)+CUdeviceptr(off), s.buf[i], m, 0)); err != nil {
			return err
		}
		if err := drv.check("cuEventRecord", drv.cuEventRecord(s.ev[i], 0)); err != nil {
			return err
		}
		s.busy[i], last = true, i
	}
	if wait && last >= 0 {
		d.waits.Add(1)
		if err := drv.check("cuEventSynchronize", drv.cuEventSynchronize(s.ev[last])); err != nil {
			return err
		}
		s.busy[last] = false
	}
	return nil
}

// stagerOnThread returns the device's stager, making it on first use.
func (d *Device) stagerOnThread() (*stager, error) {
	if d.stage != nil {
		return d.stage, nil
	}
	drv, s := d.drv, &stager{}
	var err error
	for i := range s.buf {
		if err = drv.check("cuMemHostAlloc", drv.cuMemHostAlloc(&s.buf[i], stagePiece, 0)); err != nil {
			break
		}
		if err = drv.check("cuEventCreate", drv.cuEventCreate(&s.ev[i], cuEventDisableTiming)); err != nil {
			break
		}
	}
	if err != nil {
		return nil, errors.Join(err, d.freeStager(s))
	}
	d.stage = s
	return s, nil
}

// freeStager waits for s's DMAs and frees its buffers and events, on the
// device thread.
func (d *Device) freeStager(s *stager) error {
	if s == nil {
		return nil
	}
	drv := d.drv
	var errs []error
	for i := range s.buf {
		if s.ev[i] != 0 {
			if s.busy[i] {
				errs = append(errs, drv.check("cuEventSynchronize", drv.cuEventSynchronize(s.ev[i])))
			}
			errs = append(errs, drv.check("cuEventDestroy", drv.cuEventDestroy(s.ev[i])))
		}
		if s.buf[i] != nil {
			errs = append(errs, drv.check("cuMemFreeHost", drv.cuMemFreeHost(s.buf[i])))
		}
	}
	return errors.Join(errs...)
}

// parallelCopy copies src into dst (of equal length) on stageCopiers
// goroutines: one core's memmove does not reach the host's bandwidth.
func parallelCopy(dst, src []byte) {
	part := (len(src) + stageCopiers - 1) / stageCopiers
	if part < 256<<10 {
		copy(dst, src)
		return
	}
	var wg sync.WaitGroup
	for lo := 0; lo < len(src); lo += part {
		hi := min(lo+part, len(src))
		wg.Add(1)
		go func() {
			defer wg.Done()
			copy(dst[lo:hi], src[lo:hi])
		}()
	}
	wg.Wait()
}
