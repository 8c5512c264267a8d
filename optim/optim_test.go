package optim_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/optim"
)

// Updates run in float64 and are stored in float32: compare within float32
// rounding of the values involved.
const rtol, atol = 1e-5, 1e-7

func near(t *testing.T, want float64, got float32, what string) {
	t.Helper()
	if d := math.Abs(want - float64(got)); d > atol+rtol*math.Abs(want) {
		t.Fatalf("%s: got %.9g, want %.9g (diff %.3g)", what, got, want, d)
	}
}

func TestSGDHandComputed(t *testing.T) {
	// p = 1, g = 0.5, lr = 0.1, μ = 0.9, wd = 0.1.
	// step 1: g' = 0.5 + 0.1·1 = 0.6; b = 0.6; p = 1 − 0.06 = 0.94.
	// step 2 (same raw g): g' = 0.5 + 0.094 = 0.594; b = 0.9·0.6 + 0.594 = 1.134; p = 0.94 − 0.1134 = 0.8266.
	o := optim.NewSGD(0.1, 0.9)
	o.WeightDecay = 0.1
	p := optim.Param{Key: "w", Name: "w", Data: []float32{1}, Grad: []float32{0.5}}
	require.NoError(t, o.Step([]optim.Param{p}))
	near(t, 0.94, p.Data[0], "step 1")
	require.NoError(t, o.Step([]optim.Param{p}))
	near(t, 0.8266, p.Data[0], "step 2")
	near(t, 1.134, o.State("w")[0][0], "momentum buffer")
	require.Equal(t, 1, o.StateSlots())
	require.Equal(t, 0, optim.NewSGD(0.1, 0).StateSlots())
}

func TestAdamFirstStepIsSignStep(t *testing.T) {
	// With bias correction, step 1 is lr·g/(|g| + ε) ≈ lr·sign(g).
	o := optim.NewAdam(0.01)
	p := optim.Param{Key: 1, Data: []float32{1, 1, 1}, Grad: []float32{3, -0.2, 1e-3}}
	require.NoError(t, o.Step([]optim.Param{p}))
	for i, g := range []float64{3, -0.2, 1e-3} {
		near(t, 1-0.01*g/(math.Abs(g)+1e-8), p.Data[i], "param")
	}
	require.Equal(t, 2, o.StateSlots())
	require.Len(t, o.State(1), 2)
}

// refAdam is an independent float64 transcription of PyTorch's Adam/AdamW.
func refAdam(p, g []float64, steps int, lr, b1, b2, eps, wd float64, decoupled bool) []float64 {
	p = append([]float64(nil), p...)
	m, v := make([]float64, len(p)), make([]float64, len(p))
	for t := 1; t <= steps; t++ {
		for i := range p {
			gi := g[i]
			if decoupled {
				p[i] -= lr * wd * p[i]
			} else {
				gi += wd * p[i]
			}
			m[i] = b1*m[i] + (1-b1)*gi
			v[i] = b2*v[i] + (1-b2)*gi*gi
			mh := m[i] / (1 - math.Pow(b1, float64(t)))
			vh := v[i] / (1 - math.Pow(b2, float64(t)))
			p[i] -= lr * mh / (math.Sqrt(vh) + eps)
		}
	}
	return p
}

func TestAdamAndAdamWMatchReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, decoupled := range []bool{false, true} {
		n := 64
		p64, g64 := make([]float64, n), make([]float64, n)
		data, grad := make([]float32, n), make([]float32, n)
		for i := range n {
			data[i] = float32(rng.NormFloat64())
			grad[i] = float32(rng.NormFloat64())
			p64[i], g64[i] = float64(data[i]), float64(grad[i])
		}
		o := optim.NewAdam(1e-2)
		o.WeightDecay, o.Decoupled = 0.05, decoupled
		for range 5 {
			require.NoError(t, o.Step([]optim.Param{{Key: "p", Data: data, Grad: grad}}))
		}
		want := refAdam(p64, g64, 5, 1e-2, 0.9, 0.999, 1e-8, 0.05, decoupled)
		for i := range n {
			near(t, want[i], data[i], o.Name())
		}
		require.Equal(t, 5, o.Steps())
	}
}

func TestOptimizerErrors(t *testing.T) {
	bad := optim.Param{Key: "x", Name: "x", Data: []float32{1, 2}, Grad: []float32{1}}
	for _, o := range []optim.Optimizer{optim.NewSGD(0.1, 0.9), optim.NewAdamW(1e-3)} {
		require.True(t, errors.Is(o.Step([]optim.Param{bad}), optim.ErrOptim), o.Name())
	}
	neg := optim.NewSGD(-1, 0)
	require.True(t, errors.Is(neg.Step(nil), optim.ErrOptim))
	a := optim.NewAdam(1e-3)
	a.Beta1 = 1
	require.True(t, errors.Is(a.Step(nil), optim.ErrOptim))
}

// Momentum switched on after plain steps starts each buffer from the
// gradient, as PyTorch does for a parameter whose buffer is new; so does a
// parameter first seen after the optimizer's first step. Neither panics.
func TestSGDMomentumBufferStartsFromGradient(t *testing.T) {
	// lr = 0.1, μ = 0.9, τ = 0.5, g = 0.5: a new buffer is g (not (1−τ)·g).
	o := optim.NewSGD(0.1, 0)
	w := optim.Param{Key: "w", Name: "w", Data: []float32{1}, Grad: []float32{0.5}}
	require.NoError(t, o.Step([]optim.Param{w})) // p = 1 − 0.05 = 0.95
	o.Momentum, o.Dampening = 0.9, 0.5
	v := optim.Param{Key: "v", Name: "v", Data: []float32{2}, Grad: []float32{0.5}}
	require.NotPanics(t, func() { require.NoError(t, o.Step([]optim.Param{w, v})) })
	near(t, 0.5, o.State("w")[0][0], "w's new buffer")
	near(t, 0.5, o.State("v")[0][0], "v's new buffer")
	near(t, 0.90, w.Data[0], "w after the first momentum step")
	near(t, 1.95, v.Data[0], "v after its first step")
	require.Equal(t, 1, o.StateSlots())
}

// A step that fails on one parameter updates none: no data, no state, no
// step count.
func TestFailedStepChangesNothing(t *testing.T) {
	for _, o := range []optim.Optimizer{optim.NewSGD(0.1, 0.9), optim.NewAdamW(1e-3)} {
		good := optim.Param{Key: "g", Name: "g", Data: []float32{1, 2}, Grad: []float32{0.5, -0.5}}
		bad := optim.Param{Key: "b", Name: "b", Data: []float32{1, 2}, Grad: []float32{1}}
		require.True(t, errors.Is(o.Step([]optim.Param{good, bad}), optim.ErrOptim), o.Name())
		require.Equal(t, []float32{1, 2}, good.Data, o.Name())
		require.Nil(t, o.State("g"), o.Name())
		require.Zero(t, o.Steps(), o.Name())
	}
}

// StateSlots follows the hyperparameters, not the constructor: planners
// ask before the first step, and optimizers built as struct literals count
// their state from the start.
func TestStateSlotsBeforeFirstStep(t *testing.T) {
	require.Equal(t, 1, (&optim.SGD{LR: 0.1, Momentum: 0.9}).StateSlots())
	require.Equal(t, 0, (&optim.SGD{LR: 0.1}).StateSlots())
	require.Equal(t, 2, (&optim.Adam{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}).StateSlots())
	s := optim.NewSGD(0.1, 0)
	s.Momentum = 0.9
	require.Equal(t, 1, s.StateSlots())
}
