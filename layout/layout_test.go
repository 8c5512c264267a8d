package layout_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/layout"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

type forwarder interface {
	nn.Module
	Forward(*lazy.Tensor) *lazy.Tensor
}

// images is a batch of n×c×s×s images with values in [−1, 1) and labels
// below classes, from a fixed seed.
func images(n, c, s, classes int) (*lazy.Tensor, *lazy.Tensor) {
	r := rand.New(rand.NewPCG(7, 11))
	x := make([]float32, n*c*s*s)
	for i := range x {
		x[i] = float32(2*r.Float64() - 1)
	}
	y := make([]int64, n)
	for i := range y {
		y[i] = int64(r.IntN(classes))
	}
	xt := lazy.Wrap(tensor.New(tensor.WithShape(n, c, s, s), tensor.WithBacking(x)), 0)
	yt := xt.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(y)), 0)
	return xt, yt
}

// step builds m's training step over a fixed batch under policy p, with or
// without channels last.
func step(t *testing.T, m forwarder, c, s, classes int, p precision.Policy, last bool) *precision.Step {
	t.Helper()
	x, y := images(4, c, s, classes)
	loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(m)...)
	require.NoError(t, err)
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: p, ChannelsLast: last})
	require.NoError(t, err)
	return &st.Step
}

// nets are the conv nets the tests train: the zoo's ConvNet (conv with
// bias, relu, max-pool, flatten) and a narrow ResNet with torchvision's
// stem (max-pool, batch norm in training mode, residual adds, the global
// average pool) and bottleneck blocks.
func nets() map[string]func() (forwarder, int, int, int) {
	return map[string]func() (forwarder, int, int, int){
		"convnet": func() (forwarder, int, int, int) {
			cfg := models.ConvNetConfig{Channels: 3, Size: 16, Widths: []int{4, 8}, Classes: 5}
			return models.NewConvNet(nn.Seed(1), cfg), 3, 16, 5
		},
		"resnet": func() (forwarder, int, int, int) {
			cfg := models.ResNetConfig{Blocks: []int{1, 1, 1, 1}, Bottleneck: true, Width: 4, Classes: 6, ImageSize: 32}
			return models.NewResNet(nn.Seed(1), cfg), 3, 32, 6
		},
	}
}

// TestChannelsLastSameStep checks a training step's loss and gradients
// with channels last (every convolution taken, float32 ones included)
// against the same step without, in float64 on the
// reference interpreter (relative to each output's largest magnitude:
// 1e-10, sums taken in another order) and in float32 on the CPU executor
// (1e-5), for fp32 and bf16-mixed (the CPU rounds to bfloat16 at the same
// points either way; a float32 sum in another order may round to the
// neighbouring bfloat16: 2e-2).
func TestChannelsLastSameStep(t *testing.T) {
	defer layout.TakeAllConvs()()
	for name, mk := range nets() {
		for _, p := range []precision.Policy{precision.FP32, precision.BF16Mixed} {
			t.Run(name+"/"+string(p), func(t *testing.T) {
				m, c, s, classes := mk()
				base := step(t, m, c, s, classes, p, false)
				cl := step(t, m, c, s, classes, p, true)
				require.Greater(t, cl.Graph.Len(), base.Graph.Len(), "the conversions are nodes")
				nl := 0
				for _, nd := range cl.Graph.Nodes() {
					if nd.Attrs.ChannelsLast {
						nl++
					}
				}
				require.Positive(t, nl)

				outs := func(st *precision.Step) []int { return append([]int{st.Loss}, st.Grads...) }
				if p == precision.FP32 {
					want, err := ref.Eval(base.Graph, nil, outs(base)...)
					require.NoError(t, err)
					got, err := ref.Eval(cl.Graph, nil, outs(cl)...)
					require.NoError(t, err)
					requireClose(t, float64s(want), float64s(got), 1e-10)
				}
				tol := 1e-5
				if p != precision.FP32 {
					tol = 2e-2
				}
				requireClose(t, cpuRun(t, base), cpuRun(t, cl), tol)
			})
		}
	}
}

func float64s(vs []ref.Value) [][]float64 {
	out := make([][]float64, len(vs))
	for i, v := range vs {
		out[i] = v.Data
	}
	return out
}

func cpuRun(t *testing.T, st *precision.Step) [][]float64 {
	t.Helper()
	res, err := cpu.New().Run(context.Background(), st.Graph, append([]int{st.Loss}, st.Grads...)...)
	require.NoError(t, err)
	out := make([][]float64, len(res))
	for i, r := range res {
		for _, v := range r.Float32s() {
			out[i] = append(out[i], float64(v))
		}
	}
	return out
}

// requireClose holds each output of got to want's within tol times that
// output's largest magnitude, which must not be 0.
func requireClose(t *testing.T, want, got [][]float64, tol float64) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		require.Len(t, got[i], len(want[i]), "output %d", i)
		scale := 0.0
		for _, v := range want[i] {
			scale = max(scale, math.Abs(v))
		}
		require.Positive(t, scale, "output %d is not all zero", i)
		for j := range want[i] {
			require.InDelta(t, want[i][j], got[i][j], tol*scale, "output %d [%d]", i, j)
		}
	}
}

// TestChannelsLastLeavesOtherGraphs checks that a graph without a conv2d
// comes back as it was, and that the pass refuses a graph with gradients.
func TestChannelsLastLeavesOtherGraphs(t *testing.T) {
	x := lazy.Placeholder([]int{8, 16}, graph.Float32, 0)
	lin := nn.NewLinear(nn.Seed(2), 16, 4, true)
	out := lin.Forward(x).Relu().Sum()
	require.NoError(t, out.Err())
	g := out.Graph().IR()
	ng, ids, err := layout.ChannelsLast(g)
	require.NoError(t, err)
	require.Equal(t, g.Len(), ng.Len())
	for i := range g.Len() {
		require.Equal(t, i, ids[i])
		require.Equal(t, g.Node(i).Op, ng.Node(i).Op)
		require.Equal(t, g.Node(i).Type, ng.Node(i).Type)
		require.Equal(t, g.Node(i).Inputs, ng.Node(i).Inputs)
	}
	require.Equal(t, g.Signature(), ng.Signature())

	m, c, s, classes := nets()["convnet"]()
	st := step(t, m, c, s, classes, precision.FP32, false)
	_, _, err = layout.ChannelsLast(st.Graph)
	require.ErrorIs(t, err, graph.ErrAttr)
}

// TestConvTakes checks the rule on which convolutions run channels last,
// and that a float32 step comes back unchanged under it.
func TestConvTakes(t *testing.T) {
	require.True(t, layout.ConvTakes(graph.BFloat16, 7, 1, 5))
	require.True(t, layout.ConvTakes(graph.BFloat16, 32, 32, 32), "depthwise")
	require.False(t, layout.ConvTakes(graph.Float16, 64, 1, 64))
	require.False(t, layout.ConvTakes(graph.Float32, 64, 1, 64))

	m, c, s, classes := nets()["resnet"]()
	base := step(t, m, c, s, classes, precision.FP32, false)
	cl := step(t, m, c, s, classes, precision.FP32, true)
	require.Equal(t, base.Graph.Signature(), cl.Graph.Signature())
	bf := step(t, m, c, s, classes, precision.BF16Mixed, true)
	require.Greater(t, bf.Graph.Len(), base.Graph.Len())
}
