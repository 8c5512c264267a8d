package nn_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

func TestConstructionErrors(t *testing.T) {
	opt := nn.Seed(1)
	cases := []struct {
		name string
		m    nn.Module
		want error
	}{
		{"linear zero in", nn.NewLinear(opt, 0, 4, true), graph.ErrShape},
		{"linear negative out", nn.NewLinear(opt, 4, -1, false), graph.ErrShape},
		{"no rand", nn.NewLinear(nn.Options{}, 4, 4, true), graph.ErrAttr},
		{"embedding zero dim", nn.NewEmbedding(opt, 10, 0), graph.ErrShape},
		{"conv groups", nn.NewConv2d(opt, 6, 4, [2]int{3, 3}, true, lazy.ConvOptions{Groups: 4}), graph.ErrAttr},
		{"conv zero kernel", nn.NewConv2d(opt, 3, 4, [2]int{0, 3}, true, lazy.ConvOptions{}), graph.ErrShape},
		{"layernorm eps", nn.NewLayerNorm(opt, []int{4}, 0), graph.ErrAttr},
		{"layernorm no shape", nn.NewLayerNorm(opt, nil, 1e-5), graph.ErrShape},
		{"batchnorm eps", nn.NewBatchNorm2d(opt, 4, -1, 0.1), graph.ErrAttr},
		{"dropout p", nn.NewDropout(1.5), graph.ErrAttr},
		{"mlp one size", nn.MLP(opt, []int{4}, nn.ReLU{}), graph.ErrShape},
		{"mlp nil activation", nn.MLP(opt, []int{4, 4}, nil), graph.ErrNilTensor},
		{"nil child", nn.NewSequential(nn.ReLU{}, nil), graph.ErrNilTensor},
		{"duplicate child", nn.NewSequentialNamed(nn.Child{Name: "a", Module: nn.ReLU{}}, nn.Child{Name: "a", Module: nn.ReLU{}}), graph.ErrAttr},
		{"dotted child", nn.NewSequentialNamed(nn.Child{Name: "a.b", Module: nn.ReLU{}}), graph.ErrAttr},
		{"nested bad child", nn.NewSequential(nn.NewSequential(nn.NewDropout(-1))), graph.ErrAttr},
		{"bad parameter in a sequential", nn.NewSequential(nn.ReLU{}, nn.NewSequential(nn.NewLinear(nn.Options{}, 4, 4, true))), graph.ErrAttr},
		{"float16 with data", nn.NewLinear(nn.Options{Rand: opt.Rand, DType: graph.Float16}, 4, 4, true), graph.ErrDType},
		{"int64 parameters", nn.NewLinear(nn.Options{ShapeOnly: true, DType: graph.Int64}, 4, 4, true), graph.ErrDType},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := nn.Check(c.m)
			require.Error(t, err)
			assert.ErrorIs(t, err, c.want)

			y := c.m.Forward(lazy.Placeholder([]int{2, 4}, graph.Float32, 0))
			assert.ErrorIs(t, y.Err(), c.want, "Forward returns the construction error")
			var oe *graph.OpError
			require.ErrorAs(t, y.Err(), &oe)
		})
	}
	assert.ErrorIs(t, nn.Check(nil), graph.ErrNilTensor)
}

func TestForwardErrors(t *testing.T) {
	opt := nn.Seed(1)
	m := nn.MLP(opt, []int{4, 8, 3}, nn.ReLU{})
	y := m.Forward(lazy.Placeholder([]int{2, 5}, graph.Float32, 0))
	assert.ErrorIs(t, y.Err(), graph.ErrShape, "input width 5 into Linear(4, 8)")
	var oe *graph.OpError
	require.ErrorAs(t, y.Err(), &oe)
	assert.Equal(t, "linear", oe.Op)
	assert.True(t, strings.HasSuffix(strings.Split(oe.Site, ":")[0], "_test.go"),
		"the error points at the caller, not into nn: %s", oe.Site)

	// An errored input keeps its own error through every module.
	bad := lazy.Placeholder([]int{2, 4}, graph.Float32, 0).Reshape(3, -1)
	require.Error(t, bad.Err())
	for _, mod := range []nn.Module{m, nn.NewDropout(0.2), nn.NewDropout(2), nn.Flatten{}, nn.NewConv2d(opt, 3, 4, [2]int{1, 1}, true, lazy.ConvOptions{Groups: 2}),
		nn.NewBatchNorm2d(opt, 4, 1e-5, 0.1), nn.NewBatchNorm2d(opt, 4, 0, 0.1)} {
		assert.Same(t, bad.Err(), mod.Forward(bad).Err())
	}
	assert.ErrorIs(t, nn.Flatten{}.Forward(lazy.Param(nil, "x")).Err(), graph.ErrNilTensor)
	scalar := lazy.Const(tensor.New(tensor.FromScalar(float32(2))))
	assert.ErrorIs(t, nn.Flatten{}.Forward(scalar).Err(), graph.ErrShape)

	b := newBlock(opt, 4)
	z := b.Call("nope", lazy.Placeholder([]int{2, 4}, graph.Float32, 0))
	assert.ErrorIs(t, z.Err(), graph.ErrAttr)
	assert.Nil(t, b.Get("nope"))
}

func TestErrorTensorKeepsOpError(t *testing.T) {
	inner := lazy.ErrorTensor("inner", graph.Errorf(graph.ErrShape, "bad"))
	var oe *graph.OpError
	require.ErrorAs(t, inner.Err(), &oe)
	assert.Equal(t, "inner", oe.Op)
	outer := lazy.ErrorTensor("outer", inner.Err())
	assert.Same(t, inner.Err(), outer.Err(), "an OpError is not wrapped twice")
	assert.True(t, errors.Is(outer.Err(), graph.ErrShape))
}

// A parameter made from zero-size data is refused with ErrShape where it is
// made, not by a panic when a step runs; prefixing keeps the error.
func TestNewParamRefusesZeroSize(t *testing.T) {
	p := nn.NewParam("w", tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(3, 0)))
	assert.ErrorIs(t, p.Err(), graph.ErrShape)
	var oe *graph.OpError
	require.ErrorAs(t, p.Err(), &oe)
	assert.Equal(t, "param", oe.Op)
	assert.Equal(t, [][]int{{3, 0}}, oe.Shapes)
	m := nn.NewSequential(&nn.Linear{Weight: p})
	assert.ErrorIs(t, nn.Check(m), graph.ErrShape)
	assert.ErrorIs(t, m.Forward(lazy.Placeholder([]int{2, 3}, graph.Float32, 0)).Err(), graph.ErrShape)
}
