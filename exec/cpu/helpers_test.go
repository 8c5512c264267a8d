package cpu_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/lazy"
)

// Tolerances for float32 results against float64 references: kernels
// compute in float64 and round once, so the error is a few float32 ulps.
const (
	rtol = 1e-5
	atol = 1e-6
)

// arr is a float64 reference value: row-major data and its shape.
type arr struct {
	shape []int
	v     []float64
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

func newRNG(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x5eed)) }

// uniform returns n float32 values in [lo, hi).
func uniform(r *rand.Rand, n int, lo, hi float64) []float32 {
	d := make([]float32, n)
	for i := range d {
		d[i] = float32(lo + (hi-lo)*r.Float64())
	}
	return d
}

// signed returns n values with magnitude in [lo, hi) and a random sign, for
// operands that must stay away from zero (divisors).
func signed(r *rand.Rand, n int, lo, hi float64) []float32 {
	d := uniform(r, n, lo, hi)
	for i := range d {
		if r.IntN(2) == 0 {
			d[i] = -d[i]
		}
	}
	return d
}

// ref64 widens float32 data into a reference value.
func ref64(shape []int, d []float32) arr {
	v := make([]float64, len(d))
	for i, x := range d {
		v[i] = float64(x)
	}
	return arr{shape: slices.Clone(shape), v: v}
}

func dense(shape []int, d []float32) *tensor.Dense {
	if len(shape) == 0 {
		return tensor.New(tensor.WithShape(), tensor.WithBacking([]float32{d[0]}))
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

func denseInt(shape []int, d []int64) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

// input wraps data as the graph's batched input (batch axis 0).
func input(shape []int, d []float32) *lazy.Tensor { return lazy.Wrap(dense(shape, d), 0) }

// param makes a parameter, which may be a scalar.
func param(shape []int, d []float32) *lazy.Tensor { return lazy.Param(dense(shape, d), "p") }

// run evaluates y over its full batch.
func run(t *testing.T, y *lazy.Tensor) *tensor.Dense {
	t.Helper()
	require.NoError(t, y.Err())
	res, err := cpu.New().Run(context.Background(), y.Graph().IR(), y.ID())
	require.NoError(t, err)
	require.Len(t, res, 1)
	return res[0]
}

func shapeOf(d *tensor.Dense) []int {
	if d.Shape().IsScalar() {
		return []int{}
	}
	return []int(d.Shape())
}

func floats(t *testing.T, d *tensor.Dense) []float32 {
	t.Helper()
	switch v := d.Data().(type) {
	case []float32:
		return v
	case float32:
		return []float32{v}
	}
	t.Fatalf("result holds %T, want float32 data", d.Data())
	return nil
}

// requireClose checks got against want elementwise within atol + rtol·|want|.
func requireClose(t *testing.T, want arr, got *tensor.Dense) {
	t.Helper()
	require.Equal(t, want.shape, shapeOf(got), "shape")
	g := floats(t, got)
	require.Len(t, g, len(want.v))
	for i, w := range want.v {
		diff := math.Abs(float64(g[i]) - w)
		if !(diff <= atol+rtol*math.Abs(w)) {
			t.Fatalf("element %d: got %g, want %g (|diff| %g > atol %g + rtol %g·|want|)", i, g[i], w, diff, atol, rtol)
		}
	}
}

// unflatten writes the multi-index of flat position i of shape into idx.
func unflatten(i int, shape, idx []int) {
	for k := len(shape) - 1; k >= 0; k-- {
		idx[k] = i % shape[k]
		i /= shape[k]
	}
}

func flatten(idx, shape []int) int {
	i := 0
	for k, d := range shape {
		i = i*d + idx[k]
	}
	return i
}

// refMap applies f to every element.
func refMap(a arr, f func(float64) float64) arr {
	out := arr{shape: a.shape, v: make([]float64, len(a.v))}
	for i, x := range a.v {
		out.v[i] = f(x)
	}
	return out
}

// refBroadcast applies f with NumPy broadcasting, index by index.
func refBroadcast(a, b arr, f func(x, y float64) float64) arr {
	r := max(len(a.shape), len(b.shape))
	dim := func(s []int, k int) int { // size of output axis k in s, 1 if s lacks it
		if j := k - (r - len(s)); j >= 0 {
			return s[j]
		}
		return 1
	}
	shape := make([]int, r)
	for k := range shape {
		shape[k] = max(dim(a.shape, k), dim(b.shape, k))
		if dim(a.shape, k) == 0 || dim(b.shape, k) == 0 {
			shape[k] = 0
		}
	}
	pick := func(s []int, idx []int) int { // flat position in s read at output index idx
		j := make([]int, len(s))
		for k := range s {
			if s[k] != 1 {
				j[k] = idx[k+r-len(s)]
			}
		}
		return flatten(j, s)
	}
	out := arr{shape: shape, v: make([]float64, numel(shape))}
	idx := make([]int, r)
	for i := range out.v {
		unflatten(i, shape, idx)
		out.v[i] = f(a.v[pick(a.shape, idx)], b.v[pick(b.shape, idx)])
	}
	return out
}

// refReduce folds the elements sharing an index outside axes (non-negative).
func refReduce(x arr, axes []int, keep bool, init float64, f func(acc, v float64) float64) arr {
	kshape := slices.Clone(x.shape)
	var shape []int
	for k, d := range x.shape {
		if slices.Contains(axes, k) {
			kshape[k] = 1
			if keep {
				shape = append(shape, 1)
			}
			continue
		}
		shape = append(shape, d)
	}
	if shape == nil {
		shape = []int{}
	}
	out := arr{shape: shape, v: make([]float64, numel(shape))}
	for i := range out.v {
		out.v[i] = init
	}
	idx := make([]int, len(x.shape))
	for i, v := range x.v {
		unflatten(i, x.shape, idx)
		for _, ax := range axes {
			idx[ax] = 0
		}
		o := flatten(idx, kshape)
		out.v[o] = f(out.v[o], v)
	}
	return out
}
