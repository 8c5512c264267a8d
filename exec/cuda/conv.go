package cuda

import (
	"errors"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Convolution family (cuDNN; kernels/conv.cu, pool.cu, and cuBLAS for the
// GEMMs): conv2d and its gradients on cuDNN when the executor has it (DNN),
// else, or for a shape no cuDNN algorithm takes within its workspace, as
// im2col + GEMM; max and average pooling, and their gradients; for
// float32, bfloat16 and float16 (all operands of one dtype; 16-bit sums in
// float32). Each convolution declares the im2col path's workspace (fixed)
// plus convDNNBytes (affine in the chunk's batch, as the planner's rules
// require), and cuDNN may use all of it. Channels-last nodes
// (graph.Attrs.ChannelsLast: x, y NHWC, w KRSC) run on cuDNN, or where it
// refuses them as their NCHW twins on copies (convnchw.go), and declare the
// same workspace as their NCHW twins (from the NCHW views of their
// shapes), so cuDNN chooses within the same budget; pooling has
// channels-last kernels (pool.cu's *_nhwc_*).
var convKernels = family{
	graph.OpConv2d: {run: func(k *kctx, in []operand, out operand) error {
		return k.conv2d(k.attrs(), in[0], in[1], optional(in, 2), out)
	}, ws: func(g *graph.Graph, nd *graph.Node, b int) int64 {
		a := &nd.Attrs
		w, y, size := nchwShape(a, inputAt(g, nd, 1, b)), nchwShape(a, nd.Type.AtBatch(b)), elemSize(nd.Type.DType)
		return convColBytes(w, y, convImages(g, nd), a, size) + convDNNBytes(inputAt(g, nd, 0, b), y, w, size)
	}},
	graph.OpMaxPool2d: {run: func(k *kctx, in []operand, out operand) error { return k.maxPool2d(k.attrs(), in[0], out) }},
	graph.OpAvgPool2d: {run: func(k *kctx, in []operand, out operand) error { return k.avgPool2d(k.attrs(), in[0], out) }},

	// The patches of the input gradient are the GEMM's float32 output,
	// whatever the dtype: col2im sums them in float32 and rounds once.
	graph.OpConv2dGradInput: {run: func(k *kctx, in []operand, out operand) error {
		return k.conv2dGradInput(k.attrs(), in[0], in[1], out)
	}, ws: func(g *graph.Graph, nd *graph.Node, b int) int64 {
		w, y := nchwShape(&nd.Attrs, inputAt(g, nd, 1, b)), nchwShape(&nd.Attrs, inputAt(g, nd, 0, b))
		return convColBytes(w, y, convImages(g, nd), &nd.Attrs, 4) + convDNNBytes(nd.Type.AtBatch(b), y, w, elemSize(nd.Type.DType))
	}},
	graph.OpConv2dGradWeight: {run: func(k *kctx, in []operand, out operand) error {
		return k.conv2dGradWeight(k.attrs(), in[0], in[1], out)
	}, ws: func(g *graph.Graph, nd *graph.Node, b int) int64 {
		w, y := nchwShape(&nd.Attrs, nd.Type.AtBatch(b)), nchwShape(&nd.Attrs, inputAt(g, nd, 0, b))
		return newGradWeightLayout(w, y, convImages(g, nd), nd.Attrs.Groups, nd.Type.DType).bytes +
			convDNNBytes(inputAt(g, nd, 1, b), y, w, elemSize(nd.Type.DType))
	}},
	graph.OpMaxPool2dGrad: {run: func(k *kctx, in []operand, out operand) error {
		return k.maxPool2dGrad(k.attrs(), in[0], in[1], out)
	}, ws: func(g *graph.Graph, nd *graph.Node, b int) int64 {
		return argmaxBytes(int64(graph.Numel(inputAt(g, nd, 0, b))))
	}},
	graph.OpAvgPool2dGrad: {run: func(k *kctx, in []operand, out operand) error {
		return k.avgPool2dGrad(k.attrs(), in[0], out)
	}},
}

// elemSize is the bytes of one element of dt in device memory, 4 for a
// dtype the kernels refuse (their error comes at the launch).
func elemSize(dt graph.DType) int64 {
	if dt.IsFloat() {
		return int64(dt.Size())
	}
	return 4
}

// colBytes is a patch matrix of kk rows and howo columns of size-byte
// elements: the unfolded patches of one image and group.
func colBytes(kk, howo, size int64) int64 { return size * kk * howo }

// gradWeightLayout is conv2d_grad_weight's workspace for weight w [O, C/g,
// kh, kw] and upstream gradient y [N, O, Ho, Wo] in a graph of full
// images, per tile of images and group: the patches as one [kk, tile·howo]
// matrix (for a 1×1 kernel with unit stride and no padding, the input's
// group of channels regrouped the same way) at 0; the gradient's group of
// og channels regrouped to [og, tile·howo] at gradAt; for a 16-bit
// gradient, float32 sums of every weight at sumsAt; bytes in all. The tile
// is as many images as 64 MiB holds of both matrices (at least one, at
// most the batch), fixed by the graph's full batch as the planner needs.
type gradWeightLayout struct {
	tile, gradAt, sumsAt, bytes int64
}

func newGradWeightLayout(w, y []int, full int64, groups int, dt graph.DType) gradWeightLayout {
	if len(w) != 4 || len(y) != 4 || groups < 1 {
		return gradWeightLayout{}
	}
	size := elemSize(dt)
	og, kk, howo := int64(w[0]/groups), int64(w[1]*w[2]*w[3]), int64(y[2]*y[3])
	var l gradWeightLayout
	l.tile = convTile(full, size*(kk+og)*howo)
	l.gradAt = align256(l.tile * kk * howo * size)
	l.sumsAt = align256(l.gradAt + l.tile*og*howo*size)
	l.bytes = l.sumsAt
	if dt != graph.Float32 {
		l.bytes += 4 * int64(graph.Numel(w))
	}
	return l
}

// align256 rounds n bytes up to a multiple of 256.
func align256(n int64) int64 { return ceilDiv(n, 256) * 256 }

// convColCap bounds a convolution's patch workspace. The patches of a tile
// of images (as many as fit, at least one, at most the whole batch) are
// unfolded by one im2col launch and multiplied by one strided-batched GEMM
// per group, so a chunk of N images takes ⌈N/tile⌉ launches of each
// rather than N. The tile depends on the graph's full batch, not on the
// chunk's, so the workspace is a fixed size, as the planner's affine
// rules require.
const convColCap = 64 << 20

// convTile is how many images of per patch bytes each the workspace holds,
// for a graph of full images.
func convTile(full, per int64) int64 {
	return max(1, min(full, convColCap/max(per, 1)))
}

// patchTile is how many images' patch matrices of kk·howo elements of
// size bytes the patch workspace holds, as convColBytes sizes it for the
// planner, and the bytes per image.
func (k *kctx) patchTile(kk, howo, size int64) (tile, per int64) {
	per = colBytes(kk, howo, size)
	return convTile(convImages(k.g, k.nd), per), per
}

// patches takes a convolution's patch workspace of elements of size bytes
// and says how many images' patch matrices of per bytes it holds.
func (k *kctx) patches(kk, howo, size int64) (col alloc.Ptr, tile, per int64, err error) {
	tile, per = k.patchTile(kk, howo, size)
	col, err = k.workspace(tile * per)
	return col, tile, per, err
}

// convImages is the number of images of a convolution node's graph at its
// full batch: the leading axis of its first input (x for conv2d, the
// upstream gradient for its gradients).
func convImages(g *graph.Graph, nd *graph.Node) int64 {
	if len(nd.Inputs) == 0 {
		return 1
	}
	s := g.Node(nd.Inputs[0]).Type.Shape
	if len(s) == 0 {
		return 1
	}
	return int64(s[0])
}

// argmaxBytes is max_pool2d_grad's workspace: the int32 argmax of each of
// n windows.
func argmaxBytes(n int64) int64 { return 4 * n }

// convColBytes is the patch workspace for weight w [O, C/g, kh, kw] and
// forward output y [N, O, Ho, Wo] in a graph of full images, in elements
// of size bytes: a tile of images' patch matrices (convTile), one group at
// a time; 0 when the input is used as it is (a 1×1 kernel with unit stride
// and no padding).
func convColBytes(w, y []int, full int64, a *graph.Attrs, size int64) int64 {
	if len(w) != 4 || len(y) != 4 {
		return 0
	}
	if w[2] == 1 && w[3] == 1 && a.Stride == [2]int{1, 1} && a.Padding == [2]int{} {
		return 0
	}
	per := colBytes(int64(w[1]*w[2]*w[3]), int64(y[2]*y[3]), size)
	return convTile(full, per) * per
}

// tile is the window of t images' group of cg channels, for im2col and
// col2im over a tile of images.
func (wd Window) tile(t, cg int64) Window {
	wd.N, wd.C = t, cg
	return wd
}

// convGroups checks the weight [O, C/g, kh, kw] against the input's C
// channels in a.Groups groups.
func convGroups(op string, a *graph.Attrs, w []int, c int64) error {
	g := a.Groups
	if len(w) != 4 || g < 1 || c%int64(g) != 0 || w[0]%g != 0 || c/int64(g) != int64(w[1]) {
		return graph.Errorf(graph.ErrShape, "%s weight %v does not fit %d input channels in %d groups", op, w, c, g)
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

// conv2d: per tile of images (convTile) and group, the patches are
// unfolded into the workspace (im2col, in the operands' dtype) and
// multiplied by the group's weights in one strided-batched GEMM; with a
// bias, it is broadcast into out first and the GEMMs add to it (beta = 1),
// as on the CPU. A 1×1 kernel with unit stride and no padding multiplies
// the input itself, all images in one strided-batched GEMM per group.
// 16-bit GEMMs accumulate in float32 and round each output once.
func (k *kctx) conv2d(a *graph.Attrs, x, w operand, b *operand, out operand) error {
	dt, err := floatsOf(x, w, out)
	if err != nil {
		return err
	}
	geo, err := newConvGeom("conv2d", a, nchwShape(a, x.shape), nchwShape(a, out.shape), nchwShape(a, w.shape))
	if err != nil {
		return err
	}
	wd := geo.Window
	o, groups, og, cg := geo.o, geo.groups, geo.og, geo.cg
	kk, howo, hw, chw := geo.kk, geo.howo, geo.hw, geo.chw
	var beta float32
	if b != nil {
		if _, err := floatsOf(x, *b); err != nil {
			return err
		}
		if !slices.Equal(b.shape, []int{int(o)}) {
			return graph.Errorf(graph.ErrShape, "conv2d bias %v, want [%d]", b.shape, o)
		}
		rows, inner := wd.N, howo
		if a.ChannelsLast { // out [N·Ho·Wo, O]
			rows, inner = wd.N*howo, 1
		}
		if err := k.packs(typed(kBiasFill, dt), out.n(), perPack(dt), out.p, b.p, rows, o, inner); err != nil {
			return err
		}
		beta = 1
	}
	if out.n() == 0 {
		return nil
	}
	if done, err := k.dnnConv(convForward, dt, geo, a.ChannelsLast, x, w, out, beta); done || err != nil {
		if errors.Is(err, ErrChannelsLast) {
			return k.convThroughNCHW(convForward, a, x, w, b, out, err)
		}
		return err
	}
	if wd.direct() {
		for gi := range groups {
			if err := k.blas.GemmStridedBatchedOf(dt, false, false, int(og), int(howo), int(kk), 1,
				w.at(gi*og*kk), int(kk), 0, x.at(gi*cg*hw), int(howo), chw,
				beta, out.at(gi*og*howo), int(howo), o*howo, int(wd.N)); err != nil {
				return err
			}
		}
		return nil
	}
	col, tile, _, err := k.patches(kk, howo, int64(dt.Size()))
	if err != nil {
		return err
	}
	for n0 := int64(0); n0 < wd.N; n0 += tile {
		t := min(tile, wd.N-n0)
		for gi := range groups {
			if err := k.flat(typed(kIm2col, dt), t*kk*howo, x.at(n0*chw+gi*cg*hw), col, wd.tile(t, cg), chw, kk*howo, howo); err != nil {
				return err
			}
			if err := k.blas.GemmStridedBatchedOf(dt, false, false, int(og), int(howo), int(kk), 1,
				w.at(gi*og*kk), int(kk), 0, col, int(howo), kk*howo,
				beta, out.at((n0*o+gi*og)*howo), int(howo), o*howo, int(t)); err != nil {
				return err
			}
		}
	}
	return nil
}

// conv2dGradInput: per tile of images and group, dcol = W_gᵀ·g_g in the
// workspace (one strided-batched GEMM), folded into the input gradient by
// col2im (which sets every element). dcol is float32 for every dtype, so
// col2im sums the overlapping taps in float32 and rounds once, as the CPU.
func (k *kctx) conv2dGradInput(a *graph.Attrs, g, w, out operand) error {
	dt, err := floatsOf(g, w, out)
	if err != nil {
		return err
	}
	geo, err := newConvGeom("conv2d_grad_input", a, nchwShape(a, out.shape), nchwShape(a, g.shape), nchwShape(a, w.shape))
	if err != nil {
		return err
	}
	wd := geo.Window
	o, groups, og, cg := geo.o, geo.groups, geo.og, geo.cg
	kk, howo, hw, chw := geo.kk, geo.howo, geo.hw, geo.chw
	if out.n() == 0 {
		return nil
	}
	if done, err := k.dnnConv(convGradInput, dt, geo, a.ChannelsLast, g, w, out, 0); done || err != nil {
		if errors.Is(err, ErrChannelsLast) {
			return k.convThroughNCHW(convGradInput, a, g, w, nil, out, err)
		}
		return err
	}
	if wd.direct() {
		for gi := range groups {
			if err := k.blas.GemmStridedBatchedOf(dt, true, false, int(kk), int(howo), int(og), 1,
				w.at(gi*og*kk), int(kk), 0, g.at(gi*og*howo), int(howo), o*howo,
				0, out.at(gi*cg*hw), int(hw), chw, int(wd.N)); err != nil {
				return err
			}
		}
		return nil
	}
	col, tile, _, err := k.patches(kk, howo, 4)
	if err != nil {
		return err
	}
	for n0 := int64(0); n0 < wd.N; n0 += tile {
		t := min(tile, wd.N-n0)
		for gi := range groups {
			if err := k.blas.GemmStridedBatchedToF32(dt, true, false, int(kk), int(howo), int(og), 1,
				w.at(gi*og*kk), int(kk), 0, g.at((n0*o+gi*og)*howo), int(howo), o*howo,
				0, col, int(howo), kk*howo, int(t)); err != nil {
				return err
			}
			if err := k.flat(typed(kCol2im, dt), t*cg*hw, col, out.at(n0*chw+gi*cg*hw), wd.tile(t, cg), chw, kk*howo); err != nil {
				return err
			}
		}
	}
	return nil
}

// conv2dGradWeight: dW_g = Σ over images and positions of g_g·colᵀ, one
// GEMM per tile of images and group over all the tile's positions at once
// (K = tile·Ho·Wo): the patches unfolded side by side into [kk,
// tile·howo] (im2col with a row stride; the input itself regrouped for a
// 1×1 kernel with unit stride and no padding), the gradient's group of
// channels regrouped into [og, tile·howo], and their product added in
// float32: into the zeroed output for float32, into float32 sums in the
// workspace for 16-bit, rounded once into the output at the end (the CPU
// sums in float32 and rounds once).
func (k *kctx) conv2dGradWeight(a *graph.Attrs, g, x, out operand) error {
	dt, err := floatsOf(g, x, out)
	if err != nil {
		return err
	}
	geo, err := newConvGeom("conv2d_grad_weight", a, nchwShape(a, x.shape), nchwShape(a, g.shape), nchwShape(a, out.shape))
	if err != nil {
		return err
	}
	wd := geo.Window
	o, groups, og, cg := geo.o, geo.groups, geo.og, geo.cg
	kk, howo, hw, chw := geo.kk, geo.howo, geo.hw, geo.chw
	if out.n() == 0 {
		return nil
	}
	if done, err := k.dnnConv(convGradWeight, dt, geo, a.ChannelsLast, x, g, out, 0); done || err != nil {
		if errors.Is(err, ErrChannelsLast) {
			return k.convThroughNCHW(convGradWeight, a, g, x, nil, out, err)
		}
		return err
	}
	l := newGradWeightLayout(out.shape, g.shape, convImages(k.g, k.nd), int(groups), dt)
	ws, err := k.workspace(l.bytes)
	if err != nil {
		return err
	}
	col, gr, acc := ws, ws+alloc.Ptr(l.gradAt), out.p
	if dt != graph.Float32 {
		acc = ws + alloc.Ptr(l.sumsAt)
	}
	if err := k.d.Memzero(acc, 4*out.n()); err != nil {
		return err
	}
	for n0 := int64(0); n0 < wd.N; n0 += l.tile {
		t := min(l.tile, wd.N-n0)
		for gi := range groups {
			if wd.direct() {
				err = k.packs(typed(kRegroup, dt), t*kk*howo, perPack(dt), x.at(n0*chw+gi*cg*hw), col, t, kk, howo, chw)
			} else {
				err = k.flat(typed(kIm2col, dt), t*kk*howo, x.at(n0*chw+gi*cg*hw), col, wd.tile(t, cg), chw, howo, t*howo)
			}
			if err != nil {
				return err
			}
			if err := k.packs(typed(kRegroup, dt), t*og*howo, perPack(dt), g.at((n0*o+gi*og)*howo), gr, t, og, howo, o*howo); err != nil {
				return err
			}
			if err := k.blas.GemmToF32(dt, false, true, int(og), int(kk), int(t*howo), 1, gr, int(t*howo),
				col, int(t*howo), 1, acc+alloc.Ptr(4*gi*og*kk), int(kk)); err != nil {
				return err
			}
		}
	}
	if dt == graph.Float32 {
		return nil
	}
	return k.packs(castKernel(graph.Float32, dt), out.n(), perPack(graph.Float32, dt), acc, out.p, out.n())
}

// poolKernel is the pooling kernel name for a's layout: the NCHW one, or
// its channels-last twin (pool.cu's *_nhwc_* kernels).
func poolKernel(a *graph.Attrs, nchw, nhwc string, dt graph.DType) string {
	if a.ChannelsLast {
		return typed(nhwc, dt)
	}
	return typed(nchw, dt)
}

// nchwShape is shape as an NCHW kernel's geometry reads it: permuted from
// NHWC when a asks for channels last (graph.ToNCHW).
func nchwShape(a *graph.Attrs, shape []int) []int {
	if !a.ChannelsLast {
		return shape
	}
	return graph.ToNCHW(graph.Type{Shape: shape, BatchAxis: -1}).Shape
}

func (k *kctx) maxPool2d(a *graph.Attrs, x, out operand) error {
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	wd, err := newWindow("max_pool2d", nchwShape(a, x.shape), nchwShape(a, out.shape), a.Kernel[0], a.Kernel[1], a, -1)
	if err != nil {
		return err
	}
	return k.flat(poolKernel(a, kMaxPool, kMaxPoolNHWC, dt), out.n(), x.p, out.p, wd)
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

func (k *kctx) avgPool2d(a *graph.Attrs, x, out operand) error {
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	at, err := avgAttrs(a)
	if err != nil {
		return err
	}
	wd, err := newWindow("avg_pool2d", nchwShape(a, x.shape), nchwShape(a, out.shape), a.Kernel[0], a.Kernel[1], at, -1)
	if err != nil {
		return err
	}
	return k.flat(poolKernel(a, kAvgPool, kAvgPoolNHWC, dt), out.n(), x.p, out.p, wd)
}

// maxPool2dGrad routes each window's gradient to its first maximum: the
// argmax of every window into the workspace, then a gather per input.
func (k *kctx) maxPool2dGrad(a *graph.Attrs, g, x, out operand) error {
	dt, err := floatsOf(g, x, out)
	if err != nil {
		return err
	}
	wd, err := newWindow("max_pool2d_grad", nchwShape(a, x.shape), nchwShape(a, g.shape), a.Kernel[0], a.Kernel[1], a, -1)
	if err != nil {
		return err
	}
	if out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "max_pool2d_grad of %v into %v", x.shape, out.shape)
	}
	idx, err := k.workspace(argmaxBytes(g.n()))
	if err != nil {
		return err
	}
	if err := k.flat(poolKernel(a, kMaxPoolArgmax, kMaxPoolArgmaxNHWC, dt), g.n(), x.p, idx, wd); err != nil {
		return err
	}
	return k.flat(poolKernel(a, kMaxPoolGrad, kMaxPoolGradNHWC, dt), out.n(), g.p, idx, out.p, wd)
}

func (k *kctx) avgPool2dGrad(a *graph.Attrs, g, out operand) error {
	dt, err := floatsOf(g, out)
	if err != nil {
		return err
	}
	at, err := avgAttrs(a)
	if err != nil {
		return err
	}
	wd, err := newWindow("avg_pool2d_grad", nchwShape(a, out.shape), nchwShape(a, g.shape), a.Kernel[0], a.Kernel[1], at, -1)
	if err != nil {
		return err
	}
	return k.flat(poolKernel(a, kAvgPoolGrad, kAvgPoolGradNHWC, dt), out.n(), g.p, out.p, wd)
}
