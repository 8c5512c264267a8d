package models_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/shapeinfer"
)

func TestConvNetCIFAR10Shapes(t *testing.T) {
	m := models.NewConvNet(nn.Options{ShapeOnly: true}, models.CIFAR10())
	require.NoError(t, nn.Check(m))
	// Sequential children: conv, relu, pool per stage (0–8), flatten (9),
	// linear (10).
	assert.Equal(t, []string{"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias", "10.weight", "10.bias"}, testutil.ParamNames(m))
	// 3·32·9+32 + 32·64·9+64 + 64·128·9+128 + 128·4·4·10+10
	assert.Equal(t, 896+18_496+73_856+20_490, nn.NumParams(m))
	for _, p := range m.Params() {
		assert.Nil(t, p.Value(), p.Name())
	}

	x := lazy.Placeholder([]int{4, 3, 32, 32}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{4}, graph.Int64, 0)
	logits := m.Forward(x)
	require.NoError(t, logits.Err())
	assert.Equal(t, []int{4, 10}, logits.Shape())
	assert.Equal(t, 0, logits.BatchAxis())

	loss := logits.CrossEntropy(y, graph.ReduceMean)
	grads := lazy.Grad(loss, nn.ParamTensors(m)...)
	outs := []int{loss.ID()}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
	}
	info, err := shapeinfer.Analyze(x.Graph().IR(), outs...)
	require.NoError(t, err)
	assert.True(t, info.Chunkable(), "not chunkable: %v", info.NotChunkable)
	for _, gr := range grads {
		assert.Equal(t, shapeinfer.CombineSum, info.Combine[gr.ID()])
	}
}

func TestConvNetConfigErrors(t *testing.T) {
	bad := map[string]models.ConvNetConfig{
		"size not a multiple of 2^stages": {Channels: 3, Size: 30, Widths: []int{8, 8}, Classes: 10},
		"size too small":                  {Channels: 3, Size: 2, Widths: []int{8, 8}, Classes: 10},
		"no stages":                       {Channels: 3, Size: 32, Classes: 10},
		"zero channels":                   {Channels: 0, Size: 32, Widths: []int{8}, Classes: 10},
		"zero classes":                    {Channels: 3, Size: 32, Widths: []int{8}, Classes: 0},
		"negative size":                   {Channels: 3, Size: -32, Widths: []int{8}, Classes: 10},
		"zero width":                      {Channels: 3, Size: 32, Widths: []int{8, 0}, Classes: 10},
	}
	for name, cfg := range bad {
		t.Run(name, func(t *testing.T) {
			m := models.NewConvNet(nn.Seed(1), cfg)
			assert.ErrorIs(t, nn.Check(m), graph.ErrAttr)
			out := m.Forward(lazy.Placeholder([]int{2, 3, 32, 32}, graph.Float32, 0))
			assert.ErrorIs(t, out.Err(), graph.ErrAttr)
			var oe *graph.OpError
			assert.ErrorAs(t, out.Err(), &oe)
		})
	}

	m := models.NewConvNet(nn.Options{ShapeOnly: true}, models.CIFAR10())
	out := m.Forward(lazy.Placeholder([]int{2, 3, 28, 28}, graph.Float32, 0))
	assert.ErrorIs(t, out.Err(), graph.ErrShape, "28×28 input to a 32×32 net")
}

// TestSmallConvNetMatchesReference runs logits, loss and every gradient of a
// seeded two-stage ConvNet on the CPU executor and on the float64
// reference, with cpuTol (see gpt_test.go). Random data makes ties in the
// max-pool windows, where the two could pick different winners, have
// probability zero.
func TestSmallConvNetMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	cfg := models.ConvNetConfig{Channels: 2, Size: 8, Widths: []int{3, 4}, Classes: 5}
	m := models.NewConvNet(nn.Seed(21), cfg)
	require.NoError(t, nn.Check(m))
	const b = 3
	img := make([]float32, b*cfg.Channels*cfg.Size*cfg.Size)
	for i := range img {
		img[i] = float32(rng.NormFloat64())
	}
	labels := make([]int64, b)
	for i := range labels {
		labels[i] = int64(rng.IntN(cfg.Classes))
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(b, cfg.Channels, cfg.Size, cfg.Size), tensor.WithBacking(img)), 0)
	y := x.Graph().Wrap(int64s([]int{b}, labels), 0)
	logits := m.Forward(x)
	loss := logits.CrossEntropy(y, graph.ReduceMean)
	params := nn.ParamTensors(m)
	grads := lazy.Grad(loss, params...)
	outs := []int{logits.ID(), loss.ID()}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
	}
	g := x.Graph().IR()
	got, err := cpu.New().Run(context.Background(), g, outs...)
	require.NoError(t, err)
	want, err := ref.Eval(g, nil, outs...)
	require.NoError(t, err)

	assert.Equal(t, []int{b, cfg.Classes}, want[0].Shape)
	assertClose(t, want[0], got[0], "logits")
	assertClose(t, want[1], got[1], "loss")
	for i, p := range params {
		assertClose(t, want[i+2], got[i+2], "gradient of "+p.Name())
	}
}
