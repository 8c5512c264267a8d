package batchfit_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// bnNet is conv → BatchNorm2d → relu → global average pool → linear.
type bnNet struct {
	conv *nn.Conv2d
	bn   *nn.BatchNorm2d
	fc   *nn.Linear
}

func (m *bnNet) logits(x *tensor.Dense) *lazy.Tensor {
	h := m.bn.Forward(m.conv.Forward(lazy.Wrap(x, 0))).Relu().Mean(2, 3)
	return m.fc.Forward(h)
}

func (m *bnNet) params() []*lazy.Tensor {
	var ps []*lazy.Tensor
	for _, p := range slices.Concat(m.conv.Params(), m.bn.Params(), m.fc.Params()) {
		ps = append(ps, p.Tensor())
	}
	return ps
}

func tensorOf(v []float32, shape ...int) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(v))
}

// Training-mode batch norm: one step over the whole batch matches the
// float64 reference; under a budget the whole batch does not fit, the step
// is refused with the reason, never run in chunks. Evaluation mode, with
// the running statistics updated from that step's batch, runs in chunks
// with the same results as the whole batch.
func TestSessionBatchNorm(t *testing.T) {
	const n, c, lr = 64, 8, 0.1
	const tol = 1e-5 // float32 kernels against float64 loops, values of order 1
	rng := rand.New(rand.NewPCG(5, 6))
	opt := nn.Seed(9)
	m := &bnNet{conv: nn.NewConv2d(opt, 3, c, [2]int{3, 3}, true, lazy.ConvOptions{Padding: [2]int{1, 1}}),
		bn: nn.NewBatchNorm2d(opt, c, 1e-5, 0.1), fc: nn.NewLinear(opt, c, 3, true)}
	x := tensorOf(randF32(rng, n*3*32*32), n, 3, 32, 32)
	labels := make([]int64, n)
	for i := range labels {
		labels[i] = int64(rng.IntN(3))
	}
	y := tensor.New(tensor.WithShape(n), tensor.WithBacking(labels))
	ctx := context.Background()
	step := func() (*lazy.Tensor, []*lazy.Tensor) {
		logits := m.logits(x)
		return logits.CrossEntropy(logits.Graph().Wrap(y, 0), graph.ReduceMean), m.params()
	}

	// The reference, from the parameters before the step.
	loss, ps := step()
	grads := lazy.Grad(loss, ps...)
	mean, variance := m.bn.BatchStats()
	outs := []int{loss.ID(), mean.ID(), variance.ID()}
	for _, g := range grads {
		outs = append(outs, g.ID())
	}
	want, err := ref.Eval(loss.Graph().IR(), nil, outs...)
	require.NoError(t, err)
	before := make([][]float32, len(ps))
	for i, p := range ps {
		before[i] = slices.Clone(p.Value().(*tensor.Dense).Float32s())
	}

	// With room for the whole batch, one step matches the reference. The
	// batch statistics are read first: the step moves the parameters.
	whole := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	stats, err := whole.Eval(ctx, mean, variance)
	require.NoError(t, err)
	for k := range c {
		assert.InDelta(t, want[1].Data[k], float64(stats[0].Float32s()[k]), tol, "batch mean %d", k)
		assert.InDelta(t, want[2].Data[k], float64(stats[1].Float32s()[k]), tol, "batch variance %d", k)
	}
	loss, ps = step()
	got, err := whole.Step(ctx, loss, ps, optim.NewSGD(lr, 0))
	require.NoError(t, err)
	assert.InDelta(t, want[0].Data[0], float64(got), tol)
	for i, p := range ps {
		after := p.Value().(*tensor.Dense).Float32s()
		for k, g := range want[3+i].Data {
			require.InDelta(t, float64(before[i][k])-lr*g, float64(after[k]), tol, "param %d (%s) element %d", i, p.Name(), k)
		}
	}

	// Under half of what the whole batch needs, the step is refused with
	// the reason, and no parameter moves.
	trainPeak := whole.LastPlan().PeakReserved
	require.Len(t, whole.LastPlan().Chunks, 1)
	require.NoError(t, whole.Close()) // frees its parameters for the new session (ErrParamOwned)
	whole = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	loss, ps = step()
	for i, p := range ps {
		before[i] = slices.Clone(p.Value().(*tensor.Dense).Float32s())
	}
	_, err = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: trainPeak / 2}).Step(ctx, loss, ps, optim.NewSGD(lr, 0))
	require.Error(t, err)
	assert.ErrorIs(t, err, graph.ErrNotChunkable)
	assert.ErrorIs(t, err, planner.ErrDoesNotFit)
	for i, p := range ps {
		assert.Equal(t, before[i], p.Value().(*tensor.Dense).Float32s(), "a refused step changes no parameter (%d)", i)
	}

	// Evaluation mode with the updated running statistics: chunks give the
	// whole batch's logits.
	require.NoError(t, m.bn.UpdateRunning(stats[0], stats[1]))
	m.bn.Training = false
	wholeOut, err := whole.Eval(ctx, m.logits(x))
	require.NoError(t, err)
	evalPeak := whole.LastPlan().PeakReserved
	chunked := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: evalPeak / 2})
	chunkOut, err := chunked.Eval(ctx, m.logits(x))
	require.NoError(t, err)
	require.Greater(t, len(chunked.LastPlan().Chunks), 1, "evaluation mode runs in chunks")
	for k, v := range wholeOut[0].Float32s() {
		require.InDelta(t, float64(v), float64(chunkOut[0].Float32s()[k]), 1e-6, "logit %d", k)
	}
}
