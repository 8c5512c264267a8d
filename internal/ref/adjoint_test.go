package ref

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// Linear maps and their gradient ops are checked by the adjoint identity
// <A x, g> = <x, Aᵀ g> on random data. Tolerance: 1e-10 relative to the
// larger side (at least 1), far above float64 rounding on these sizes.
const adjTol = 1e-10

func requireAdjoint(t *testing.T, lhs, rhs float64) {
	t.Helper()
	require.Greater(t, math.Abs(lhs), 1e-6, "vacuous check: <Ax, g> is 0")
	require.LessOrEqual(t, math.Abs(lhs-rhs), adjTol*max(1, math.Abs(lhs), math.Abs(rhs)), "<Ax, g> = %v, <x, Aᵀg> = %v", lhs, rhs)
}

func f32Type(shape ...int) graph.Type {
	return graph.Type{Shape: shape, DType: graph.Float32, BatchAxis: -1}
}

// randFor draws a uniform [−1, 1) value for each source id in ids.
func randFor(rng *rand.Rand, d *dsl, ids ...int) map[int]Value {
	m := map[int]Value{}
	for _, id := range ids {
		m[id] = randValue(rng, -1, 1, d.shape(id)...)
	}
	return m
}

func TestConv2dAdjoint(t *testing.T) {
	cases := []struct {
		x, w             []int
		stride, pad, dil [2]int
		groups           int
	}{
		{x: []int{1, 1, 3, 3}, w: []int{1, 1, 2, 2}},
		{x: []int{2, 3, 5, 6}, w: []int{4, 3, 3, 2}, stride: [2]int{2, 1}, pad: [2]int{1, 0}},
		{x: []int{2, 4, 7, 7}, w: []int{6, 2, 3, 3}, stride: [2]int{2, 3}, pad: [2]int{2, 1}, dil: [2]int{2, 1}, groups: 2},
		{x: []int{1, 6, 4, 5}, w: []int{6, 1, 2, 3}, pad: [2]int{1, 1}, dil: [2]int{1, 2}, groups: 6}, // depthwise
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i, c := range cases {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			d := newDSL(t)
			x, w := d.param(c.x...), d.param(c.w...)
			a := graph.Attrs{Stride: c.stride, Padding: c.pad, Dilation: c.dil, Groups: c.groups}
			y := d.op(graph.OpConv2d, a, x, w)
			g := d.param(d.shape(y)...)
			ai, aw := a, a
			ai.Target, aw.Target = f32Type(c.x...), f32Type(c.w...)
			gx := d.op(graph.OpConv2dGradInput, ai, g, w)
			gw := d.op(graph.OpConv2dGradWeight, aw, g, x)
			in := randFor(rng, d, x, w, g)
			v := d.eval(in, y, gx, gw)
			requireAdjoint(t, dot(v[0], in[g]), dot(in[x], v[1]))
			requireAdjoint(t, dot(v[0], in[g]), dot(in[w], v[2]))
		})
	}
}

func TestPoolAdjoint(t *testing.T) {
	cases := []struct {
		x                        []int
		kernel, stride, pad, dil [2]int
	}{
		{x: []int{1, 1, 4, 4}, kernel: [2]int{2, 2}},
		{x: []int{2, 3, 5, 7}, kernel: [2]int{3, 2}, stride: [2]int{1, 2}, pad: [2]int{1, 1}},
		{x: []int{1, 2, 6, 6}, kernel: [2]int{2, 3}, stride: [2]int{2, 1}, pad: [2]int{1, 1}, dil: [2]int{2, 1}},
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for i, c := range cases {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			d := newDSL(t)
			x := d.param(c.x...)
			maxA := graph.Attrs{Kernel: c.kernel, Stride: c.stride, Padding: c.pad, Dilation: c.dil}
			avgA := graph.Attrs{Kernel: c.kernel, Stride: c.stride, Padding: c.pad}
			mp := d.op(graph.OpMaxPool2d, maxA, x)
			ap := d.op(graph.OpAvgPool2d, avgA, x)
			gm, ga := d.param(d.shape(mp)...), d.param(d.shape(ap)...)
			mg := d.op(graph.OpMaxPool2dGrad, maxA, gm, x)
			avgA.Target = f32Type(c.x...)
			ag := d.op(graph.OpAvgPool2dGrad, avgA, ga)
			in := randFor(rng, d, x, gm, ga)
			v := d.eval(in, mp, ap, mg, ag)
			// max pooling is linear in x once each window's argmax is fixed,
			// and its gradient routes g to exactly those argmaxes.
			requireAdjoint(t, dot(v[0], in[gm]), dot(in[x], v[2]))
			requireAdjoint(t, dot(v[1], in[ga]), dot(in[x], v[3]))
		})
	}
}

func TestSliceAdjoint(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, c := range []graph.Attrs{
		{Axis: 0, Start: 1, End: 4, Step: 1},
		{Axis: 1, Start: 0, End: 5, Step: 2},
		{Axis: 2, Start: 1, End: 4, Step: 3},
	} {
		d := newDSL(t)
		x := d.param(4, 5, 4)
		s := d.op(graph.OpSlice, c, x)
		g := d.param(d.shape(s)...)
		c.Target = f32Type(4, 5, 4)
		sg := d.op(graph.OpSliceGrad, c, g)
		in := randFor(rng, d, x, g)
		v := d.eval(in, s, sg)
		requireAdjoint(t, dot(v[0], in[g]), dot(in[x], v[1]))
	}
}

func TestExpandAdjointOfSum(t *testing.T) {
	// expand g [3, 1] → [2, 3, 4] is the adjoint of summing [2, 3, 4] over
	// axes 0 and 2 (keepdim gives [1, 3, 1], the same elements as g).
	rng := rand.New(rand.NewPCG(7, 8))
	d := newDSL(t)
	x := d.param(2, 3, 4)
	g := d.param(3, 1)
	sum := d.op(graph.OpSum, graph.Attrs{Axes: []int{0, 2}, KeepDim: true}, x)
	ex := d.op(graph.OpExpand, graph.Attrs{Target: f32Type(2, 3, 4)}, g)
	in := randFor(rng, d, x, g)
	v := d.eval(in, sum, ex)
	requireAdjoint(t, dot(v[0], in[g]), dot(in[x], v[1]))
}

func TestEmbeddingAdjoint(t *testing.T) {
	// Indices repeat, so the gradient must add rows, not overwrite them.
	rng := rand.New(rand.NewPCG(9, 10))
	d := newDSL(t)
	idx := d.src(graph.OpConst, graph.Int64, 3, 4)
	w := d.param(5, 6)
	e := d.op(graph.OpEmbedding, graph.Attrs{}, idx, w)
	g := d.param(d.shape(e)...)
	eg := d.op(graph.OpEmbeddingGrad, graph.Attrs{Target: f32Type(5, 6)}, g, idx)
	in := randFor(rng, d, w, g)
	in[idx] = val([]int{3, 4}, 0, 4, 4, 1, 2, 0, 3, 4, 1, 1, 0, 2)
	v := d.eval(in, e, eg)
	requireAdjoint(t, dot(v[0], in[g]), dot(in[w], v[1]))
}
