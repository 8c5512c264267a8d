// Package dist is data-parallel training over several ranks: one process
// per GPU, the global batch split into contiguous
// shards, gradients made the whole batch's by an all-reduce before every
// optimizer step.
//
// The pieces:
//
//   - Communicator: AllReduceSum, Broadcast, ReduceScatterSum, AllGather
//     and Abort over float32 buffers, with a deadline on every call.
//     NewNCCL runs it over NCCL (exec/cuda's purego bindings of
//     libnccl.so.2); NewLocal is the in-process fake (ranks as
//     goroutines) that CPU tests and CPU data-parallel training use;
//     NewTCP is a host communicator across processes over TCP, through
//     torchrun's variables, with NewLocal's results bit for bit.
//   - Rendezvous by torchrun's conventions: EnvFromOS reads RANK,
//     WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; ExchangeID has
//     rank 0 serve the 128-byte NCCL unique id over TCP, the others dial
//     with retries, all before a deadline. `batchfit launch -n N -- prog`
//     starts N local processes with those variables set.
//   - Trainer: a rank's Session (its own plan within its own free memory,
//     its own chunks) plus a Communicator. Trainer.Step scales the
//     gradients of a mean loss by n_r/N (the rank's graph averaged over
//     its shard of n_r samples) and sums them over ranks in ~25 MiB
//     buckets, in reverse parameter order; every rank then runs the same
//     optimizer step. BroadcastParams starts every rank from rank 0's
//     parameters. TestGradientsEqualWholeBatch holds losses, gradients and
//     parameters to a single process's whole-batch run.
//   - ZeRO (Options.ZeRO): stage 1 shards the optimizer's state over the
//     ranks, stage 2 the gradients too (reduce-scattered), stage 3 the
//     parameters too (gathered ahead of each step's forward), over a flat
//     Layout of the parameters; on host copies, any communicator.
//     PlanZeRO plans one rank of the sharded layout (planner.Shard), the
//     communicator's overhead out of its budget; SaveSharded and
//     LoadSharded write a checkpoint shard per rank and read it back on
//     any world size.
//
// Memory: NCCL's own device buffers (and the communicator's staging
// buffer) are outside the session's allocator. NewNCCL measures them with
// cuMemGetInfo around its init and a warm-up collective
// (Communicator.Overhead); New takes them out of Options.Session.Budget,
// so each rank's plan holds predicted = measured for what its allocator
// reserves.
//
// Failure: every collective has a deadline. A rank that dies or hangs
// makes the others return an error wrapping ErrTimeout or ErrAborted
// within it; on NCCL a watchdog polls ncclCommGetAsyncError while a
// collective runs and calls ncclCommAbort at the deadline. A Step error
// before the optimizer update leaves the rank's parameters as they were
// (the step may be retried); after it, only the loss's all-reduce remains,
// which the caller's context no longer stops, and its failure wraps
// ErrStepApplied (do not retry). A loss over other rows than the rank's
// shard is ErrShard.
//
// Where gradients are summed: over NCCL with a CUDA session, on the
// device, in place, overlapping backward. The session's executor hands
// each gradient to the communicator's Reduction as soon as the launch
// that makes it is queued (exec.Options.Reduce; when the rank's step runs
// in several chunks, after the last one's accumulation); full buckets go
// to NCCL as one group on the communicator's own stream, ordered after
// the gradients by an event, and each rank's gradients are multiplied by
// n_r/N inside the sum (NCCL's PreMulSum). The optimizer then runs on the
// device. With the in-process fake, or a CPU session, the sums run on
// host copies of the gradients inside the optimizer step. See the
// README's "Data parallel" section for what has run where.
package dist
