package cpu_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
)

// refPool2d applies the direct definition of max or average pooling in
// float64. Max skips padded taps; average counts them as zeros and always
// divides by kh·kw.
func refPool2d(isMax bool, x []float64, xs []int, o lazy.PoolOptions) ([]int, []float64) {
	n, c, h, w := xs[0], xs[1], xs[2], xs[3]
	kh, kw := o.Kernel[0], o.Kernel[1]
	sh, sw := o.Stride[0], o.Stride[1]
	if sh == 0 {
		sh, sw = kh, kw
	}
	dh, dw := max(o.Dilation[0], 1), max(o.Dilation[1], 1)
	ph, pw := o.Padding[0], o.Padding[1]
	ho := (h+2*ph-dh*(kh-1)-1)/sh + 1
	wo := (w+2*pw-dw*(kw-1)-1)/sw + 1
	out := make([]float64, n*c*ho*wo)
	for p := range n * c {
		for y := range ho {
			for xo := range wo {
				m, s := math.Inf(-1), 0.0
				for ki := range kh {
					for kj := range kw {
						ih, iw := y*sh-ph+ki*dh, xo*sw-pw+kj*dw
						if ih < 0 || ih >= h || iw < 0 || iw >= w {
							continue
						}
						v := x[(p*h+ih)*w+iw]
						m = math.Max(m, v)
						s += v
					}
				}
				if isMax {
					out[(p*ho+y)*wo+xo] = m
				} else {
					out[(p*ho+y)*wo+xo] = s / float64(kh*kw)
				}
			}
		}
	}
	return []int{n, c, ho, wo}, out
}

type poolCase struct {
	name string
	xs   []int
	opt  lazy.PoolOptions
	// data, when set, makes the input from the seeded source.
	data func(rng *rand.Rand, n int) []float32
}

// ties draws small integers so that most windows hold repeated maxima.
func ties(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.IntN(3))
	}
	return v
}

// negative draws values in [−2, −1): a padding treated as 0 would win.
func negative(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(-1 - rng.Float64())
	}
	return v
}

// withNaN is random data with every 17th value NaN.
func withNaN(rng *rand.Rand, n int) []float32 {
	v := testutil.RandFloats(rng, n)
	for i := 0; i < n; i += 17 {
		v[i] = float32(math.NaN())
	}
	return v
}

func runPoolCases(t *testing.T, isMax bool, cases []poolCase) {
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(6, uint64(i)))
			gen := c.data
			if gen == nil {
				gen = testutil.RandFloats
			}
			xd := gen(rng, graph.Numel(c.xs))
			x := lazy.Wrap(mkDense(xd, c.xs...), 0)
			y := x.AvgPool2d(c.opt)
			if isMax {
				y = x.MaxPool2d(c.opt)
			}
			shape, got := runFor(t, y)
			wantShape, want := refPool2d(isMax, widen(xd), c.xs, c.opt)
			require.Equal(t, wantShape, shape)
			closeTo(t, want, got, poolRTol, poolATol)
		})
	}
}

func TestMaxPool2d(t *testing.T) {
	runPoolCases(t, true, []poolCase{
		{name: "2x2 default stride", xs: []int{2, 3, 8, 6}, opt: lazy.PoolOptions{Kernel: [2]int{2, 2}}},
		{name: "3x3 stride 2 padding 1", xs: []int{2, 3, 9, 8}, opt: lazy.PoolOptions{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}},
		{name: "stride differs from kernel, non-square", xs: []int{1, 2, 7, 11},
			opt: lazy.PoolOptions{Kernel: [2]int{2, 3}, Stride: [2]int{1, 2}, Padding: [2]int{1, 1}}},
		{name: "dilation 2", xs: []int{2, 2, 9, 9}, opt: lazy.PoolOptions{Kernel: [2]int{3, 2}, Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{2, 2}}},
		{name: "ties", xs: []int{2, 3, 8, 8}, opt: lazy.PoolOptions{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, data: ties},
		{name: "negative input, padding never wins", xs: []int{1, 2, 5, 6}, opt: lazy.PoolOptions{Kernel: [2]int{2, 2}, Stride: [2]int{1, 1}, Padding: [2]int{1, 1}}, data: negative},
		{name: "NaN propagates", xs: []int{1, 2, 6, 6}, opt: lazy.PoolOptions{Kernel: [2]int{2, 2}}, data: withNaN},
	})
}

func TestAvgPool2d(t *testing.T) {
	runPoolCases(t, false, []poolCase{
		{name: "2x2 default stride", xs: []int{2, 3, 8, 6}, opt: lazy.PoolOptions{Kernel: [2]int{2, 2}}},
		{name: "3x3 stride 2 padding 1", xs: []int{2, 3, 9, 8}, opt: lazy.PoolOptions{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}},
		{name: "non-square, stride 1, padding", xs: []int{1, 2, 7, 11},
			opt: lazy.PoolOptions{Kernel: [2]int{2, 3}, Stride: [2]int{1, 1}, Padding: [2]int{1, 1}}},
		{name: "negative input with padding", xs: []int{1, 2, 5, 6}, opt: lazy.PoolOptions{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}, data: negative},
	})
}
