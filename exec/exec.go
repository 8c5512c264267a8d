package exec

import (
	"context"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// Executor runs graphs and compiled programs: the seam a Session uses.
// exec/cpu and exec/cuda implement it; each supplies device memory and
// kernels, and this package the host side they share.
type Executor interface {
	// Run evaluates g with the data held by its source nodes and returns the
	// values of outputs, in order.
	Run(ctx context.Context, g *graph.Graph, outputs ...int) ([]*tensor.Dense, error)
	// Execute runs program p for chunks through the executor's allocator
	// (planner.Replay with hooks that compute). p must be compiled with
	// the executor's Workspace.
	Execute(ctx context.Context, p *planner.Program, chunks []planner.Chunk, o Options) (*Result, error)
	// Workspace is the executor's kernel workspace rule, compiled into
	// every program it runs.
	Workspace() planner.WorkspaceFunc
	// Allocator is the allocator every device byte of the executor comes
	// from.
	Allocator() *alloc.Allocator
	// Overhead is the bytes the allocator holds outside every program
	// (library workspaces).
	Overhead() int64
	// Reserve is the device memory a plan must leave free for the
	// driver's own use (cuda.DriverReserve; 0 on the CPU).
	Reserve() int64
	// SyncParams brings trained parameters' host tensors up to date.
	SyncParams() error
	// SyncState brings the host copies of optimizer state kept on the
	// device up to date in their optimizers (optim.Common.State), for a
	// checkpoint; state kept on the host (the CPU's) needs nothing.
	SyncState() error
	// Held lists the buffers the executor keeps resident, in allocation
	// order (PlanResidents tells a plan about them). The slice may be
	// shared with later calls: callers must not modify it.
	Held() []Held
	// ReleaseUnread frees the resident constants that p does not read,
	// before p runs; it reports whether it freed any.
	ReleaseUnread(p *planner.Program) (bool, error)
	// Close releases the executor's device memory.
	Close() error
	Yielder
}

// Yielder is an executor that can hand its device memory back between
// steps and take it again (pytorch_memlab's Courtesy). Yield keeps host
// copies of everything that must survive (parameters, constants, optimizer
// state held on the device), frees every block the executor keeps resident
// and empties its allocator's cache. Restore allocates those blocks again,
// in the order they were first allocated, and refills them, so the next
// step runs as if Yield had never happened: the same values, and the
// allocator in the state a first step's persistent allocations leave, so
// planned peaks are measured again. A resident run while yielded restores
// first.
type Yielder interface {
	Yield() error
	Restore() error
	Yielded() bool
}

// Options configures Execute. Both executors take the same options; the
// ones about device copies do nothing on the CPU, whose memory is the
// host's.
type Options struct {
	// Feed supplies the data of a source node (the whole batch for an
	// input); where it returns nil, or is nil, the node's own value is used.
	Feed func(id int) tensor.Tensor
	// Resident keeps parameters, constants and optimizer state allocated
	// across calls, keyed by their host tensors, as a training loop does;
	// otherwise they are freed when the call ends. A resident parameter is
	// not uploaded again: after a device-side update the device holds its
	// current value and the host tensor is stale unless SyncParams is set.
	Resident bool
	// Optimizer, when set, updates the program's trained parameters from
	// their gradients (p.Trained[i] from p.Kept[i]) after the last chunk.
	// On the CPU it updates the host tensors. On CUDA *optim.SGD and
	// *optim.Adam run on the device with the sgd_multi_f32 and
	// adam_multi_f32 kernels (one launch per 64 parameters), from the plan
	// the optimizer makes (PlanDevice, CommitDevice: per-parameter steps,
	// groups, the schedule, clipping), reading every per-step value from
	// the device scalars in the program's finish workspace (compiled with
	// planner.CompileOptions.OptimizerScalars, as a Session's steps are;
	// without them the step fails with graph.ErrAttr): parameters and
	// their state stay there (state in the program's BufState buffers,
	// owned by the optimizer that last stepped them; the optimizer's host
	// State is empty until SyncState). Other optimizers run on the host:
	// gradients and parameters are downloaded, Step updates the host
	// tensors, and the parameters are uploaded again.
	Optimizer optim.Optimizer
	// Update is called with host copies of the final kept outputs (summed
	// over chunks; on the CPU the slices alias them): the trained
	// parameters' host tensors are brought up to date first, Update may
	// change them in place, and (on CUDA) they are uploaded again after it.
	// It takes precedence over Optimizer.
	Update func(kept [][]float32) error
	// SyncParams downloads the trained parameters into their host tensors
	// after a device-side update, so host and device agree. Without it a
	// resident parameter's device copy is newer than its host tensor until
	// Executor.SyncParams.
	SyncParams bool
	// KeptOnDevice leaves the kept outputs (the gradients) on the device
	// when nothing on the host needs them (no Update, and no optimizer or
	// one that runs on the device): Result.Outputs holds nil in their
	// places. A training loop sets it, since downloading every gradient
	// every step costs as much as the step itself on a large model. The
	// CPU returns them regardless.
	KeptOnDevice bool
	// OpTime, when set, reports every node's device time per chunk, after
	// the step (CUDA: events recorded around its launches, with no
	// synchronisation between nodes).
	OpTime func(nd *graph.Node, c planner.Chunk, d time.Duration)
	// UpdateTime, when set, reports the device time of the step's end,
	// after its last chunk (the gradients' reduction, the loss scale's
	// unscale and check, the optimizer's update), once the step is done:
	// what OpTime's nodes leave out. CUDA: two events around it; CPU: its
	// wall time.
	UpdateTime func(d time.Duration)
	// Timeline records the allocator's state after every program step in
	// Result.Usage.Timeline: the measured counterpart of a plan's timeline.
	Timeline bool
	// Reduce, when set, sums the final kept outputs (float32 gradients)
	// over data-parallel ranks in place on the device, before the loss
	// scale's unscale and check and before Update or Optimizer (package
	// dist, through NCCL). With one chunk each gradient is handed to
	// Reduce.Add as soon as the launch that makes it is queued, so the
	// sums overlap the rest of backward; with several, after the last
	// chunk's accumulation. Finish then calls Reduce.Wait. Only the CUDA
	// executor takes it; the CPU executor refuses a call that sets it
	// (dist reduces host gradients in the optimizer step instead).
	Reduce Reducer
	// LossScale, when not 0, is the loss scale S of dynamic loss scaling
	// (precision.Scaler): the kept outputs are gradients of the loss
	// multiplied by S. After the last chunk, before Update or Optimizer,
	// every kept output is multiplied in place by float32(1/S) (exact when
	// S is a power of two) and checked for infinities and NaNs: on CUDA by
	// the grad_unscale_f32 kernel over all of them, which sets a flag in the
	// program's finish workspace, read once; on the CPU on the host. If any
	// value is not finite, Result.Skipped is set and neither Update nor
	// Optimizer runs: parameters and optimizer state (its step count
	// included) stay as they were. The program must be compiled with
	// planner.CompileOptions.FinishWorkspace = UnscaleBytes, so the flag
	// is planned like any buffer. Kept outputs returned to the host hold
	// the unscaled values.
	LossScale float32
	// Offload runs Optimizer on the host (ZeRO-Offload): p must be
	// compiled with planner.CompileOptions.Offload, its trained
	// parameters and their gradients bfloat16 on the device, the
	// optimizer an *optim.Adam. After the last chunk each gradient is
	// copied to host memory the executor holds (OffloadHost: the float32
	// masters, the optimizer state and a staging buffer per parameter,
	// page-locked on CUDA), the masters are updated there on every core
	// (optim.Adam.StepOffload), and the new weights, rounded to bfloat16,
	// are copied back over the device's parameters. Result.Usage.
	// HostPinned is the host memory held. SyncParams copies the masters
	// into the host tensors (the CPU does after every step), UploadParams
	// reads them from there again. It takes no LossScale and no Reduce.
	Offload bool
}

// Reducer sums gradients over the ranks of a data-parallel job, on the
// device, in place (Options.Reduce; dist's NCCL communicator makes one per
// step).
type Reducer interface {
	// Add hands over one final gradient: count float32 elements at buf.
	// The reducer may start summing it once the work queued so far on the
	// executor's stream is done, and returns without waiting for that.
	Add(buf alloc.Ptr, count int64) error
	// Wait starts whatever Add handed over that is not started yet and
	// returns when every sum is in place: the executor's next launches
	// (the optimizer) see the summed values.
	Wait() error
}

// UnscaleBytes is the finish workspace (planner.CompileOptions.
// FinishWorkspace) a program run with Options.LossScale needs: the 4-byte
// inf/NaN flag the CUDA unscale kernel sets. The CPU needs none, but its
// simulated device accounts for it as CUDA's does, so plans agree.
const UnscaleBytes = 4

// Result is what Execute returns.
type Result struct {
	// Outputs holds the program's outputs combined over chunks: per-sample
	// values concatenated along their batch axis, sums added, maxima
	// maxed; kept outputs are their final sums.
	Outputs []*tensor.Dense
	// Usage is the allocator's measured peak over the call (Overhead
	// included), and its timeline when Options.Timeline is set.
	Usage planner.Usage
	// Skipped reports that the update did not run: under
	// Options.LossScale, a kept output held an inf or NaN once unscaled.
	Skipped bool
}

// Budget is the device memory a plan may reserve on e: what its device
// has free, less Reserve, plus what its allocator reserves already (its
// cache and its resident blocks, which a plan counts again), less
// Overhead, which is reserved but outside every plan.
func Budget(e Executor) (int64, error) {
	a := e.Allocator()
	free, _, err := a.Backend().MemInfo()
	if err != nil {
		return 0, err
	}
	return free - e.Reserve() + a.Stats().ReservedBytes[alloc.All].Current - e.Overhead(), nil
}

// HostParams pairs p's trained parameters with their gradients for a
// host-side optimizer step: the data of each parameter's host tensor
// (source gives it), which Step updates in place.
func HostParams(p *planner.Program, source func(id int) tensor.Tensor, grads [][]float32) ([]optim.Param, error) {
	if len(grads) != len(p.Trained) {
		return nil, graph.Errorf(graph.ErrArity, "the optimizer updates %d trained parameters from %d kept outputs; they must pair up",
			len(p.Trained), len(grads))
	}
	ps := make([]optim.Param, len(p.Trained))
	for i, id := range p.Trained {
		nd := p.Graph.Node(id)
		data, err := ParamData(nd, source(id))
		if err != nil {
			return nil, err
		}
		ps[i] = optim.Param{Key: source(id), Name: nd.Name, Data: data, Grad: grads[i]}
	}
	return ps, nil
}
