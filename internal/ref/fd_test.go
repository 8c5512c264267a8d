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
	"github.com/batchfit/batchfit/shapeinfer"
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

// gradCase builds out = f(p) where p[0] is a data-less batched input (axis
// 0) and p[1:] are ParamSpec parameters; the checked loss is Σ out·r with r
// a fixed random weight, so every output element counts with its own
// coefficient. Chains start from p[0]: an op on free leaves alone would
// start a graph of its own.
type gradCase struct {
	name     string
	shapes   [][]int
	positive bool // draw inputs from [0.5, 2) instead of [−1, 1)
	build    func(p []*lazy.Tensor) *lazy.Tensor
}

func c3(x float32) *lazy.Tensor { return lazy.Const(tf([]int{3}, x, 2*x, -x)) }

var gradCases = []gradCase{
	{name: "neg", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Neg() }},
	{name: "exp", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Exp() }},
	{name: "log", shapes: [][]int{{2, 3}}, positive: true, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Log() }},
	{name: "sqrt", shapes: [][]int{{2, 3}}, positive: true, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Sqrt() }},
	{name: "abs", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Abs() }},
	{name: "tanh", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Tanh() }},
	{name: "sigmoid", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Sigmoid() }},
	{name: "relu", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Relu() }},
	{name: "gelu", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MulScalar(3).Gelu() }},
	{name: "gelu_tanh", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MulScalar(3).GeluTanh() }},
	{name: "scalar_ops", shapes: [][]int{{2, 3}}, positive: true, build: func(p []*lazy.Tensor) *lazy.Tensor {
		x := p[0]
		return x.AddScalar(1).SubScalar(0.5).RSubScalar(3).MulScalar(1.5).DivScalar(2).RDivScalar(2).Add(x.PowScalar(2.5))
	}},
	{name: "maximum_scalar", shapes: [][]int{{3, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MaximumScalar(0.1) }},
	{name: "add_sub_broadcast", shapes: [][]int{{2, 3}, {3}, {2, 1}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Add(p[1]).Sub(p[2])
	}},
	{name: "mul_div_broadcast", shapes: [][]int{{2, 3}, {3}, {2, 1}}, positive: true, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Mul(p[1]).Div(p[2])
	}},
	{name: "pow", shapes: [][]int{{2, 3}, {1, 3}}, positive: true, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Pow(p[1]) }},
	{name: "maximum", shapes: [][]int{{2, 3}, {3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Maximum(p[1]) }},
	{name: "matmul_batched", shapes: [][]int{{2, 3, 4}, {4, 2}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MatMul(p[1]) }},
	{name: "matmul_broadcast", shapes: [][]int{{2, 1, 3, 4}, {3, 4, 2}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].MatMul(p[1]) }},
	{name: "linear_rank3", shapes: [][]int{{2, 3, 4}, {5, 4}, {5}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Linear(p[1], p[2]) }},
	{name: "linear_rank1", shapes: [][]int{{4}, {3, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Linear(p[1], nil) }},
	{name: "sum_mean", shapes: [][]int{{2, 3, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Sum(1).Add(p[0].Mean(1)).Add(p[0].MeanKeepDim(0, 1).Reshape(4)).Add(p[0].SumKeepDim(1).Reshape(2, 4))
	}},
	{name: "max", shapes: [][]int{{3, 4, 2}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Max(1).Add(p[0].MaxKeepDim(0, 1).Reshape(2)) }},
	{name: "softmax", shapes: [][]int{{2, 4, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Softmax(1) }},
	{name: "log_softmax", shapes: [][]int{{3, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].LogSoftmax(0) }},
	{name: "layer_norm", shapes: [][]int{{2, 3, 4}, {3, 4}, {3, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].LayerNorm(p[1], p[2], 2, 1e-5)
	}},
	{name: "layer_norm_plain", shapes: [][]int{{3, 5}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].LayerNorm(nil, nil, 1, 1e-5) }},
	{name: "reshape_permute", shapes: [][]int{{2, 3, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Reshape(6, 4).Permute(1, 0).Reshape(2, 2, 6).Permute(2, 0, 1)
	}},
	{name: "slice_concat", shapes: [][]int{{4, 5}, {4, 2}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return lazy.Concat(1, p[0].SliceStep(1, 1, 5, 2), p[1], p[0].Slice(1, 0, 1)).Slice(0, 1, 3)
	}},
	{name: "embedding", shapes: [][]int{{5, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return lazy.Const(ti([]int{2, 3}, 4, 0, 4, 1, 1, 3)).Embedding(p[0])
	}},
	{name: "conv2d", shapes: [][]int{{2, 4, 6, 5}, {6, 2, 3, 2}, {6}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].Conv2d(p[1], p[2], lazy.ConvOptions{Stride: [2]int{2, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 2}, Groups: 2})
	}},
	{name: "max_pool2d", shapes: [][]int{{2, 2, 5, 5}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MaxPool2d(lazy.PoolOptions{Kernel: [2]int{3, 2}, Stride: [2]int{2, 1}, Padding: [2]int{1, 1}})
	}},
	{name: "avg_pool2d", shapes: [][]int{{2, 2, 5, 4}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].AvgPool2d(lazy.PoolOptions{Kernel: [2]int{2, 3}, Stride: [2]int{1, 2}, Padding: [2]int{1, 1}})
	}},
	{name: "cross_entropy", shapes: [][]int{{4, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		y := lazy.Const(ti([]int{4}, 2, 0, 1, 2))
		return p[0].CrossEntropy(y, graph.ReduceMean).Add(p[0].MulScalar(2).CrossEntropy(y, graph.ReduceSum))
	}},
	{name: "mse", shapes: [][]int{{3, 2}, {3, 2}}, build: func(p []*lazy.Tensor) *lazy.Tensor {
		return p[0].MSE(p[1], graph.ReduceMean).Add(p[0].Tanh().MSE(p[1], graph.ReduceSum))
	}},
	{name: "mixed_const", shapes: [][]int{{2, 3}}, build: func(p []*lazy.Tensor) *lazy.Tensor { return p[0].Mul(c3(0.5)).Add(c3(1)) }},
}

// buildCase builds c's graph, appends loss = Σ out·r and its backward pass,
// and returns the graph, the loss, the sources, their gradients and values.
func buildCase(t *testing.T, c gradCase, rng *rand.Rand) (g *graph.Graph, loss int, params, grads []int, vals map[int]Value) {
	t.Helper()
	ps := make([]*lazy.Tensor, len(c.shapes))
	ps[0] = lazy.Placeholder(c.shapes[0], graph.Float32, 0)
	for i, s := range c.shapes[1:] {
		ps[i+1] = lazy.ParamSpec(s, graph.Float32, fmt.Sprintf("p%d", i+1))
	}
	out := c.build(ps)
	require.NoError(t, out.Err())
	g = out.Graph().IR()
	vals = map[int]Value{}
	params = make([]int, len(ps))
	lo, hi := -1.0, 1.0
	if c.positive {
		lo, hi = 0.5, 2
	}
	for i, s := range c.shapes {
		if i == 0 {
			params[i] = ps[0].ID()
		} else {
			params[i] = paramID(t, g, fmt.Sprintf("p%d", i))
		}
		vals[params[i]] = randValue(rng, lo, hi, s...)
	}
	r, err := shapeinfer.AppendSource(g, graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: out.Shape(), DType: graph.Float32}})
	require.NoError(t, err)
	vals[r] = randValue(rng, -1, 1, out.Shape()...)
	prod, err := shapeinfer.Append(g, graph.Node{Op: graph.OpMul, Inputs: []int{out.ID(), r}})
	require.NoError(t, err)
	loss, err = shapeinfer.Append(g, graph.Node{Op: graph.OpSum, Inputs: []int{prod}})
	require.NoError(t, err)
	grads, err = autodiff.Backward(g, loss, params)
	require.NoError(t, err)
	return g, loss, params, grads, vals
}

func TestOpsFiniteDifferences(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	for _, c := range gradCases {
		t.Run(c.name, func(t *testing.T) {
			g, loss, params, grads, vals := buildCase(t, c, rng)
			fdCheck(t, g, loss, params, grads, vals)
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
	for _, c := range gradCases {
		g, _, _, _, _ := buildCase(t, c, rng)
		for _, n := range g.Nodes() {
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
