package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/batchfit/batchfit/graph"
)

// Options configures Open.
type Options struct {
	// Ordinal picks the device; 0 is the first.
	Ordinal int
	// CacheDir holds compiled cubins; "" means
	// os.UserCacheDir()/batchfit/cubin.
	CacheDir string
	// AlgoCacheDir holds the timed cuDNN algorithm searches' results
	// (convfind.go); "" means os.UserCacheDir()/batchfit/cudnn.
	AlgoCacheDir string
	// NoCache compiles every kernel afresh, times every convolution shape
	// afresh (once per process) and writes nothing to disk.
	NoCache bool
}

// Device is one GPU with its primary context current on a dedicated,
// OS-thread-locked goroutine. Its methods are safe for concurrent use;
// calls are serialised on that goroutine, or run on the caller's own
// locked thread while the goroutine waits (an Executor's Execute, doHere).
// "The device thread" below is whichever of the two runs the driver work.
type Device struct {
	drv  *driver
	opts Options

	dev           cuDevice
	ctx           CUcontext
	name          string
	major, minor  int
	sms           int // streaming multiprocessors
	total         int64
	driverVersion int

	// tid is the OS thread id of the device goroutine while it runs (0
	// before and after), or of the thread a doHere call runs on while it
	// runs: do calls from that thread run directly.
	tid atomic.Int64
	// workerTid is the device goroutine's thread id, which tid returns to
	// after a doHere call.
	workerTid int64
	// held serialises the driver work: the device goroutine holds it
	// while it runs a request, and a doHere call while it runs. The
	// fields below that only "the device goroutine" uses are used under
	// it.
	held      sync.Mutex
	reqs      chan request
	quit      chan struct{}
	stopped   chan struct{}
	closeOnce sync.Once
	closeErr  error // set by the worker before it closes stopped

	stage    *stager      // pinned upload buffers, made on first large upload (staging.go)
	pinned   pinnedSet    // page-locked memory AllocHost gave callers (pinned.go)
	readback *readbackBuf // pinned buffer of the early reads (readback.go)
	norms    *normReads   // pinned words of clipping's gradient norms (readback.go)
	// waits counts the host's waits for the device: synchronous copies,
	// synchronisations and event waits (tests check that a step adds none
	// where it should not).
	waits atomic.Int64
	// tail is set while a resident Execute's last kernels may still run
	// (readback.go); a free of device memory waits for them first.
	tail bool

	// sample is the device's free memory as the last Execute left it
	// (sampleMemInfo), which MemInfo returns while it is current.
	sample atomic.Pointer[memSample]

	// capture is the stream a CUDA graph capture records while the
	// executor captures a segment (graphs.go), 0 otherwise: launches and
	// memsets go there, and calls that need the host fail with
	// ErrHostInCapture. Used on the device thread only.
	capture uintptr
}

// request is a closure for the device goroutine and where its result goes.
type request struct {
	fn   func() error
	done chan error
}

// Open loads the driver on first use and opens a device. Without a usable
// GPU the error wraps ErrNoGPU and says why.
func Open(o Options) (*Device, error) {
	drv, err := loadDriver()
	if err != nil {
		return nil, err
	}
	var count int32
	if err := drv.check("cuDeviceGetCount", drv.cuDeviceGetCount(&count)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoGPU, err)
	}
	if count == 0 {
		return nil, fmt.Errorf("%w: the driver reports no devices", ErrNoGPU)
	}
	if o.Ordinal < 0 || o.Ordinal >= int(count) {
		return nil, graph.Errorf(graph.ErrAttr, "cuda: device ordinal %d out of range [0, %d)", o.Ordinal, count)
	}
	d := &Device{
		drv:     drv,
		opts:    o,
		reqs:    make(chan request),
		quit:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	if err := d.query(); err != nil {
		return nil, err
	}
	ready := make(chan error)
	go d.worker(ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return d, nil
}

// query reads the device's properties; none of these calls needs a context.
func (d *Device) query() error {
	drv := d.drv
	if err := drv.check("cuDeviceGet", drv.cuDeviceGet(&d.dev, int32(d.opts.Ordinal))); err != nil {
		return err
	}
	var major, minor, version int32
	if err := drv.check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(&major, attrComputeCapabilityMajor, d.dev)); err != nil {
		return err
	}
	if err := drv.check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(&minor, attrComputeCapabilityMinor, d.dev)); err != nil {
		return err
	}
	d.major, d.minor = int(major), int(minor)
	var sms int32
	if err := drv.check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(&sms, attrMultiprocessorCount, d.dev)); err != nil {
		return err
	}
	d.sms = int(sms)
	name := make([]byte, 256)
	if err := drv.check("cuDeviceGetName", drv.cuDeviceGetName(&name[0], int32(len(name)), d.dev)); err != nil {
		return err
	}
	d.name = goString(&name[0])
	var total uintptr
	if err := drv.check("cuDeviceTotalMem_v2", drv.cuDeviceTotalMem(&total, d.dev)); err != nil {
		return err
	}
	d.total = int64(total)
	if err := drv.check("cuDriverGetVersion", drv.cuDriverGetVersion(&version)); err != nil {
		return err
	}
	d.driverVersion = int(version)
	return nil
}

// worker owns the OS thread on which the context is current: it retains
// the primary context, reports on ready, then runs requests until Close.
// It never unlocks the thread: the thread, whose context was made current
// here, ends with the goroutine, so no other goroutine inherits it.
func (d *Device) worker(ready chan<- error) {
	runtime.LockOSThread()
	drv := d.drv
	if err := drv.check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(&d.ctx, d.dev)); err != nil {
		ready <- err
		return
	}
	if err := drv.check("cuCtxSetCurrent", drv.cuCtxSetCurrent(d.ctx)); err != nil {
		drv.cuDevicePrimaryCtxRelease(d.dev)
		ready <- err
		return
	}
	if tid := gettid(); tid > 0 {
		d.workerTid = tid
		d.tid.Store(tid)
	}
	ready <- nil
	for {
		select {
		case r := <-d.reqs:
			d.held.Lock()
			deviceJobs.Add(1)
			err := r.fn()
			d.held.Unlock()
			r.done <- err
		case <-d.quit:
			d.held.Lock() // no doHere call runs during or after the release
			defer d.held.Unlock()
			d.closeErr = errors.Join(
				d.freeStager(d.stage),
				d.freeReadback(d.readback),
				d.freeNorms(d.norms),
				drv.check("cuCtxSynchronize", drv.cuCtxSynchronize()),
				d.freePinned(),
				drv.check("cuCtxSetCurrent", drv.cuCtxSetCurrent(0)),
				drv.check("cuDevicePrimaryCtxRelease_v2", drv.cuDevicePrimaryCtxRelease(d.dev)))
			d.tid.Store(0)
			close(d.stopped)
			return
		}
	}
}

// do runs fn on the device goroutine and returns its error. Called from
// the device goroutine itself (from inside another fn) it runs fn at once,
// so a long fn, such as an executor's whole replay, may use every method
// of the package, an Allocator over this device's Backend included,
// without a hop per call. While a long fn runs, other goroutines' calls
// wait for it: one that holds a lock the fn needs (a goroutine calling
// EmptyCache on the fn's allocator) would deadlock, and fn must not call
// Close.
func (d *Device) do(fn func() error) error {
	if d.onThread() {
		return fn()
	}
	r := request{fn: fn, done: make(chan error, 1)}
	select {
	case d.reqs <- r:
		return <-r.done
	case <-d.stopped:
		return ErrClosed
	}
}

// doHere is do on the calling goroutine's own OS thread, locked to it for
// the call, with the device's context made current there: no hop to the
// device goroutine and back, whose two thread wake-ups (10–20 µs each)
// would otherwise lie between one training step and the next. The device
// goroutine waits meanwhile, so fn may do all that a do fn may. Without
// thread ids (not Linux) it is do.
func (d *Device) doHere(fn func() error) (err error) {
	if d.onThread() {
		return fn()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tid := gettid()
	if tid <= 0 || d.workerTid <= 0 {
		return d.do(fn)
	}
	d.held.Lock()
	defer d.held.Unlock()
	select {
	case <-d.stopped:
		return ErrClosed
	default:
	}
	// The thread may hold another device's context (a call made from that
	// device's doHere fn): it gets it back after.
	var prev CUcontext
	if err := d.drv.check("cuCtxGetCurrent", d.drv.cuCtxGetCurrent(&prev)); err != nil {
		return err
	}
	if err := d.drv.check("cuCtxSetCurrent", d.drv.cuCtxSetCurrent(d.ctx)); err != nil {
		return err
	}
	d.tid.Store(tid)
	defer func() {
		d.tid.Store(d.workerTid)
		if prev != d.ctx {
			err = errors.Join(err, d.drv.check("cuCtxSetCurrent", d.drv.cuCtxSetCurrent(prev)))
		}
	}()
	deviceJobs.Add(1)
	return fn()
}

// onThread reports whether the caller runs on the device thread: the
// device goroutine's, or a doHere caller's during its call. Either is
// locked to its goroutine meanwhile, so no other goroutine runs there.
func (d *Device) onThread() bool {
	tid := d.tid.Load()
	return tid > 0 && gettid() == tid
}

// Close waits for queued work, releases the primary context and stops the
// device goroutine. Modules and BLAS handles should be closed first.
// Calls after Close return ErrClosed.
func (d *Device) Close() error {
	d.closeOnce.Do(func() {
		close(d.quit)
		<-d.stopped
	})
	return d.closeErr
}

// Synchronize waits until all work queued on the device has finished and
// returns the first error of an asynchronous launch.
func (d *Device) Synchronize() error {
	return d.do(func() error {
		if d.capture != 0 {
			return ErrHostInCapture
		}
		return d.syncOnThread()
	})
}

// syncOnThread waits for all queued work, on the device thread.
func (d *Device) syncOnThread() error {
	d.tail = false
	d.waits.Add(1)
	return d.drv.check("cuCtxSynchronize", d.drv.cuCtxSynchronize())
}

// Name is the device's marketing name, e.g. "NVIDIA H100 80GB HBM3".
func (d *Device) Name() string { return d.name }

// SMs returns the device's number of streaming multiprocessors.
func (d *Device) SMs() int { return d.sms }

// ComputeCapability returns the major and minor compute capability.
func (d *Device) ComputeCapability() (major, minor int) { return d.major, d.minor }

// Arch is the NVRTC target, e.g. "sm_90".
func (d *Device) Arch() string { return fmt.Sprintf("sm_%d%d", d.major, d.minor) }

// TotalMem is the device's memory in bytes.
func (d *Device) TotalMem() int64 { return d.total }

// DriverVersion is the CUDA version the driver supports, as the driver
// encodes it: 1000·major + 10·minor (13000 for 13.0).
func (d *Device) DriverVersion() int { return d.driverVersion }

// Ordinal is the device index given to Open.
func (d *Device) Ordinal() int { return d.opts.Ordinal }

// Describe is a one-line summary for reports:
// "cuda: NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB, driver 13.0)".
func (d *Device) Describe() string {
	return fmt.Sprintf("cuda: %s (%s, %.1f GiB, driver %s)",
		d.name, d.Arch(), float64(d.total)/(1<<30), formatVersion(d.driverVersion))
}

func formatVersion(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }
