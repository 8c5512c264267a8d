package dist

import (
	"context"
	"errors"
	"fmt"
	"github.com/batchfit/batchfit/exec"
	"time"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// Shard is rank's contiguous part [lo, hi) of a global batch of n samples
// split over size ranks: the first n mod size ranks get one sample more,
// so shard sizes differ by at most one. n must be at least size (every
// rank needs a sample: its graph has a batch axis); otherwise the error
// wraps ErrShard.
func Shard(n, rank, size int) (lo, hi int, err error) {
	if size <= 0 || rank < 0 || rank >= size || n < size {
		return 0, 0, fmt.Errorf("%w: %d samples over %d ranks (rank %d); every rank needs one", ErrShard, n, size, rank)
	}
	q, r := n/size, n%size
	lo = rank*q + min(rank, r)
	hi = lo + q
	if rank < r {
		hi++
	}
	return lo, hi, nil
}

// Options configures a Trainer.
type Options struct {
	// Session configures the rank's own session (its device, precision,
	// budget). A Budget is the rank's whole budget: the communicator's
	// Overhead is taken out of it before the session sees it.
	Session batchfit.Options
	// BucketBytes is the gradient bytes per all-reduce
	// (DefaultBucketBytes if 0).
	BucketBytes int64
	// SumLoss says the loss sums over samples (graph.ReduceSum) instead of
	// averaging (ReduceMean, the default). See Trainer.Step.
	SumLoss bool
	// ZeRO shards the training state over the ranks: ZeRO1 the
	// optimizer's state, ZeRO2 the gradients too, ZeRO3 the parameters
	// too (ZeROOff, 0: replicated). The sums, the update and the gathers
	// run on host copies (see Trainer.Step); stage 3 needs a CPU session.
	// An optimizer that clips by the global norm (optim.Common.Clip) gets
	// every rank's part of the norm (optim.Common.SetNormOf); one that
	// clips but cannot take the norm so is refused (ErrZeRO). A wrapper
	// around an optimizer hides both from the trainer: clip with the
	// optimizer itself.
	ZeRO int
}

// Trainer is one rank of data-parallel training: a Session that plans and
// runs this rank's shard of the batch in the chunks its own free memory
// allows, and a Communicator that makes the gradients the whole global
// batch's before every optimizer step. Every rank runs the same optimizer
// step on the same gradients from the same parameters (broadcast from rank
// 0 by BroadcastParams), so parameters stay identical on every rank.
type Trainer struct {
	comm Communicator
	sess *batchfit.Session
	opts Options
	wait time.Duration // the last step's time blocked on communication
	z    zero
}

// LastWait is how long the last Step waited on communication after its
// session's own work was queued: the device reduction's Wait (the sums
// that did not finish beside backward) plus the loss's all-reduce; with a
// host reduction, the whole of it. A data-parallel step costs a single
// GPU's step of the shard plus about this.
func (t *Trainer) LastWait() time.Duration { return t.wait }

// New makes the rank's session. With Options.Session.Budget set, the
// session gets Budget − comm.Overhead(): NCCL's device buffers lie outside
// the session's allocator, so the plan counts them as stated overhead and
// predicted = measured holds per rank. Without a budget the session reads
// cuMemGetInfo, from which NCCL's buffers are already gone.
func New(comm Communicator, o Options) (*Trainer, error) {
	if comm == nil {
		return nil, errors.New("dist: nil communicator")
	}
	so := o.Session
	if so.Budget > 0 {
		so.Budget -= comm.Overhead()
		if so.Budget <= 0 {
			return nil, fmt.Errorf("%w: budget %d B leaves nothing beside the communicator's %d B", planner.ErrBudget, o.Session.Budget, comm.Overhead())
		}
	}
	s := batchfit.NewSession(so)
	if err := s.Err(); err != nil {
		return nil, err
	}
	if err := checkZeRO(o, s.OnCUDA()); err != nil {
		return nil, errors.Join(err, s.Close())
	}
	return &Trainer{comm: comm, sess: s, opts: o, z: zero{stage: o.ZeRO}}, nil
}

// Session is the rank's session (its plans, usage, allocator).
func (t *Trainer) Session() *batchfit.Session { return t.sess }

// Comm is the trainer's communicator.
func (t *Trainer) Comm() Communicator { return t.comm }

// Shard is this rank's part of a global batch of n samples.
func (t *Trainer) Shard(n int) (lo, hi int, err error) { return Shard(n, t.comm.Rank(), t.comm.Size()) }

// Close closes the session (syncing parameters to the host), not the
// communicator, which the caller owns. Under ZeRO stage 3 the host
// tensors are whole only after GatherParams (a collective, which Close
// does not run).
func (t *Trainer) Close() error { return t.sess.Close() }

// BroadcastParams gives every rank rank 0's parameter values (their host
// tensors, float32). Call it before the first Step: from then on the
// session's device copies are the parameters, and a host tensor changed
// later is not uploaded again.
func (t *Trainer) BroadcastParams(ctx context.Context, params []*lazy.Tensor) error {
	bufs, err := hostData(params)
	if err != nil {
		return err
	}
	return broadcastBuckets(ctx, t.comm, bufs, 0, t.opts.BucketBytes)
}

func hostData(params []*lazy.Tensor) ([][]float32, error) {
	bufs := make([][]float32, len(params))
	for i, p := range params {
		v := p.Value()
		if v == nil {
			return nil, fmt.Errorf("dist: parameter %d (%q) has no host tensor", i, p.Name())
		}
		d, ok := v.Data().([]float32)
		if !ok {
			return nil, fmt.Errorf("dist: parameter %d (%q) is %T, want float32 data", i, p.Name(), v.Data())
		}
		bufs[i] = d
	}
	return bufs, nil
}

// Step runs one data-parallel training step. loss is this rank's loss over
// its shard of a global batch of globalN samples (Shard says which rows),
// built as a single process would build it over the whole batch; params
// and opt are as in Session.Step. It returns the global batch's loss,
// identical on every rank.
//
// Gradient scaling: a mean loss over the shard is scaled by 1/n_r (its
// graph was built with the shard's count), and the whole batch's is
// Σ_r (n_r/N)·mean_r. So each rank multiplies its summed-over-chunks
// gradients by n_r/N, and the all-reduce sums them: exactly the global
// batch's gradient, whatever the chunks and shard sizes
// (TestGradientsEqualWholeBatch holds it to 1e-6). A summed loss
// (Options.SumLoss) needs no scale. The loss is reduced the same way.
//
// Where the gradients are summed: with an NCCL communicator and a CUDA
// session, on the device, where the gradients are. The session hands
// each gradient to NCCL as soon as the launch that makes it is queued
// (when the rank's step runs in one chunk; after the last chunk's
// accumulation otherwise), in buckets of Options.BucketBytes, each summed
// on NCCL's own stream while backward goes on; the optimizer then runs on
// the device as in a single-GPU session (exec.Options.Reduce). Otherwise
// (the in-process fake, a CPU session) the sums run in the optimizer
// step, on the host copies of the gradients, bucket by bucket in reverse
// parameter order.
//
// Under ZeRO (Options.ZeRO) the host path runs whatever the communicator
// and session: the gradients are all-reduced (stage 1) or reduce-scattered
// (stages 2, 3) on host copies, in pieces of Options.BucketBytes over all
// ranks' blocks, the caller's optimizer updates this rank's pieces of the
// flat Layout (keyed by ShardKey), and the updated shards are
// all-gathered (stages 1, 2) or kept as the parameters of record and
// gathered ahead of the next step's forward (stage 3). A failure in that
// all-gather, after the update, wraps ErrStepApplied.
//
// A step that fails on this rank for a reason of its own (its graph, its
// memory) aborts the communicator, so the other ranks' steps return
// ErrAborted at once instead of waiting for their deadline. loss must
// cover this rank's shard exactly (its graph's batch is hi − lo of
// Shard): another batch would scale its gradients wrongly, and is
// ErrShard before anything runs.
//
// Faults and retries: ctx bounds the step up to its update. The gradients
// are summed before the optimizer runs, so an error until then (ctx's
// end, a peer's failure, this rank's own) has updated nothing on this
// rank and the step may be retried. After the update only the loss's
// all-reduce remains; it runs even if ctx has ended meanwhile (bounded by
// the communicator's deadline), and if it fails (a peer died after its
// update) the error wraps ErrStepApplied: parameters and optimizer state
// hold the step, and retrying it would apply it twice.
func (t *Trainer) Step(ctx context.Context, globalN int, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) (float32, error) {
	l, err := t.step(ctx, globalN, loss, params, opt)
	if err != nil {
		_ = t.comm.Abort() // the error that matters is err
	}
	return l, err
}

func (t *Trainer) step(ctx context.Context, globalN int, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) (float32, error) {
	lo, hi, err := t.Shard(globalN)
	if err != nil {
		return 0, err
	}
	if opt == nil {
		return 0, errors.New("dist: nil optimizer")
	}
	if err := loss.Err(); err != nil {
		return 0, err
	}
	if g := loss.Graph(); g != nil && g.IR().Batch() != hi-lo {
		return 0, fmt.Errorf("%w: rank %d's loss covers %d rows; its shard of %d samples is rows [%d, %d), %d rows",
			ErrShard, t.comm.Rank(), g.IR().Batch(), globalN, lo, hi, hi-lo)
	}
	scale := float32(1)
	if !t.opts.SumLoss {
		scale = float32(hi-lo) / float32(globalN)
	}
	var l float32
	if t.z.stage != ZeROOff {
		l, t.wait, err = t.zeroStep(ctx, loss, params, opt, scale)
	} else if dc, ok := t.comm.(deviceComm); ok && t.sess.OnCUDA() {
		// The gradients stay on the device: NCCL sums them in place
		// between backward and the optimizer, which the session runs there
		// (or on the host after a download, for optimizers without device
		// kernels).
		red := &timedReducer{Reducer: dc.reduction(ctx, scale)}
		l, err = t.sess.StepWith(ctx, loss, params, opt, batchfit.StepOptions{Reduce: red})
		t.wait = red.wait
	} else {
		r := &reducer{Optimizer: opt, ctx: ctx, t: t, scale: scale}
		l, err = t.sess.Step(ctx, loss, params, r)
		t.wait = r.wait
	}
	if err != nil {
		return 0, err
	}
	// The update has run: the loss's all-reduce completes the step on
	// every rank whatever ctx does now, within the communicator's deadline.
	buf := []float32{l * scale}
	start := time.Now()
	if err := t.comm.AllReduceSum(context.WithoutCancel(ctx), buf); err != nil {
		return 0, fmt.Errorf("%w (do not retry it): the loss's all-reduce failed: %w", ErrStepApplied, err)
	}
	t.wait += time.Since(start)
	return buf[0], nil
}

// deviceComm is a Communicator that also sums buffers on the device
// (NCCL): a CUDA session's gradients are reduced where they are.
type deviceComm interface {
	reduction(ctx context.Context, scale float32) exec.Reducer
}

// timedReducer times an exec.Reducer's Wait.
type timedReducer struct {
	exec.Reducer
	wait time.Duration
}

func (r *timedReducer) Wait() error {
	start := time.Now()
	err := r.Reducer.Wait()
	r.wait = time.Since(start)
	return err
}

// reducer is the optimizer the session runs: it makes the gradients the
// global batch's, then steps the caller's optimizer.
type reducer struct {
	optim.Optimizer
	ctx   context.Context
	t     *Trainer
	scale float32
	wait  time.Duration
}

func (r *reducer) Step(params []optim.Param) error {
	grads := make([][]float32, len(params))
	for i, p := range params {
		grads[i] = p.Grad
	}
	start := time.Now()
	if err := reduceBuckets(r.ctx, r.t.comm, grads, r.scale, r.t.opts.BucketBytes); err != nil {
		return err
	}
	r.wait = time.Since(start)
	return r.Optimizer.Step(params)
}
