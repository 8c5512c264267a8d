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

	ncclScalarHostImmediate = 1 // ncclScalarResidence_t: the scalar is read from host memory at the call

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
	// ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
	//     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
	ncclReduceScatter func(send, recv CUdeviceptr, recvcount uintptr, dtype, op int32, comm ncclComm, stream uintptr) ncclResult
	// ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
	//     ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
	ncclAllGather func(send, recv CUdeviceptr, sendcount uintptr, dtype int32, comm ncclComm, stream uintptr) ncclResult
	// ncclResult_t ncclGroupStart(void), ncclGroupEnd(void)
	ncclGroupStart func() ncclResult
	ncclGroupEnd   func() ncclResult
	// ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar,
	//     ncclDataType_t datatype, ncclScalarResidence_t residence, ncclComm_t comm)
	ncclRedOpCreatePreMulSum func(op *int32, scalar *float32, dtype, residence int32, comm ncclComm) ncclResult
	// ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm)
	ncclRedOpDestroy func(op int32, comm ncclComm) ncclResult
	// const char *ncclGetErrorString(ncclResult_t result)
	ncclGetErrorString func(r ncclResult) *byte
	// const char *ncclGetLastError(ncclComm_t comm)
	ncclGetLastError func(comm ncclComm) *byte

	// From libcuda: CUresult cuStreamQuery(CUstream hStream), which the
	// watchdog polls instead of blocking in cuStreamSynchronize; and the
	// communicator's own stream: cuStreamDestroy_v2(CUstream hStream),
	// cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags).
	cuStreamQuery     func(stream uintptr) cuResult
	cuStreamDestroy   func(stream uintptr) cuResult
	cuStreamWaitEvent func(stream uintptr, ev CUevent, flags uint32) cuResult
	// CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int
	// flags, int priority) and cuCtxGetStreamPriorityRange(int
	// *leastPriority, int *greatestPriority): the communicator's stream
	// gets the greatest priority, so the sums' blocks are scheduled ahead
	// of backward's as SMs free up.
	cuStreamCreateWithPriority  func(stream *uintptr, flags uint32, priority int32) cuResult
	cuCtxGetStreamPriorityRange func(least, greatest *int32) cuResult
}

const (
	cuStreamNonBlocking  = 0x1 // CU_STREAM_NON_BLOCKING: no implicit sync with stream 0
	cuEventDisableTiming = 0x2 // CU_EVENT_DISABLE_TIMING
)

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
		sym(&n.ncclReduceScatter, "ncclReduceScatter"),
		sym(&n.ncclAllGather, "ncclAllGather"),
		sym(&n.ncclGroupStart, "ncclGroupStart"),
		sym(&n.ncclGroupEnd, "ncclGroupEnd"),
		sym(&n.ncclRedOpCreatePreMulSum, "ncclRedOpCreatePreMulSum"),
		sym(&n.ncclRedOpDestroy, "ncclRedOpDestroy"),
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
			err = bind(cu, []symbol{sym(&n.cuStreamQuery, "cuStreamQuery"),
				sym(&n.cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy"), sym(&n.cuStreamWaitEvent, "cuStreamWaitEvent"),
				sym(&n.cuStreamCreateWithPriority, "cuStreamCreateWithPriority"),
				sym(&n.cuCtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange")})
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
	stageN   int     // float32 elements in staging
	stream   uintptr // every collective runs here (non-blocking: no implicit sync with stream 0; the greatest priority)
	overhead int64

	abortReq atomic.Bool // Abort asked the polling loop to abort
	aborted  atomic.Bool // ncclCommAbort was called
	closed   atomic.Bool
}

// NewNCCL joins rank of a size-rank communicator identified by id on
// device d (ncclCommInitRank), allocates the staging buffer and runs a
// warm-up of each collective (all-reduce, broadcast, reduce-scatter,
// all-gather), and measures the device memory all of that took
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
		var least, greatest int32
		if err := d.drv.check("cuCtxGetStreamPriorityRange", n.cuCtxGetStreamPriorityRange(&least, &greatest)); err != nil {
			return err
		}
		if err := d.drv.check("cuStreamCreateWithPriority", n.cuStreamCreateWithPriority(&c.stream, cuStreamNonBlocking, greatest)); err != nil {
			return err
		}
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
	if err == nil && c.stageN >= size { // ZeRO's collectives, so their buffers are measured too
		mine := c.staging + CUdeviceptr(4*rank)
		err = c.run(context.Background(), "ncclReduceScatter", func(s uintptr) ncclResult {
			return n.ncclReduceScatter(c.staging, mine, 1, ncclFloat32, ncclSum, c.comm, s)
		})
		if err == nil {
			err = c.run(context.Background(), "ncclAllGather", func(s uintptr) ncclResult {
				return n.ncclAllGather(mine, c.staging, 1, ncclFloat32, c.comm, s)
			})
		}
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

// run enqueues a collective on the communicator's stream from the device
// thread and waits for it (wait).
func (c *NCCL) run(ctx context.Context, fn string, enqueue func(stream uintptr) ncclResult) error {
	if err := c.usable(); err != nil {
		return err
	}
	if err := c.d.do(func() error {
		if err := c.n.check(fn, enqueue(c.stream), c.comm); err != nil {
			return errors.Join(err, c.abortNow())
		}
		return nil
	}); err != nil {
		return err
	}
	return c.wait(ctx, fn)
}

// wait polls the communicator's stream until what it holds is done,
// failing on an asynchronous error, the deadline, ctx or Abort, in which
// case it aborts the communicator. The polls back off from 1 µs to
// 100 µs, so a collective's end is seen within about 100 µs.
func (c *NCCL) wait(ctx context.Context, fn string) error {
	deadline := time.Now().Add(c.timeout)
	return c.d.do(func() error {
		for wait := time.Microsecond; ; wait = min(2*wait, 100*time.Microsecond) {
			switch r := c.n.cuStreamQuery(c.stream); r {
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

// ReduceScatterSum sums send (Size() blocks of len(recv) values) over the
// ranks and gives this rank its block of the sum in recv, through the
// staging buffer in pieces of at most StagingBytes/Size() values per
// block (ncclReduceScatter in place: each piece's Size() blocks are packed
// into the staging buffer, and this rank's block of the result is read
// back from its place there).
func (c *NCCL) ReduceScatterSum(ctx context.Context, send, recv []float32) error {
	if err := c.usable(); err != nil {
		return err
	}
	m := len(recv)
	if len(send) != m*c.size {
		return &NCCLError{Func: "ncclReduceScatter", Code: 4, Name: ncclResultNames[4],
			Msg: fmt.Sprintf("send of %d values is not %d blocks of recv's %d", len(send), c.size, m)}
	}
	k := max(c.stageN/c.size, 1)
	for off := 0; off < m; off += k {
		n := min(k, m-off)
		for r := range c.size {
			if err := CopyHtoD(c.d, alloc.Ptr(c.staging)+alloc.Ptr(4*r*n), send[r*m+off:r*m+off+n]); err != nil {
				return err
			}
		}
		mine := c.staging + CUdeviceptr(4*c.rank*n)
		if err := c.run(ctx, "ncclReduceScatter", func(s uintptr) ncclResult {
			return c.n.ncclReduceScatter(c.staging, mine, uintptr(n), ncclFloat32, ncclSum, c.comm, s)
		}); err != nil {
			return err
		}
		if err := CopyDtoH(c.d, recv[off:off+n], alloc.Ptr(mine)); err != nil {
			return err
		}
	}
	return nil
}

// AllGather concatenates every rank's send, in rank order, into recv
// (Size() blocks of len(send) values), through the staging buffer in
// pieces as ReduceScatterSum (ncclAllGather in place).
func (c *NCCL) AllGather(ctx context.Context, send, recv []float32) error {
	if err := c.usable(); err != nil {
		return err
	}
	m := len(send)
	if len(recv) != m*c.size {
		return &NCCLError{Func: "ncclAllGather", Code: 4, Name: ncclResultNames[4],
			Msg: fmt.Sprintf("recv of %d values is not %d blocks of send's %d", len(recv), c.size, m)}
	}
	k := max(c.stageN/c.size, 1)
	for off := 0; off < m; off += k {
		n := min(k, m-off)
		mine := c.staging + CUdeviceptr(4*c.rank*n)
		if err := CopyHtoD(c.d, alloc.Ptr(mine), send[off:off+n]); err != nil {
			return err
		}
		if err := c.run(ctx, "ncclAllGather", func(s uintptr) ncclResult {
			return c.n.ncclAllGather(mine, c.staging, uintptr(n), ncclFloat32, c.comm, s)
		}); err != nil {
			return err
		}
		for r := range c.size {
			if err := CopyDtoH(c.d, recv[r*m+off:r*m+off+n], alloc.Ptr(c.staging)+alloc.Ptr(4*r*n)); err != nil {
				return err
			}
		}
	}
	return nil
}

// ReduceScatterDevice sums the device buffer send (Size()·recvcount
// float32 values) over the ranks into recv (recvcount values, this rank's
// block of the sum) on the communicator's own stream, after everything
// queued on stream 0 so far, and waits for it with the deadline, abort and
// asynchronous-error checks of every collective. recv may be send's block
// of this rank (in place). Both buffers are the caller's (allocated by the
// session's allocator, so its plans count them).
func (c *NCCL) ReduceScatterDevice(ctx context.Context, send, recv alloc.Ptr, recvcount int64) error {
	return c.runAfterStream0(ctx, "ncclReduceScatter", func(s uintptr) ncclResult {
		return c.n.ncclReduceScatter(CUdeviceptr(send), CUdeviceptr(recv), uintptr(recvcount), ncclFloat32, ncclSum, c.comm, s)
	})
}

// AllGatherDevice gathers every rank's device buffer send (sendcount
// float32 values) into recv (Size()·sendcount values, in rank order) on
// the communicator's own stream, as ReduceScatterDevice. send may be
// recv's block of this rank (in place).
func (c *NCCL) AllGatherDevice(ctx context.Context, send, recv alloc.Ptr, sendcount int64) error {
	return c.runAfterStream0(ctx, "ncclAllGather", func(s uintptr) ncclResult {
		return c.n.ncclAllGather(CUdeviceptr(send), CUdeviceptr(recv), uintptr(sendcount), ncclFloat32, c.comm, s)
	})
}

// runAfterStream0 is run with the communicator's stream first waiting
// for what stream 0 holds now (an event), so the collective sees the
// executor's results.
func (c *NCCL) runAfterStream0(ctx context.Context, fn string, enqueue func(stream uintptr) ncclResult) error {
	if err := c.usable(); err != nil {
		return err
	}
	if err := c.d.do(func() error { return c.waitStream0() }); err != nil {
		return err
	}
	return c.run(ctx, fn, enqueue)
}

// waitStream0 makes the communicator's stream wait for the work queued on
// stream 0 so far; on the device thread.
func (c *NCCL) waitStream0() error {
	var ev CUevent
	if err := c.d.drv.check("cuEventCreate", c.d.drv.cuEventCreate(&ev, cuEventDisableTiming)); err != nil {
		return err
	}
	err := c.d.drv.check("cuEventRecord", c.d.drv.cuEventRecord(ev, 0))
	if err == nil {
		err = c.d.drv.check("cuStreamWaitEvent", c.n.cuStreamWaitEvent(c.stream, ev, 0))
	}
	// Destroying an event a stream still waits on is allowed: its
	// resources go when the wait is over.
	return errors.Join(err, c.d.drv.check("cuEventDestroy", c.d.drv.cuEventDestroy(ev)))
}

// Reduction sums device buffers over the ranks in place, each rank's
// values multiplied by its own scale first (NCCL's PreMulSum; a plain sum
// when the scale is 1), on the communicator's own stream so the sums run
// beside the executor's work: it implements exec.Reducer. Add gathers
// buffers into buckets of the communicator's StagingBytes; a full bucket
// goes out as one NCCL group, ordered after everything queued on stream 0
// so far (an event the communicator's stream waits on). Wait sends the
// rest and polls the stream until every sum is in place, with the
// deadline, abort and asynchronous-error checks of every collective. One
// Reduction serves one step, from one goroutine.
type Reduction struct {
	c       *NCCL
	ctx     context.Context
	scale   float32
	op      int32
	opMade  bool
	bufs    []alloc.Ptr
	counts  []int64
	bytes   int64
	started bool
	done    bool
}

// NewReduction starts a reduction whose buffers are scaled by scale.
func (c *NCCL) NewReduction(ctx context.Context, scale float32) *Reduction {
	return &Reduction{c: c, ctx: ctx, scale: scale, op: ncclSum}
}

// Add queues count float32 elements at buf; a full bucket is enqueued.
func (r *Reduction) Add(buf alloc.Ptr, count int64) error {
	if r.done {
		return &NCCLError{Func: "ncclAllReduce", Code: 5, Name: ncclResultNames[5], Msg: "Add after Wait"}
	}
	r.bufs, r.counts, r.bytes = append(r.bufs, buf), append(r.counts, count), r.bytes+4*count
	if r.bytes >= 4*int64(r.c.stageN) {
		return r.flush()
	}
	return nil
}

// flush enqueues the gathered buffers as one group on the communicator's
// stream, after the work queued on stream 0 so far.
func (r *Reduction) flush() error {
	if len(r.bufs) == 0 {
		return nil
	}
	if err := r.c.usable(); err != nil {
		return err
	}
	bufs, counts := r.bufs, r.counts
	r.bufs, r.counts, r.bytes = nil, nil, 0
	c := r.c
	err := c.d.do(func() error {
		if r.scale != 1 && !r.opMade {
			s := r.scale
			if err := c.n.check("ncclRedOpCreatePreMulSum", c.n.ncclRedOpCreatePreMulSum(&r.op, &s, ncclFloat32, ncclScalarHostImmediate, c.comm), c.comm); err != nil {
				return err
			}
			r.opMade = true
		}
		// The sums must see the gradients: the communicator's stream waits
		// for what stream 0 holds now.
		if err := c.waitStream0(); err != nil {
			return err
		}
		r.started = true
		if err := c.n.check("ncclAllReduce", allReduceGroup(c, bufs, counts, r.op), c.comm); err != nil {
			return errors.Join(err, c.abortNow())
		}
		return nil
	})
	return err
}

// allReduceGroup enqueues one in-place all-reduce per buffer on the
// communicator's stream, in one NCCL group; the first failure's code.
func allReduceGroup(c *NCCL, bufs []alloc.Ptr, counts []int64, op int32) ncclResult {
	if r := c.n.ncclGroupStart(); r != ncclSuccess {
		return r
	}
	var first ncclResult
	for i, p := range bufs {
		if counts[i] <= 0 {
			continue
		}
		if r := c.n.ncclAllReduce(CUdeviceptr(p), CUdeviceptr(p), uintptr(counts[i]), ncclFloat32, op, c.comm, c.stream); r != ncclSuccess && first == ncclSuccess {
			first = r
		}
	}
	// The group must be closed even after a failed call in it.
	if r := c.n.ncclGroupEnd(); first == ncclSuccess {
		first = r
	}
	return first
}

// Wait enqueues the last bucket and returns when every sum is in place.
// The executor's later launches on stream 0 come after it returns, so
// they see the sums.
func (r *Reduction) Wait() error {
	if r.done {
		return nil
	}
	err := r.flush()
	r.done = true
	if err == nil && r.started {
		err = r.c.wait(r.ctx, "ncclAllReduce")
	}
	if r.opMade && !r.c.aborted.Load() { // an abort freed the communicator and its ops
		c := r.c
		err = errors.Join(err, c.d.do(func() error { return c.n.check("ncclRedOpDestroy", c.n.ncclRedOpDestroy(r.op, c.comm), c.comm) }))
	}
	return err
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
		if c.stream != 0 {
			err = errors.Join(err, c.d.drv.check("cuStreamDestroy", c.n.cuStreamDestroy(c.stream)))
			c.stream = 0
		}
		return err
	})
}
