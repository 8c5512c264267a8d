package graph_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
)

func countOp(g *graph.Graph, op graph.Op) int {
	n := 0
	for _, nd := range g.Nodes() {
		if nd.Op == op {
			n++
		}
	}
	return n
}

// A forward RMSNorm written out, x·(mean(x²)+ε)^−½·w, is one
// fused_pointwise node giving only y: its five intermediates are never
// stored.
func TestFusePointwiseForwardRMSNorm(t *testing.T) {
	x := lazy.Placeholder([]int{4, 6, 16}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{16}, graph.Float32, "w")
	y := x.Mul(x.Mul(x).MeanKeepDim(-1).AddScalar(1e-5).PowScalar(-0.5)).Mul(w)
	require.NoError(t, y.Err())
	g := y.Graph().IR()
	fg, ids, err := graph.FusePointwise(g, []int{y.ID()})
	require.NoError(t, err)
	require.Equal(t, 1, countOp(fg, graph.OpFusedPointwise))
	assert.Equal(t, 3, fg.Len(), "x, w and the fused node")
	out := fg.Node(ids[y.ID()])
	require.Equal(t, graph.OpFusedPointwise, out.Op)
	assert.Equal(t, g.Node(y.ID()).Type, out.Type)
	assert.Len(t, out.Attrs.Pointwise.Outs, 1)
	assert.True(t, out.Attrs.Pointwise.HasReduce())
}

// A group never reads, through a node outside it, a value of its own:
// exp(x) feeds a matmul whose product is added to exp(x), so the add
// cannot join exp's group; each is a group of one and left alone.
func TestFusePointwiseNoCycle(t *testing.T) {
	x := lazy.Placeholder([]int{4, 8}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{8, 8}, graph.Float32, "w")
	e := x.Exp()
	y := e.Add(e.MatMul(w)).Tanh()
	require.NoError(t, y.Err())
	fg, _, err := graph.FusePointwise(y.Graph().IR(), []int{y.ID()})
	require.NoError(t, err)
	require.Equal(t, 1, countOp(fg, graph.OpFusedPointwise), "add and tanh fuse; exp stays")
	assert.Equal(t, 1, countOp(fg, graph.OpExp))
	assert.Equal(t, 1, countOp(fg, graph.OpMatMul))
}

// Save or recompute: in a training graph of an RMSNorm written out and a
// linear layer after it, the backward group recomputes x·r from x (which
// backward reads anyway) rather than keeping it, so the forward group
// gives the norm (the linear's input) and per-row values only. The
// unfused graph keeps x·r, a value of x's size.
func TestFusePointwiseRecomputesForBackward(t *testing.T) {
	x := lazy.Placeholder([]int{4, 6, 16}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{16}, graph.Float32, "w")
	lw := lazy.ParamSpec([]int{16, 16}, graph.Float32, "lw")
	xr := x.Mul(x.Mul(x).MeanKeepDim(-1).AddScalar(1e-5).PowScalar(-0.5))
	norm := xr.Mul(w)
	y := norm.MatMul(lw).Tanh().Sum()
	require.NoError(t, y.Err())
	g := y.Graph().IR()
	wrt, err := lazy.ParamIDs(y, w, lw)
	require.NoError(t, err)
	grads, err := autodiff.Backward(g, y.ID(), append([]int{x.ID()}, wrt...))
	require.NoError(t, err)
	fg, ids, err := graph.FusePointwise(g, append([]int{y.ID()}, grads...))
	require.NoError(t, err)
	assert.Equal(t, -1, ids[xr.ID()], "x·r is not stored")
	nd := fg.Node(ids[norm.ID()])
	require.Equal(t, graph.OpFusedPointwise, nd.Op)
	var shapes [][]int
	for _, in := range nd.Inputs {
		shapes = append(shapes, fg.Node(in).Type.Shape)
	}
	p := nd.Attrs.Pointwise
	row, err := p.Rows(graph.RowInputs(shapes, []int{4, 6, 16}))
	require.NoError(t, err)
	full := 0
	for _, o := range p.Outs {
		if !row[o.Node] {
			full++
		}
	}
	assert.Equal(t, 1, full, "the forward group gives the norm and nothing else of x's size: %s", p.Text())
	assert.Less(t, fg.Len(), g.Len())
}

// Nodes an executor pairs (graph.CompanionProducer) stay as they are: a
// float32 add feeding an rms_norm keeps its add.
func TestFusePointwiseKeepsCompanions(t *testing.T) {
	x := lazy.Placeholder([]int{4, 16}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{16}, graph.Float32, "w")
	h := x.Tanh().Add(x)
	n := h.RMSNorm(w, 1e-5)
	y := n.Exp().Neg()
	require.NoError(t, y.Err())
	g := y.Graph().IR()
	require.Equal(t, h.ID(), graph.CompanionProducer(g, n.ID()), "the add is the norm's producer")
	fg, _, err := graph.FusePointwise(g, []int{y.ID(), h.ID()})
	require.NoError(t, err)
	assert.Equal(t, 1, countOp(fg, graph.OpAdd))
	assert.Equal(t, 1, countOp(fg, graph.OpRMSNorm))
	assert.Equal(t, 1, countOp(fg, graph.OpFusedPointwise), "exp and neg")
}

// Two groups that would read each other through plain nodes (exp(x) + a
// product of neg(tanh(y)), and tanh(y) times a product of exp(x)) are a
// cycle once each is one node: both are left as plain nodes.
func TestFusePointwiseTwoGroupCycle(t *testing.T) {
	x := lazy.Placeholder([]int{4, 8}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{4, 8}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{8, 8}, graph.Float32, "w")
	a1 := x.Exp()
	b0 := y.Tanh()
	b1 := b0.Mul(a1.MatMul(w))
	b2 := b0.Neg()
	a2 := a1.Add(b2.MatMul(w))
	require.NoError(t, a2.Err())
	require.NoError(t, b1.Err())
	g := a2.Graph().IR()
	fg, ids, err := graph.FusePointwise(g, []int{a2.ID(), b1.ID()})
	require.NoError(t, err)
	assert.Equal(t, 0, countOp(fg, graph.OpFusedPointwise))
	assert.Equal(t, g.Len(), fg.Len())
	assert.GreaterOrEqual(t, ids[a2.ID()], 0)
}

// kernelOf is the fused_pointwise node whose kernel gives node id of fg:
// the group's first node (graph.FusedPointwiseProducer), or id itself.
func kernelOf(t *testing.T, fg *graph.Graph, id int) int {
	t.Helper()
	require.Equal(t, graph.OpFusedPointwise, fg.Node(id).Op, "node %d", id)
	if p := graph.FusedPointwiseProducer(fg, id); p >= 0 {
		return p
	}
	return id
}

// Sibling groups: the backward of silu(a)·b reads its output gradient g
// in b's gradient g·silu(a) and in a's, silu_grad(g·b, a). Each is a
// group of its own (g comes from a matmul, outside any group); they merge
// into one kernel that reads g, a and b once and gives both gradients.
// With the merge disabled by a cycle (b's gradient feeding a's through a
// matmul) they stay two kernels.
func TestFusePointwiseMergesSiblings(t *testing.T) {
	x := lazy.Placeholder([]int{4, 6, 16}, graph.Float32, 0)
	wa := lazy.ParamSpec([]int{16, 32}, graph.Float32, "wa")
	wb := lazy.ParamSpec([]int{16, 32}, graph.Float32, "wb")
	wo := lazy.ParamSpec([]int{32, 16}, graph.Float32, "wo")
	a, b := x.MatMul(wa), x.MatMul(wb)
	loss := a.Silu().Mul(b).MatMul(wo).Tanh().Sum()
	require.NoError(t, loss.Err())
	g := loss.Graph().IR()
	grads, err := autodiff.Backward(g, loss.ID(), []int{a.ID(), b.ID()})
	require.NoError(t, err)
	fg, ids, err := graph.FusePointwise(g, append([]int{loss.ID()}, grads...))
	require.NoError(t, err)
	ga, gb := ids[grads[0]], ids[grads[1]]
	require.GreaterOrEqual(t, ga, 0)
	require.GreaterOrEqual(t, gb, 0)
	assert.Equal(t, kernelOf(t, fg, ga), kernelOf(t, fg, gb), "a's and b's gradients come from one kernel")
	assert.Len(t, fg.Node(ga).Attrs.Pointwise.Outs, 2)
}

// Two groups reading one value stay apart when merging them would make a
// cycle: u = exp(x)·2 feeds a matmul whose product v is added to tanh(x),
// so a kernel giving both would read its own output.
func TestFusePointwiseSiblingsNoCycle(t *testing.T) {
	x0 := lazy.Placeholder([]int{4, 8}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{8, 8}, graph.Float32, "w")
	w2 := lazy.ParamSpec([]int{8, 8}, graph.Float32, "w2")
	x := x0.MatMul(w2) // outside any group, read by both
	u := x.Exp().MulScalar(2)
	v := x.Tanh().Neg().Add(u.MatMul(w))
	require.NoError(t, v.Err())
	fg, ids, err := graph.FusePointwise(v.Graph().IR(), []int{v.ID(), u.ID()})
	require.NoError(t, err)
	require.Equal(t, 2, countOp(fg, graph.OpFusedPointwise), "exp·2 and tanh, neg, add: two kernels")
	assert.NotEqual(t, kernelOf(t, fg, ids[u.ID()]), kernelOf(t, fg, ids[v.ID()]))
}

// A column sum joins the group of the value it sums: a written RMSNorm's
// weight gradient, Σ over the rows of g·x·r, is a ColSum output of the
// kernel that computes the input gradient g·r, and no [rows, C] value of
// it is stored. A value computed from the sum (tanh(Σ + x)) does not join
// that group, which could give Σ only once its kernel ends. Values equal
// the unfused graph's in float64 (the reference evaluator) within 1e-12.
// A sum without KeepDim, over rows of fewer than 128 columns, or with the
// batch axis last stays a plain sum.
func TestFusePointwiseColumnSum(t *testing.T) {
	build := func(shape []int, batchAxis int, keep bool) (*graph.Graph, []int) {
		lg := lazy.NewGraph()
		x := lg.Placeholder(shape, graph.Float32, batchAxis)
		g := lg.Placeholder(shape, graph.Float32, batchAxis)
		r := x.Mul(x).MeanKeepDim(-1).AddScalar(1e-5).PowScalar(-0.5)
		dx := g.Mul(r)
		gxr := g.Mul(x).Mul(r)
		var dw *lazy.Tensor
		if keep {
			dw = gxr.SumKeepDim(0, 1)
		} else {
			dw = gxr.Sum(0, 1)
		}
		z := dw.Add(x).Tanh()
		require.NoError(t, z.Err())
		return z.Graph().IR(), []int{x.ID(), g.ID(), dx.ID(), dw.ID(), z.ID()}
	}
	g, ids := build([]int{4, 8, 128}, 0, true)
	outs := ids[2:]
	fg, nid, err := graph.FusePointwise(g, outs)
	require.NoError(t, err)
	assert.Zero(t, countOp(fg, graph.OpSum), "the column sum is fused")
	dw := fg.Node(nid[ids[3]])
	require.Equal(t, graph.OpFusedPointwise, dw.Op)
	assert.True(t, dw.Attrs.Pointwise.Outs[dw.Attrs.Axis].ColSum)
	assert.Equal(t, g.Node(ids[3]).Type, dw.Type)
	assert.Equal(t, kernelOf(t, fg, nid[ids[2]]), kernelOf(t, fg, nid[ids[3]]), "dx and Σ g·x·r from one kernel")
	assert.NotEqual(t, kernelOf(t, fg, nid[ids[3]]), kernelOf(t, fg, nid[ids[4]]), "tanh(Σ + x) is not in Σ's kernel")
	full := 0 // fused nodes of a [rows, C] value: dx and tanh(Σ + x) only
	for _, nd := range fg.Nodes() {
		if nd.Op == graph.OpFusedPointwise && len(nd.Type.Shape) == 3 && nd.Type.Shape[0] == 4 {
			full++
		}
	}
	assert.Equal(t, 2, full, "g·x·r is not stored")
	rng := rand.New(rand.NewPCG(5, 6))
	vals := map[int]ref.Value{}
	fvals := map[int]ref.Value{}
	for _, id := range ids[:2] {
		v := ref.Zeros(4, 8, 128)
		for i := range v.Data {
			v.Data[i] = rng.Float64()*2 - 1
		}
		vals[id], fvals[nid[id]] = v, v
	}
	want, err := ref.Eval(g, vals, outs...)
	require.NoError(t, err)
	fouts := make([]int, len(outs))
	for i, o := range outs {
		fouts[i] = nid[o]
	}
	got, err := ref.Eval(fg, fvals, fouts...)
	require.NoError(t, err)
	for k := range want {
		require.Equal(t, want[k].Shape, got[k].Shape)
		for i := range want[k].Data {
			require.InDelta(t, want[k].Data[i], got[k].Data[i], 1e-12, "output %d element %d", k, i)
		}
	}
	for _, c := range []struct {
		name      string
		shape     []int
		batchAxis int
		keep      bool
	}{{"no KeepDim", []int{4, 8, 128}, 0, false}, {"short rows", []int{4, 8, 64}, 0, true}, {"batch axis last", []int{4, 8, 128}, 2, true}} {
		g, ids := build(c.shape, c.batchAxis, c.keep)
		fg, _, err := graph.FusePointwise(g, ids[2:])
		require.NoError(t, err, c.name)
		assert.Equal(t, 1, countOp(fg, graph.OpSum), c.name)
	}
}
