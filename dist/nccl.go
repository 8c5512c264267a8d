package dist

import (
	"context"
	"errors"
	"fmt"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/batchfit/batchfit/exec/cuda"
)

// NCCLOptions configures NewNCCL.
type NCCLOptions struct {
	// Timeout bounds every collective and the communicator's init
	// (DefaultTimeout if 0): a rank that waits longer aborts the
	// communicator (ncclCommAbort) and returns ErrTimeout.
	Timeout time.Duration
	// RendezvousTimeout bounds the exchange of the unique id (1 minute if
	// 0).
	RendezvousTimeout time.Duration
	// BucketBytes sizes the device staging buffer host data passes
	// through; give it the Trainer's Options.BucketBytes
	// (DefaultBucketBytes if 0).
	BucketBytes int64
}

// SelectDevice makes this process see only its own GPU, as ordinal 0 (the
// device a Session opens), before CUDA is initialised: with
// CUDA_VISIBLE_DEVICES unset it sets it to LOCAL_RANK; set to a list of
// more than one device, it keeps the LOCAL_RANK-th entry; set to one
// device, it leaves it (`batchfit launch` sets it per rank this way). It
// must run before anything in the process opens a CUDA device (NewNCCL
// calls it first); a world of one rank is left as it is.
func SelectDevice(e Env) error {
	if e.WorldSize <= 1 {
		return nil
	}
	v, ok := os.LookupEnv("CUDA_VISIBLE_DEVICES")
	if !ok {
		return os.Setenv("CUDA_VISIBLE_DEVICES", strconv.Itoa(e.LocalRank))
	}
	list := strings.Split(v, ",")
	if len(list) == 1 {
		return nil
	}
	if e.LocalRank >= len(list) {
		return fmt.Errorf("%w: LOCAL_RANK %d, but CUDA_VISIBLE_DEVICES=%q lists %d devices", ErrBadEnv, e.LocalRank, v, len(list))
	}
	return os.Setenv("CUDA_VISIBLE_DEVICES", strings.TrimSpace(list[e.LocalRank]))
}

// NewNCCL joins the job e describes over NCCL: it selects this rank's GPU
// (SelectDevice), opens it, exchanges the unique id through rank 0
// (ExchangeID) and initialises the communicator. Call it before making
// the rank's Trainer (or any Session): the Trainer's session then opens
// the same device, whose primary context the communicator shares, and
// plans around the memory NCCL took (Overhead).
func NewNCCL(ctx context.Context, e Env, o NCCLOptions) (Communicator, error) {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.RendezvousTimeout <= 0 {
		o.RendezvousTimeout = time.Minute
	}
	if o.BucketBytes <= 0 {
		o.BucketBytes = DefaultBucketBytes
	}
	if err := SelectDevice(e); err != nil {
		return nil, err
	}
	d, err := cuda.Open(cuda.Options{})
	if err != nil {
		return nil, err
	}
	var id []byte
	if e.Rank == 0 {
		if id, err = cuda.NCCLUniqueID(); err != nil {
			return nil, errors.Join(err, d.Close())
		}
	}
	if id, err = ExchangeID(ctx, e, id, time.Now().Add(o.RendezvousTimeout)); err != nil {
		return nil, errors.Join(err, d.Close())
	}
	c, err := d.NewNCCL(id, e.Rank, e.WorldSize, cuda.NCCLOptions{Timeout: o.Timeout, StagingBytes: o.BucketBytes})
	if err != nil {
		if errors.Is(err, cuda.ErrNCCLTimeout) {
			// The device's thread is stuck in ncclCommInitRank: leave it.
			return nil, &RankError{Rank: e.Rank, Op: "init", Err: fmt.Errorf("%w: %w", ErrTimeout, err)}
		}
		return nil, errors.Join(&RankError{Rank: e.Rank, Op: "init", Err: err}, d.Close())
	}
	return &ncclComm{c: c, d: d}, nil
}

// ncclComm is a Communicator over cuda.NCCL with the package's errors.
type ncclComm struct {
	c *cuda.NCCL
	d *cuda.Device
}

func (n *ncclComm) Rank() int       { return n.c.Rank() }
func (n *ncclComm) Size() int       { return n.c.Size() }
func (n *ncclComm) Overhead() int64 { return n.c.Overhead() }
func (n *ncclComm) Abort() error    { return n.c.Abort() }

func (n *ncclComm) AllReduceSum(ctx context.Context, buf []float32) error {
	return n.wrap("all-reduce", n.c.AllReduceSum(ctx, buf))
}

func (n *ncclComm) Broadcast(ctx context.Context, buf []float32, root int) error {
	return n.wrap("broadcast", n.c.Broadcast(ctx, buf, root))
}

func (n *ncclComm) ReduceScatterSum(ctx context.Context, send, recv []float32) error {
	if err := blocks(n.c.Rank(), "reduce-scatter", len(send), len(recv), n.c.Size()); err != nil {
		return err
	}
	return n.wrap("reduce-scatter", n.c.ReduceScatterSum(ctx, send, recv))
}

func (n *ncclComm) AllGather(ctx context.Context, send, recv []float32) error {
	if err := blocks(n.c.Rank(), "all-gather", len(recv), len(send), n.c.Size()); err != nil {
		return err
	}
	return n.wrap("all-gather", n.c.AllGather(ctx, send, recv))
}

// reduction is one step's exec.Reducer: NCCL sums on the device, each
// rank's gradients scaled by scale, with the package's errors.
func (n *ncclComm) reduction(ctx context.Context, scale float32) exec.Reducer {
	return &ncclReduction{n: n, r: n.c.NewReduction(ctx, scale)}
}

type ncclReduction struct {
	n *ncclComm
	r *cuda.Reduction
}

func (r *ncclReduction) Add(buf alloc.Ptr, count int64) error {
	return r.n.wrap("all-reduce", r.r.Add(buf, count))
}

func (r *ncclReduction) Wait() error { return r.n.wrap("all-reduce", r.r.Wait()) }

// Close destroys the communicator and closes its device handle (the
// primary context stays while a session holds it).
func (n *ncclComm) Close() error { return errors.Join(n.c.Close(), n.d.Close()) }

// wrap gives cuda's NCCL errors the package's sentinels.
func (n *ncclComm) wrap(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, cuda.ErrNCCLTimeout):
		err = fmt.Errorf("%w: %w", ErrTimeout, err)
	case errors.Is(err, cuda.ErrClosed):
		err = fmt.Errorf("%w: %w", ErrClosed, err)
	default: // aborted, an asynchronous NCCL error, a peer gone: the group is aborted
		err = fmt.Errorf("%w: %w", ErrAborted, err)
	}
	return &RankError{Rank: n.c.Rank(), Op: op, Err: err}
}
