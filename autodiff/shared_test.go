package autodiff_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
)

// Tolerances. Central differences with h = 1e-6 in float64 have truncation
// error O(h²) and rounding error about ε·|f|/h ≈ 1e-10, so autodiff's
// float64 gradient (ref.Eval of the appended nodes) must agree to 1e-6
// relative, measured against max(|grad|, 1e-2). The CPU executor runs in
// float32: its gradients are held to rtol 1e-4 of the float64 ones, with
// atol 1e-6 for entries near zero.
const (
	fdStep           = 1e-6
	fdTol            = 1e-6
	cpuRtol, cpuAtol = 1e-4, 1e-6
)

func f32(rng *rand.Rand, shape ...int) *tensor.Dense {
	d := make([]float32, graph.Numel(shape))
	for i := range d {
		d[i] = float32(rng.Float64()*2 - 1)
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

func i64(rng *rand.Rand, n, classes int) *tensor.Dense {
	d := make([]int64, n)
	for i := range d {
		d[i] = int64(rng.IntN(classes))
	}
	return tensor.New(tensor.WithShape(n), tensor.WithBacking(d))
}

// sharedCase builds a loss in which parameters a and b play two roles. With
// a == b the graph uses one parameter twice.
type sharedCase struct {
	name  string
	shape []int // of the parameter used twice
	build func(rng *rand.Rand, g *lazy.Graph, a, b *lazy.Tensor) *lazy.Tensor
}

var sharedCases = []sharedCase{
	{"x·W·W", []int{3, 3}, func(rng *rand.Rand, g *lazy.Graph, a, b *lazy.Tensor) *lazy.Tensor {
		x := g.Wrap(f32(rng, 4, 3), 0)
		r := g.Wrap(f32(rng, 4, 3), 0)
		return x.MatMul(a).MatMul(b).Tanh().Mul(r).Sum()
	}},
	{"tanh(x·Wᵀ) + x·W", []int{3, 3}, func(rng *rand.Rand, g *lazy.Graph, a, b *lazy.Tensor) *lazy.Tensor {
		x := g.Wrap(f32(rng, 4, 3), 0)
		r := g.Wrap(f32(rng, 4, 3), 0)
		return x.Linear(a, nil).Tanh().Add(x.MatMul(b)).Mul(r).Sum()
	}},
	{"x·(W⊙W)", []int{3, 2}, func(rng *rand.Rand, g *lazy.Graph, a, b *lazy.Tensor) *lazy.Tensor {
		x := g.Wrap(f32(rng, 4, 3), 0)
		r := g.Wrap(f32(rng, 4, 2), 0)
		return x.MatMul(a.Mul(b)).Mul(r).Sum()
	}},
	{"one bias in two layers", []int{3}, func(rng *rand.Rand, g *lazy.Graph, a, b *lazy.Tensor) *lazy.Tensor {
		x := g.Wrap(f32(rng, 4, 3), 0)
		y := g.Wrap(i64(rng, 4, 3), 0)
		w1, w2 := lazy.Param(f32(rng, 3, 3), "w1"), lazy.Param(f32(rng, 3, 3), "w2")
		return x.Linear(w1, a).Tanh().Linear(w2, b).CrossEntropy(y, graph.ReduceMean)
	}},
	{"tied embedding and output head", []int{5, 3}, func(rng *rand.Rand, g *lazy.Graph, a, b *lazy.Tensor) *lazy.Tensor {
		tokens := g.Wrap(i64(rng, 4, 5), 0)
		targets := g.Wrap(i64(rng, 4, 5), 0)
		return tokens.Embedding(a).Tanh().Linear(b, nil).CrossEntropy(targets, graph.ReduceMean)
	}},
}

// gradOf builds c with the given parameters from a rng seeded with seed (so
// both builds draw the same data) and evaluates the gradients of params in
// float64.
func gradOf(t *testing.T, c sharedCase, seed uint64, a, b *lazy.Tensor, params ...*lazy.Tensor) (*graph.Graph, *lazy.Tensor, []*lazy.Tensor, []ref.Value) {
	t.Helper()
	g := lazy.NewGraph()
	loss := c.build(rand.New(rand.NewPCG(seed, seed+1)), g, a, b)
	require.NoError(t, loss.Err())
	grads := lazy.Grad(loss, params...)
	ids := make([]int, len(grads))
	for i, gr := range grads {
		require.NoError(t, gr.Err())
		ids[i] = gr.ID()
	}
	vals, err := ref.Eval(g.IR(), nil, ids...)
	require.NoError(t, err)
	return g.IR(), loss, grads, vals
}

// fdGrad is the central difference of the loss in every element of source
// node p, evaluated in float64 by ref.Eval with p overridden.
func fdGrad(t *testing.T, g *graph.Graph, loss, p int) ref.Value {
	t.Helper()
	base, err := ref.FromTensor(g.Node(p).Value)
	require.NoError(t, err)
	lossAt := func(v ref.Value) float64 {
		out, err := ref.Eval(g, map[int]ref.Value{p: v}, loss)
		require.NoError(t, err)
		return out[0].Data[0]
	}
	fd := ref.Zeros(base.Shape...)
	for i := range base.Data {
		moved := base.Clone()
		moved.Data[i] = base.Data[i] + fdStep
		plus := lossAt(moved)
		moved.Data[i] = base.Data[i] - fdStep
		fd.Data[i] = (plus - lossAt(moved)) / (2 * fdStep)
	}
	return fd
}

// A parameter used twice gets the sum of both uses' gradients: equal to the
// gradients of two distinct parameters holding the same data, added; equal
// to central finite differences; and computed the same by the CPU executor.
func TestSharedParameterGradientsAdd(t *testing.T) {
	for k, c := range sharedCases {
		t.Run(c.name, func(t *testing.T) {
			seed := uint64(100 + k)
			data := f32(rand.New(rand.NewPCG(seed, 7)), c.shape...)
			w := lazy.Param(data, "w")
			g, loss, grads, shared := gradOf(t, c, seed, w, w, w)

			// Split: two parameters, same values, one use each.
			w1, w2 := lazy.Param(data.Clone().(*tensor.Dense), "w.1"), lazy.Param(data.Clone().(*tensor.Dense), "w.2")
			_, _, _, split := gradOf(t, c, seed, w1, w2, w1, w2)
			for i, v := range shared[0].Data {
				sum := split[0].Data[i] + split[1].Data[i]
				require.InDelta(t, sum, v, 1e-12*max(math.Abs(sum), 1), "element %d: shared %v, uses %v + %v", i, v, split[0].Data[i], split[1].Data[i])
			}
			// Both uses contribute: neither alone is the whole gradient.
			require.NotEqual(t, split[0].Data, shared[0].Data)
			require.NotEqual(t, split[1].Data, shared[0].Data)

			wid := g.NodeNamed("w")
			require.GreaterOrEqual(t, wid, 0)
			fd := fdGrad(t, g, loss.ID(), wid)
			for i, got := range shared[0].Data {
				require.LessOrEqual(t, math.Abs(fd.Data[i]-got), fdTol*max(math.Abs(got), 1e-2),
					"element %d: autodiff %v, finite difference %v", i, got, fd.Data[i])
			}

			out, err := cpu.New().Run(context.Background(), g, grads[0].ID())
			require.NoError(t, err)
			got := out[0].Data().([]float32)
			require.Len(t, got, len(shared[0].Data))
			for i, want := range shared[0].Data {
				require.InDelta(t, want, float64(got[i]), cpuAtol+cpuRtol*math.Abs(want), "element %d", i)
			}
		})
	}
}

// loss = Σ (x·W·W)² with x = [1 2] (a batch of one) and W = [[1 2] [3 4]],
// worked by hand:
//
//	y  = x·W  = [1·1+2·3, 1·2+2·4]      = [7 10]
//	z  = y·W  = [7·1+10·3, 7·2+10·4]    = [37 54]
//	loss      = 37² + 54² = 1369 + 2916 = 4285
//	dz = 2z                             = [74 108]
//	dy = dz·Wᵀ = [74·1+108·2, 74·3+108·4] = [290 654]
//	dW from z = y·W:  yᵀ·dz = [[7·74 7·108] [10·74 10·108]] = [[518 756] [740 1080]]
//	dW from y = x·W:  xᵀ·dy = [[1·290 1·654] [2·290 2·654]] = [[290 654] [580 1308]]
//	dW = sum          = [[808 1410] [1320 2388]]
//	dx = dy·Wᵀ = [290·1+654·2, 290·3+654·4] = [1598 3486]
//
// Every intermediate is an integer below 2²⁴, so float32 is exact too.
func TestSharedParameterByHand(t *testing.T) {
	x := lazy.Wrap(tensor.New(tensor.WithShape(1, 2), tensor.WithBacking([]float32{1, 2})), 0)
	w := lazy.Param(tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]float32{1, 2, 3, 4})), "w")
	z := x.MatMul(w).MatMul(w)
	loss := z.Mul(z).Sum()
	grads := lazy.Grad(loss, w, x)
	g := loss.Graph().IR()
	ids := []int{loss.ID(), grads[0].ID(), grads[1].ID()}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
	}
	want := [][]float64{{4285}, {808, 1410, 1320, 2388}, {1598, 3486}}

	vals, err := ref.Eval(g, nil, ids...)
	require.NoError(t, err)
	for i := range want {
		require.Equal(t, want[i], vals[i].Data, "ref output %d", i)
	}

	out, err := cpu.New().Run(context.Background(), g, ids...)
	require.NoError(t, err)
	require.Equal(t, float32(4285), out[0].Data())
	require.Equal(t, []float32{808, 1410, 1320, 2388}, out[1].Data())
	require.Equal(t, []float32{1598, 3486}, out[2].Data())
}
