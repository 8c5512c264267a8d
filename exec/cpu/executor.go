package cpu

import (
	"context"
	"fmt"
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
	once         sync.Once // makes the zero Executor usable
	mu           sync.Mutex
	a            *alloc.Allocator // fixed once set: read without mu
	resident     map[residentKey]*residentBuf
	residentList []*residentBuf // in allocation order, for Restore
	yielded      bool
}

// Unlimited is the capacity of the default accounting device: 1 EiB.
const Unlimited = 1 << 60

// New returns a CPU executor accounting on an unlimited simulated device.
func New() *Executor {
	return NewOn(alloc.New(alloc.NewSimBackend(Unlimited), alloc.Options{}))
}

// NewOn returns a CPU executor accounting its buffers in a.
func NewOn(a *alloc.Allocator) *Executor {
	return &Executor{a: a, resident: map[residentKey]*residentBuf{}}
}

func (e *Executor) allocator() *alloc.Allocator {
	e.once.Do(func() {
		if e.a == nil { // the zero Executor
			e.a = alloc.New(alloc.NewSimBackend(Unlimited), alloc.Options{})
			e.resident = map[residentKey]*residentBuf{}
		}
	})
	return e.a
}

// Allocator is the allocator the executor accounts in. It takes no lock,
// so an Update callback may read its stats mid-step.
func (e *Executor) Allocator() *alloc.Allocator { return e.allocator() }

var (
	_ exec.Executor = (*Executor)(nil)
	_ exec.Yielder  = (*Executor)(nil)
)

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
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Workspace: Workspace})
	if err != nil {
		return nil, err
	}
	n := g.Batch()
	if n == 0 { // no batched input: one run of the constants
		n, b = 1, 1
	}
	p.Batch = n
	res, err := e.Execute(ctx, p, []planner.Chunk{{Size: b}}, ExecOptions{Feed: feed})
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

// fromTensor copies a source's data, checking it against the node's type.
func fromTensor(nd *graph.Node, t tensor.Tensor, shape []int) (*buf, error) {
	what := fmt.Sprintf("%s %q (node %d)", nd.Op, nd.Name, nd.ID)
	if t == nil {
		return nil, graph.Errorf(graph.ErrNoData, "%s has no data (shape-only graph)", what)
	}
	got := []int(t.Shape())
	if t.Shape().IsScalar() {
		got = []int{}
	}
	if shape == nil { // any shape: the caller checks
		shape = got
	} else if !slices.Equal(got, shape) {
		return nil, graph.Errorf(graph.ErrShape, "%s: data shape %v, want %v", what, got, shape)
	}
	b := &buf{shape: shape}
	switch data := t.Data().(type) {
	case []float32:
		if nd.Type.DType != graph.Float32 {
			return nil, graph.Errorf(graph.ErrDType, "%s: float32 data for a %s node", what, nd.Type.DType)
		}
		b.f = contiguous(t, data).([]float32)
	case []int64:
		if nd.Type.DType != graph.Int64 {
			return nil, graph.Errorf(graph.ErrDType, "%s: int64 data for a %s node", what, nd.Type.DType)
		}
		b.i = contiguous(t, data).([]int64)
	case float32:
		b.f = []float32{data}
	case int64:
		b.i = []int64{data}
	default:
		return nil, graph.Errorf(graph.ErrDType, "%s: unsupported data %T", what, data)
	}
	return b, nil
}

// contiguous returns row-major data of t; views are materialised.
func contiguous(t tensor.Tensor, data any) any {
	if d, ok := t.(*tensor.Dense); ok && d.IsMaterializable() {
		if m, ok := d.Materialize().(*tensor.Dense); ok {
			return m.Data()
		}
	}
	return data
}

func toDense(b *buf) *tensor.Dense {
	if b.f == nil {
		return tensor.New(tensor.WithShape(b.shape...), tensor.WithBacking(b.i))
	}
	return tensor.New(tensor.WithShape(b.shape...), tensor.WithBacking(b.f))
}
