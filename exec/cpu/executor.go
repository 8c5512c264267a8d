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

// SyncParams does nothing: the host tensors are the parameters.
func (e *Executor) SyncParams() error { return nil }

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
	p, chunks, err := exec.Single(g, info, b, Workspace, outputs)
	if err != nil {
		return nil, err
	}
	res, err := e.Execute(ctx, p, chunks, ExecOptions{Feed: feed})
	if err != nil {
		return nil, err
	}
	return res.Outputs, nil
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

// eval dispatches one node to its kernel. The switch names every op; its
// default is an error so a new op cannot run unimplemented.
func eval(nd *graph.Node, in []*buf, out *buf, chunkStart int) error {
	a := &nd.Attrs
	if nd.Op == graph.OpDropout {
		return dropoutKernel(a, nd.Type, chunkStart, in[0], out)
	}
	if nd.Op == graph.OpCausalMask {
		return causalMaskKernel(a.Scalar, in[0], out)
	}
	switch nd.Op.Category() {
	case graph.CatUnary, graph.CatScalar:
		return unaryKernel(nd.Op, a, in[0], out)
	case graph.CatBinary:
		return binaryKernel(nd.Op, in[0], in[1], out)
	case graph.CatGrad:
		return gradKernel(nd, in, out)
	}
	switch nd.Op {
	case graph.OpMatMul:
		return matmulKernel(a.TransA, a.TransB, in[0], in[1], out)
	case graph.OpLinear:
		return linearKernel(in[0], in[1], optional(in, 2), out)
	case graph.OpSum, graph.OpMean, graph.OpMax:
		return reduceKernel(nd.Op, a, in[0], out)
	case graph.OpSoftmax, graph.OpLogSoftmax:
		return softmaxKernel(nd.Op == graph.OpLogSoftmax, a.Axis, in[0], out)
	case graph.OpLayerNorm:
		return layerNormKernel(a, in[0], optional(in, 1), optional(in, 2), out)
	case graph.OpBatchNorm:
		return batchNormKernel(a, in, out)
	case graph.OpReshape:
		return reshapeKernel(in[0], out)
	case graph.OpPermute:
		return permuteKernel(a.Perm, in[0], out)
	case graph.OpSlice:
		return sliceKernel(a, in[0], out)
	case graph.OpConcat:
		return concatKernel(a.Axis, in, out)
	case graph.OpEmbedding:
		return embeddingKernel(in[0], in[1], out)
	case graph.OpConv2d:
		return conv2dKernel(a, in[0], in[1], optional(in, 2), out)
	case graph.OpMaxPool2d:
		return maxPool2dKernel(a, in[0], out)
	case graph.OpAvgPool2d:
		return avgPool2dKernel(a, in[0], out)
	case graph.OpCrossEntropy:
		return crossEntropyKernel(a, in[0], in[1], out)
	case graph.OpMSE:
		return mseKernel(a, in[0], in[1], out)
	case graph.OpFill:
		for i := range out.f {
			out.f[i] = float32(a.Scalar)
		}
		return nil
	}
	return graph.Errorf(graph.ErrAttr, "cpu executor has no kernel for op %s", nd.Op)
}

func optional(in []*buf, i int) *buf {
	if i < len(in) {
		return in[i]
	}
	return nil
}
