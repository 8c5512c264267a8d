package autodiff_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
)

// ops counts the ops of the nodes from id from on.
func opsFrom(g *graph.Graph, from int) map[graph.Op]int {
	n := map[graph.Op]int{}
	for id := from; id < g.Len(); id++ {
		n[g.Node(id).Op]++
	}
	return n
}

// Slices that tile an axis (q, k, v cut from one projection, in any order)
// get one concat of their gradients; any other set of slices gets a
// slice_grad each. Either way the gradient equals central finite
// differences (tolerance fdTol, as TestSharedParameterGradientsAdd).
func TestSliceGradientsOfATilingConcatenate(t *testing.T) {
	for _, c := range []struct {
		name    string
		cuts    [][2]int // slices of axis 1 of x [4, 6]
		concats int
		grads   int // slice_grad nodes
	}{
		{"three in order", [][2]int{{0, 2}, {2, 4}, {4, 6}}, 1, 0},
		{"three out of order", [][2]int{{4, 6}, {0, 2}, {2, 4}}, 1, 0},
		{"the whole axis", [][2]int{{0, 6}}, 0, 0},
		{"a gap", [][2]int{{0, 2}, {3, 6}}, 0, 2},
		{"an overlap", [][2]int{{0, 4}, {2, 6}}, 0, 2},
		{"one piece", [][2]int{{1, 5}}, 0, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(5, 6))
			w := lazy.Param(f32(rng, 6, 6), "w")
			g := lazy.NewGraph()
			x := g.Wrap(f32(rng, 4, 6), 0).MatMul(w) // [4, 6], batch axis 0
			var loss *lazy.Tensor
			for i, cut := range c.cuts {
				part := x.Slice(1, cut[0], cut[1]).Tanh().Mul(g.Wrap(f32(rng, 4, cut[1]-cut[0]), 0))
				if i%2 == 1 {
					part = part.Mul(part) // the pieces' gradients differ in form
				}
				if loss == nil {
					loss = part.Sum()
				} else {
					loss = loss.Add(part.Sum())
				}
			}
			require.NoError(t, loss.Err())
			before := g.IR().Len()
			grads := lazy.Grad(loss, w)
			require.NoError(t, grads[0].Err())
			ops := opsFrom(g.IR(), before)
			require.Equal(t, c.concats, ops[graph.OpConcat], "concat nodes")
			require.Equal(t, c.grads, ops[graph.OpSliceGrad], "slice_grad nodes")

			vals, err := ref.Eval(g.IR(), nil, grads[0].ID())
			require.NoError(t, err)
			got := vals[0]
			fd := fdGrad(t, g.IR(), loss.ID(), g.IR().NodeNamed("w"))
			for i, v := range got.Data {
				require.LessOrEqual(t, math.Abs(fd.Data[i]-v), fdTol*max(math.Abs(v), 1e-2),
					"element %d: autodiff %v, finite difference %v", i, v, fd.Data[i])
			}
		})
	}
}
