package cpu

import (
	"slices"

	"gonum.org/v1/gonum/blas"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Convolution family: conv2d and its gradients as GEMMs over unfolded
// patches (this file and convgrad.go); pooling is in pool.go.
var convKernels = family{
	graph.OpConv2d: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return conv2dKernel(&nd.Attrs, in[0], in[1], optional(in, 2), out)
	}, ws: func(g *graph.Graph, nd *graph.Node, _ int) int64 {
		w, a := nchw(nd, g.Node(nd.Inputs[1]).Type.Shape), nd.Attrs
		if w[2] == 1 && w[3] == 1 && a.Stride == [2]int{1, 1} && a.Padding == [2]int{} {
			return 0 // the input is the patch matrix
		}
		return colBytes(nd, w, nchw(nd, nd.Type.Shape))
	}},
	graph.OpConv2dGradInput: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return conv2dGradInputKernel(&nd.Attrs, in[0], in[1], out)
	}, ws: func(g *graph.Graph, nd *graph.Node, _ int) int64 {
		return colBytes(nd, nchw(nd, g.Node(nd.Inputs[1]).Type.Shape), nchw(nd, g.Node(nd.Inputs[0]).Type.Shape))
	}},
	graph.OpConv2dGradWeight: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return conv2dGradWeightKernel(&nd.Attrs, in[0], in[1], out)
	}, ws: func(g *graph.Graph, nd *graph.Node, _ int) int64 {
		return colBytes(nd, nchw(nd, nd.Type.Shape), nchw(nd, g.Node(nd.Inputs[0]).Type.Shape))
	}},
}

// colBytes is the workspace of the unfolded patches for weight w [O, C/g,
// kh, kw] and forward output y [N, O, Ho, Wo]: [C/g·kh·kw, Ho·Wo] elements
// of nd's dtype, made once per call and reused across samples and groups.
func colBytes(nd *graph.Node, w, y []int) int64 {
	return int64(w[1]*w[2]*w[3]) * int64(y[2]*y[3]) * int64(nd.Type.DType.Size())
}

// window is the geometry of a 2-D convolution or pooling over NCHW data.
type window struct {
	n, c, h, w int // input
	kh, kw     int
	sh, sw     int // stride
	ph, pw     int // padding
	dh, dw     int // dilation
	ho, wo     int // output extent
}

// newWindow checks x and out against the window attributes and returns the
// geometry. Stride and dilation must already be normalised to ≥ 1. outC is
// the output's channel count, or −1 for as many as the input (pooling).
func newWindow(op string, x, out *buf, kh, kw int, a *graph.Attrs, outC int) (window, error) {
	if err := checkLen(op+" input", x); err != nil {
		return window{}, err
	}
	if err := checkLen(op+" out", out); err != nil {
		return window{}, err
	}
	if len(x.shape) != 4 {
		return window{}, graph.Errorf(graph.ErrShape, "%s needs an NCHW input, got %v", op, x.shape)
	}
	if outC < 0 {
		outC = x.shape[1]
	}
	wd := window{n: x.shape[0], c: x.shape[1], h: x.shape[2], w: x.shape[3], kh: kh, kw: kw,
		sh: a.Stride[0], sw: a.Stride[1], ph: a.Padding[0], pw: a.Padding[1],
		dh: a.Dilation[0], dw: a.Dilation[1]}
	if wd.sh < 1 || wd.sw < 1 || wd.dh < 1 || wd.dw < 1 || wd.ph < 0 || wd.pw < 0 || kh < 1 || kw < 1 {
		return window{}, graph.Errorf(graph.ErrAttr, "%s kernel %dx%d, stride %v, padding %v, dilation %v out of range",
			op, kh, kw, a.Stride, a.Padding, a.Dilation)
	}
	wd.ho = shapeinfer.ConvOut(wd.h, kh, wd.sh, wd.ph, wd.dh)
	wd.wo = shapeinfer.ConvOut(wd.w, kw, wd.sw, wd.pw, wd.dw)
	if want := []int{wd.n, outC, wd.ho, wd.wo}; wd.ho < 1 || wd.wo < 1 || !slices.Equal(out.shape, want) {
		return window{}, graph.Errorf(graph.ErrShape, "%s of %v gives %v, output buffer is %v", op, x.shape, want, out.shape)
	}
	return wd, nil
}

// span returns the output range [lo, hi) along one axis whose input index
// o·stride − pad + off falls inside [0, size).
func span(off, stride, pad, size, outN int) (lo, hi int) {
	first := pad - off // smallest o·stride allowed
	if first > 0 {
		lo = (first + stride - 1) / stride
	}
	last := size - 1 + pad - off // largest o·stride allowed
	if last < 0 {
		return 0, 0
	}
	hi = min(last/stride+1, outN)
	return min(lo, hi), hi
}

// im2col unfolds the c channels of one sample (src, c×h×w) into col, a
// [c·kh·kw, ho·wo] matrix whose row (ci, ki, kj) holds, for every output
// position, the input value that kernel tap sees (0 in the padding).
func (wd *window) im2col(src []float32, c int, col []float32) {
	hw, howo := wd.h*wd.w, wd.ho*wd.wo
	row := 0
	for ci := range c {
		plane := src[ci*hw : (ci+1)*hw]
		for ki := range wd.kh {
			ohLo, ohHi := span(ki*wd.dh, wd.sh, wd.ph, wd.h, wd.ho)
			for kj := range wd.kw {
				dst := col[row*howo : (row+1)*howo]
				row++
				owLo, owHi := span(kj*wd.dw, wd.sw, wd.pw, wd.w, wd.wo)
				clear(dst[:ohLo*wd.wo])
				clear(dst[ohHi*wd.wo:])
				for oh := ohLo; oh < ohHi; oh++ {
					d := dst[oh*wd.wo : (oh+1)*wd.wo]
					clear(d[:owLo])
					clear(d[owHi:])
					if owLo >= owHi {
						continue
					}
					ih := oh*wd.sh - wd.ph + ki*wd.dh
					iw := owLo*wd.sw - wd.pw + kj*wd.dw
					s := plane[ih*wd.w:]
					if wd.sw == 1 {
						copy(d[owLo:owHi], s[iw:])
						continue
					}
					for ow := owLo; ow < owHi; ow++ {
						d[ow] = s[iw]
						iw += wd.sw
					}
				}
			}
		}
	}
}

// conv2dKernel convolves x [N, C, H, W] with w [O, C/g, kh, kw] (+ b [O]) into
// out [N, O, Ho, Wo]: per sample and group, the patches are unfolded into one
// buffer reused for the whole call and multiplied by the group's weights.
func conv2dKernel(a *graph.Attrs, x, w, b *buf, out *buf) error {
	if err := checkLen("conv2d weight", w); err != nil {
		return err
	}
	if len(w.shape) != 4 {
		return graph.Errorf(graph.ErrShape, "conv2d weight must be [out, in/groups, kh, kw], got %v", w.shape)
	}
	o, cg := w.shape[0], w.shape[1]
	wd, err := newWindow("conv2d", x, out, w.shape[2], w.shape[3], a, o)
	if err != nil {
		return err
	}
	g := a.Groups
	if g < 1 || wd.c%g != 0 || o%g != 0 || wd.c/g != cg {
		return graph.Errorf(graph.ErrShape, "conv2d weight %v does not fit input %v in %d groups", w.shape, x.shape, g)
	}
	howo := wd.ho * wd.wo
	og := o / g
	kk := cg * wd.kh * wd.kw // GEMM inner dimension
	var beta float32
	if b != nil {
		if err := checkLen("conv2d bias", b); err != nil {
			return err
		}
		if !slices.Equal(b.shape, []int{o}) {
			return graph.Errorf(graph.ErrShape, "conv2d bias %v, want [%d]", b.shape, o)
		}
		for ni := range wd.n {
			for oi := range o {
				p := out.f[(ni*o+oi)*howo : (ni*o+oi+1)*howo]
				for i := range p {
					p[i] = b.f[oi]
				}
			}
		}
		beta = 1
	}
	// A 1×1 kernel with unit stride and no padding sees the input itself.
	direct := wd.kh == 1 && wd.kw == 1 && wd.sh == 1 && wd.sw == 1 && wd.ph == 0 && wd.pw == 0
	var col []float32
	if !direct {
		col = make([]float32, kk*howo)
	}
	chw := wd.c * wd.h * wd.w
	for ni := range wd.n {
		sample := x.f[ni*chw : (ni+1)*chw]
		for gi := range g {
			src := sample[gi*cg*wd.h*wd.w : (gi+1)*cg*wd.h*wd.w]
			if direct {
				col = src
			} else {
				wd.im2col(src, cg, col)
			}
			dst := out.f[(ni*o+gi*og)*howo : (ni*o+(gi+1)*og)*howo]
			gemm(blas.NoTrans, blas.NoTrans, og, howo, kk,
				w.f[gi*og*kk:(gi+1)*og*kk], max(kk, 1), col, max(howo, 1), beta, dst, max(howo, 1))
		}
	}
	return nil
}
