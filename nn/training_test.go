package nn_test

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

func TestSetTrainingReachesNestedModules(t *testing.T) {
	opt := nn.Seed(1)
	drop := nn.NewDropout(0.5)
	bn := nn.NewBatchNorm2d(opt, 3, 1e-5, 0.1)
	inner := nn.NewSequential(bn, nn.ReLU{})
	model := nn.NewSequential(nn.NewLinear(opt, 4, 4, true), drop, inner)

	nn.SetTraining(model, true)
	assert.True(t, drop.Training)
	assert.True(t, bn.Training)
	nn.SetTraining(model, false)
	assert.False(t, drop.Training)
	assert.False(t, bn.Training, "a module inside a nested Sequential is reached")
}

// Dropouts finds every Dropout by its path, and a Dropout restored to a
// saved counter (SetStep) draws the masks the original draws next.
func TestDropoutsAndTheirCounters(t *testing.T) {
	a, b := nn.NewDropout(0.5), nn.NewDropout(0.3)
	inner := nn.NewSequentialNamed(nn.Child{Name: "drop", Module: b})
	m := nn.NewSequentialNamed(nn.Child{Name: "in", Module: a}, nn.Child{Name: "relu", Module: nn.ReLU{}}, nn.Child{Name: "block", Module: inner})
	ds := nn.Dropouts(m)
	require.Len(t, ds, 2)
	assert.Equal(t, "in", ds[0].Path)
	assert.Same(t, a, ds[0].Dropout)
	assert.Equal(t, "block.drop", ds[1].Path)
	assert.Same(t, b, ds[1].Dropout)
	assert.Equal(t, "", nn.Dropouts(a)[0].Path, "a bare layer")
	assert.Empty(t, nn.Dropouts(nil))

	mask := func(d *nn.Dropout) []float32 {
		x := lazy.Wrap(tensor.New(tensor.WithShape(4, 8), tensor.WithBacking(slices.Repeat([]float32{1}, 32))), 0)
		out, err := cpu.New().Run(context.Background(), x.Graph().IR(), d.Forward(x).ID())
		require.NoError(t, err)
		return out[0].Data().([]float32)
	}
	a.Training, a.Seed = true, 9
	mask(a)
	assert.Equal(t, uint64(1), a.Step())
	want := mask(a)
	c := nn.NewDropout(0.5)
	c.Training, c.Seed = true, 9
	c.SetStep(1)
	assert.Equal(t, want, mask(c), "the second step's mask")
	assert.NotEqual(t, want, mask(c), "and a third, another")
}
