package cpu_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/lazy"
)

// Movement ops only copy elements, so results must match exactly. The
// references map each output index to its source index one element at a
// time; pick applies such a map to float or int64 data.

// sourceIndex lists, for each output element, the input and the flat
// position in it that the element comes from.
type sourceIndex func(out []int) (input int, at []int)

func refMove(outShape []int, inShapes [][]int, src sourceIndex) (which, flat []int) {
	n := numel(outShape)
	which, flat = make([]int, n), make([]int, n)
	idx := make([]int, len(outShape))
	for i := range n {
		unflatten(i, outShape, idx)
		k, at := src(idx)
		which[i], flat[i] = k, flatten(at, inShapes[k])
	}
	return which, flat
}

func pick[T any](ins [][]T, which, flat []int) []T {
	out := make([]T, len(flat))
	for i := range out {
		out[i] = ins[which[i]][flat[i]]
	}
	return out
}

func ints(t *testing.T, d *tensor.Dense) []int64 {
	t.Helper()
	v, ok := d.Data().([]int64)
	require.True(t, ok, "result holds %T, want []int64", d.Data())
	return v
}

func randInts(seed uint64, n int) []int64 {
	r := newRNG(seed)
	d := make([]int64, n)
	for i := range d {
		d[i] = r.Int64N(1000) - 500
	}
	return d
}

func permuteSource(perm []int) sourceIndex {
	return func(out []int) (int, []int) {
		at := make([]int, len(out))
		for k, p := range perm {
			at[p] = out[k]
		}
		return 0, at
	}
}

func TestPermute(t *testing.T) {
	shape := []int{2, 3, 4, 5}
	cases := [][]int{{2, 0, 3, 1}, {3, 2, 1, 0}, {0, 1, 3, 2}, {1, 0, 2, 3}, {0, 1, 2, 3}, {-1, 0, -2, 1}}
	for i, perm := range cases {
		t.Run(fmt.Sprint(perm), func(t *testing.T) {
			norm := make([]int, len(perm))
			outShape := make([]int, len(perm))
			for k, p := range perm {
				norm[k] = (p + len(shape)) % len(shape)
				outShape[k] = shape[norm[k]]
			}
			which, flat := refMove(outShape, [][]int{shape}, permuteSource(norm))

			d := uniform(newRNG(500+uint64(i)), numel(shape), -5, 5)
			got := run(t, input(shape, d).Permute(perm...))
			require.Equal(t, outShape, shapeOf(got))
			require.Equal(t, pick([][]float32{d}, which, flat), floats(t, got))

			di := randInts(510+uint64(i), numel(shape))
			goti := run(t, lazy.Wrap(denseInt(shape, di), 0).Permute(perm...))
			require.Equal(t, outShape, shapeOf(goti))
			require.Equal(t, pick([][]int64{di}, which, flat), ints(t, goti))
		})
	}
}

// TestReshape reshapes a permuted value, whose buffer order differs from its
// input's, then checks every element against the permutation reference.
func TestReshape(t *testing.T) {
	shape := []int{4, 3, 2}
	d := uniform(newRNG(520), numel(shape), -5, 5)
	y := input(shape, d).Permute(2, 0, 1).Reshape(2, -1)
	got := run(t, y)
	require.Equal(t, []int{2, 12}, shapeOf(got))
	which, flat := refMove([]int{2, 4, 3}, [][]int{shape}, permuteSource([]int{2, 0, 1}))
	require.Equal(t, pick([][]float32{d}, which, flat), floats(t, got))

	di := randInts(521, numel(shape))
	goti := run(t, lazy.Wrap(denseInt(shape, di), 0).Reshape(-1))
	require.Equal(t, di, ints(t, goti))
}

func TestSlice(t *testing.T) {
	shape := []int{4, 6, 5}
	cases := []struct{ axis, norm, start, end, step int }{
		{1, 1, 1, 6, 2},
		{-1, 2, 0, 5, 3},
		{2, 2, 4, 5, 1},
		{0, 0, 1, 3, 1},
		{1, 1, 0, 6, 1},
		{1, 1, 2, 5, 7}, // step past the end: one element
	}
	for i, c := range cases {
		t.Run(fmt.Sprintf("axis%d_%d:%d:%d", c.axis, c.start, c.end, c.step), func(t *testing.T) {
			outShape := append([]int(nil), shape...)
			outShape[c.norm] = (c.end - c.start + c.step - 1) / c.step
			which, flat := refMove(outShape, [][]int{shape}, func(out []int) (int, []int) {
				at := append([]int(nil), out...)
				at[c.norm] = c.start + out[c.norm]*c.step
				return 0, at
			})

			d := uniform(newRNG(530+uint64(i)), numel(shape), -5, 5)
			got := run(t, input(shape, d).SliceStep(c.axis, c.start, c.end, c.step))
			require.Equal(t, outShape, shapeOf(got))
			require.Equal(t, pick([][]float32{d}, which, flat), floats(t, got))

			di := randInts(540+uint64(i), numel(shape))
			goti := run(t, lazy.Wrap(denseInt(shape, di), 0).SliceStep(c.axis, c.start, c.end, c.step))
			require.Equal(t, pick([][]int64{di}, which, flat), ints(t, goti))
		})
	}
}

func TestConcat(t *testing.T) {
	cases := []struct {
		axis, norm int
		shapes     [][]int
	}{
		{1, 1, [][]int{{2, 3, 4}, {2, 1, 4}, {2, 5, 4}}}, // three inputs, middle axis
		{0, 0, [][]int{{2, 3}, {4, 3}, {1, 3}}},
		{-1, 2, [][]int{{2, 3, 1}, {2, 3, 4}, {2, 3, 2}}},
		{1, 1, [][]int{{3, 2}}},
	}
	for ci, c := range cases {
		t.Run(fmt.Sprintf("axis%d_%v", c.axis, c.shapes), func(t *testing.T) {
			outShape := append([]int(nil), c.shapes[0]...)
			outShape[c.norm] = 0
			for _, s := range c.shapes {
				outShape[c.norm] += s[c.norm]
			}
			which, flat := refMove(outShape, c.shapes, func(out []int) (int, []int) {
				at := append([]int(nil), out...)
				k := 0
				for at[c.norm] >= c.shapes[k][c.norm] {
					at[c.norm] -= c.shapes[k][c.norm]
					k++
				}
				return k, at
			})

			g := lazy.NewGraph()
			var fs, is []*lazy.Tensor
			var fd [][]float32
			var id [][]int64
			for k, s := range c.shapes {
				d := uniform(newRNG(550+uint64(10*ci+k)), numel(s), -5, 5)
				di := randInts(560+uint64(10*ci+k), numel(s))
				fd, id = append(fd, d), append(id, di)
				// Inputs share one graph, so their batch axes (axis 0) must
				// agree: later ones are parameters.
				if k == 0 {
					fs = append(fs, g.Wrap(dense(s, d), 0))
				} else {
					fs = append(fs, param(s, d))
				}
				is = append(is, lazy.Const(denseInt(s, di)))
			}
			got := run(t, lazy.Concat(c.axis, fs...))
			require.Equal(t, outShape, shapeOf(got))
			require.Equal(t, pick(fd, which, flat), floats(t, got))

			goti := run(t, lazy.Concat(c.axis, is...))
			require.Equal(t, outShape, shapeOf(goti))
			require.Equal(t, pick(id, which, flat), ints(t, goti))
		})
	}
}
