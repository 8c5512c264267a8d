package batchfit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// A runtime error in a step whose graph matches an earlier step's (its
// program and step graph come from the caches) names the call site of the
// graph being run, not that of the graph the caches were made from.
func TestStepErrorNamesTheRunGraphsSite(t *testing.T) {
	const n, in, classes = 8, 4, 3
	data := make([]float32, n*in)
	for i := range data {
		data[i] = float32(i%7) - 3
	}
	labels := func(bad bool) *tensor.Dense {
		l := make([]int64, n)
		for i := range l {
			l[i] = int64(i % classes)
		}
		if bad {
			l[5] = -1
		}
		return tensor.New(tensor.WithShape(n), tensor.WithBacking(l))
	}
	model := nn.MLP(nn.Seed(1), []int{in, 8, classes}, nn.ReLU{})
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	t.Cleanup(func() { require.NoError(t, sess.Close()) })
	opt := optim.NewSGD(0.1, 0)
	ctx := context.Background()
	input := func() *lazy.Tensor {
		return lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(data)), 0)
	}
	site := func(loss *lazy.Tensor) string {
		nd := loss.Graph().IR().Node(loss.ID())
		require.Equal(t, graph.OpCrossEntropy, nd.Op)
		return nd.Site
	}

	x := input()
	first := model.Forward(x).CrossEntropy(x.Graph().Wrap(labels(false), 0), lazy.Mean) // the caches' graph
	_, err := sess.Step(ctx, first, nn.ParamTensors(model), opt)
	require.NoError(t, err)

	x = input()
	second := model.Forward(x).CrossEntropy(x.Graph().Wrap(labels(true), 0), lazy.Mean) // the graph run, on another line
	require.NotEqual(t, site(first), site(second))
	_, err = sess.Step(ctx, second, nn.ParamTensors(model), opt)
	require.ErrorIs(t, err, graph.ErrAttr)
	require.Equal(t, 1, sess.StepGraphHits(), "the step graph came from the template")
	var oe *graph.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "cross_entropy", oe.Op)
	require.Equal(t, site(second), oe.Site, "%v", err)
}
