package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Convolution family: conv2d, max and average pooling, and their gradients.
var convKernels = family{
	graph.OpConv2d: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		conv2d(out, in, a)
		return nil
	},
	graph.OpMaxPool2d: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		maxPool(out, in[0], a)
		return nil
	},
	graph.OpAvgPool2d: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		avgPool(out, in[0], a)
		return nil
	},
	graph.OpConv2dGradInput: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		conv2dGradInput(out, in[0], in[1], a)
		return nil
	},
	graph.OpConv2dGradWeight: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		conv2dGradWeight(out, in[0], in[1], a)
		return nil
	},
	graph.OpMaxPool2dGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		maxPoolGrad(out, in[0], in[1], a)
		return nil
	},
	graph.OpAvgPool2dGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		avgPoolGrad(out, in[0], a)
		return nil
	},
}

// convTaps calls f(xi, wi, oi) for every product x[xi]·w[wi] that conv2d
// adds into out[oi]: x [N,C,H,W], w [O,C/G,KH,KW], out [N,O,HO,WO], output
// channel o reading input channels of group o/(O/G); taps that land in the
// zero padding are skipped. The forward pass and both gradients walk this
// one loop nest, which makes them adjoint by construction.
func convTaps(xs, ws, os []int, a *graph.Attrs, f func(xi, wi, oi int)) {
	n, c, h, w := xs[0], xs[1], xs[2], xs[3]
	o, cg, kh, kw := ws[0], ws[1], ws[2], ws[3]
	ho, wo := os[2], os[3]
	og := o / a.Groups // output channels per group
	for b := range n {
		for oc := range o {
			grp := oc / og
			for y := range ho {
				for x := range wo {
					oi := ((b*o+oc)*ho+y)*wo + x
					for ic := range cg {
						ci := grp*cg + ic
						for i := range kh {
							for j := range kw {
								iy := y*a.Stride[0] - a.Padding[0] + i*a.Dilation[0]
								ix := x*a.Stride[1] - a.Padding[1] + j*a.Dilation[1]
								if iy < 0 || iy >= h || ix < 0 || ix >= w {
									continue
								}
								f(((b*c+ci)*h+iy)*w+ix, ((oc*cg+ic)*kh+i)*kw+j, oi)
							}
						}
					}
				}
			}
		}
	}
}

// conv2d: out[n,o,y,x] = b[o] + Σ x[n, ci, y·s−p+i·d, x·s−p+j·d]·w[o, ic, i, j].
func conv2d(out Value, in []Value, a *graph.Attrs) {
	x, w := in[0], in[1]
	convTaps(x.Shape, w.Shape, out.Shape, a, func(xi, wi, oi int) {
		out.Data[oi] += x.Data[xi] * w.Data[wi]
	})
	if len(in) == 3 {
		plane := out.Shape[2] * out.Shape[3]
		for i := range out.Data {
			out.Data[i] += in[2].Data[(i/plane)%out.Shape[1]]
		}
	}
}

// conv2dGradInput: every tap x·w → out sends g[out]·w back to x.
func conv2dGradInput(out, g, w Value, a *graph.Attrs) {
	convTaps(out.Shape, w.Shape, g.Shape, a, func(xi, wi, oi int) {
		out.Data[xi] += g.Data[oi] * w.Data[wi]
	})
}

// conv2dGradWeight: every tap x·w → out sends g[out]·x back to w.
func conv2dGradWeight(out, g, x Value, a *graph.Attrs) {
	convTaps(x.Shape, out.Shape, g.Shape, a, func(xi, wi, oi int) {
		out.Data[wi] += g.Data[oi] * x.Data[xi]
	})
}

// poolWindows calls f(oi, taps) for each output element of a pooling over
// x [N,C,H,W] into out [N,C,HO,WO], with taps the flat positions of the
// window's in-bounds elements in row-major window order.
func poolWindows(xs, os []int, kernel, stride, pad, dil [2]int, f func(oi int, taps []int)) {
	n, c, h, w := xs[0], xs[1], xs[2], xs[3]
	ho, wo := os[2], os[3]
	taps := make([]int, 0, kernel[0]*kernel[1])
	for b := range n {
		for ch := range c {
			for y := range ho {
				for x := range wo {
					taps = taps[:0]
					for i := range kernel[0] {
						for j := range kernel[1] {
							iy := y*stride[0] - pad[0] + i*dil[0]
							ix := x*stride[1] - pad[1] + j*dil[1]
							if iy >= 0 && iy < h && ix >= 0 && ix < w {
								taps = append(taps, ((b*c+ch)*h+iy)*w+ix)
							}
						}
					}
					f(((b*c+ch)*ho+y)*wo+x, taps)
				}
			}
		}
	}
}

// argmaxTap is the first tap holding the window's maximum (a NaN wins, as
// in PyTorch), or −1 for a window entirely in the padding.
func argmaxTap(x Value, taps []int) int {
	best, arg := math.Inf(-1), -1
	for k, t := range taps {
		if v := x.Data[t]; k == 0 || v > best || math.IsNaN(v) {
			best, arg = v, t
		}
	}
	return arg
}

func maxPool(out, x Value, a *graph.Attrs) {
	poolWindows(x.Shape, out.Shape, a.Kernel, a.Stride, a.Padding, a.Dilation, func(oi int, taps []int) {
		out.Data[oi] = math.Inf(-1) // padding never wins
		if t := argmaxTap(x, taps); t >= 0 {
			out.Data[oi] = x.Data[t]
		}
	})
}

func maxPoolGrad(out, g, x Value, a *graph.Attrs) {
	poolWindows(x.Shape, g.Shape, a.Kernel, a.Stride, a.Padding, a.Dilation, func(oi int, taps []int) {
		if t := argmaxTap(x, taps); t >= 0 {
			out.Data[t] += g.Data[oi]
		}
	})
}

// avgPool divides each window's in-bounds sum by kh·kw: the zero padding
// counts in the divisor. Average pooling has no dilation.
func avgPool(out, x Value, a *graph.Attrs) {
	div := float64(a.Kernel[0] * a.Kernel[1])
	poolWindows(x.Shape, out.Shape, a.Kernel, a.Stride, a.Padding, [2]int{1, 1}, func(oi int, taps []int) {
		s := 0.0
		for _, t := range taps {
			s += x.Data[t]
		}
		out.Data[oi] = s / div
	})
}

// avgPoolGrad sends g/(kh·kw) to every in-bounds element of each window.
func avgPoolGrad(out, g Value, a *graph.Attrs) {
	div := float64(a.Kernel[0] * a.Kernel[1])
	poolWindows(out.Shape, g.Shape, a.Kernel, a.Stride, a.Padding, [2]int{1, 1}, func(oi int, taps []int) {
		for _, t := range taps {
			out.Data[t] += g.Data[oi] / div
		}
	})
}
