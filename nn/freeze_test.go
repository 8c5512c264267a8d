package nn_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// Freeze marks parameters frozen on their lazy tensors, Trainable lists
// the others, FreezeAs stores a parameter in 16 bits over the same float32
// data, keeps it frozen when a container prefixes its name, and refuses a
// dtype that is not a float; a layer reading a 16-bit weight widens it to
// its input's dtype.
func TestFreeze(t *testing.T) {
	o := nn.Seed(1)
	first := nn.NewLinear(o, 4, 3, true)
	m := nn.NewSequential(first, nn.ReLU{}, nn.NewLinear(o, 3, 2, true))
	require.Len(t, nn.Trainable(m), 4)
	nn.Freeze(first.Bias)
	require.True(t, first.Bias.Frozen())
	require.True(t, first.Bias.Tensor().Frozen())
	require.Len(t, nn.Trainable(m), 3)
	data := first.Weight.Value()
	require.NoError(t, nn.FreezeAs(graph.BFloat16, first.Weight))
	require.Equal(t, graph.BFloat16, first.Weight.Tensor().DType())
	require.True(t, first.Weight.Frozen())
	require.Same(t, data, first.Weight.Value(), "the float32 data stays")
	require.Equal(t, "0.weight", first.Weight.Name())
	require.Len(t, nn.Trainable(m), 2)
	first.Weight.SetFrozen(false)
	require.Len(t, nn.Trainable(m), 3)
	require.ErrorIs(t, nn.FreezeAs(graph.Int64, first.Weight), graph.ErrDType)

	// Built before a container names it, a 16-bit frozen layer stays so.
	inner := nn.NewLinear(o, 4, 4, false)
	require.NoError(t, nn.FreezeAs(graph.Float16, inner.Weight))
	nn.NewSequential(inner)
	require.Equal(t, graph.Float16, inner.Weight.Tensor().DType())
	require.True(t, inner.Weight.Frozen())
	require.Equal(t, "0.weight", inner.Weight.Name())

	x := lazy.Placeholder([]int{2, 4}, graph.Float32, 0)
	y := inner.Forward(x)
	require.NoError(t, y.Err())
	require.Equal(t, graph.Float32, y.DType())
}

// SetFrozen only marks parameters.
func TestSetFrozenOnlyParams(t *testing.T) {
	x := lazy.Placeholder([]int{2}, graph.Float32, 0)
	x.SetFrozen(true)
	require.False(t, x.Frozen())
}
