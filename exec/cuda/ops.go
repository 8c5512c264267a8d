package cuda

import (
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Movement ops work on float32 and int64 alike: pick picks the kernel.
func pick(dt graph.DType, f32, i64 string) string {
	if dt == graph.Int64 {
		return i64
	}
	return f32
}

// sameDType fails unless the inputs have out's dtype.
func sameDType(out operand, in ...operand) error {
	for _, x := range in {
		if x.dt != out.dt {
			return graph.Errorf(graph.ErrDType, "input %v is %s, output %v is %s", x.shape, x.dt, out.shape, out.dt)
		}
	}
	return nil
}

// reshape copies; the planner makes reshapes views of their input's block,
// so this runs only for a program that does not.
func (r *runner) reshape(x, out operand) error {
	if err := sameDType(out, x); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "reshape of %v to %v", x.shape, out.shape)
	}
	if x.p == out.p {
		return nil
	}
	return r.copy(out.dt, x.p, out.p, out.n())
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

func (r *runner) permute(perm []int, x, out operand) error {
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
		return r.copy(out.dt, x.p, out.p, n)
	case permuteTranspose:
		return r.transpose(out.dt, x.p, out.p, pl.batch, pl.rows, pl.cols)
	}
	return r.gather(out.dt, x.p, out.p, pl.dims, pl.strides)
}

// copy launches copy_*, which moves 16 bytes a thread: n elements of dt.
func (r *runner) copy(dt graph.DType, src, dst alloc.Ptr, n int64) error {
	return r.flat(pick(dt, kCopyF32, kCopyI64), ceilDiv(n*int64(dt.Size()), 16), src, dst, n)
}

// gather copies the positions of merged axes dims (row-major, contiguous in
// dst) from src at Σ idx·strides: by rows of 16-byte units (gather_rows_f32)
// when the innermost axis is contiguous on both sides and every size and
// stride is a multiple of 4 floats, element by element otherwise.
func (r *runner) gather(dt graph.DType, src, dst alloc.Ptr, dims, strides []int) error {
	if err := checkRank("gather", dims); err != nil {
		return err
	}
	n := int64(graph.Numel(dims))
	last := len(dims) - 1
	rows := dt == graph.Float32 && last >= 0 && strides[last] == 1 && dims[last]%4 == 0 && src%16 == 0 && dst%16 == 0
	for _, s := range strides[:max(last, 0)] {
		rows = rows && s%4 == 0
	}
	if rows {
		return r.flat(kGatherRows, n/4, src, dst, n/int64(dims[last]), int64(dims[last]), newStrided(dims[:last], strides[:last]))
	}
	return r.flat(pick(dt, kGatherF32, kGatherI64), n, src, dst, n, int64(0), newStrided(dims, strides))
}

// transpose launches transpose_*: src [batch, rows, cols] → dst [batch,
// cols, rows].
func (r *runner) transpose(dt graph.DType, src, dst alloc.Ptr, batch, rows, cols int64) error {
	grid := [3]uint32{uint32(min(ceilDiv(cols, 32), maxGridX)), uint32(min(ceilDiv(rows, 32), maxGridYZ)), uint32(min(batch, maxGridYZ))}
	return r.launch(pick(dt, kTransposeF32, kTransposeI64), grid, [3]uint32{32, 8, 1}, src, dst, batch, rows, cols)
}

// expand broadcasts g to out's shape (the backward of reductions).
func (r *runner) expand(g, out operand) error {
	s, err := graph.BroadcastStrides(g.shape, out.shape)
	if err != nil {
		return err
	}
	n := out.n()
	if n == 0 {
		return nil
	}
	dims, st := mergeAxes(out.shape, s, graph.ContiguousStrides(out.shape))
	return r.gather(graph.Float32, g.p, out.p, dims, st[0])
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

func (r *runner) slice(a *graph.Attrs, x, out operand) error {
	if err := sameDType(out, x); err != nil {
		return err
	}
	if err := sliceAttrs(a, x.shape, out.shape); err != nil {
		return err
	}
	outer, n, inner := axisSplit(x.shape, a.Axis)
	m := out.shape[a.Axis]
	if a.Step == 1 { // each outer index's m·inner elements are one contiguous run: a row copy
		l := int64(m * inner)
		return r.flat(pick(out.dt, kCopy2dF32, kCopy2dI64), ceilDiv(int64(outer)*l, 4), x.p, int64(n*inner), int64(a.Start*inner),
			out.p, l, int64(0), int64(outer), l)
	}
	return r.flat(pick(out.dt, kSliceF32, kSliceI64), out.n(), x.p, out.p, int64(outer), int64(n), int64(inner),
		int64(m), int64(a.Start), int64(a.Step))
}

// sliceGrad scatters g into zeros at the sliced positions (the kernel
// writes every element).
func (r *runner) sliceGrad(a *graph.Attrs, g, out operand) error {
	if err := sliceAttrs(a, out.shape, g.shape); err != nil {
		return err
	}
	outer, n, inner := axisSplit(out.shape, a.Axis)
	m := g.shape[a.Axis]
	return r.flat(kSliceGrad, out.n(), g.p, out.p, int64(outer), int64(n), int64(inner), int64(m), int64(a.Start), int64(a.Step))
}

// concat joins in along axis: one row-block copy per input.
func (r *runner) concat(axis int, in []operand, out operand) error {
	if err := sameDType(out, in...); err != nil {
		return err
	}
	rank := len(out.shape)
	if axis < 0 || axis >= rank {
		return graph.Errorf(graph.ErrAttr, "concat axis %d out of range for rank %d", axis, rank)
	}
	total := 0
	for _, x := range in {
		if len(x.shape) != rank {
			return graph.Errorf(graph.ErrShape, "concat of %v into %v", x.shape, out.shape)
		}
		for k, d := range x.shape {
			if k != axis && d != out.shape[k] {
				return graph.Errorf(graph.ErrShape, "concat of %v into %v along axis %d", x.shape, out.shape, axis)
			}
		}
		total += x.shape[axis]
	}
	if total != out.shape[axis] {
		return graph.Errorf(graph.ErrShape, "concat along axis %d: inputs sum to %d, output has %d", axis, total, out.shape[axis])
	}
	outer, inner := int64(graph.Numel(out.shape[:axis])), int64(graph.Numel(out.shape[axis+1:]))
	off := int64(0)
	for _, x := range in {
		l := int64(x.shape[axis]) * inner
		if err := r.flat(pick(out.dt, kCopy2dF32, kCopy2dI64), ceilDiv(outer*l, 4), x.p, l, int64(0), out.p, int64(total)*inner, off, outer, l); err != nil {
			return err
		}
		off += l
	}
	return nil
}

// Indices and labels are data, so the kernels report the first bad position
// in a device flag; badFlag arms it.
func (r *runner) badFlag(ws *alloc.Block, off int64) (alloc.Ptr, error) {
	w, err := workspace(ws, off+8)
	if err != nil {
		return 0, err
	}
	bad := w + alloc.Ptr(off)
	return bad, r.e.d.memset(bad, 0xFF, 8)
}

// firstBad reads the flag: the first bad position and its index value, or
// ok when every index was in range. It waits for the kernels before it.
func (r *runner) firstBad(bad alloc.Ptr, idx operand) (pos, val int64, ok bool, err error) {
	var got [1]int64
	if err := CopyDtoH(r.e.d, got[:], bad); err != nil {
		return 0, 0, false, err
	}
	if got[0] == -1 {
		return 0, 0, true, nil
	}
	pos = got[0]
	err = CopyDtoH(r.e.d, got[:], idx.at(pos))
	return pos, got[0], false, err
}

func (r *runner) embedding(idx, w, out operand, ws *alloc.Block) error {
	if len(w.shape) != 2 || idx.dt != graph.Int64 || w.dt != graph.Float32 {
		return graph.Errorf(graph.ErrShape, "embedding needs int64 indices and a float32 [V, D] weight, got %v and %v", idx.shape, w.shape)
	}
	v, d := int64(w.shape[0]), int64(w.shape[1])
	if out.n() != idx.n()*d {
		return graph.Errorf(graph.ErrShape, "embedding of indices %v with weight %v into %v", idx.shape, w.shape, out.shape)
	}
	if out.n() == 0 {
		return nil
	}
	bad, err := r.badFlag(ws, 0)
	if err != nil {
		return err
	}
	if err := r.flat(kEmbedding, out.n(), idx.p, w.p, out.p, idx.n(), v, d, bad); err != nil {
		return err
	}
	pos, val, ok, err := r.firstBad(bad, idx)
	if err == nil && !ok {
		err = graph.Errorf(graph.ErrAttr, "embedding index %d (position %d) out of range for %d rows", val, pos, v)
	}
	return err
}

// embeddingGrad scatter-adds rows of g into the zeroed weight gradient.
func (r *runner) embeddingGrad(g, idx, out operand, ws *alloc.Block) error {
	if len(out.shape) != 2 || idx.dt != graph.Int64 {
		return graph.Errorf(graph.ErrShape, "embedding_grad needs int64 indices and a [V, D] output, got %v and %v", idx.shape, out.shape)
	}
	v, d := int64(out.shape[0]), int64(out.shape[1])
	if g.n() != idx.n()*d {
		return graph.Errorf(graph.ErrShape, "embedding_grad of g %v with indices %v into %v", g.shape, idx.shape, out.shape)
	}
	if err := r.e.d.Memzero(out.p, 4*out.n()); err != nil || g.n() == 0 {
		return err
	}
	bad, err := r.badFlag(ws, 0)
	if err != nil {
		return err
	}
	if err := r.flat(kEmbeddingGrad, g.n(), g.p, idx.p, out.p, idx.n(), v, d, bad); err != nil {
		return err
	}
	pos, val, ok, err := r.firstBad(bad, idx)
	if err == nil && !ok {
		err = graph.Errorf(graph.ErrAttr, "embedding index %d at position %d outside [0, %d)", val, pos, v)
	}
	return err
}

// Convolution and pooling.

// convGroups checks the weight [O, C/g, kh, kw] against the input's C
// channels in a.Groups groups.
func convGroups(op string, a *graph.Attrs, w []int, c int64) error {
	g := a.Groups
	if len(w) != 4 || g < 1 || c%int64(g) != 0 || w[0]%g != 0 || c/int64(g) != int64(w[1]) {
		return graph.Errorf(graph.ErrShape, "%s weight %v does not fit %d input channels in %d groups", op, w, c, g)
	}
	return nil
}

// one is the window of one image's group of cg channels, for im2col and
// col2im.
func (wd Window) one(cg int64) Window {
	wd.N, wd.C = 1, cg
	return wd
}

// conv2d: per image and group, the patches are unfolded into the
// workspace (im2col) and multiplied by the group's weights; with a bias,
// it is broadcast into out first and the GEMMs add to it (beta = 1), as on
// the CPU. A 1×1 kernel with unit stride and no padding multiplies the
// input itself, all images in one strided-batched GEMM per group.
func (r *runner) conv2d(a *graph.Attrs, x, w operand, b *operand, out operand, ws *alloc.Block) error {
	if err := floats(x, w, out); err != nil {
		return err
	}
	geo, err := newConvGeom("conv2d", a, x.shape, out.shape, w.shape)
	if err != nil {
		return err
	}
	wd := geo.Window
	o, groups, og, cg := geo.o, geo.groups, geo.og, geo.cg
	kk, howo, hw, chw := geo.kk, geo.howo, geo.hw, geo.chw
	var beta float32
	if b != nil {
		if err := floats(*b); err != nil {
			return err
		}
		if !slices.Equal(b.shape, []int{int(o)}) {
			return graph.Errorf(graph.ErrShape, "conv2d bias %v, want [%d]", b.shape, o)
		}
		if err := r.flat(kBiasFill, out.n(), out.p, b.p, wd.N, o, howo); err != nil {
			return err
		}
		beta = 1
	}
	if out.n() == 0 {
		return nil
	}
	if wd.direct() {
		for gi := range groups {
			if err := r.e.blas.GemmStridedBatched(false, false, int(og), int(howo), int(kk), 1,
				w.at(gi*og*kk), int(kk), 0, x.at(gi*cg*hw), int(howo), chw,
				beta, out.at(gi*og*howo), int(howo), o*howo, int(wd.N)); err != nil {
				return err
			}
		}
		return nil
	}
	col, err := workspace(ws, 4*kk*howo)
	if err != nil {
		return err
	}
	one := wd.one(cg)
	for ni := range wd.N {
		for gi := range groups {
			if err := r.flat(kIm2col, kk*howo, x.at(ni*chw+gi*cg*hw), col, one, chw, kk*howo); err != nil {
				return err
			}
			if err := r.e.blas.Gemm(false, false, int(og), int(howo), int(kk), 1, w.at(gi*og*kk), int(kk),
				col, int(howo), beta, out.at((ni*o+gi*og)*howo), int(howo)); err != nil {
				return err
			}
		}
	}
	return nil
}

// convGeom is a convolution's window with the sizes of its per-group
// GEMMs: o output channels in groups of og, cg input channels per group,
// kk = cg·kh·kw rows of the unfolded patches, howo output and hw input
// positions per plane, chw elements per input image.
type convGeom struct {
	Window
	o, groups, og, cg, kk, howo, hw, chw int64
}

// newConvGeom checks a convolution's weight w [O, C/groups, kh, kw] against
// its input x and output y (the same shapes for the gradients) and works
// out its GEMM sizes.
func newConvGeom(op string, a *graph.Attrs, x, y, w []int) (convGeom, error) {
	if len(w) != 4 {
		return convGeom{}, graph.Errorf(graph.ErrShape, "%s weight must be [out, in/groups, kh, kw], got %v", op, w)
	}
	wd, err := newWindow(op, x, y, w[2], w[3], a, w[0])
	if err != nil {
		return convGeom{}, err
	}
	if err := convGroups(op, a, w, wd.C); err != nil {
		return convGeom{}, err
	}
	c := convGeom{Window: wd, o: int64(w[0]), groups: int64(a.Groups)}
	c.og, c.cg = c.o/c.groups, wd.C/c.groups
	c.kk, c.howo, c.hw = c.cg*wd.KH*wd.KW, wd.HO*wd.WO, wd.H*wd.W
	c.chw = wd.C * c.hw
	return c, nil
}

// conv2dGradInput: per image and group, dcol = W_gᵀ·g_g in the workspace,
// folded into the input gradient by col2im (which sets every element).
func (r *runner) conv2dGradInput(a *graph.Attrs, g, w, out operand, ws *alloc.Block) error {
	if err := floats(w); err != nil {
		return err
	}
	geo, err := newConvGeom("conv2d_grad_input", a, out.shape, g.shape, w.shape)
	if err != nil {
		return err
	}
	wd := geo.Window
	o, groups, og, cg := geo.o, geo.groups, geo.og, geo.cg
	kk, howo, hw, chw := geo.kk, geo.howo, geo.hw, geo.chw
	if out.n() == 0 {
		return nil
	}
	if wd.direct() {
		for gi := range groups {
			if err := r.e.blas.GemmStridedBatched(true, false, int(kk), int(howo), int(og), 1,
				w.at(gi*og*kk), int(kk), 0, g.at(gi*og*howo), int(howo), o*howo,
				0, out.at(gi*cg*hw), int(hw), chw, int(wd.N)); err != nil {
				return err
			}
		}
		return nil
	}
	col, err := workspace(ws, 4*kk*howo)
	if err != nil {
		return err
	}
	one := wd.one(cg)
	for ni := range wd.N {
		for gi := range groups {
			if err := r.e.blas.Gemm(true, false, int(kk), int(howo), int(og), 1, w.at(gi*og*kk), int(kk),
				g.at((ni*o+gi*og)*howo), int(howo), 0, col, int(howo)); err != nil {
				return err
			}
			if err := r.flat(kCol2im, cg*hw, col, out.at(ni*chw+gi*cg*hw), one, chw, kk*howo); err != nil {
				return err
			}
		}
	}
	return nil
}

// conv2dGradWeight: dW_g = Σ over images of g_g·colᵀ, with col the
// unfolded patches of the forward input (the input itself for a 1×1
// kernel with unit stride and no padding), accumulated into the zeroed
// output.
func (r *runner) conv2dGradWeight(a *graph.Attrs, g, x, out operand, ws *alloc.Block) error {
	if err := floats(x); err != nil {
		return err
	}
	geo, err := newConvGeom("conv2d_grad_weight", a, x.shape, g.shape, out.shape)
	if err != nil {
		return err
	}
	wd := geo.Window
	o, groups, og, cg := geo.o, geo.groups, geo.og, geo.cg
	kk, howo, hw, chw := geo.kk, geo.howo, geo.hw, geo.chw
	if err := r.e.d.Memzero(out.p, 4*out.n()); err != nil || out.n() == 0 {
		return err
	}
	var col alloc.Ptr
	if !wd.direct() {
		if col, err = workspace(ws, 4*kk*howo); err != nil {
			return err
		}
	}
	one := wd.one(cg)
	for ni := range wd.N {
		for gi := range groups {
			src := x.at(ni*chw + gi*cg*hw)
			if !wd.direct() {
				if err := r.flat(kIm2col, kk*howo, src, col, one, chw, kk*howo); err != nil {
					return err
				}
				src = col
			}
			if err := r.e.blas.Gemm(false, true, int(og), int(kk), int(howo), 1, g.at((ni*o+gi*og)*howo), int(howo),
				src, int(howo), 1, out.at(gi*og*kk), int(kk)); err != nil {
				return err
			}
		}
	}
	return nil
}

func (r *runner) maxPool2d(a *graph.Attrs, x, out operand) error {
	if err := floats(x, out); err != nil {
		return err
	}
	wd, err := newWindow("max_pool2d", x.shape, out.shape, a.Kernel[0], a.Kernel[1], a, -1)
	if err != nil {
		return err
	}
	return r.flat(kMaxPool, out.n(), x.p, out.p, wd)
}

// avgAttrs is a with avg_pool2d's dilation, which must be 1.
func avgAttrs(a *graph.Attrs) (*graph.Attrs, error) {
	if a.Dilation != [2]int{1, 1} && a.Dilation != [2]int{} {
		return nil, graph.Errorf(graph.ErrAttr, "avg_pool2d has no dilation, got %v", a.Dilation)
	}
	at := *a
	at.Dilation = [2]int{1, 1}
	return &at, nil
}

func (r *runner) avgPool2d(a *graph.Attrs, x, out operand) error {
	if err := floats(x, out); err != nil {
		return err
	}
	at, err := avgAttrs(a)
	if err != nil {
		return err
	}
	wd, err := newWindow("avg_pool2d", x.shape, out.shape, a.Kernel[0], a.Kernel[1], at, -1)
	if err != nil {
		return err
	}
	return r.flat(kAvgPool, out.n(), x.p, out.p, wd)
}

// maxPool2dGrad routes each window's gradient to its first maximum: the
// argmax of every window into the workspace, then a gather per input.
func (r *runner) maxPool2dGrad(a *graph.Attrs, g, x, out operand, ws *alloc.Block) error {
	if err := floats(x); err != nil {
		return err
	}
	wd, err := newWindow("max_pool2d_grad", x.shape, g.shape, a.Kernel[0], a.Kernel[1], a, -1)
	if err != nil {
		return err
	}
	if out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "max_pool2d_grad of %v into %v", x.shape, out.shape)
	}
	idx, err := workspace(ws, 4*g.n())
	if err != nil {
		return err
	}
	if err := r.flat(kMaxPoolArgmax, g.n(), x.p, idx, wd); err != nil {
		return err
	}
	return r.flat(kMaxPoolGrad, out.n(), g.p, idx, out.p, wd)
}

func (r *runner) avgPool2dGrad(a *graph.Attrs, g, out operand) error {
	at, err := avgAttrs(a)
	if err != nil {
		return err
	}
	wd, err := newWindow("avg_pool2d_grad", out.shape, g.shape, a.Kernel[0], a.Kernel[1], at, -1)
	if err != nil {
		return err
	}
	return r.flat(kAvgPoolGrad, out.n(), g.p, out.p, wd)
}

// Losses.

// sumF64 sums n doubles at src, times scale, into the float out[0] with one
// block.
func (r *runner) sumF64(src, out alloc.Ptr, n int64, scale float64) error {
	return r.launch(kSumF64, [3]uint32{1, 1, 1}, [3]uint32{1024, 1, 1}, src, out, n, scale)
}

// crossEntropy: per-row losses in double into the workspace, then their
// sum times a.Scalar; a bad label is an error, as on the CPU.
func (r *runner) crossEntropy(a *graph.Attrs, logits, labels, out operand, ws *alloc.Block) error {
	if err := floats(logits, out); err != nil {
		return err
	}
	if len(logits.shape) != 2 || labels.dt != graph.Int64 || labels.n() != int64(logits.shape[0]) || out.n() != 1 {
		return graph.Errorf(graph.ErrShape, "cross_entropy needs logits [N, C], int64 labels [N] and a scalar output, got %v, %v, %v",
			logits.shape, labels.shape, out.shape)
	}
	n, c := int64(logits.shape[0]), int64(logits.shape[1])
	loss, err := workspace(ws, 8*n+8)
	if err != nil {
		return err
	}
	bad, err := r.badFlag(ws, 8*n)
	if err != nil {
		return err
	}
	if n > 0 {
		block := rowBlock(c)
		if err := r.launch(kCrossEntropy, rowGrid(n, block, 1), block, logits.p, labels.p, loss, n, c, bad); err != nil {
			return err
		}
	}
	if err := r.sumF64(loss, out.p, n, a.Scalar); err != nil || n == 0 {
		return err
	}
	row, label, ok, err := r.firstBad(bad, labels)
	if err == nil && !ok {
		err = graph.Errorf(graph.ErrAttr, "cross_entropy label %d (row %d) out of range for %d classes", label, row, c)
	}
	return err
}

// crossEntropyGrad: g·Scalar·(softmax(logits) − onehot(label)).
func (r *runner) crossEntropyGrad(a *graph.Attrs, g, logits, labels, out operand, ws *alloc.Block) error {
	if err := floats(logits); err != nil {
		return err
	}
	if len(logits.shape) != 2 || labels.dt != graph.Int64 || labels.n() != int64(logits.shape[0]) || out.n() != logits.n() || g.n() != 1 {
		return graph.Errorf(graph.ErrShape, "cross_entropy_grad needs a scalar g, logits [N, C] and int64 labels [N], got %v, %v, %v",
			g.shape, logits.shape, labels.shape)
	}
	n, c := int64(logits.shape[0]), int64(logits.shape[1])
	if out.n() == 0 {
		return nil
	}
	bad, err := r.badFlag(ws, 0)
	if err != nil {
		return err
	}
	block := rowBlock(c)
	if err := r.launch(kCrossEntGrad, rowGrid(n, block, 1), block, g.p, logits.p, labels.p, out.p, n, c, a.Scalar, bad); err != nil {
		return err
	}
	row, label, ok, err := r.firstBad(bad, labels)
	if err == nil && !ok {
		err = graph.Errorf(graph.ErrAttr, "cross_entropy label %d at row %d outside [0, %d)", label, row, c)
	}
	return err
}

// mse: a double partial per block into the workspace, then their sum times
// a.Scalar.
func (r *runner) mse(a *graph.Attrs, pred, target, out operand, ws *alloc.Block) error {
	if err := floats(pred, target, out); err != nil {
		return err
	}
	if pred.n() != target.n() || out.n() != 1 {
		return graph.Errorf(graph.ErrShape, "mse of %v and %v into %v", pred.shape, target.shape, out.shape)
	}
	partial, err := workspace(ws, 8*mseGrid)
	if err != nil {
		return err
	}
	n := pred.n()
	grid := min(max(ceilDiv(n, mseBlock), 1), mseGrid)
	if err := r.launch(kMSEPartial, [3]uint32{uint32(grid), 1, 1}, [3]uint32{mseBlock, 1, 1}, pred.p, target.p, partial, n); err != nil {
		return err
	}
	return r.sumF64(partial, out.p, grid, a.Scalar)
}

// Batch normalisation: per-channel statistics into the workspace, from the
// batch (training) or the running statistics (evaluation), then the
// per-element kernels.

// channels views x [N, C, ...] as [n, c, inner].
func channels(op string, x operand) (n, c, inner int64, err error) {
	if len(x.shape) < 2 {
		return 0, 0, 0, graph.Errorf(graph.ErrShape, "%s needs [N, C, ...], got %v", op, x.shape)
	}
	return int64(x.shape[0]), int64(x.shape[1]), int64(graph.Numel(x.shape[2:])), nil
}

// bnStats computes the statistics into the workspace; runMean and runVar
// are the running statistics, needed (and only read) in evaluation mode.
func (r *runner) bnStats(a *graph.Attrs, x operand, runMean, runVar *operand, ws *alloc.Block) (alloc.Ptr, error) {
	n, c, inner, err := channels("batch_norm", x)
	if err != nil {
		return 0, err
	}
	stats, err := workspace(ws, 16*c)
	if err != nil {
		return 0, err
	}
	if a.Training {
		return stats, r.perChannel(kBatchNormStats, c, x.p, stats, n, c, inner, a.Eps)
	}
	if runMean == nil || runVar == nil || runMean.n() != c || runVar.n() != c {
		return 0, graph.Errorf(graph.ErrShape, "batch_norm in evaluation mode needs running statistics of [%d]", c)
	}
	if err := floats(*runMean, *runVar); err != nil {
		return 0, err
	}
	return stats, r.flat(kBatchNormRunSt, c, runMean.p, runVar.p, stats, c, a.Eps)
}

func (r *runner) batchNorm(a *graph.Attrs, in []operand, out operand, ws *alloc.Block) error {
	x := in[0]
	if err := floats(x, out); err != nil {
		return err
	}
	var runMean, runVar *operand
	if !a.Training {
		runMean, runVar = optional(in, 1), optional(in, 2)
	}
	stats, err := r.bnStats(a, x, runMean, runVar, ws)
	if err != nil {
		return err
	}
	n, c, inner, _ := channels("batch_norm", x)
	aff := graph.BatchNormAffine(a.Training)
	w, b := optional(in, aff), optional(in, aff+1)
	for _, p := range []*operand{w, b} {
		if p != nil && (p.n() != c || p.dt != graph.Float32) {
			return graph.Errorf(graph.ErrShape, "batch_norm parameter %v, want float32 [%d]", p.shape, c)
		}
	}
	if out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "batch_norm: input %v, output %v", x.shape, out.shape)
	}
	return r.flat(kBatchNorm, x.n(), x.p, stats, ptrOf(w), ptrOf(b), out.p, n, c, inner)
}

// batchNormGradX is the training-mode gradient of batch_norm's input.
func (r *runner) batchNormGradX(a *graph.Attrs, g, x operand, w *operand, out operand, ws *alloc.Block) error {
	if err := floats(x); err != nil {
		return err
	}
	if !a.Training {
		return graph.Errorf(graph.ErrAttr, "batch_norm_grad_x exists in training mode only")
	}
	stats, err := r.bnStats(a, x, nil, nil, ws)
	if err != nil {
		return err
	}
	n, c, inner, _ := channels("batch_norm_grad_x", x)
	if g.n() != x.n() || out.n() != x.n() || w != nil && (w.n() != c || w.dt != graph.Float32) {
		return graph.Errorf(graph.ErrShape, "batch_norm_grad_x: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	return r.perChannel(kBatchNormGradX, c, g.p, x.p, ptrOf(w), stats, out.p, n, c, inner)
}

// batchNormGradW is Σ g·x̂ per channel, x̂ normalised as the forward op did.
func (r *runner) batchNormGradW(a *graph.Attrs, in []operand, out operand, ws *alloc.Block) error {
	g, x := in[0], in[1]
	if err := floats(x); err != nil {
		return err
	}
	stats, err := r.bnStats(a, x, optional(in, 2), optional(in, 3), ws)
	if err != nil {
		return err
	}
	n, c, inner, _ := channels("batch_norm_grad_w", x)
	if g.n() != x.n() || out.n() != c {
		return graph.Errorf(graph.ErrShape, "batch_norm_grad_w: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	return r.perChannel(kBatchNormGradW, c, g.p, x.p, stats, out.p, n, c, inner)
}
