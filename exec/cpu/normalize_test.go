package cpu_test

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/batchfit/batchfit/lazy"
)

// refSoftmax evaluates every element from its whole line along axis.
func refSoftmax(x arr, axis int, log bool) arr {
	out := arr{shape: x.shape, v: make([]float64, len(x.v))}
	idx := make([]int, len(x.shape))
	line := make([]float64, x.shape[axis])
	for i := range x.v {
		unflatten(i, x.shape, idx)
		own := idx[axis]
		m := math.Inf(-1)
		for k := range line {
			idx[axis] = k
			line[k] = x.v[flatten(idx, x.shape)]
			m = math.Max(m, line[k])
		}
		var s float64
		for _, v := range line {
			s += math.Exp(v - m)
		}
		if log {
			out.v[i] = line[own] - m - math.Log(s)
		} else {
			out.v[i] = math.Exp(line[own]-m) / s
		}
	}
	return out
}

func TestSoftmax(t *testing.T) {
	shape := []int{3, 5, 4}
	cases := []struct {
		axis, norm int
		shift      float64 // added to the data: results must not overflow
	}{
		{1, 1, 0},  // middle axis
		{-1, 2, 0}, // contiguous rows
		{0, 0, 0},  // outermost
		{-2, 1, 80},
		{2, 2, 80},
	}
	for i, c := range cases {
		for _, log := range []bool{false, true} {
			t.Run(fmt.Sprintf("axis%d_shift%g_log%v", c.axis, c.shift, log), func(t *testing.T) {
				d := uniform(newRNG(300+uint64(i)), numel(shape), c.shift-4, c.shift+4)
				in := input(shape, d)
				y := in.Softmax(c.axis)
				if log {
					y = in.LogSoftmax(c.axis)
				}
				requireClose(t, refSoftmax(ref64(shape, d), c.norm, log), run(t, y))
			})
		}
	}
}

func refLayerNorm(x arr, k int, w, b []float32, eps float64) arr {
	inner := numel(x.shape[len(x.shape)-k:])
	out := arr{shape: x.shape, v: make([]float64, len(x.v))}
	for r := 0; r < len(x.v); r += inner {
		row := x.v[r : r+inner]
		var mean float64
		for _, v := range row {
			mean += v
		}
		mean /= float64(inner)
		var variance float64
		for _, v := range row {
			variance += (v - mean) * (v - mean)
		}
		variance /= float64(inner) // biased, as PyTorch
		for j, v := range row {
			y := (v - mean) / math.Sqrt(variance+eps)
			if w != nil {
				y *= float64(w[j])
			}
			if b != nil {
				y += float64(b[j])
			}
			out.v[r+j] = y
		}
	}
	return out
}

func TestLayerNorm(t *testing.T) {
	shape := []int{2, 3, 4, 5}
	const eps = 1e-5
	for _, k := range []int{1, 2, 3} {
		for _, affine := range []string{"none", "weight", "weight_bias"} {
			t.Run(fmt.Sprintf("dims%d_%s", k, affine), func(t *testing.T) {
				r := newRNG(400 + uint64(k))
				d := uniform(r, numel(shape), -3, 5)
				norm := slices.Clone(shape[len(shape)-k:])
				var w, b []float32
				var wt, bt *lazy.Tensor
				if affine != "none" {
					w = uniform(r, numel(norm), 0.5, 1.5)
					wt = param(norm, w)
				}
				if affine == "weight_bias" {
					b = uniform(r, numel(norm), -1, 1)
					bt = param(norm, b)
				}
				y := input(shape, d).LayerNorm(wt, bt, k, eps)
				requireClose(t, refLayerNorm(ref64(shape, d), k, w, b, eps), run(t, y))
			})
		}
	}
}
