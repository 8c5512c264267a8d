package cpu_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
)

// refMatMul multiplies the last two axes of x and y in float64, broadcasting
// the leading axes into lead.
func refMatMul(x []float64, xs []int, y []float64, ys []int, lead []int) []float64 {
	m, k, n := xs[len(xs)-2], xs[len(xs)-1], ys[len(ys)-1]
	xl, yl := xs[:len(xs)-2], ys[:len(ys)-2]
	batches := graph.Numel(lead)
	out := make([]float64, batches*m*n)
	idx := make([]int, len(lead))
	for bi := range batches {
		unravel(bi, lead, idx)
		xo := bcastOffset(idx, xl) * m * k
		yo := bcastOffset(idx, yl) * k * n
		for i := range m {
			for j := range n {
				var s float64
				for p := range k {
					s += x[xo+i*k+p] * y[yo+p*n+j]
				}
				out[(bi*m+i)*n+j] = s
			}
		}
	}
	return out
}

func TestMatMul(t *testing.T) {
	cases := []struct {
		name           string
		xs, ys         []int
		xBatch, yBatch int // axis wrapped as the batch, or −1 for a parameter
		want           []int
	}{
		{"2d", []int{7, 13}, []int{13, 5}, 0, -1, []int{7, 5}},
		{"x batched, y one matrix", []int{2, 3, 4, 5}, []int{5, 6}, 0, -1, []int{2, 3, 4, 6}},
		{"x one matrix, y batched", []int{4, 5}, []int{2, 3, 5, 6}, -1, 0, []int{2, 3, 4, 6}},
		{"x broadcasts axis 1, y axis 0", []int{2, 1, 4, 5}, []int{3, 5, 6}, 0, -1, []int{2, 3, 4, 6}},
		{"y broadcasts axis 1, x axis 0", []int{3, 4, 5}, []int{2, 1, 5, 6}, -1, 0, []int{2, 3, 4, 6}},
		{"both rank 4, crossed size-1 axes", []int{2, 1, 4, 5}, []int{1, 3, 5, 6}, 0, -1, []int{2, 3, 4, 6}},
		{"attention scores", []int{2, 3, 16, 8}, []int{2, 3, 8, 16}, 0, 0, []int{2, 3, 16, 16}},
		{"attention values", []int{2, 3, 16, 16}, []int{2, 3, 16, 8}, 0, 0, []int{2, 3, 16, 8}},
		{"long inner dimension", []int{3, 300}, []int{300, 4}, 0, -1, []int{3, 4}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, uint64(i)))
			xd := testutil.RandFloats(rng, graph.Numel(c.xs))
			yd := testutil.RandFloats(rng, graph.Numel(c.ys))
			g := lazy.NewGraph()
			operand := func(d []float32, s []int, batch int, name string) *lazy.Tensor {
				if batch < 0 {
					return lazy.Param(mkDense(d, s...), name)
				}
				return g.Wrap(mkDense(d, s...), batch)
			}
			y := operand(xd, c.xs, c.xBatch, "x").MatMul(operand(yd, c.ys, c.yBatch, "y"))
			shape, got := runFor(t, y)
			require.Equal(t, c.want, shape)
			want := refMatMul(widen(xd), c.xs, widen(yd), c.ys, c.want[:len(c.want)-2])
			closeTo(t, want, got, gemmRTol, gemmATol)
		})
	}
}

// refLinear is x·wᵀ + b over x flattened to rows of in features.
func refLinear(x, w, b []float64, in, out int) []float64 {
	rows := len(x) / in
	y := make([]float64, rows*out)
	for r := range rows {
		for o := range out {
			var s float64
			if b != nil {
				s = b[o]
			}
			for i := range in {
				s += x[r*in+i] * w[o*in+i]
			}
			y[r*out+o] = s
		}
	}
	return y
}

func TestLinear(t *testing.T) {
	cases := []struct {
		name    string
		xs      []int
		in, out int
		bias    bool
	}{
		{"no bias", []int{5, 12}, 12, 7, false},
		{"bias", []int{5, 12}, 12, 7, true},
		{"3-d input with bias", []int{3, 4, 12}, 12, 9, true},
		{"3-d input without bias", []int{3, 4, 200}, 200, 6, false},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(2, uint64(i)))
			xd := testutil.RandFloats(rng, graph.Numel(c.xs))
			wd := testutil.RandFloats(rng, c.out*c.in)
			w := lazy.Param(mkDense(wd, c.out, c.in), "w")
			var b *lazy.Tensor
			var bref []float64
			if c.bias {
				bd := testutil.RandFloats(rng, c.out)
				b, bref = lazy.Param(mkDense(bd, c.out), "b"), widen(bd)
			}
			y := lazy.Wrap(mkDense(xd, c.xs...), 0).Linear(w, b)
			shape, got := runFor(t, y)
			want := append(append([]int(nil), c.xs[:len(c.xs)-1]...), c.out)
			require.Equal(t, want, shape)
			closeTo(t, refLinear(widen(xd), widen(wd), bref, c.in, c.out), got, gemmRTol, gemmATol)
		})
	}
}

func BenchmarkMatMul_512x512x512(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 0))
	x := lazy.Wrap(mkDense(testutil.RandFloats(rng, 512*512), 512, 512), 0)
	y := x.MatMul(lazy.Param(mkDense(testutil.RandFloats(rng, 512*512), 512, 512), "w"))
	benchRun(b, y, 2*512*512*512)
}

func BenchmarkLinear_256x784_to_512_bias(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 1))
	x := lazy.Wrap(mkDense(testutil.RandFloats(rng, 256*784), 256, 784), 0)
	y := x.Linear(lazy.Param(mkDense(testutil.RandFloats(rng, 512*784), 512, 784), "w"),
		lazy.Param(mkDense(testutil.RandFloats(rng, 512), 512), "b"))
	benchRun(b, y, 2*256*784*512)
}
