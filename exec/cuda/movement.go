package cuda

import (
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Movement family (kernels/movement.cu, index.cu): reshape, permute,
// slice, concat and slice's gradient on float32, bfloat16, float16 and
// int64 alike (moving), and the embedding lookup with its gradient.
var movementKernels = family{
	graph.OpReshape:   {run: func(k *kctx, in []operand, out operand) error { return k.reshape(in[0], out) }},
	graph.OpPermute:   {run: func(k *kctx, in []operand, out operand) error { return k.permute(k.attrs().Perm, in[0], out) }},
	graph.OpSlice:     {run: func(k *kctx, in []operand, out operand) error { return k.slice(k.attrs(), in[0], out) }},
	graph.OpConcat:    {run: func(k *kctx, in []operand, out operand) error { return k.concat(k.attrs().Axis, in, out) }},
	graph.OpSliceGrad: {run: func(k *kctx, in []operand, out operand) error { return k.sliceGrad(k.attrs(), in[0], out) }},
	graph.OpEmbedding: {run: func(k *kctx, in []operand, out operand) error {
		return k.embedding(in[0], in[1], out)
	}, ws: flagWorkspace},
	graph.OpEmbeddingGrad: {run: func(k *kctx, in []operand, out operand) error {
		return k.embeddingGrad(in[0], in[1], optional(in, 2), out)
	}, ws: func(_ *graph.Graph, nd *graph.Node, b int) int64 {
		return embeddingGradWorkspace(nd.Type.DType, int64(graph.Numel(nd.Type.AtBatch(b))))
	}},
}

// flagWorkspace: the bad-index flag (badFlag).
func flagWorkspace(*graph.Graph, *graph.Node, int) int64 { return flagBytes }

// sumsOffset is where a workspace's float32 sums start, after the flag.
const sumsOffset = 256

// embeddingGradWorkspace is embedding_grad's workspace for an output of n
// elements of dt: the flag, and for a 16-bit output its float32 sums.
func embeddingGradWorkspace(dt graph.DType, n int64) int64 {
	if dt == graph.Float32 {
		return flagBytes
	}
	return sumsOffset + 4*n
}

// reshape copies; the planner makes reshapes views of their input's block,
// so this runs only for a program that does not.
func (k *kctx) reshape(x, out operand) error {
	if err := sameDType(out, x); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "reshape of %v to %v", x.shape, out.shape)
	}
	if x.p == out.p {
		return nil
	}
	return k.copy(out.dt, x.p, out.p, out.n())
}

// permuteKind is how a permute runs.
type permuteKind uint8

const (
	permuteCopy      permuteKind = iota // the order does not change
	permuteTranspose                    // [batch, rows, cols] → [batch, cols, rows]
	permuteGather                       // anything else
)

// permutePlan is a permute after merging axes.
type permutePlan struct {
	kind              permuteKind
	batch, rows, cols int64
	dims, strides     []int // for a gather: the output's merged axes and their source strides
}

// planPermute lays out the permute of shape by perm (output axis k is
// input axis perm[k]) into out. After merging axes, a plain copy or a swap
// of the last two axes (with a batch prefix) takes the tiled transpose;
// anything else a gather.
func planPermute(perm, shape, out []int) (permutePlan, error) {
	rank := len(shape)
	if len(perm) != rank || len(out) != rank {
		return permutePlan{}, graph.Errorf(graph.ErrAttr, "permute %v of %v into %v", perm, shape, out)
	}
	xs := graph.ContiguousStrides(shape)
	src := make([]int, rank)
	seen := make([]bool, rank)
	for k, p := range perm {
		if p < 0 || p >= rank || seen[p] || out[k] != shape[p] {
			return permutePlan{}, graph.Errorf(graph.ErrAttr, "permute %v of %v into %v", perm, shape, out)
		}
		seen[p] = true
		src[k] = xs[p]
	}
	dims, st := mergeAxes(out, src, graph.ContiguousStrides(out))
	s := st[0]
	switch {
	case len(dims) == 0 || len(dims) == 1 && s[0] == 1:
		return permutePlan{kind: permuteCopy}, nil
	case len(dims) == 2 && s[0] == 1 && s[1] == dims[0]: // [r, c] → [c, r]
		return permutePlan{kind: permuteTranspose, batch: 1, rows: int64(dims[1]), cols: int64(dims[0])}, nil
	case len(dims) == 3 && s[1] == 1 && s[2] == dims[1] && s[0] == dims[1]*dims[2]: // [b, r, c] → [b, c, r]
		return permutePlan{kind: permuteTranspose, batch: int64(dims[0]), rows: int64(dims[2]), cols: int64(dims[1])}, nil
	}
	if err := checkRank("permute", dims); err != nil {
		return permutePlan{}, err
	}
	return permutePlan{kind: permuteGather, dims: dims, strides: s}, nil
}

func (k *kctx) permute(perm []int, x, out operand) error {
	if err := sameDType(out, x); err != nil {
		return err
	}
	pl, err := planPermute(perm, x.shape, out.shape)
	if err != nil {
		return err
	}
	n := out.n()
	if n == 0 {
		return nil
	}
	switch pl.kind {
	case permuteCopy:
		return k.copy(out.dt, x.p, out.p, n)
	case permuteTranspose:
		return k.transpose(out.dt, x.p, out.p, pl.batch, pl.rows, pl.cols)
	}
	return k.gather(out.dt, x.p, out.p, pl.dims, pl.strides)
}

// units16 is the number of threads of a kernel that moves n elements of dt
// 16 bytes at a time (copy_*, copy2d_*): one per 16 bytes.
func units16(dt graph.DType, n int64) int64 { return ceilDiv(n*int64(dt.Size()), 16) }

// copy launches copy_*, which moves 16 bytes a thread: n elements of dt.
func (k *kctx) copy(dt graph.DType, src, dst alloc.Ptr, n int64) error {
	name, err := moving(kCopy, dt)
	if err != nil {
		return err
	}
	return k.flat(name, units16(dt, n), src, dst, n)
}

// gather copies the positions of merged axes dims (row-major, contiguous in
// dst) from src at Σ idx·strides: by rows of 16-byte units (gather_rows_*)
// when the innermost axis is contiguous on both sides and every size and
// stride is a multiple of 16 bytes' worth of elements, element by element
// otherwise.
func (k *kctx) gather(dt graph.DType, src, dst alloc.Ptr, dims, strides []int) error {
	if err := checkRank("gather", dims); err != nil {
		return err
	}
	name, err := moving(kGather, dt)
	if err != nil {
		return err
	}
	n := int64(graph.Numel(dims))
	last := len(dims) - 1
	per := 16 / dt.Size() // elements per 16-byte unit
	rows := n > 0 && last >= 0 && strides[last] == 1 && dims[last]%per == 0 && src%16 == 0 && dst%16 == 0
	for _, s := range strides[:max(last, 0)] {
		rows = rows && s%per == 0
	}
	if rows {
		name, _ := moving(kGatherRows, dt)
		return k.flat(name, n/int64(per), src, dst, n/int64(dims[last]), int64(dims[last]), newStrided(dims[:last], strides[:last]))
	}
	return k.flat(name, n, src, dst, n, int64(0), newStrided(dims, strides))
}

// transpose launches transpose_*: src [batch, rows, cols] → dst [batch,
// cols, rows], in tiles of 32×32 elements (64×64 for 16-bit ones).
func (k *kctx) transpose(dt graph.DType, src, dst alloc.Ptr, batch, rows, cols int64) error {
	name, err := moving(kTranspose, dt)
	if err != nil {
		return err
	}
	tile := int64(32)
	if dt.Size() == 2 {
		tile = 64
	}
	grid := [3]uint32{uint32(min(ceilDiv(cols, tile), maxGridX)), uint32(min(ceilDiv(rows, tile), maxGridYZ)), uint32(min(batch, maxGridYZ))}
	return k.launch(name, grid, [3]uint32{32, 8, 1}, src, dst, batch, rows, cols)
}

// sliceAttrs checks a slice of shape along a.Axis giving sliced.
func sliceAttrs(a *graph.Attrs, shape, sliced []int) error {
	ax, rank := a.Axis, len(shape)
	if ax < 0 || ax >= rank || a.Step < 1 || a.Start < 0 || a.Start > a.End || a.End > shape[ax] {
		return graph.Errorf(graph.ErrAttr, "slice [%d:%d:%d] of axis %d of %v", a.Start, a.End, a.Step, ax, shape)
	}
	want := slices.Clone(shape)
	want[ax] = (a.End - a.Start + a.Step - 1) / a.Step
	if !slices.Equal(want, sliced) {
		return graph.Errorf(graph.ErrShape, "slice [%d:%d:%d] of axis %d of %v gives %v, not %v", a.Start, a.End, a.Step, ax, shape, want, sliced)
	}
	return nil
}

func (k *kctx) slice(a *graph.Attrs, x, out operand) error {
	if err := sameDType(out, x); err != nil {
		return err
	}
	if err := sliceAttrs(a, x.shape, out.shape); err != nil {
		return err
	}
	outer, n, inner := axisSplit(x.shape, a.Axis)
	m := out.shape[a.Axis]
	if a.Step == 1 { // each outer index's m·inner elements are one contiguous run: a row copy
		name, err := moving(kCopy2d, out.dt)
		if err != nil {
			return err
		}
		l := int64(m * inner)
		return k.flat(name, units16(out.dt, int64(outer)*l), x.p, int64(n*inner), int64(a.Start*inner),
			out.p, l, int64(0), int64(outer), l)
	}
	name, err := moving(kSlice, out.dt)
	if err != nil {
		return err
	}
	return k.flat(name, out.n(), x.p, out.p, int64(outer), int64(n), int64(inner),
		int64(m), int64(a.Start), int64(a.Step))
}

// sliceGrad scatters g into zeros at the sliced positions (the kernel
// writes every element).
func (k *kctx) sliceGrad(a *graph.Attrs, g, out operand) error {
	dt, err := floatsOf(g, out)
	if err != nil {
		return err
	}
	if err := sliceAttrs(a, out.shape, g.shape); err != nil {
		return err
	}
	name, err := moving(kSliceGrad, dt)
	if err != nil {
		return err
	}
	outer, n, inner := axisSplit(out.shape, a.Axis)
	m := g.shape[a.Axis]
	return k.flat(name, out.n(), g.p, out.p, int64(outer), int64(n), int64(inner), int64(m), int64(a.Start), int64(a.Step))
}

// concat joins in along axis: one row-block copy per input.
func (k *kctx) concat(axis int, in []operand, out operand) error {
	if err := sameDType(out, in...); err != nil {
		return err
	}
	shapes := make([][]int, len(in))
	for i, x := range in {
		shapes[i] = x.shape
	}
	if err := exec.CheckConcat(axis, out.shape, shapes); err != nil {
		return err
	}
	name, err := moving(kCopy2d, out.dt)
	if err != nil {
		return err
	}
	outer, inner := int64(graph.Numel(out.shape[:axis])), int64(graph.Numel(out.shape[axis+1:]))
	off := int64(0)
	for _, x := range in {
		l := int64(x.shape[axis]) * inner
		if err := k.flat(name, units16(out.dt, outer*l), x.p, l, int64(0), out.p, int64(out.shape[axis])*inner, off, outer, l); err != nil {
			return err
		}
		off += l
	}
	return nil
}

func (k *kctx) embedding(idx, w, out operand) error {
	dt, err := floatsOf(w, out)
	if err != nil {
		return err
	}
	if idx.dt != graph.Int64 {
		return graph.Errorf(graph.ErrDType, "embedding indices are %s, want int64", idx.dt)
	}
	if len(w.shape) != 2 {
		return graph.Errorf(graph.ErrShape, "embedding needs a [V, D] weight, got %v", w.shape)
	}
	v, d := int64(w.shape[0]), int64(w.shape[1])
	if out.n() != idx.n()*d {
		return graph.Errorf(graph.ErrShape, "embedding of indices %v with weight %v into %v", idx.shape, w.shape, out.shape)
	}
	if out.n() == 0 {
		return nil
	}
	bad, err := k.badFlag(0)
	if err != nil {
		return err
	}
	if err := k.flat(typed(kEmbedding, dt), out.n(), idx.p, w.p, out.p, idx.n(), v, d, bad); err != nil {
		return err
	}
	return k.firstBad(bad, idx, "embedding", "index", 0, v)
}

// embeddingGrad scatter-adds rows of g into the zeroed weight gradient
// (or onto a copy of r, graph.FuseEmbeddingGradAdd's addend):
// with float32 atomics into the output itself, or for a 16-bit gradient
// into float32 sums in the workspace, rounded once into the output
// (cast_f32_*), as the CPU sums in float32 and rounds the result.
func (k *kctx) embeddingGrad(g, idx operand, onto *operand, out operand) error {
	dt, err := floatsOf(g, out)
	if err != nil {
		return err
	}
	if idx.dt != graph.Int64 {
		return graph.Errorf(graph.ErrDType, "embedding_grad indices are %s, want int64", idx.dt)
	}
	if len(out.shape) != 2 {
		return graph.Errorf(graph.ErrShape, "embedding_grad needs a [V, D] output, got %v", out.shape)
	}
	v, d := int64(out.shape[0]), int64(out.shape[1])
	if g.n() != idx.n()*d {
		return graph.Errorf(graph.ErrShape, "embedding_grad of g %v with indices %v into %v", g.shape, idx.shape, out.shape)
	}
	if out.n() == 0 {
		return nil
	}
	acc := out.p
	if dt != graph.Float32 {
		w, err := k.workspace(embeddingGradWorkspace(dt, out.n()))
		if err != nil {
			return err
		}
		acc = w + sumsOffset
	}
	switch {
	case onto != nil && (onto.dt != dt || onto.n() != out.n()):
		return graph.Errorf(graph.ErrShape, "embedding_grad onto %s%v into %s%v", onto.dt, onto.shape, dt, out.shape)
	case onto != nil && dt == graph.Float32: // the rows scatter-add onto r (graph.FuseEmbeddingGradAdd)
		if err := k.copy(dt, onto.p, acc, out.n()); err != nil {
			return err
		}
	case onto != nil:
		if err := k.packs(castKernel(dt, graph.Float32), out.n(), perPack(graph.Float32, dt), onto.p, acc, out.n()); err != nil {
			return err
		}
	default:
		if err := k.d.Memzero(acc, 4*out.n()); err != nil {
			return err
		}
	}
	if g.n() > 0 {
		bad, err := k.badFlag(0)
		if err != nil {
			return err
		}
		if err := k.flat(typed(kEmbeddingGrad, dt), g.n(), g.p, idx.p, acc, idx.n(), v, d, bad); err != nil {
			return err
		}
		if err := k.firstBad(bad, idx, "embedding", "index", 1, v); err != nil {
			return err
		}
	}
	if dt == graph.Float32 {
		return nil
	}
	return k.packs(castKernel(graph.Float32, dt), out.n(), perPack(graph.Float32, dt), acc, out.p, out.n())
}
