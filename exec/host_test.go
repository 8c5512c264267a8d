package exec_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// A source of no elements (an empty batch, a zero-width layer) reads as an
// empty buffer of its dtype; gorgonia's Data would panic on it. Data of
// the wrong dtype is still refused, typed.
func TestFromTensorEmpty(t *testing.T) {
	node := func(dt graph.DType) *graph.Node {
		return &graph.Node{Op: graph.OpInput, Name: "x", Type: graph.Type{Shape: []int{0, 3}, DType: dt}}
	}
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		b, err := exec.FromTensor(node(dt), tensor.New(tensor.WithShape(0, 3), tensor.Of(tensor.Float32)), []int{0, 3})
		require.NoError(t, err, "%s", dt)
		require.Equal(t, []int{0, 3}, b.Shape)
		require.NotNil(t, b.F)
		require.Empty(t, b.F)
		require.Equal(t, []int{0, 3}, []int(b.Dense().Shape()))
	}
	b, err := exec.FromTensor(node(graph.Int64), tensor.New(tensor.WithShape(0, 3), tensor.Of(tensor.Int64)), nil)
	require.NoError(t, err)
	require.Nil(t, b.F)
	require.Empty(t, b.I)
	_, err = exec.FromTensor(node(graph.Int64), tensor.New(tensor.WithShape(0, 3), tensor.Of(tensor.Float32)), nil)
	require.ErrorIs(t, err, graph.ErrDType)
	_, err = exec.FromTensor(node(graph.Float32), tensor.New(tensor.WithShape(0, 3), tensor.Of(tensor.Float64)), nil)
	require.ErrorIs(t, err, graph.ErrDType)
}
