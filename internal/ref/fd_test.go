package ref

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// Finite-difference checks: gradients that autodiff appends, evaluated by
// Eval, against central differences (f(p+h) − f(p−h))/2h of the loss, also
// evaluated by Eval with overridden sources. Truncation error is O(h²) and
// rounding about ε·|f|/h ≈ 1e-10, so with h = 1e-6 the check holds at
// 1e-6 relative (measured against max(|grad|, 1e-2), so that near-zero
// entries are held to 1e-8 absolute).
const (
	fdStep = 1e-6
	fdTol  = 1e-6
)

// fdCheck compares the gradient nodes grads, d loss/d p for each source p
// in params, with central differences. vals must hold a value for every
// data-less source.
func fdCheck(t *testing.T, g *graph.Graph, loss int, params, grads []int, vals map[int]Value) {
	t.Helper()
	ad, err := Eval(g, vals, grads...)
	require.NoError(t, err)
	lossAt := func(over map[int]Value) float64 {
		v, err := Eval(g, over, loss)
		require.NoError(t, err)
		return v[0].Data[0]
	}
	for k, p := range params {
		base, ok := vals[p]
		if !ok { // a source holding data: perturb a copy of it
			v, err := Eval(g, nil, p)
			require.NoError(t, err)
			base = v[0]
		}
		require.Equal(t, base.Shape, ad[k].Shape, "gradient shape of node %d", p)
		over := map[int]Value{}
		for id, v := range vals {
			over[id] = v
		}
		for i := range base.Data {
			moved := base.Clone()
			moved.Data[i] = base.Data[i] + fdStep
			over[p] = moved
			plus := lossAt(over)
			moved.Data[i] = base.Data[i] - fdStep
			minus := lossAt(over)
			fd := (plus - minus) / (2 * fdStep)
			got := ad[k].Data[i]
			require.LessOrEqual(t, math.Abs(fd-got), fdTol*max(math.Abs(got), 1e-2),
				"d loss/d node %d (%s) element %d: autodiff %v, finite difference %v", p, g.Node(p).Op, i, got, fd)
		}
	}
}

func TestMLPFiniteDifferences(t *testing.T) {
	// linear → tanh → linear → cross_entropy (mean) on a batch of 6.
	rng := rand.New(rand.NewPCG(11, 12))
	const n, in, hidden, classes = 6, 4, 5, 3
	rnd := func(shape ...int) []float32 {
		d := make([]float32, graph.Numel(shape))
		for i := range d {
			d[i] = float32(rng.Float64()*2 - 1)
		}
		return d
	}
	labels := make([]int64, n)
	for i := range labels {
		labels[i] = int64(rng.IntN(classes))
	}
	x := lazy.Wrap(tf([]int{n, in}, rnd(n, in)...), 0)
	y := x.Graph().Wrap(ti([]int{n}, labels...), 0)
	w1 := lazy.Param(tf([]int{hidden, in}, rnd(hidden, in)...), "l1.weight")
	b1 := lazy.Param(tf([]int{hidden}, rnd(hidden)...), "l1.bias")
	w2 := lazy.Param(tf([]int{classes, hidden}, rnd(classes, hidden)...), "l2.weight")
	b2 := lazy.Param(tf([]int{classes}, rnd(classes)...), "l2.bias")
	loss := x.Linear(w1, b1).Tanh().Linear(w2, b2).CrossEntropy(y, graph.ReduceMean)
	grads := lazy.Grad(loss, w1, b1, w2, b2, x)
	ids := make([]int, len(grads))
	for i, gr := range grads {
		require.NoError(t, gr.Err())
		ids[i] = gr.ID()
	}
	ir := x.Graph().IR()
	params := []int{paramID(t, ir, "l1.weight"), paramID(t, ir, "l1.bias"), paramID(t, ir, "l2.weight"), paramID(t, ir, "l2.bias"), x.ID()}
	fdCheck(t, ir, loss.ID(), params, ids, map[int]Value{})
}

func TestOpsFiniteDifferences(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	for _, c := range Cases {
		if c.Ties || c.Rounds {
			continue // not differentiable at ties
		}
		t.Run(c.Name, func(t *testing.T) {
			b, err := c.Build(rng)
			require.NoError(t, err)
			fdCheck(t, b.Graph, b.Loss, b.Params, b.Grads, b.Vals)
		})
	}
}

func TestMatMulTransposeFiniteDifferences(t *testing.T) {
	// The lazy API has no transpose flags; append them directly.
	rng := rand.New(rand.NewPCG(15, 16))
	for _, tr := range [][2]bool{{true, false}, {false, true}, {true, true}} {
		t.Run(fmt.Sprint(tr), func(t *testing.T) {
			// op(A) is [2, 4, 3] and op(B) is [3, 5].
			aShape, bShape := []int{2, 4, 3}, []int{3, 5}
			if tr[0] {
				aShape = []int{2, 3, 4}
			}
			if tr[1] {
				bShape = []int{5, 3}
			}
			d := newDSL(t)
			a, b := d.param(aShape...), d.param(bShape...)
			mm := d.op(graph.OpMatMul, graph.Attrs{TransA: tr[0], TransB: tr[1]}, a, b)
			r := d.param(d.shape(mm)...)
			loss := d.op(graph.OpSum, graph.Attrs{}, d.op(graph.OpMul, graph.Attrs{}, mm, r))
			grads, err := autodiff.Backward(d.g, loss, []int{a, b})
			require.NoError(t, err)
			fdCheck(t, d.g, loss, []int{a, b}, grads, randFor(rng, d, a, b, r))
		})
	}
}

// TestFiniteDifferencesCoverEveryOp makes sure the checks above, with their
// backward passes, run every non-source op of the op table at least once.
func TestFiniteDifferencesCoverEveryOp(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 18))
	seen := make([]bool, graph.NumOps)
	for _, c := range Cases {
		b, err := c.Build(rng)
		require.NoError(t, err)
		for _, n := range b.Graph.Nodes() {
			seen[n.Op] = true
			if n.Op == graph.OpMatMul && (n.Attrs.TransA || n.Attrs.TransB) {
				seen[0] = true // stands for "a transposed matmul ran"
			}
		}
	}
	require.True(t, seen[0], "no matmul with transpose flags")
	var missing []string
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		if op.Category() != graph.CatSource && !seen[op] {
			missing = append(missing, op.String())
		}
	}
	slices.Sort(missing)
	require.Empty(t, missing)
}
