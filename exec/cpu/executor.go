package cpu

import (
	"context"
	"slices"
	"sync"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// buf is a dense row-major value: f for floating-point dtypes, i for int64.
type buf struct {
	shape []int
	f     []float32
	i     []int64
	half  graph.DType // a 16-bit parameter's dtype: f is a rounded copy of its host tensor
}

func newBuf(t graph.Type, shape []int) *buf {
	b := &buf{shape: shape}
	if t.DType == graph.Int64 {
		b.i = make([]int64, graph.Numel(shape))
	} else {
		b.f = make([]float32, graph.Numel(shape))
	}
	return b
}

// Executor evaluates graphs on the CPU. Every buffer it uses is accounted
// in a caching allocator (on a simulated device by default), so measured
// peaks can be compared with the planner's predictions.
type Executor struct {
	once     sync.Once // makes the zero Executor usable
	mu       sync.Mutex
	a        *alloc.Allocator // fixed once set: read without mu
	resident exec.Residents[*buf]
	offload  exec.OffloadHost // an offloaded optimizer's host memory (Go heap)
}

// Unlimited is the capacity of the default accounting device: 1 EiB.
const Unlimited = 1 << 60

// New returns a CPU executor accounting on an unlimited simulated device.
func New() *Executor {
	return NewOn(alloc.New(alloc.NewSimBackend(Unlimited), alloc.Options{}))
}

// NewOn returns a CPU executor accounting its buffers in a.
func NewOn(a *alloc.Allocator) *Executor { return &Executor{a: a} }

func (e *Executor) allocator() *alloc.Allocator {
	e.once.Do(func() {
		if e.a == nil { // the zero Executor
			e.a = alloc.New(alloc.NewSimBackend(Unlimited), alloc.Options{})
		}
	})
	return e.a
}

// Allocator is the allocator the executor accounts in. It takes no lock,
// so an Update callback may read its stats mid-step.
func (e *Executor) Allocator() *alloc.Allocator { return e.allocator() }

// Workspace is the CPU kernels' workspace rule (exec.Executor).
func (e *Executor) Workspace() planner.WorkspaceFunc { return Workspace }

// Overhead is 0: the CPU holds nothing outside its programs.
func (e *Executor) Overhead() int64 { return 0 }

// Reserve is 0: the CPU's simulated device has no driver (exec.Executor).
func (e *Executor) Reserve() int64 { return 0 }

// SyncParams does nothing: the host tensors are the parameters (an
// offloaded step copies its masters into them).
func (e *Executor) SyncParams() error { return nil }

// UploadParams makes the next step and evaluation read the host tensors
// as they are now (a checkpoint loaded between steps). Float32
// parameters need nothing: their host tensors are the parameters. A
// 16-bit one (a frozen base stored in bfloat16) is held as a rounded copy,
// which is rounded again from its host tensor here, and an offloaded
// step's masters are read from the host tensors again.
func (e *Executor) UploadParams() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.offload.MarkStale()
	for _, rb := range e.resident.List() {
		v := rb.Val
		if rb.Key().Kind() != planner.BufParam || v == nil || !v.half.IsHalf() {
			continue
		}
		d, ok := rb.Key().Data().(*tensor.Dense)
		if !ok || d.Dtype() != tensor.Float32 || d.Size() != len(v.f) {
			return graph.Errorf(graph.ErrDType, "cpu: a 16-bit parameter's host tensor is not float32 of %d values", len(v.f))
		}
		copy(v.f, d.Float32s())
		exec.Round(v.half, v.f)
	}
	return nil
}

// OffloadPinned is the host memory the executor holds for an offloaded
// optimizer (exec.Options.Offload): masters, state and staging.
func (e *Executor) OffloadPinned() int64 { return e.offload.Pinned() }

// SyncState does nothing: the CPU's optimizers keep their state on the
// host, where optim.Common.State reads it.
func (e *Executor) SyncState() error { return nil }

var _ exec.Executor = (*Executor)(nil)

// Run evaluates g over its full batch.
func (e *Executor) Run(ctx context.Context, g *graph.Graph, outputs ...int) ([]*tensor.Dense, error) {
	return e.RunBatch(ctx, g, g.Batch(), nil, outputs...)
}

// RunBatch evaluates g for b samples. feed, when non-nil, may supply the
// data of any source node id (b samples for an input, values for a
// shape-only parameter); where it returns nil the source's own value is
// used.
func (e *Executor) RunBatch(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
	info, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		return nil, err
	}
	return e.RunAnalyzed(ctx, g, info, b, feed, outputs...)
}

// RunAnalyzed is RunBatch with the graph's analysis already made (callers
// cache it by graph signature). info must be Analyze(g, outputs...).
func (e *Executor) RunAnalyzed(ctx context.Context, g *graph.Graph, info *shapeinfer.Result, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
	if len(info.LastUse) != g.Len() || !slices.Equal(info.Outputs, outputs) {
		return nil, graph.Errorf(graph.ErrArity, "analysis of %d nodes with outputs %v does not match a graph of %d nodes with outputs %v",
			len(info.LastUse), info.Outputs, g.Len(), outputs)
	}
	return exec.RunOnce(ctx, e, g, info, b, feed, outputs)
}

func shapesOf(bs []*buf) [][]int {
	s := make([][]int, len(bs))
	for i, b := range bs {
		if b != nil {
			s[i] = b.shape
		}
	}
	return s
}

// bufOf and hostOf convert between the kernels' buf and exec.HostBuf,
// sharing the data.
func bufOf(h *exec.HostBuf) *buf  { return &buf{shape: h.Shape, f: h.F, i: h.I} }
func hostOf(b *buf) *exec.HostBuf { return &exec.HostBuf{Shape: b.shape, F: b.f, I: b.i} }
