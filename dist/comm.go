package dist

import (
	"context"
	"time"
)

// DefaultTimeout bounds every collective unless Options say otherwise: a
// rank that waits longer for its peers gets ErrTimeout and aborts the
// communicator.
const DefaultTimeout = 5 * time.Minute

// Communicator is a group of ranks that reduce and broadcast float32
// buffers. NCCL (NewNCCL), the in-process fake (NewLocal) and TCP
// (NewTCP) implement it.
//
// Buffers are host slices: parameters at the start (BroadcastParams), the
// loss, and the gradients of a step whose optimizer runs on the host. A
// CUDA session's gradients are summed on the device instead, through the
// NCCL communicator's device reduction (see Trainer.Step). Every rank
// must call the same collectives in the same order with the same lengths
// (and root); a call waits for all ranks, at most the communicator's
// timeout, then returns an error wrapping ErrTimeout and aborts the group.
// A Communicator is used from one goroutine at a time; Abort may be called
// from any goroutine at any time.
type Communicator interface {
	// Rank is this rank's index in [0, Size).
	Rank() int
	// Size is the number of ranks (the world size).
	Size() int
	// AllReduceSum replaces buf on every rank by the element-wise sum of
	// every rank's buf.
	AllReduceSum(ctx context.Context, buf []float32) error
	// Broadcast replaces buf on every rank by root's buf.
	Broadcast(ctx context.Context, buf []float32, root int) error
	// ReduceScatterSum sums send over the ranks and gives each rank its
	// block of the sum: send holds Size() blocks of len(recv) values, and
	// recv on rank r becomes the element-wise sum of every rank's block r
	// (ncclReduceScatter). ZeRO's gradients are summed this way.
	ReduceScatterSum(ctx context.Context, send, recv []float32) error
	// AllGather concatenates every rank's send in rank order into recv,
	// which holds Size() blocks of len(send) values (ncclAllGather).
	// ZeRO's parameter shards are gathered this way.
	AllGather(ctx context.Context, send, recv []float32) error
	// Abort fails every pending and later collective of the group, on
	// every rank (ErrAborted), without waiting for peers.
	Abort() error
	// Overhead is the device memory the communicator holds outside every
	// allocator (NCCL's buffers and its staging buffer), measured at init:
	// a Trainer counts it in its session's budget. 0 for the fake.
	Overhead() int64
	// Close releases the communicator (ncclCommDestroy). Later calls
	// return ErrClosed.
	Close() error
}
