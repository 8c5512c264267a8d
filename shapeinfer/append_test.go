package shapeinfer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/shapeinfer"
)

func TestAppendSource(t *testing.T) {
	g := graph.New()
	x, err := shapeinfer.AppendSource(g, graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{4, 3}, DType: graph.Float32, BatchAxis: 0}})
	require.NoError(t, err)
	assert.Equal(t, 4, g.Batch())
	assert.Equal(t, 1, g.Node(x).Type.PerSample)

	// A parameter never has a batch axis, whatever its type says.
	w, err := shapeinfer.AppendSource(g, graph.Node{Op: graph.OpParam, Type: graph.Type{Shape: []int{3}, DType: graph.Float32, BatchAxis: 0}})
	require.NoError(t, err)
	assert.Equal(t, -1, g.Node(w).Type.BatchAxis)

	for _, c := range []struct {
		name string
		n    graph.Node
		want error
	}{
		{"not a source", graph.Node{Op: graph.OpRelu, Type: f(3)}, graph.ErrArity},
		{"invalid dtype", graph.Node{Op: graph.OpParam, Type: graph.Type{Shape: []int{3}}}, graph.ErrDType},
		{"negative dim", graph.Node{Op: graph.OpConst, Type: f(-1, 3)}, graph.ErrShape},
		{"too large", graph.Node{Op: graph.OpConst, Type: f(1<<30, 1<<30, 1<<30)}, graph.ErrShape},
		{"batch axis out of range", graph.Node{Op: graph.OpInput, Type: fp(2, 1, 4, 3)}, graph.ErrAttr},
		{"no batch axis", graph.Node{Op: graph.OpInput, Type: f(4, 3)}, graph.ErrAttr},
		{"empty batch", graph.Node{Op: graph.OpInput, Type: fb(0, 0, 3)}, graph.ErrShape},
		{"second batch size", graph.Node{Op: graph.OpInput, Type: fb(0, 5, 3)}, graph.ErrShape},
	} {
		_, err := shapeinfer.AppendSource(g, c.n)
		assert.ErrorIs(t, err, c.want, c.name)
	}
	assert.Equal(t, 2, g.Len(), "rejected sources are not appended")
}

func TestAppendChecksSize(t *testing.T) {
	g := graph.New()
	x, err := shapeinfer.AppendSource(g, graph.Node{Op: graph.OpInput, Type: fb(0, 4, 0)})
	require.NoError(t, err)
	// 2⁴⁰·2⁴⁰ wraps to 0 in int arithmetic, which equals the input's 0
	// elements; the size check sees the real product.
	_, err = shapeinfer.Append(g, graph.Node{Op: graph.OpReshape, Inputs: []int{x}, Attrs: graph.Attrs{Shape: []int{1 << 40, 0, 1 << 40}}})
	assert.ErrorIs(t, err, graph.ErrShape)
	_, err = shapeinfer.Append(g, graph.Node{Op: graph.OpReshape, Inputs: []int{x}, Attrs: graph.Attrs{Shape: []int{1 << 40, 1, 1 << 40}}})
	assert.ErrorIs(t, err, graph.ErrShape)

	// An empty tensor may have large axes, as long as the value left after
	// reducing the empty axis away would fit.
	e, err := shapeinfer.Append(g, graph.Node{Op: graph.OpReshape, Inputs: []int{x}, Attrs: graph.Attrs{Shape: []int{1 << 26, 0, 1 << 26}}})
	require.NoError(t, err)
	_, err = shapeinfer.Append(g, graph.Node{Op: graph.OpSum, Inputs: []int{e}, Attrs: graph.Attrs{Axes: []int{1}}})
	assert.NoError(t, err) // [2²⁶, 2²⁶] float32 = 2⁵⁴ B
	assert.ErrorIs(t, shapeinfer.CheckSize(f(1<<30, 0, 1<<30)), graph.ErrShape)
	assert.ErrorIs(t, shapeinfer.CheckSize(f(1<<30, 1<<30, 0)), graph.ErrShape, "independent of where the zero is")

	assert.NoError(t, shapeinfer.CheckSize(f(1<<27, 1<<27))) // 2⁵⁴ elements · 4 B = 2⁵⁶ B
	assert.ErrorIs(t, shapeinfer.CheckSize(f(1<<27, 1<<27, 2)), graph.ErrShape)
	assert.NoError(t, shapeinfer.CheckSize(i(1<<53))) // 2⁵³ · 8 B = 2⁵⁶ B
	assert.ErrorIs(t, shapeinfer.CheckSize(i(1<<53+1)), graph.ErrShape)
}

func TestAppendRejectsBadInputIDs(t *testing.T) {
	g := graph.New()
	_, err := shapeinfer.Append(g, graph.Node{Op: graph.OpRelu, Inputs: []int{0}})
	assert.ErrorIs(t, err, graph.ErrArity)
	_, err = shapeinfer.Append(g, graph.Node{Op: graph.OpRelu, Inputs: []int{-1}})
	assert.ErrorIs(t, err, graph.ErrArity)
	assert.Zero(t, g.Len())
}
