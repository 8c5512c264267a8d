package cpu_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
)

// refConv2d is the direct definition of a grouped, strided, padded, dilated
// NCHW convolution, in float64. b may be nil.
func refConv2d(x []float64, xs []int, w []float64, ws []int, b []float64, o lazy.ConvOptions) ([]int, []float64) {
	n, c, h, wd := xs[0], xs[1], xs[2], xs[3]
	oc, cg, kh, kw := ws[0], ws[1], ws[2], ws[3]
	g := max(o.Groups, 1)
	sh, sw := max(o.Stride[0], 1), max(o.Stride[1], 1)
	dh, dw := max(o.Dilation[0], 1), max(o.Dilation[1], 1)
	ph, pw := o.Padding[0], o.Padding[1]
	ho := (h+2*ph-dh*(kh-1)-1)/sh + 1
	wo := (wd+2*pw-dw*(kw-1)-1)/sw + 1
	og := oc / g
	out := make([]float64, n*oc*ho*wo)
	for ni := range n {
		for oi := range oc {
			gi := oi / og
			for y := range ho {
				for xo := range wo {
					var s float64
					if b != nil {
						s = b[oi]
					}
					for ci := range cg {
						cin := gi*cg + ci
						for ki := range kh {
							for kj := range kw {
								ih := y*sh - ph + ki*dh
								iw := xo*sw - pw + kj*dw
								if ih < 0 || ih >= h || iw < 0 || iw >= wd {
									continue
								}
								s += x[((ni*c+cin)*h+ih)*wd+iw] * w[((oi*cg+ci)*kh+ki)*kw+kj]
							}
						}
					}
					out[((ni*oc+oi)*ho+y)*wo+xo] = s
				}
			}
		}
	}
	return []int{n, oc, ho, wo}, out
}

func TestConv2d(t *testing.T) {
	cases := []struct {
		name   string
		xs, ws []int
		opt    lazy.ConvOptions
		bias   bool
	}{
		{"3x3 padding 1 with bias", []int{2, 3, 7, 9}, []int{4, 3, 3, 3}, lazy.ConvOptions{Padding: [2]int{1, 1}}, true},
		{"no padding no bias", []int{2, 3, 7, 9}, []int{4, 3, 3, 3}, lazy.ConvOptions{}, false},
		{"stride 2 padding 1", []int{2, 3, 9, 8}, []int{5, 3, 3, 3}, lazy.ConvOptions{Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, true},
		{"dilation 2", []int{1, 2, 10, 11}, []int{3, 2, 3, 2}, lazy.ConvOptions{Dilation: [2]int{2, 2}, Padding: [2]int{2, 1}}, false},
		{"groups 2", []int{2, 4, 6, 7}, []int{6, 2, 3, 3}, lazy.ConvOptions{Groups: 2, Padding: [2]int{1, 1}}, true},
		{"depthwise", []int{2, 5, 8, 6}, []int{5, 1, 3, 3}, lazy.ConvOptions{Groups: 5, Padding: [2]int{1, 1}}, false},
		{"depthwise multiplier 2 with bias", []int{2, 5, 8, 6}, []int{10, 1, 3, 3}, lazy.ConvOptions{Groups: 5, Stride: [2]int{2, 1}}, true},
		{"non-square kernel and input", []int{1, 3, 5, 12}, []int{2, 3, 2, 5}, lazy.ConvOptions{Stride: [2]int{1, 2}, Padding: [2]int{0, 2}}, true},
		{"1x1 kernel", []int{2, 6, 5, 4}, []int{3, 6, 1, 1}, lazy.ConvOptions{}, true},
		{"1x1 kernel stride 2", []int{2, 6, 5, 4}, []int{3, 6, 1, 1}, lazy.ConvOptions{Stride: [2]int{2, 2}}, false},
		{"1x1 kernel groups 3 padding 1", []int{1, 6, 4, 4}, []int{6, 2, 1, 1}, lazy.ConvOptions{Groups: 3, Padding: [2]int{1, 1}}, true},
		{"everything mixed", []int{3, 4, 9, 7}, []int{6, 2, 3, 2},
			lazy.ConvOptions{Stride: [2]int{2, 1}, Padding: [2]int{1, 2}, Dilation: [2]int{2, 3}, Groups: 2}, true},
		{"padding larger than kernel reach", []int{1, 2, 3, 3}, []int{2, 2, 2, 2}, lazy.ConvOptions{Padding: [2]int{3, 2}, Stride: [2]int{2, 3}}, true},
		{"many channels", []int{2, 32, 6, 6}, []int{8, 32, 3, 3}, lazy.ConvOptions{Padding: [2]int{1, 1}}, true},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(4, uint64(i)))
			xd := testutil.RandFloats(rng, graph.Numel(c.xs))
			wd := testutil.RandFloats(rng, graph.Numel(c.ws))
			var b *lazy.Tensor
			var bref []float64
			if c.bias {
				bd := testutil.RandFloats(rng, c.ws[0])
				b, bref = lazy.Param(mkDense(bd, c.ws[0]), "b"), widen(bd)
			}
			y := lazy.Wrap(mkDense(xd, c.xs...), 0).Conv2d(lazy.Param(mkDense(wd, c.ws...), "w"), b, c.opt)
			shape, got := runFor(t, y)
			wantShape, want := refConv2d(widen(xd), c.xs, widen(wd), c.ws, bref, c.opt)
			require.Equal(t, wantShape, shape)
			closeTo(t, want, got, gemmRTol, gemmATol)
		})
	}
}

func BenchmarkConv2d_N8_C64_32x32_k3x3_O64_pad1(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 0))
	x := lazy.Wrap(mkDense(testutil.RandFloats(rng, 8*64*32*32), 8, 64, 32, 32), 0)
	y := x.Conv2d(lazy.Param(mkDense(testutil.RandFloats(rng, 64*64*3*3), 64, 64, 3, 3), "w"),
		lazy.Param(mkDense(testutil.RandFloats(rng, 64), 64), "b"), lazy.ConvOptions{Padding: [2]int{1, 1}})
	benchRun(b, y, 2*8*64*32*32*64*3*3)
}
