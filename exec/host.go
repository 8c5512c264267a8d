package exec

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// HostBuf is a dense row-major value in host memory: F for floating-point
// dtypes, I for int64.
type HostBuf struct {
	Shape []int
	F     []float32
	I     []int64

	moments *moments // Combine's float64 state of a CombineMoments output
}

// NewHostBuf returns a zeroed value of dtype dt and the given shape.
func NewHostBuf(dt graph.DType, shape []int) *HostBuf {
	b := &HostBuf{Shape: shape}
	if dt == graph.Int64 {
		b.I = make([]int64, graph.Numel(shape))
	} else {
		b.F = make([]float32, graph.Numel(shape))
	}
	return b
}

// Dense wraps b's data, without a copy.
func (b *HostBuf) Dense() *tensor.Dense {
	if b.F == nil {
		return tensor.New(tensor.WithShape(b.Shape...), tensor.WithBacking(b.I))
	}
	return tensor.New(tensor.WithShape(b.Shape...), tensor.WithBacking(b.F))
}

// FromTensor reads a source's data, checking it against the node's type;
// shape nil accepts any shape (the caller checks). Row-major data is used
// in place; views are materialised.
func FromTensor(nd *graph.Node, t tensor.Tensor, shape []int) (*HostBuf, error) {
	what := fmt.Sprintf("%s %q (node %d)", nd.Op, nd.Name, nd.ID)
	if t == nil {
		return nil, graph.Errorf(graph.ErrNoData, "%s has no data (shape-only graph)", what)
	}
	got := []int(t.Shape())
	if t.Shape().IsScalar() {
		got = []int{}
	}
	if shape == nil {
		shape = got
	} else if !slices.Equal(got, shape) {
		return nil, graph.Errorf(graph.ErrShape, "%s: data shape %v, want %v", what, got, shape)
	}
	b := &HostBuf{Shape: shape}
	wrong := func(kind string) error {
		return graph.Errorf(graph.ErrDType, "%s: %s data for a %s node", what, kind, nd.Type.DType)
	}
	if graph.Numel(shape) == 0 {
		// gorgonia's Data panics on a tensor of no elements: check the
		// dtype from Dtype and hand back an empty buffer.
		switch dt := nd.Type.DType; {
		case t.Dtype() == tensor.Float32 && (dt == graph.Float32 || dt.IsHalf()):
			b.F = []float32{}
		case t.Dtype() == tensor.Int64 && dt == graph.Int64:
			b.I = []int64{}
		default:
			return nil, wrong(t.Dtype().String())
		}
		return b, nil
	}
	switch data := t.Data().(type) {
	case []float32:
		switch dt := nd.Type.DType; {
		case dt == graph.Float32:
			b.F = contiguous(t, data).([]float32)
		case dt.IsHalf(): // converted at the boundary: a rounded copy
			b.F = slices.Clone(contiguous(t, data).([]float32))
			Round(dt, b.F)
		default:
			return nil, wrong("float32")
		}
	case []int64:
		if nd.Type.DType != graph.Int64 {
			return nil, wrong("int64")
		}
		b.I = contiguous(t, data).([]int64)
	case float32:
		if dt := nd.Type.DType; dt != graph.Float32 && !dt.IsHalf() {
			return nil, wrong("float32")
		}
		b.F = []float32{data}
		Round(nd.Type.DType, b.F)
	case int64:
		if nd.Type.DType != graph.Int64 {
			return nil, wrong("int64")
		}
		b.I = []int64{data}
	default:
		return nil, graph.Errorf(graph.ErrDType, "%s: unsupported data %T", what, data)
	}
	if n := graph.Numel(shape); len(b.F) != n && len(b.I) != n {
		return nil, graph.Errorf(graph.ErrShape, "%s: %d values for shape %v", what, max(len(b.F), len(b.I)), shape)
	}
	return b, nil
}

// Round rounds every value of f in place to dt's precision when dt is a
// 16-bit float (round to nearest even, package half) and leaves f alone
// otherwise. Host-side executors store float16 and bfloat16 values as
// float32 holding exactly representable values: they call Round on every
// value such a node produces, where a device kernel stores its result.
func Round(dt graph.DType, f []float32) {
	switch dt {
	case graph.BFloat16:
		for i, x := range f {
			f[i] = half.RoundBF16(x)
		}
	case graph.Float16:
		for i, x := range f {
			f[i] = half.RoundF16(x)
		}
	}
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

// ParamData is the float32 storage of trained parameter nd's host tensor
// t, which a host-side optimizer updates in place.
func ParamData(nd *graph.Node, t tensor.Tensor) ([]float32, error) {
	d, ok := t.(*tensor.Dense)
	switch {
	case !ok || d == nil:
		return nil, graph.Errorf(graph.ErrNoData, "parameter %q (node %d) has no dense host data", nd.Name, nd.ID)
	case d.Dtype() != tensor.Float32:
		return nil, graph.Errorf(graph.ErrDType, "parameter %q (node %d) is %v, want float32", nd.Name, nd.ID, d.Dtype())
	case d.RequiresIterator():
		return nil, graph.Errorf(graph.ErrAttr, "parameter %q (node %d) is a transposed or strided view; materialize it before training", nd.Name, nd.ID)
	}
	f := d.Float32s()
	if len(f) != nd.Type.Numel() {
		return nil, graph.Errorf(graph.ErrShape, "parameter %q (node %d) holds %d values for shape %v", nd.Name, nd.ID, len(f), nd.Type.Shape)
	}
	return f, nil
}

// MoveChunk copies between a chunk and the whole along axis: the chunk
// covers whole[..., off:off+k, ...]; toWhole says which way.
func MoveChunk(chunk, whole *HostBuf, axis, off int, toWhole bool) {
	outer := graph.Numel(whole.Shape[:axis])
	inner := graph.Numel(whole.Shape[axis+1:])
	k, n := chunk.Shape[axis], whole.Shape[axis]
	for o := range outer {
		c, w := o*k*inner, (o*n+off)*inner
		switch {
		case chunk.F != nil && toWhole:
			copy(whole.F[w:w+k*inner], chunk.F[c:c+k*inner])
		case chunk.F != nil:
			copy(chunk.F[c:c+k*inner], whole.F[w:w+k*inner])
		case toWhole:
			copy(whole.I[w:w+k*inner], chunk.I[c:c+k*inner])
		default:
			copy(chunk.I[c:c+k*inner], whole.I[w:w+k*inner])
		}
	}
}

// ChunkOf is chunk c of input nd's data full, which holds the whole batch
// of n samples or exactly the chunk. Rows that lie contiguously in full
// are returned without a copy; otherwise they are gathered.
func ChunkOf(nd *graph.Node, full *HostBuf, c planner.Chunk, n int) (*HostBuf, error) {
	want := nd.Type.AtBatch(c.Size)
	if slices.Equal(full.Shape, want) {
		return full, nil
	}
	if whole := nd.Type.AtBatch(n); !slices.Equal(full.Shape, whole) {
		return nil, graph.Errorf(graph.ErrShape, "input node %d: data shape %v, want %v (chunk) or %v (whole batch)", nd.ID, full.Shape, want, whole)
	}
	ax, off := nd.Type.BatchAxis, c.Start*nd.Type.PerSample
	if graph.Numel(full.Shape[:ax]) == 1 {
		inner := graph.Numel(full.Shape[ax+1:])
		lo, hi := off*inner, (off+want[ax])*inner
		if full.F != nil {
			return &HostBuf{Shape: want, F: full.F[lo:hi]}, nil
		}
		return &HostBuf{Shape: want, I: full.I[lo:hi]}, nil
	}
	chunk := NewHostBuf(nd.Type.DType, want)
	MoveChunk(chunk, full, ax, off, false)
	return chunk, nil
}

// Combine merges chunk c's value v of output node o into the running
// result acc (nil before the first chunk) and returns it: per-sample
// values are concatenated along the batch axis, sums added, maxima maxed
// (NaN wins, +0 beats −0), per-channel statistics (batch_norm_stats)
// merged exactly (CombineMoments, MergeMoments); the first chunk's value,
// copied, stands for constants.
func Combine(acc, v *HostBuf, p *planner.Program, o int, c planner.Chunk) *HostBuf {
	nd := p.Graph.Node(o)
	if acc == nil {
		if nd.Type.BatchAxis < 0 {
			acc = &HostBuf{Shape: v.Shape, F: slices.Clone(v.F), I: slices.Clone(v.I)}
			if p.Info.Combine[o] == shapeinfer.CombineMoments {
				acc.moments = newMoments(v.F, c.Size*valuesPerSample(p, o))
			}
			return acc
		}
		acc = NewHostBuf(nd.Type.DType, nd.Type.AtBatch(p.Batch))
	}
	switch {
	case nd.Type.BatchAxis >= 0:
		MoveChunk(v, acc, nd.Type.BatchAxis, c.Start*nd.Type.PerSample, true)
	case p.Info.Combine[o] == shapeinfer.CombineSum:
		for j, x := range v.F {
			acc.F[j] += x
		}
	case p.Info.Combine[o] == shapeinfer.CombineMax:
		for j, x := range v.F {
			acc.F[j] = max(acc.F[j], x)
		}
	case p.Info.Combine[o] == shapeinfer.CombineMoments:
		acc.moments.merge(v.F, c.Size*valuesPerSample(p, o))
		acc.moments.store(acc.F)
		Round(nd.Type.DType, acc.F)
	}
	return acc
}

// valuesPerSample is how many values of each channel one sample holds in
// the input x [N, C, ...] of batch_norm_stats node o.
func valuesPerSample(p *planner.Program, o int) int {
	x := p.Graph.Node(p.Graph.Node(o).Inputs[0]).Type
	return graph.Numel(x.AtBatch(1)) / max(x.Shape[1], 1)
}

// moments is the float64 state of a CombineMoments output: per channel,
// the count of values merged, their mean and Σ (x − mean)².
type moments struct {
	count    float64
	mean, m2 []float64
}

// newMoments starts from a chunk's statistics f [2, C] (mean, unbiased
// variance) over count values per channel.
func newMoments(f []float32, count int) *moments {
	c := len(f) / 2
	m := &moments{count: float64(count), mean: make([]float64, c), m2: make([]float64, c)}
	for k := range c {
		m.mean[k] = float64(f[k])
		m.m2[k] = float64(f[c+k]) * (m.count - 1)
	}
	return m
}

// merge adds a chunk's statistics f over count values per channel.
func (m *moments) merge(f []float32, count int) {
	c := len(m.mean)
	for k := range c {
		m.mean[k], m.m2[k] = MergeMoments(m.count, m.mean[k], m.m2[k], float64(count), float64(f[k]), float64(f[c+k])*float64(count-1))
	}
	m.count += float64(count)
}

// store writes the statistics merged so far into f [2, C]: the mean and
// the unbiased variance.
func (m *moments) store(f []float32) {
	c := len(m.mean)
	for k := range c {
		f[k] = float32(m.mean[k])
		f[c+k] = float32(m.m2[k] / (m.count - 1))
	}
}

// MergeMoments merges two disjoint sets of values, of nA and nB values
// with means meanA, meanB and sums of squared deviations m2A, m2B, into
// the mean and sum of squared deviations of their union, exactly up to
// rounding (Chan, Golub and LeVeque's pairwise update):
//
//	δ = meanB − meanA,  mean = meanA + δ·nB/(nA + nB),
//	m2 = m2A + m2B + δ²·nA·nB/(nA + nB).
//
// The unbiased variance of the union is m2/(nA + nB − 1). This is how a
// batch_norm_stats output run in batch chunks becomes the statistics of
// the whole batch, chunk by chunk.
func MergeMoments(nA, meanA, m2A, nB, meanB, m2B float64) (mean, m2 float64) {
	n := nA + nB
	d := meanB - meanA
	return meanA + d*nB/n, m2A + m2B + d*d*nA*nB/n
}

// KeptOutputs maps each of p's outputs to the kept entry it carries (−1
// for none): kept entry j goes to the first output of its node not yet
// taken.
func KeptOutputs(p *planner.Program) ([]int, error) {
	keptOf := make([]int, len(p.Outputs))
	for i := range keptOf {
		keptOf[i] = -1
	}
	for j, k := range p.Kept {
		i := -1
		for cand, o := range p.Outputs {
			if o == k && keptOf[cand] < 0 {
				i = cand
				break
			}
		}
		if i < 0 {
			return nil, graph.Errorf(graph.ErrArity, "kept node %d is not among the program's outputs %v", k, p.Outputs)
		}
		keptOf[i] = j
	}
	return keptOf, nil
}

// CheckChunks refuses chunks of a graph that mixes samples: they would
// give wrong numbers silently (training-mode batch_norm would normalise
// each chunk by its own statistics), as the planner refuses them. It
// refuses chunks smaller than the graph's MinChunk too (per-chunk batch
// statistics of a chunk with one value per channel), which the planner
// never makes.
func CheckChunks(p *planner.Program, chunks []planner.Chunk) error {
	if len(chunks) <= 1 || p.Info == nil {
		return nil
	}
	if p.Info.NotChunkable != nil {
		return p.Info.NotChunkable
	}
	for _, c := range chunks {
		if c.Size < p.Info.MinChunk {
			return graph.Errorf(graph.ErrShape, "chunk %d holds %d samples; the graph's per-chunk batch statistics need at least %d a chunk (more than one value per channel)",
				c.Index, c.Size, p.Info.MinChunk)
		}
	}
	return nil
}

// Outputs converts combined outputs to tensors; a nil entry (a kept
// output left on the device) stays nil.
func Outputs(p *planner.Program, outs []*HostBuf) ([]*tensor.Dense, error) {
	res := make([]*tensor.Dense, len(outs))
	for i, b := range outs {
		if b == nil {
			continue
		}
		if graph.Numel(b.Shape) == 0 {
			// gorgonia.org/tensor builds a Dense with a size-0 axis but
			// panics on Data(), so such an output is refused.
			return nil, graph.Errorf(graph.ErrShape, "output node %d has size-0 shape %v, which gorgonia.org/tensor cannot hold", p.Outputs[i], b.Shape)
		}
		res[i] = b.Dense()
	}
	return res, nil
}

// Single compiles g for outputs with ws and returns the program and the
// one chunk that runs b of its samples, as Executor.Run and RunBatch do:
// a graph with no batched input runs its constants once.
func Single(g *graph.Graph, info *shapeinfer.Result, b int, ws planner.WorkspaceFunc, outputs []int) (*planner.Program, []planner.Chunk, error) {
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Workspace: ws})
	if err != nil {
		return nil, nil, err
	}
	n := g.Batch()
	if n == 0 {
		n, b = 1, 1
	}
	p.Batch = n
	return p, []planner.Chunk{{Size: b}}, nil
}

// RunOnce evaluates outputs of g for b samples on e, in one chunk: what both
// executors' Run and RunBatch do. info is shapeinfer.Analyze(g, outputs...);
// feed, when non-nil, may supply the data of any source node.
func RunOnce(ctx context.Context, e Executor, g *graph.Graph, info *shapeinfer.Result, b int, feed func(id int) tensor.Tensor, outputs []int) ([]*tensor.Dense, error) {
	p, chunks, err := Single(g, info, b, e.Workspace(), outputs)
	if err != nil {
		return nil, err
	}
	res, err := e.Execute(ctx, p, chunks, Options{Feed: feed})
	if err != nil {
		return nil, err
	}
	return res.Outputs, nil
}

// CheckConcat checks that inputs of shapes in concatenate along axis into
// out: the kernels' guard against a graph whose types were bypassed.
func CheckConcat(axis int, out []int, in [][]int) error {
	rank := len(out)
	if axis < 0 || axis >= rank {
		return graph.Errorf(graph.ErrAttr, "concat axis %d out of range for rank %d", axis, rank)
	}
	total := 0
	for _, x := range in {
		if len(x) != rank {
			return graph.Errorf(graph.ErrShape, "concat of %v into %v", x, out)
		}
		for k, d := range x {
			if k != axis && d != out[k] {
				return graph.Errorf(graph.ErrShape, "concat of %v into %v along axis %d", x, out, axis)
			}
		}
		total += x[axis]
	}
	if total != out[axis] {
		return graph.Errorf(graph.ErrShape, "concat along axis %d: inputs sum to %d, output has %d", axis, total, out[axis])
	}
	return nil
}

// ChunkError is an error a kernel raised while a chunk of the batch ran:
// the samples it held are Start to Start+Size−1 of the caller's batch.
// A RowError inside names the caller's row (InChunk locates it); shapes
// in the messages are the chunk's.
type ChunkError struct {
	Start, Size int
	Err         error
}

func (e *ChunkError) Error() string {
	return fmt.Sprintf("in samples %d to %d of the batch: %v", e.Start, e.Start+e.Size-1, e.Err)
}

func (e *ChunkError) Unwrap() error { return e.Err }

// InChunk wraps err, raised by node nd's kernel while chunk c of p ran,
// with the samples the chunk held, unless c is the whole batch; a
// RowError in err is located in the caller's batch first.
func InChunk(p *planner.Program, nd *graph.Node, c planner.Chunk, err error) error {
	if err == nil {
		return nil
	}
	var re *RowError
	if errors.As(err, &re) {
		re.Locate(p, nd, c)
	}
	if c.Start == 0 && c.Size == p.Batch {
		return err
	}
	return &ChunkError{Start: c.Start, Size: c.Size, Err: err}
}

// InvScale is the factor unscaling multiplies gradients by under loss
// scale s: 1/s computed in float64 and rounded to float32, as PyTorch's
// GradScaler computes its inv_scale. It is exact when s is a power of two.
func InvScale(s float32) float32 { return float32(1 / float64(s)) }

// Unscale multiplies every value of grads in place by InvScale(s), in
// float32 as the CUDA kernel grad_unscale_f32 does, and reports whether
// every result is finite (a scaled value that overflowed, or a NaN,
// stays one). The CPU executor's Finish runs it under Options.LossScale.
func Unscale(grads [][]float32, s float32) (finite bool) {
	inv := InvScale(s)
	finite = true
	for _, g := range grads {
		for i, x := range g {
			y := x * inv
			g[i] = y
			if math.Float32bits(y)&0x7f800000 == 0x7f800000 { // exponent all ones: inf or NaN
				finite = false
			}
		}
	}
	return finite
}

// CheckLossScale refuses a loss scale that is not a finite positive
// float32, one whose program has no finish workspace for the flag, and
// kept outputs that are not float32 (gradients of float32 parameters are).
func CheckLossScale(p *planner.Program, s float32) error {
	if s == 0 {
		return nil
	}
	if !(s > 0) || s > math.MaxFloat32 {
		return graph.Errorf(graph.ErrAttr, "loss scale %g is not a finite positive number", s)
	}
	for _, k := range p.Kept {
		if dt := p.Graph.Node(k).Type.DType; dt != graph.Float32 {
			return graph.Errorf(graph.ErrDType, "kept output %d is %s: a loss scale unscales float32 gradients", k, dt)
		}
	}
	if len(p.Kept) > 0 && p.CallerFinish() < UnscaleBytes {
		return graph.Errorf(graph.ErrAttr, "a step with a loss scale needs a program compiled with a finish workspace of %d bytes (planner.CompileOptions.FinishWorkspace = exec.UnscaleBytes), for the inf/NaN flag; it has %d",
			UnscaleBytes, p.CallerFinish())
	}
	return nil
}
