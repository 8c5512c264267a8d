package cuda

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/batchfit/batchfit/alloc"
)

// NCCL through purego: libnccl.so.2 is dlopened on first use (never in
// init), like libcublas. Communicators run every call on their Device's
// locked thread, where the primary context is current, on the legacy
// default stream (stream 0) that the executor launches on.

type (
	ncclComm   uintptr // ncclComm_t
	ncclResult int32   // ncclResult_t
)

// ncclUniqueID is ncclUniqueId: 128 opaque bytes, passed by value to
// ncclCommInitRank (in memory on the stack under the SysV ABI; purego
// places structs as the C compiler does).
type ncclUniqueID struct{ Internal [NCCLIDSize]byte }

// NCCLIDSize is the size of an NCCL unique id.
const NCCLIDSize = 128

// ncclDataType_t, ncclRedOp_t and ncclResult_t values (nccl.h).
const (
	ncclFloat32 = 7
	ncclSum     = 0

	ncclSuccess    = 0
	ncclInProgress = 7

	cudaErrorNotReady = 600 // CUDA_ERROR_NOT_READY from cuStreamQuery
)

var ncclResultNames = map[int]string{
	0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
	4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}

// NCCLError is a failed NCCL call (or an asynchronous error that
// ncclCommGetAsyncError reported).
type NCCLError struct {
	Func string // e.g. "ncclAllReduce"
	Code int    // the ncclResult_t
	Name string // e.g. "ncclRemoteError"
	Msg  string // ncclGetLastError's text, when there is one
}

func (e *NCCLError) Error() string {
	s := fmt.Sprintf("nccl: %s: %s (%d)", e.Func, e.Name, e.Code)
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Errors of NCCL communicators.
var (
	// ErrNCCLTimeout: a collective (or init) did not finish within the
	// communicator's timeout; the communicator was aborted.
	ErrNCCLTimeout = errors.New("nccl: deadline exceeded")
	// ErrNCCLAborted: the communicator was aborted (Abort, or an earlier
	// timeout or asynchronous error).
	ErrNCCLAborted = errors.New("nccl: communicator aborted")
)

// ncclLib holds the libnccl.so.2 entry points; C signatures in comments.
type ncclLib struct {
	// ncclResult_t ncclGetVersion(int *version)
	ncclGetVersion func(v *int32) ncclResult
	// ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)
	ncclGetUniqueId func(id *ncclUniqueID) ncclResult
	// ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
	ncclCommInitRank func(comm *ncclComm, nranks int32, id ncclUniqueID, rank int32) ncclResult
	// ncclResult_t ncclCommDestroy(ncclComm_t comm)
	ncclCommDestroy func(comm ncclComm) ncclResult
	// ncclResult_t ncclCommAbort(ncclComm_t comm)
	ncclCommAbort func(comm ncclComm) ncclResult
	// ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
	ncclCommGetAsyncError func(comm ncclComm, r *ncclResult) ncclResult
	// ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
	//     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
	ncclAllReduce func(send, recv CUdeviceptr, count uintptr, dtype, op int32, comm ncclComm, stream uintptr) ncclResult
	// ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
	//     ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
	ncclBroadcast func(send, recv CUdeviceptr, count uintptr, dtype, root int32, comm ncclComm, stream uintptr) ncclResult
	// ncclResult_t ncclGroupStart(void), ncclGroupEnd(void)
	ncclGroupStart func() ncclResult
	ncclGroupEnd   func() ncclResult
	// const char *ncclGetErrorString(ncclResult_t result)
	ncclGetErrorString func(r ncclResult) *byte
	// const char *ncclGetLastError(ncclComm_t comm)
	ncclGetLastError func(comm ncclComm) *byte

	// CUresult cuStreamQuery(CUstream hStream), from libcuda: the watchdog
	// polls the stream instead of blocking in cuStreamSynchronize.
	cuStreamQuery func(stream uintptr) cuResult
}

func (n *ncclLib) symbols() []symbol {
	return []symbol{
		sym(&n.ncclGetVersion, "ncclGetVersion"),
		sym(&n.ncclGetUniqueId, "ncclGetUniqueId"),
		sym(&n.ncclCommInitRank, "ncclCommInitRank"),
		sym(&n.ncclCommDestroy, "ncclCommDestroy"),
		sym(&n.ncclCommAbort, "ncclCommAbort"),
		sym(&n.ncclCommGetAsyncError, "ncclCommGetAsyncError"),
		sym(&n.ncclAllReduce, "ncclAllReduce"),
		sym(&n.ncclBroadcast, "ncclBroadcast"),
		sym(&n.ncclGroupStart, "ncclGroupStart"),
		sym(&n.ncclGroupEnd, "ncclGroupEnd"),
		sym(&n.ncclGetErrorString, "ncclGetErrorString"),
		sym(&n.ncclGetLastError, "ncclGetLastError"),
	}
}

func (n *ncclLib) check(fn string, r ncclResult, comm ncclComm) error {
	if r == ncclSuccess {
		return nil
	}
	e := &NCCLError{Func: fn, Code: int(r), Name: ncclResultNames[int(r)]}
	if e.Name == "" {
		e.Name = goString(n.ncclGetErrorString(r))
	}
	if comm != 0 {
		e.Msg = goString(n.ncclGetLastError(comm))
	}
	return e
}

var ncclOnce struct {
	sync.Once
	n       *ncclLib
	version int
	err     error
}

// ncclEnvDefaults are set in the process environment before NCCL loads,
// unless already set: NVLink SHARP (multicast) stays off, as the GPU
// machines require, and connections are made at init, so the memory
// measured there is all NCCL takes.
var ncclEnvDefaults = [][2]string{{"NCCL_NVLS_ENABLE", "0"}, {"NCCL_RUNTIME_CONNECT", "0"}}

// loadNCCL dlopens libnccl.so.2 and binds its functions, once. Failures
// wrap ErrNoLibrary (and ErrNoGPU when the driver is missing).
func loadNCCL() (*ncclLib, error) {
	ncclOnce.Do(func() {
		if _, err := loadDriver(); err != nil {
			ncclOnce.err = err
			return
		}
		for _, kv := range ncclEnvDefaults {
			if _, ok := os.LookupEnv(kv[0]); !ok {
				_ = os.Setenv(kv[0], kv[1])
			}
		}
		lib, err := dlopen("libnccl.so.2", "libnccl.so")
		if err != nil {
			ncclOnce.err = fmt.Errorf("%w: cannot load libnccl.so.2: %v", ErrNoLibrary, err)
			return
		}
		n := new(ncclLib)
		if err := bind(lib, n.symbols()); err != nil {
			ncclOnce.err = fmt.Errorf("%w: libnccl.so.2: %v", ErrNoLibrary, err)
			return
		}
		cu, err := dlopen("libcuda.so.1")
		if err == nil {
			err = bind(cu, []symbol{sym(&n.cuStreamQuery, "cuStreamQuery")})
		}
		if err != nil {
			ncclOnce.err = fmt.Errorf("%w: libcuda.so.1: %v", ErrNoGPU, err)
			return
		}
		var v int32
		if err := n.check("ncclGetVersion", n.ncclGetVersion(&v), 0); err != nil {
			ncclOnce.err = err
			return
		}
		ncclOnce.n, ncclOnce.version = n, int(v)
	})
	return ncclOnce.n, ncclOnce.err
}

// NCCLVersion is the loaded library's version code (22803 for 2.28.3).
func NCCLVersion() (int, error) {
	_, err := loadNCCL()
	return ncclOnce.version, err
}

// NCCLUniqueID returns a new unique id (ncclGetUniqueId), which rank 0
// hands to every rank before NewNCCL.
func NCCLUniqueID() ([]byte, error) {
	n, err := loadNCCL()
	if err != nil {
		return nil, err
	}
	var id ncclUniqueID
	if err := n.check("ncclGetUniqueId", n.ncclGetUniqueId(&id), 0); err != nil {
		return nil, err
	}
	return id.Internal[:], nil
}

// NCCLOptions configures NewNCCL.
type NCCLOptions struct {
	// Timeout bounds init and every collective; after it the communicator
	// is aborted (ncclCommAbort) and the call returns ErrNCCLTimeout.
	// 5 minutes if 0.
	Timeout time.Duration
	// StagingBytes is the device buffer host data passes through (a
	// gradient bucket's size); 25 MiB if 0.
	StagingBytes int64
}

// NCCL is one rank of an NCCL communicator over host float32 buffers:
// each call copies through a device staging buffer, runs the collective on
// stream 0 and polls it (cuStreamQuery, ncclCommGetAsyncError) until it
// finishes, the deadline passes or Abort is called; then it aborts the
// communicator. Use it from one goroutine at a time; Abort from any.
type NCCL struct {
	d        *Device
	n        *ncclLib
	comm     ncclComm
	rank     int
	size     int
	timeout  time.Duration
	staging  CUdeviceptr
	stageN   int // float32 elements in staging
	overhead int64

	abortReq atomic.Bool // Abort asked the polling loop to abort
	aborted  atomic.Bool // ncclCommAbort was called
	closed   atomic.Bool
}

// NewNCCL joins rank of a size-rank communicator identified by id on
// device d (ncclCommInitRank), allocates the staging buffer and runs a
// warm-up all-reduce, and measures the device memory all of that took
// (cuMemGetInfo before and after): Overhead. ncclCommInitRank waits for
// every rank; if they do not all arrive within the timeout NewNCCL returns
// ErrNCCLTimeout, leaving the device's thread blocked in NCCL (exit the
// process).
func (d *Device) NewNCCL(id []byte, rank, size int, o NCCLOptions) (*NCCL, error) {
	n, err := loadNCCL()
	if err != nil {
		return nil, err
	}
	if len(id) != NCCLIDSize || size <= 0 || rank < 0 || rank >= size {
		return nil, &NCCLError{Func: "ncclCommInitRank", Code: 4, Name: ncclResultNames[4],
			Msg: fmt.Sprintf("id of %d bytes, rank %d of %d", len(id), rank, size)}
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Minute
	}
	if o.StagingBytes <= 0 {
		o.StagingBytes = 25 << 20
	}
	c := &NCCL{d: d, n: n, rank: rank, size: size, timeout: o.Timeout, stageN: int(o.StagingBytes / 4)}
	var uid ncclUniqueID
	copy(uid.Internal[:], id)
	var before uintptr
	done := make(chan error, 1)
	go func() {
		done <- d.do(func() error {
			var total uintptr
			if err := d.drv.check("cuMemGetInfo_v2", d.drv.cuMemGetInfo(&before, &total)); err != nil {
				return err
			}
			return n.check("ncclCommInitRank", n.ncclCommInitRank(&c.comm, int32(size), uid, int32(rank)), 0)
		})
	}()
	select {
	case err := <-done:
		if err != nil {
			return nil, err
		}
	case <-time.After(o.Timeout):
		return nil, fmt.Errorf("%w: ncclCommInitRank (rank %d of %d) waited %v for its peers", ErrNCCLTimeout, rank, size, o.Timeout)
	}
	err = d.do(func() error {
		return d.drv.check("cuMemAlloc_v2", d.drv.cuMemAlloc(&c.staging, uintptr(c.stageN)*4))
	})
	if err == nil { // warm-up: NCCL connects its channels and allocates its buffers
		err = c.run(context.Background(), "ncclAllReduce", func(s uintptr) ncclResult {
			return n.ncclAllReduce(c.staging, c.staging, uintptr(c.stageN), ncclFloat32, ncclSum, c.comm, s)
		})
	}
	if err == nil {
		err = c.run(context.Background(), "ncclBroadcast", func(s uintptr) ncclResult {
			return n.ncclBroadcast(c.staging, c.staging, 1, ncclFloat32, 0, c.comm, s)
		})
	}
	if err == nil {
		err = d.do(func() error {
			var after, total uintptr
			if err := d.drv.check("cuMemGetInfo_v2", d.drv.cuMemGetInfo(&after, &total)); err != nil {
				return err
			}
			c.overhead = int64(before) - int64(after)
			return nil
		})
	}
	if err != nil {
		return nil, errors.Join(err, c.Abort(), c.Close())
	}
	return c, nil
}

// Rank and Size are the communicator's rank and number of ranks.
func (c *NCCL) Rank() int { return c.rank }

// Size is the number of ranks.
func (c *NCCL) Size() int { return c.size }

// Overhead is the device memory NCCL and the staging buffer took at init,
// from cuMemGetInfo: outside every allocator.
func (c *NCCL) Overhead() int64 { return c.overhead }

// run enqueues a collective on stream 0 from the device thread and polls
// it until it completes, failing on an asynchronous error, the deadline,
// ctx or Abort, in which case it aborts the communicator.
func (c *NCCL) run(ctx context.Context, fn string, enqueue func(stream uintptr) ncclResult) error {
	if err := c.usable(); err != nil {
		return err
	}
	deadline := time.Now().Add(c.timeout)
	return c.d.do(func() error {
		if err := c.n.check(fn, enqueue(0), c.comm); err != nil {
			return errors.Join(err, c.abortNow())
		}
		for wait := time.Microsecond; ; wait = min(2*wait, time.Millisecond) {
			switch r := c.n.cuStreamQuery(0); r {
			case cudaSuccess:
				return nil
			case cudaErrorNotReady:
			default:
				return errors.Join(c.d.drv.check("cuStreamQuery", r), c.abortNow())
			}
			var async ncclResult
			if err := c.n.check("ncclCommGetAsyncError", c.n.ncclCommGetAsyncError(c.comm, &async), c.comm); err != nil {
				return errors.Join(err, c.abortNow())
			}
			if async != ncclSuccess && async != ncclInProgress {
				return errors.Join(c.n.check(fn+" (async)", async, c.comm), c.abortNow())
			}
			switch {
			case c.abortReq.Load():
				return errors.Join(ErrNCCLAborted, c.abortNow())
			case ctx.Err() != nil:
				return errors.Join(fmt.Errorf("%w: %s: %w", ErrNCCLAborted, fn, ctx.Err()), c.abortNow())
			case time.Now().After(deadline):
				return errors.Join(fmt.Errorf("%w: %s (rank %d of %d) waited %v", ErrNCCLTimeout, fn, c.rank, c.size, c.timeout), c.abortNow())
			}
			time.Sleep(wait)
		}
	})
}

// usable is ErrClosed after Close, ErrNCCLAborted after an abort, else nil.
func (c *NCCL) usable() error {
	switch {
	case c.closed.Load():
		return ErrClosed
	case c.aborted.Load():
		return ErrNCCLAborted
	}
	return nil
}

// abortNow calls ncclCommAbort once; on the device thread.
func (c *NCCL) abortNow() error {
	if c.aborted.Swap(true) {
		return nil
	}
	return c.n.check("ncclCommAbort", c.n.ncclCommAbort(c.comm), 0)
}

// AllReduceSum replaces buf by its sum over the ranks, through the
// staging buffer in pieces of at most StagingBytes.
func (c *NCCL) AllReduceSum(ctx context.Context, buf []float32) error {
	return c.staged(ctx, buf, "ncclAllReduce", func(count uintptr, s uintptr) ncclResult {
		return c.n.ncclAllReduce(c.staging, c.staging, count, ncclFloat32, ncclSum, c.comm, s)
	})
}

// Broadcast replaces buf by root's buf.
func (c *NCCL) Broadcast(ctx context.Context, buf []float32, root int) error {
	return c.staged(ctx, buf, "ncclBroadcast", func(count uintptr, s uintptr) ncclResult {
		return c.n.ncclBroadcast(c.staging, c.staging, count, ncclFloat32, int32(root), c.comm, s)
	})
}

func (c *NCCL) staged(ctx context.Context, buf []float32, fn string, op func(count, stream uintptr) ncclResult) error {
	// Before any copy: after Close the staging buffer is gone.
	if err := c.usable(); err != nil {
		return err
	}
	for off := 0; off < len(buf); off += c.stageN {
		piece := buf[off:min(off+c.stageN, len(buf))]
		if err := CopyHtoD(c.d, alloc.Ptr(c.staging), piece); err != nil {
			return err
		}
		if err := c.run(ctx, fn, func(s uintptr) ncclResult { return op(uintptr(len(piece)), s) }); err != nil {
			return err
		}
		if err := CopyDtoH(c.d, piece, alloc.Ptr(c.staging)); err != nil {
			return err
		}
	}
	return nil
}

// Abort aborts the communicator (ncclCommAbort): a collective in flight
// on this rank returns ErrNCCLAborted at its next poll, and the peers'
// collectives fail (or time out). Safe from any goroutine.
func (c *NCCL) Abort() error {
	c.abortReq.Store(true)
	if c.aborted.Load() || c.comm == 0 {
		return nil
	}
	return c.d.do(c.abortNow)
}

// Close destroys the communicator (ncclCommDestroy, or nothing after an
// abort, which freed it) and frees the staging buffer. It does not close
// the Device.
func (c *NCCL) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	return c.d.do(func() error {
		var err error
		if !c.aborted.Swap(true) && c.comm != 0 {
			err = c.n.check("ncclCommDestroy", c.n.ncclCommDestroy(c.comm), 0)
		}
		if c.staging != 0 {
			err = errors.Join(err, c.d.drv.check("cuMemFree_v2", c.d.drv.cuMemFree(c.staging)))
			c.staging = 0
		}
		return err
	})
}
