package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// manyParams is a step over 150 parameters of assorted sizes (1, sizes
// that are not multiples of 4, up to 4099 elements): the device optimizer
// updates them in three lists (64 a launch). The first two share one
// gradient node: Σ c₀·y² with y = Σ_batch x + p₀ + p₁ gives both the
// upstream gradient of y itself. Every other parameter pᵢ adds Σ cᵢ·pᵢ²,
// so its gradient, 2cᵢpᵢ, is nonzero, random and new every step. The cᵢ
// are constants; all data is uniform in [−1, 1).
type manyParams struct {
	init   [][]float32 // the parameters' initial values
	consts [][]float32 // c₀ (for the shared pair), then cᵢ for each other parameter
	x      []float32   // the [batch, 5] input
}

const manyParamsBatch = 6

func newManyParams(rng *rand.Rand) manyParams {
	sizes := []int{1, 2, 3, 5, 7, 8, 13, 31, 33, 64, 100, 255, 257, 1000, 4099}
	m := manyParams{init: [][]float32{testutil.RandFloats(rng, 5), testutil.RandFloats(rng, 5)},
		consts: [][]float32{testutil.RandFloats(rng, 5)}, x: testutil.RandFloats(rng, manyParamsBatch*5)}
	for i := range 148 {
		n := sizes[i%len(sizes)]
		m.init = append(m.init, testutil.RandFloats(rng, n))
		m.consts = append(m.consts, testutil.RandFloats(rng, n))
	}
	return m
}

// build returns the step's loss over fresh parameters holding m.init.
func (m manyParams) build() (*lazy.Tensor, []*lazy.Tensor) {
	dense := func(v []float32) *tensor.Dense {
		return tensor.New(tensor.WithShape(len(v)), tensor.WithBacking(slices.Clone(v)))
	}
	params := make([]*lazy.Tensor, len(m.init))
	for i, v := range m.init {
		params[i] = lazy.Param(dense(v), fmt.Sprintf("p%d", i))
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(manyParamsBatch, 5), tensor.WithBacking(slices.Clone(m.x))), 0)
	y := x.Sum(0).Add(params[0]).Add(params[1])
	loss := y.Mul(y).Mul(lazy.Const(dense(m.consts[0]))).Sum()
	for i, p := range params[2:] {
		loss = loss.Add(p.Mul(p).Mul(lazy.Const(dense(m.consts[i+1]))).Sum())
	}
	return loss, params
}

// TestDeviceOptimizerManyParams: sgd_multi_f32 and adam_multi_f32 update
// 150 parameters (manyParams: three lists, sizes 1 to 4099, a shared
// gradient) bit for bit as optim.go's SGD (with momentum, dampening,
// Nesterov, weight decay, and without momentum) and Adam and AdamW do on
// the host, over 3 steps. One executor runs two copies of the step: one
// with the optimizer on the device, one with it on the host through
// ExecOptions.Update (gradients downloaded, host parameters updated and
// uploaded).
//
// Tolerance: none, the parameters must be equal. The gradients come from
// the same deterministic kernels on bitwise-equal parameters, so they are
// equal; the kernels then evaluate optim.go's expressions in double in the
// same order, with the products and sums rounded one by one (no FMA
// contraction) and IEEE-rounded division and square root, so each update
// is the host's exactly (kernels/README.md; this assumes a Go build that
// does not fuse either, as amd64).
func TestDeviceOptimizerManyParams(t *testing.T) {
	const steps = 3
	device(t) // skips without a GPU
	ctx := context.Background()
	m := newManyParams(rand.New(rand.NewPCG(47, 48)))
	for _, c := range []struct {
		name string
		opt  func() optim.Optimizer
	}{
		{"sgd", func() optim.Optimizer { o := optim.NewSGD(0.05, 0); o.WeightDecay = 1e-2; return o }},
		{"sgd-momentum", func() optim.Optimizer {
			o := optim.NewSGD(0.05, 0.9)
			o.WeightDecay, o.Dampening = 1e-2, 0.1
			return o
		}},
		{"sgd-nesterov", func() optim.Optimizer {
			o := optim.NewSGD(0.05, 0.9)
			o.Nesterov, o.WeightDecay = true, 1e-2
			return o
		}},
		{"adam", func() optim.Optimizer { o := optim.NewAdam(1e-2); o.WeightDecay = 1e-2; return o }},
		{"adamw", func() optim.Optimizer { return optim.NewAdamW(1e-2) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := freshExecutor(t, cuda.ExecutorOptions{})
			devOpt, hostOpt := c.opt(), c.opt()
			loss, devParams := m.build()
			dp := stepProgram(t, loss, devParams, devOpt.StateSlots())
			require.Len(t, dp.Trained, 150)
			require.Equal(t, dp.Kept[0], dp.Kept[1], "the case under test: p0 and p1 share one gradient node")
			loss, hostParamsT := m.build()
			hp := stepProgram(t, loss, hostParamsT, hostOpt.StateSlots())
			update := func(kept [][]float32) error { // as batchfit.Session.Step's
				ps := make([]optim.Param, len(hostParamsT))
				for i, pt := range hostParamsT {
					ps[i] = optim.Param{Key: pt.Value(), Name: pt.Name(), Data: pt.Value().(*tensor.Dense).Float32s(), Grad: kept[i]}
				}
				return hostOpt.Step(ps)
			}
			chunks := planner.Chunks(manyParamsBatch, 1) // the parameter terms are batch-independent
			for step := range steps {
				dres, err := e.Execute(ctx, dp, chunks, cuda.ExecOptions{Resident: true, Optimizer: devOpt, SyncParams: true})
				require.NoError(t, err, "device step %d", step)
				hres, err := e.Execute(ctx, hp, chunks, cuda.ExecOptions{Resident: true, Update: update})
				require.NoError(t, err, "host step %d", step)
				require.Equal(t, scalarOf(t, hres.Outputs[0]), scalarOf(t, dres.Outputs[0]), "step %d loss", step)
			}
			require.Equal(t, steps, devOpt.Steps())
			want, got := hostParams(t, hostParamsT), hostParams(t, devParams)
			for i := range want {
				require.Equal(t, want[i], got[i], "parameter %s (%d elements)", devParams[i].Name(), len(want[i]))
				require.NotEqual(t, m.init[i], got[i], "parameter %s was updated", devParams[i].Name())
				for j, v := range got[i] {
					require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 0), "parameter %s[%d] = %g", devParams[i].Name(), j, v)
				}
			}
		})
	}
}
