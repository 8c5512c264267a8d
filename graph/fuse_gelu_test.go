package graph_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// nodes is a small graph builder for the fusion and companion tests.
type nodes struct {
	t *testing.T
	g *graph.Graph
}

func (b nodes) in(dt graph.DType, batched bool, shape ...int) int {
	n := graph.Node{Op: graph.OpParam, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: -1}}
	if batched {
		n.Op, n.Type.BatchAxis, n.Type.PerSample = graph.OpInput, 0, 1
	}
	id, err := b.g.Append(n)
	require.NoError(b.t, err)
	return id
}

func (b nodes) node(op graph.Op, a graph.Attrs, ins ...int) int {
	id, err := b.g.Append(graph.Node{Op: op, Attrs: a, Inputs: ins})
	require.NoError(b.t, err)
	return id
}

// TestFuseGeluGrad: gelu_grad of a matmul nothing else reads becomes one
// matmul_gelu_grad with the matmul's transposes and the GELU's form; the
// near misses stay as they were.
func TestFuseGeluGrad(t *testing.T) {
	b := nodes{t, graph.New()}
	g, w, x := b.in(graph.Float32, true, 4, 3), b.in(graph.Float32, false, 7, 3), b.in(graph.Float32, true, 4, 7)
	mm := b.node(graph.OpMatMul, graph.Attrs{TransB: true}, g, w)
	gg := b.node(graph.OpGeluGrad, graph.Attrs{Approx: true}, mm, x)
	// Near misses: a matmul read twice; a matmul that is an output; a
	// gelu_grad of a non-matmul; a matmul writing float32 from bfloat16.
	mm2 := b.node(graph.OpMatMul, graph.Attrs{TransB: true}, g, w)
	twice := b.node(graph.OpGeluGrad, graph.Attrs{}, mm2, x)
	sum := b.node(graph.OpAdd, graph.Attrs{}, mm2, twice)
	mm3 := b.node(graph.OpMatMul, graph.Attrs{TransB: true}, g, w)
	kept := b.node(graph.OpGeluGrad, graph.Attrs{}, mm3, x)
	plain := b.node(graph.OpGeluGrad, graph.Attrs{}, x, x)
	hg, hw, hx := b.in(graph.BFloat16, true, 4, 3), b.in(graph.BFloat16, false, 3, 7), b.in(graph.Float32, true, 4, 7)
	wide := b.node(graph.OpMatMul, graph.Attrs{Target: graph.Type{DType: graph.Float32}}, hg, hw)
	widened := b.node(graph.OpGeluGrad, graph.Attrs{}, wide, hx)

	outs := []int{gg, sum, kept, mm3, plain, widened}
	ng, ids, err := graph.FuseGeluGrad(b.g, outs)
	require.NoError(t, err)
	require.Equal(t, b.g.Len()-1, ng.Len(), "one matmul goes")
	assert.Equal(t, -1, ids[mm])
	f := ng.Node(ids[gg])
	assert.Equal(t, graph.OpMatMulGeluGrad, f.Op)
	assert.Equal(t, []int{ids[g], ids[w], ids[x]}, f.Inputs)
	assert.True(t, f.Attrs.TransB && !f.Attrs.TransA && f.Attrs.Approx)
	assert.Equal(t, b.g.Node(gg).Type, f.Type)
	for _, id := range []int{twice, kept, plain, widened} {
		assert.Equal(t, graph.OpGeluGrad, ng.Node(ids[id]).Op, "node %d", id)
	}
	for _, id := range []int{mm2, mm3, wide} {
		assert.Equal(t, graph.OpMatMul, ng.Node(ids[id]).Op, "node %d", id)
	}

	// A graph without the pattern comes back as a copy of itself.
	ng2, ids2, err := graph.FuseGeluGrad(ng, []int{ids[gg], ids[sum], ids[kept], ids[mm3], ids[plain], ids[widened]})
	require.NoError(t, err)
	require.Equal(t, ng.Len(), ng2.Len())
	for i := range ng.Len() {
		assert.Equal(t, i, ids2[i])
		assert.Equal(t, ng.Node(i).Op, ng2.Node(i).Op)
		assert.Equal(t, ng.Node(i).Inputs, ng2.Node(i).Inputs)
		assert.Equal(t, ng.Node(i).Type, ng2.Node(i).Type)
	}
}

// TestGeluCompanions: a tanh-form gelu pairs with the linear it reads;
// CompanionProducer dispatches on the op.
func TestGeluCompanions(t *testing.T) {
	b := nodes{t, graph.New()}
	x, w, bias := b.in(graph.BFloat16, true, 2, 4, 3), b.in(graph.BFloat16, false, 8, 3), b.in(graph.BFloat16, false, 8)
	lin := b.node(graph.OpLinear, graph.Attrs{}, x, w, bias)
	tanh := b.node(graph.OpGelu, graph.Attrs{Approx: true}, lin)
	assert.Equal(t, lin, graph.GeluProducer(b.g, tanh))
	assert.Equal(t, lin, graph.CompanionProducer(b.g, tanh))
	assert.Equal(t, -1, graph.GeluProducer(b.g, b.node(graph.OpGelu, graph.Attrs{}, lin)), "the erf form")
	assert.Equal(t, -1, graph.GeluProducer(b.g, b.node(graph.OpGelu, graph.Attrs{Approx: true}, x)), "not a linear")

}
