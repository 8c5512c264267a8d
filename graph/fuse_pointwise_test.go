package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
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
