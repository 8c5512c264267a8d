package nn_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// The CPU executor computes in float32 with float64 sums; against the
// float64 loops below over values in [−2, 2) it holds to 1e-5.
const bnTol = 1e-5

func f32s(t tensor.Tensor) []float32 { return t.(*tensor.Dense).Float32s() }

func randDense(rng *rand.Rand, lo, hi float64, shape ...int) *tensor.Dense {
	d := make([]float32, graph.Numel(shape))
	for i := range d {
		d[i] = float32(lo + (hi-lo)*rng.Float64())
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

func run(t *testing.T, outs ...*lazy.Tensor) [][]float32 {
	t.Helper()
	ids := make([]int, len(outs))
	for i, o := range outs {
		require.NoError(t, o.Err())
		ids[i] = o.ID()
	}
	res, err := cpu.New().Run(context.Background(), outs[0].Graph().IR(), ids...)
	require.NoError(t, err)
	vals := make([][]float32, len(res))
	for i, r := range res {
		vals[i] = r.Float32s()
	}
	return vals
}

// refBatchNorm normalises x [n, c, hw] (row-major) per channel with the given
// mean and variance, or with the batch's (biased variance) when mean is nil.
// It also returns the batch mean and unbiased variance.
func refBatchNorm(x []float32, n, c, hw int, mean, variance []float64, w, b []float32, eps float64) (y, bMean, bVar []float64) {
	bMean, bVar = make([]float64, c), make([]float64, c)
	m := float64(n * hw)
	for k := range c {
		for i := range n {
			for j := range hw {
				bMean[k] += float64(x[(i*c+k)*hw+j]) / m
			}
		}
		for i := range n {
			for j := range hw {
				d := float64(x[(i*c+k)*hw+j]) - bMean[k]
				bVar[k] += d * d
			}
		}
	}
	biased := make([]float64, c)
	for k := range c {
		biased[k] = bVar[k] / m
		bVar[k] /= m - 1
	}
	if mean == nil {
		mean, variance = bMean, biased
	}
	y = make([]float64, len(x))
	for i := range n {
		for k := range c {
			for j := range hw {
				p := (i*c+k)*hw + j
				y[p] = (float64(x[p])-mean[k])/math.Sqrt(variance[k]+eps)*float64(w[k]) + float64(b[k])
			}
		}
	}
	return y, bMean, bVar
}

func requireNear(t *testing.T, want []float64, got []float32, tol float64, what string) {
	t.Helper()
	require.Len(t, got, len(want), what)
	for i := range want {
		require.InDelta(t, want[i], float64(got[i]), tol, "%s element %d", what, i)
	}
}

func TestBatchNorm2dDefaults(t *testing.T) {
	bn := nn.NewBatchNorm2d(nn.Seed(1), 3, 1e-5, 0.1)
	require.NoError(t, nn.Check(bn))
	assert.True(t, bn.Training, "training mode by default, as in PyTorch")
	assert.Equal(t, []string{"weight", "bias"}, testutil.ParamNames(bn), "running statistics are buffers, not parameters")
	assert.Equal(t, []float32{1, 1, 1}, f32s(bn.Weight.Value()))
	assert.Equal(t, []float32{0, 0, 0}, f32s(bn.Bias.Value()))
	assert.Equal(t, []float32{0, 0, 0}, f32s(bn.RunningMean.Value()))
	assert.Equal(t, []float32{1, 1, 1}, f32s(bn.RunningVar.Value()))

	m := nn.NewSequential(nn.NewConv2d(nn.Seed(1), 2, 3, [2]int{3, 3}, false, lazy.ConvOptions{}), bn)
	assert.Equal(t, []string{"0.weight", "1.weight", "1.bias"}, testutil.ParamNames(m))
}

// A training step's worth of use: normalise with the batch's statistics,
// read them back, fold them into the running statistics, then evaluate with
// those.
func TestBatchNorm2dTrainThenEval(t *testing.T) {
	const n, c, h, w = 4, 3, 2, 5
	rng := rand.New(rand.NewPCG(7, 8))
	bn := nn.NewBatchNorm2d(nn.Seed(1), c, 1e-5, 0.1)
	copy(f32s(bn.Weight.Value()), f32s(randDense(rng, 0.5, 2, c)))
	copy(f32s(bn.Bias.Value()), f32s(randDense(rng, -1, 1, c)))
	wt, bt := f32s(bn.Weight.Value()), f32s(bn.Bias.Value())

	xd := randDense(rng, -2, 2, n, c, h, w)
	y := bn.Forward(lazy.Wrap(xd, 0))
	mean, variance := bn.BatchStats()
	m2, v2 := bn.BatchStats()
	assert.Same(t, mean, m2, "BatchStats builds its nodes once per Forward")
	assert.Same(t, variance, v2)
	got := run(t, y, mean, variance)
	want, bMean, bVar := refBatchNorm(xd.Float32s(), n, c, h*w, nil, nil, wt, bt, 1e-5)
	requireNear(t, want, got[0], bnTol, "training output")
	requireNear(t, bMean, got[1], bnTol, "batch mean")
	requireNear(t, bVar, got[2], bnTol, "unbiased batch variance")

	md := tensor.New(tensor.WithShape(c), tensor.WithBacking(got[1]))
	vd := tensor.New(tensor.WithShape(c), tensor.WithBacking(got[2]))
	require.NoError(t, bn.UpdateRunning(md, vd))
	runMean, runVar := make([]float64, c), make([]float64, c)
	for k := range c { // from zeros and ones with momentum 0.1
		runMean[k] = 0.1 * bMean[k]
		runVar[k] = 0.9 + 0.1*bVar[k]
	}
	requireNear(t, runMean, f32s(bn.RunningMean.Value()), 1e-6, "running mean")
	requireNear(t, runVar, f32s(bn.RunningVar.Value()), 1e-6, "running variance")

	bn.Training = false
	xe := randDense(rng, -2, 2, 2, c, h, w) // any batch size: samples are independent
	got = run(t, bn.Forward(lazy.Wrap(xe, 0)))
	want, _, _ = refBatchNorm(xe.Float32s(), 2, c, h*w, runMean, runVar, wt, bt, 1e-5)
	requireNear(t, want, got[0], bnTol, "evaluation output")
}

func TestBatchNorm2dErrors(t *testing.T) {
	opt := nn.Seed(1)
	for _, c := range []struct {
		name string
		bn   *nn.BatchNorm2d
		want error
	}{
		{"no channels", nn.NewBatchNorm2d(opt, 0, 1e-5, 0.1), graph.ErrShape},
		{"eps 0", nn.NewBatchNorm2d(opt, 3, 0, 0.1), graph.ErrAttr},
		{"momentum above 1", nn.NewBatchNorm2d(opt, 3, 1e-5, 1.5), graph.ErrAttr},
		{"momentum NaN", nn.NewBatchNorm2d(opt, 3, 1e-5, math.NaN()), graph.ErrAttr},
	} {
		t.Run(c.name, func(t *testing.T) {
			assert.ErrorIs(t, nn.Check(c.bn), c.want)
			y := c.bn.Forward(lazy.Placeholder([]int{2, 3, 4, 4}, graph.Float32, 0))
			assert.ErrorIs(t, y.Err(), c.want)
			var oe *graph.OpError
			require.ErrorAs(t, y.Err(), &oe)
		})
	}

	bn := nn.NewBatchNorm2d(opt, 3, 1e-5, 0.1)
	mean, variance := bn.BatchStats()
	assert.ErrorIs(t, mean.Err(), graph.ErrNoData, "no training-mode Forward yet")
	assert.ErrorIs(t, variance.Err(), graph.ErrNoData)

	for _, mode := range []bool{true, false} {
		bn.Training = mode
		for _, shape := range [][]int{{2, 3}, {2, 3, 4}, {2, 4, 5, 5}} { // not NCHW; 4 channels, not 3
			y := bn.Forward(lazy.Placeholder(shape, graph.Float32, 0))
			assert.ErrorIs(t, y.Err(), graph.ErrShape, "training %v, input %v", mode, shape)
			var oe *graph.OpError
			require.ErrorAs(t, y.Err(), &oe)
			assert.Equal(t, "batch_norm", oe.Op)
		}
	}
	bn.Training = true
	y := bn.Forward(lazy.Placeholder([]int{1, 3, 1, 1}, graph.Float32, 0))
	assert.ErrorIs(t, y.Err(), graph.ErrShape, "one value per channel has no variance")

	three := tensor.New(tensor.WithShape(3), tensor.WithBacking([]float32{1, 2, 3}))
	four := tensor.New(tensor.WithShape(4), tensor.WithBacking([]float32{1, 2, 3, 4}))
	ints := tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{1, 2, 3}))
	assert.ErrorIs(t, bn.UpdateRunning(three, four), graph.ErrShape)
	assert.ErrorIs(t, bn.UpdateRunning(ints, three), graph.ErrDType)
	assert.ErrorIs(t, bn.UpdateRunning(nil, three), graph.ErrNilTensor)
	assert.Equal(t, []float32{0, 0, 0}, f32s(bn.RunningMean.Value()), "a rejected update changes nothing")
	assert.Equal(t, []float32{1, 1, 1}, f32s(bn.RunningVar.Value()))
}

// Buffers names every running statistic by its module path, as PyTorch's
// state_dict does, and hands out the tensors the layers read.
func TestBuffersNamesRunningStatistics(t *testing.T) {
	opt := nn.Options{ShapeOnly: true}
	bn0, bn2 := nn.NewBatchNorm2d(opt, 4, 1e-5, 0.1), nn.NewBatchNorm2d(opt, 8, 1e-5, 0.1)
	inner := nn.NewSequentialNamed(nn.Child{Name: "bn", Module: bn2})
	m := nn.NewSequential(bn0, nn.ReLU{}, inner)
	bs := nn.Buffers(m)
	require.Len(t, bs, 4)
	names := []string{"0.running_mean", "0.running_var", "2.bn.running_mean", "2.bn.running_var"}
	tensors := []*lazy.Tensor{bn0.RunningMean, bn0.RunningVar, bn2.RunningMean, bn2.RunningVar}
	for i, b := range bs {
		assert.Equal(t, names[i], b.Name)
		assert.Same(t, tensors[i], b.Tensor, b.Name)
	}
	assert.Equal(t, []string{"0.weight", "0.bias", "2.bn.weight", "2.bn.bias"}, testutil.ParamNames(m), "buffers are not parameters")
	assert.Empty(t, nn.Buffers(nn.MLP(opt, []int{3, 4, 2}, nn.ReLU{})))
	assert.Empty(t, nn.Buffers(nil))
	assert.Len(t, nn.Buffers(bn0), 2, "a bare layer's buffers have no prefix")
	assert.Equal(t, "running_var", nn.Buffers(bn0)[1].Name)
}

// PerChunkStats (from Options or set on the layer): a training Forward
// builds the per-chunk op and registers one step update with the graph,
// batch_norm_stats of its input, which applies UpdateRunning with its two
// rows; BatchStats then reads those rows. Evaluation mode and the default
// register nothing.
func TestBatchNorm2dPerChunkStats(t *testing.T) {
	const n, c, h, w = 4, 3, 2, 5
	rng := rand.New(rand.NewPCG(9, 10))
	opt := nn.Seed(1)
	opt.PerChunkStats = true
	bn := nn.NewBatchNorm2d(opt, c, 1e-5, 0.1)
	require.True(t, bn.PerChunkStats, "Options.PerChunkStats sets the layer's")
	assert.False(t, nn.NewBatchNorm2d(nn.Seed(1), c, 1e-5, 0.1).PerChunkStats, "off by default")

	xd := randDense(rng, -2, 2, n, c, h, w)
	x := lazy.Wrap(xd, 0)
	y := bn.Forward(x)
	require.NoError(t, y.Err())
	nd := x.Graph().IR().Node(y.ID())
	assert.True(t, nd.Attrs.Training && nd.Attrs.PerChunk, "per-chunk batch_norm")
	ups := x.Graph().StepUpdates()
	require.Len(t, ups, 1)
	assert.Equal(t, graph.OpBatchNormStats, x.Graph().IR().Node(ups[0].Value.ID()).Op)
	assert.Equal(t, []int{x.ID()}, x.Graph().IR().Node(ups[0].Value.ID()).Inputs)

	mean, variance := bn.BatchStats()
	got := run(t, y, mean, variance, ups[0].Value)
	want, bMean, bVar := refBatchNorm(xd.Float32s(), n, c, h*w, nil, nil, []float32{1, 1, 1}, []float32{0, 0, 0}, 1e-5)
	requireNear(t, want, got[0], bnTol, "training output, in one chunk")
	requireNear(t, bMean, got[1], bnTol, "BatchStats mean")
	requireNear(t, bVar, got[2], bnTol, "BatchStats variance")
	requireNear(t, append(bMean, bVar...), got[3], bnTol, "the registered statistics")

	// The update folds them in once, as UpdateRunning does.
	stats := tensor.New(tensor.WithShape(2, c), tensor.WithBacking(got[3]))
	require.NoError(t, ups[0].Apply(stats))
	runMean, runVar := make([]float64, c), make([]float64, c)
	for k := range c {
		runMean[k] = 0.1 * bMean[k]
		runVar[k] = 0.9 + 0.1*bVar[k]
	}
	requireNear(t, runMean, f32s(bn.RunningMean.Value()), 1e-6, "running mean")
	requireNear(t, runVar, f32s(bn.RunningVar.Value()), 1e-6, "running variance")
	wrong := tensor.New(tensor.WithShape(c), tensor.WithBacking(make([]float32, c)))
	assert.ErrorIs(t, ups[0].Apply(wrong), graph.ErrShape)
	requireNear(t, runMean, f32s(bn.RunningMean.Value()), 1e-6, "a rejected update changes nothing")

	bn.Training = false
	x = lazy.Wrap(xd, 0)
	require.NoError(t, bn.Forward(x).Err())
	assert.Empty(t, x.Graph().StepUpdates(), "evaluation mode")
	bn.Training, bn.PerChunkStats = true, false
	x = lazy.Wrap(xd, 0)
	require.NoError(t, bn.Forward(x).Err())
	assert.Empty(t, x.Graph().StepUpdates(), "whole-batch statistics: updates stay explicit")
}
