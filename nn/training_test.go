package nn_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

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
