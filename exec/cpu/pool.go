package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Pooling (conv family): max and average pooling and their gradients.
var poolKernels = family{
	graph.OpMaxPool2d: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return maxPool2dKernel(&nd.Attrs, in[0], out) }},
	graph.OpAvgPool2d: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return avgPool2dKernel(&nd.Attrs, in[0], out) }},
	graph.OpMaxPool2dGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		maxPool2dGrad(&nd.Attrs, in[0], in[1], out)
		return nil
	}},
	graph.OpAvgPool2dGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		avgPool2dGrad(&nd.Attrs, in[0], out)
		return nil
	}},
}

// maxPool2dKernel takes the max over each window of x [N, C, H, W]. Padded
// positions are −inf: they never win, so they are simply skipped. NaN
// propagates, as in PyTorch.
func maxPool2dKernel(a *graph.Attrs, x, out *buf) error {
	wd, err := newWindow("max_pool2d", x, out, a.Kernel[0], a.Kernel[1], a, -1)
	if err != nil {
		return err
	}
	wd.pool(x.f, out.f, func(src []float32, ih0, iw0 int) float32 {
		m := float32(math.Inf(-1))
		for ki := range wd.kh {
			ih := ih0 + ki*wd.dh
			if ih < 0 || ih >= wd.h {
				continue
			}
			row := src[ih*wd.w : (ih+1)*wd.w]
			for kj := range wd.kw {
				iw := iw0 + kj*wd.dw
				if iw < 0 || iw >= wd.w {
					continue
				}
				if v := row[iw]; v > m || v != v {
					m = v
				}
			}
		}
		return m
	})
	return nil
}

// avgPool2dKernel averages each window of x [N, C, H, W]. Zero padding counts
// in the divisor, which is therefore always kh·kw (PyTorch's
// count_include_pad=True).
func avgPool2dKernel(a *graph.Attrs, x, out *buf) error {
	if a.Dilation != [2]int{1, 1} && a.Dilation != [2]int{} {
		return graph.Errorf(graph.ErrAttr, "avg_pool2d has no dilation, got %v", a.Dilation)
	}
	at := *a
	at.Dilation = [2]int{1, 1}
	wd, err := newWindow("avg_pool2d", x, out, a.Kernel[0], a.Kernel[1], &at, -1)
	if err != nil {
		return err
	}
	inv := 1 / float64(wd.kh*wd.kw)
	wd.pool(x.f, out.f, func(src []float32, ih0, iw0 int) float32 {
		var s float64
		jlo, jhi := max(iw0, 0), min(iw0+wd.kw, wd.w)
		for ih := max(ih0, 0); ih < min(ih0+wd.kh, wd.h) && jlo < jhi; ih++ {
			for _, v := range src[ih*wd.w+jlo : ih*wd.w+jhi] {
				s += float64(v)
			}
		}
		return float32(s * inv)
	})
	return nil
}

// pool applies f to every window of every (sample, channel) plane; f gets the
// plane and the input coordinates of the window's top-left tap (possibly in
// the padding).
func (wd *window) pool(in, out []float32, f func(plane []float32, ih0, iw0 int) float32) {
	hw, howo := wd.h*wd.w, wd.ho*wd.wo
	for p := range wd.n * wd.c {
		plane := in[p*hw : (p+1)*hw]
		dst := out[p*howo : (p+1)*howo]
		for oh := range wd.ho {
			for ow := range wd.wo {
				dst[oh*wd.wo+ow] = f(plane, oh*wd.sh-wd.ph, ow*wd.sw-wd.pw)
			}
		}
	}
}

// poolWindows calls visit(n·c plane, output index, input index) for every
// in-bounds input position of every window, windows in row-major order and
// positions row-major within each window.
func poolWindows(a *graph.Attrs, in, out []int, visit func(plane, o, i int)) {
	h, w, ho, wo := in[2], in[3], out[2], out[3]
	for p := range in[0] * in[1] {
		for oy := range ho {
			for ox := range wo {
				o := (p*ho+oy)*wo + ox
				for ky := range a.Kernel[0] {
					iy := oy*a.Stride[0] - a.Padding[0] + ky*a.Dilation[0]
					if iy < 0 || iy >= h {
						continue
					}
					for kx := range a.Kernel[1] {
						ix := ox*a.Stride[1] - a.Padding[1] + kx*a.Dilation[1]
						if ix < 0 || ix >= w {
							continue
						}
						visit(p, o, (p*h+iy)*w+ix)
					}
				}
			}
		}
	}
}

// maxPool2dGrad routes each window's gradient to its first maximum.
func maxPool2dGrad(a *graph.Attrs, g, x, out *buf) {
	clear(out.f)
	best := make([]int, len(g.f))
	for i := range best {
		best[i] = -1
	}
	poolWindows(a, x.shape, g.shape, func(_, o, i int) {
		if best[o] < 0 || x.f[i] > x.f[best[o]] {
			best[o] = i
		}
	})
	for o, i := range best {
		if i >= 0 {
			out.f[i] += g.f[o]
		}
	}
}

// avgPool2dGrad spreads each window's gradient over its kh·kw positions
// (padding included in the divisor, as in the forward op).
func avgPool2dGrad(a *graph.Attrs, g, out *buf) {
	clear(out.f)
	inv := 1 / float32(a.Kernel[0]*a.Kernel[1])
	poolWindows(a, out.shape, g.shape, func(_, o, i int) {
		out.f[i] += g.f[o] * inv
	})
}
