package dist

import (
	"errors"
	"fmt"
)

// Errors of the package. Every error a Communicator, the rendezvous or a
// Trainer returns wraps one of these (or a library's own typed error,
// such as cuda.NCCLError), so callers test them with errors.Is.
var (
	// ErrTimeout: a collective, the rendezvous or a communicator's init
	// did not finish within its deadline (a peer died or hangs). The
	// communicator is aborted: every later call returns ErrAborted.
	ErrTimeout = errors.New("dist: deadline exceeded")
	// ErrAborted: the communicator was aborted (by Abort, by a peer's
	// failure or by the watchdog after a timeout).
	ErrAborted = errors.New("dist: communicator aborted")
	// ErrBadEnv: the rendezvous variables (RANK, WORLD_SIZE, LOCAL_RANK,
	// MASTER_ADDR, MASTER_PORT) are missing or inconsistent.
	ErrBadEnv = errors.New("dist: bad rendezvous environment")
	// ErrRendezvous: the rendezvous failed for a reason other than its
	// deadline (a peer sent a malformed id, the port is taken).
	ErrRendezvous = errors.New("dist: rendezvous failed")
	// ErrMismatch: ranks called collectives that do not pair up (another
	// operation, length or root at the same position).
	ErrMismatch = errors.New("dist: ranks disagree")
	// ErrClosed: the communicator was closed.
	ErrClosed = errors.New("dist: communicator closed")
	// ErrShard: the global batch cannot be split over the ranks (fewer
	// samples than ranks, or a rank's shard is not the size Shard gives).
	ErrShard = errors.New("dist: bad shard")
	// ErrStepApplied: a Trainer.Step failed after its optimizer update
	// had run on this rank (in the loss's all-reduce, which completes the
	// step): parameters and optimizer state hold the step, so retrying it
	// would apply it twice. A step error without it updated nothing on
	// this rank.
	ErrStepApplied = errors.New("dist: the step's update was applied")
	// ErrZeRO: a ZeRO configuration the trainer cannot run (a stage other
	// than 0–3, stage 3 on a CUDA session, an optimizer that clips by the
	// global norm but cannot take it from the ranks), or parameters other
	// than the ones its layout was made of.
	ErrZeRO = errors.New("dist: ZeRO")
)

// RankError is a failure that names the rank it was seen on and the
// collective that failed.
type RankError struct {
	Rank int
	Op   string
	Err  error
}

func (e *RankError) Error() string { return fmt.Sprintf("dist: rank %d: %s: %v", e.Rank, e.Op, e.Err) }
func (e *RankError) Unwrap() error { return e.Err }
