package optim_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/optim"
)

// randGrads draws steps×n gradients in [−1, 1), none zero.
func randGrads(rng *rand.Rand, steps, n int) [][]float32 {
	g := make([][]float32, steps)
	for s := range g {
		g[s] = make([]float32, n)
		for i := range g[s] {
			g[s][i] = float32(2*rng.Float64()-1) + 1e-3
		}
	}
	return g
}

// A parameter first trained at the optimizer's fourth step gets the bias
// correction of its own first step: its first update is lr·g/(|g| + ε),
// as PyTorch's per-parameter state["step"] gives (the optimizer's global
// count would give 1 − 0.9⁴ for c1 and scale the step by 0.58).
//
// Tolerance: float32 rounding of the parameter (rtol 1e-5, atol 1e-7).
func TestAdamLateParamGetsItsOwnFirstStep(t *testing.T) {
	o := optim.NewAdam(0.01)
	early := optim.Param{Key: "early", Name: "early", Data: []float32{1, 2}, Grad: []float32{0.3, -0.7}}
	for range 3 {
		require.NoError(t, o.Step([]optim.Param{early}))
	}
	late := optim.Param{Key: "late", Name: "late", Data: []float32{1, 1, 1}, Grad: []float32{2, -0.25, 1e-3}}
	require.NoError(t, o.Step([]optim.Param{early, late}))
	for i, g := range []float64{2, -0.25, 1e-3} {
		near(t, 1-0.01*g/(math.Abs(g)+1e-8), late.Data[i], "late parameter's first update")
	}
	require.Equal(t, 4, o.Steps())
	require.Equal(t, 4, o.ParamStep("early"))
	require.Equal(t, 1, o.ParamStep("late"))
	require.Equal(t, 0, o.ParamStep("never"))
	require.Equal(t, []any{"early", "late"}, o.Keys())
}

// refAdamPerParam is an independent float64 transcription of PyTorch's
// Adam/AdamW for one parameter first updated at global step `from` (its
// own step count starting there), with lr(step) the scheduled rate and
// clip(step) the factor its gradient is scaled by.
func refAdamPerParam(p []float64, grads [][]float32, from int, lr func(int) float64, b1, b2, eps, wd float64, decoupled bool) []float64 {
	p = slices.Clone(p)
	m, v := make([]float64, len(p)), make([]float64, len(p))
	for s := from; s < len(grads); s++ {
		t := float64(s - from + 1)
		for i := range p {
			g := float64(grads[s][i])
			if decoupled {
				p[i] *= 1 - lr(s)*wd
			} else {
				g += wd * p[i]
			}
			m[i] = b1*m[i] + (1-b1)*g
			v[i] = b2*v[i] + (1-b2)*g*g
			p[i] -= lr(s) * (m[i] / (1 - math.Pow(b1, t))) / (math.Sqrt(v[i]/(1-math.Pow(b2, t))) + eps)
		}
	}
	return p
}

// Two parameter groups with their own learning rate, weight decay and
// betas, under a schedule, one parameter joining late: each follows the
// reference with its group's values and its own step count.
//
// Tolerance: rtol 1e-5 (float32 storage of the parameter and the moments
// against float64 throughout, over 8 steps).
func TestAdamWGroupsScheduleLateJoin(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const steps, n = 8, 16
	ga, gb := randGrads(rng, steps, n), randGrads(rng, steps, n)
	init := func() []float32 {
		d := make([]float32, n)
		for i := range d {
			d[i] = float32(rng.NormFloat64())
		}
		return d
	}
	a, b := init(), init()
	a64, b64 := toF64(a), toF64(b)
	o := optim.NewAdamW(1e-2)
	o.WeightDecay = 0.1
	g := o.AddGroup("no_decay", "b")
	g.WeightDecay, g.LR, g.Beta1 = 0, 3e-2, 0.8
	sched := optim.Cosine{Warmup: 2, Total: steps, MinRatio: 0.1}
	o.Schedule = sched
	for s := range steps {
		ps := []optim.Param{{Key: "a", Name: "a", Data: a, Grad: ga[s]}}
		if s >= 3 {
			ps = append(ps, optim.Param{Key: "b", Name: "b", Data: b, Grad: gb[s]})
		}
		require.NoError(t, o.Step(ps))
	}
	wantA := refAdamPerParam(a64, ga, 0, func(s int) float64 { return sched.LR(1e-2, s) }, 0.9, 0.999, 1e-8, 0.1, true)
	wantB := refAdamPerParam(b64, gb, 3, func(s int) float64 { return sched.LR(3e-2, s) }, 0.8, 0.999, 1e-8, 0, true)
	for i := range n {
		near(t, wantA[i], a[i], "group default")
		near(t, wantB[i], b[i], "group no_decay")
	}
	require.Equal(t, steps, o.ParamStep("a"))
	require.Equal(t, steps-3, o.ParamStep("b"))
}

func toF64(f []float32) []float64 {
	out := make([]float64, len(f))
	for i, x := range f {
		out[i] = float64(x)
	}
	return out
}

// checkpointable is what a checkpoint reads and writes of an optimizer.
type checkpointable interface {
	optim.Optimizer
	Keys() []any
	ParamStep(any) int
	SetState(any, int, int, [][]float32) error
	SetSteps(int) error
}

// A run saved after 5 steps (Keys, ParamStep, State, Steps) and restored
// into a fresh optimizer (SetState, SetSteps) continues bit for bit as the
// uninterrupted run, for Adam with a schedule and clipping and for SGD with
// momentum.
func TestResumeIsBitIdentical(t *testing.T) {
	for _, mk := range []func() checkpointable{
		func() checkpointable {
			o := optim.NewAdamW(1e-2)
			o.Schedule = optim.WarmupLinear{Warmup: 3, Total: 10}
			o.Clip = optim.Clip{MaxNorm: 0.5}
			return o
		},
		func() checkpointable {
			o := optim.NewSGD(0.1, 0.9)
			o.Nesterov, o.WeightDecay = true, 1e-3
			o.Schedule = optim.StepDecay{Every: 3, Gamma: 0.5}
			return o
		},
	} {
		rng := rand.New(rand.NewPCG(5, 6))
		grads := randGrads(rng, 10, 7)
		start := []float32{1, -2, 3, 0.5, -0.25, 2, 1}
		straight, straightData := mk(), slices.Clone(start)
		for s := range 10 {
			require.NoError(t, straight.Step([]optim.Param{{Key: "w", Name: "w", Data: straightData, Grad: grads[s]}}))
		}
		first, data := mk(), slices.Clone(start)
		for s := range 5 {
			require.NoError(t, first.Step([]optim.Param{{Key: "w", Name: "w", Data: data, Grad: grads[s]}}))
		}
		// The checkpoint: copies of everything, as a file would hold.
		saved := map[any][][]float32{}
		steps := map[any]int{}
		for _, k := range first.Keys() {
			for _, s := range first.State(k) {
				saved[k] = append(saved[k], slices.Clone(s))
			}
			steps[k] = first.ParamStep(k)
		}
		resumed := mk()
		for k, st := range saved {
			require.NoError(t, resumed.SetState(k, len(data), steps[k], st))
		}
		require.NoError(t, resumed.SetSteps(first.Steps()))
		for s := 5; s < 10; s++ {
			require.NoError(t, resumed.Step([]optim.Param{{Key: "w", Name: "w", Data: data, Grad: grads[s]}}))
		}
		require.Equal(t, straightData, data, resumed.Name())
		require.Equal(t, straight.State("w"), resumed.State("w"), resumed.Name())
		require.Equal(t, 10, resumed.Steps())
	}
}

// SetState refuses slots of the wrong size; SetSteps a negative count.
func TestSetStateErrors(t *testing.T) {
	o := optim.NewAdam(1e-3)
	require.ErrorIs(t, o.SetState("w", 3, 1, [][]float32{{1, 2}}), optim.ErrOptim)
	require.ErrorIs(t, o.SetState("w", 3, -1, nil), optim.ErrOptim)
	require.ErrorIs(t, o.SetSteps(-1), optim.ErrOptim)
	// A restored state of another size is refused by the next step.
	require.NoError(t, o.SetState("w", 3, 2, [][]float32{{1, 2, 3}, {1, 2, 3}}))
	err := o.Step([]optim.Param{{Key: "w", Name: "w", Data: []float32{1, 2}, Grad: []float32{1, 1}}})
	require.ErrorIs(t, err, optim.ErrOptim)
}

// A key that cannot index a map and a key in two groups are errors, not
// panics.
func TestKeyAndGroupErrors(t *testing.T) {
	o := optim.NewSGD(0.1, 0)
	bad := optim.Param{Key: []int{1}, Name: "slice", Data: []float32{1}, Grad: []float32{1}}
	require.NotPanics(t, func() { require.ErrorIs(t, o.Step([]optim.Param{bad}), optim.ErrOptim) })
	o.AddGroup("a", "w")
	o.AddGroup("b", "w")
	w := optim.Param{Key: "w", Name: "w", Data: []float32{1}, Grad: []float32{1}}
	require.ErrorIs(t, o.Step([]optim.Param{w}), optim.ErrOptim)
	o.Groups = []*optim.Group{nil}
	require.ErrorIs(t, o.Step([]optim.Param{w}), optim.ErrOptim)
	o.Groups = nil
	g := o.AddGroup("neg", "w")
	g.LR = -1
	require.ErrorIs(t, o.Step([]optim.Param{w}), optim.ErrOptim)
	require.Zero(t, o.Steps())
}

// The device protocol: PlanDevice changes nothing; CommitDevice advances
// the counts and leaves the state on the device (host State nil); a host
// step is refused until the device's copy comes back (SetDeviceCopy); a
// state set on the host is handed to the device to upload, and the
// device's older copy of it is ignored; a plan older than the latest
// commit is refused.
func TestDevicePlanProtocol(t *testing.T) {
	o := optim.NewAdam(1e-2)
	ps := []optim.DeviceParam{{Key: "w", Name: "w", N: 2}}
	pl, err := o.PlanDevice(ps)
	require.NoError(t, err)
	require.Zero(t, o.Steps())
	require.Len(t, pl.Params, 1)
	u := pl.Params[0]
	require.True(t, u.Fresh)
	require.Equal(t, 1, u.Step)
	require.InDelta(t, 0.1, u.C1, 1e-15)
	require.InDelta(t, 0.001, u.C2, 1e-15)
	require.Equal(t, 2, pl.Slots)
	require.NoError(t, o.CommitDevice(pl))
	require.ErrorIs(t, o.CommitDevice(pl), optim.ErrOptim, "a stale plan")
	require.Equal(t, 1, o.Steps())
	require.Equal(t, 1, o.ParamStep("w"))
	require.True(t, o.OnDevice("w"))
	require.Nil(t, o.State("w"))
	host := optim.Param{Key: "w", Name: "w", Data: []float32{1, 2}, Grad: []float32{1, 1}}
	require.ErrorIs(t, o.Step([]optim.Param{host}), optim.ErrOptim, "state on the device")

	pl, err = o.PlanDevice(ps)
	require.NoError(t, err)
	require.False(t, pl.Params[0].Fresh)
	require.Nil(t, pl.Params[0].Upload, "the device holds the state")
	require.Equal(t, 2, pl.Params[0].Step)

	m, v := []float32{0.5, 0.25}, []float32{0.125, 0.0625}
	require.NoError(t, o.SetDeviceCopy("w", [][]float32{m, v}, true))
	require.Equal(t, [][]float32{m, v}, o.State("w"))
	require.NoError(t, o.Step([]optim.Param{host}), "a synced state steps on the host")
	require.False(t, o.OnDevice("w"))
	pl, err = o.PlanDevice(ps)
	require.NoError(t, err)
	require.Len(t, pl.Params[0].Upload, 2, "the host's newer state goes to the device")
	require.Equal(t, 3, pl.Params[0].Step)

	require.NoError(t, o.CommitDevice(pl))
	o.DeviceLost("w")
	_, err = o.PlanDevice(ps)
	require.ErrorIs(t, err, optim.ErrOptim, "the state went with its device")
	require.NoError(t, o.SetState("w", 2, 3, [][]float32{m, v}))
	pl, err = o.PlanDevice(ps)
	require.NoError(t, err)
	require.Equal(t, [][]float32{m, v}, pl.Params[0].Upload)

	// A state restored on the host while the device still holds an older
	// one: the device's copy, synced or handed back, is stale and ignored.
	require.NoError(t, o.CommitDevice(pl))
	require.NoError(t, o.SetState("w", 2, 7, [][]float32{v, m}))
	require.NoError(t, o.SetDeviceCopy("w", [][]float32{{9, 9}, {9, 9}}, true))
	require.Equal(t, [][]float32{v, m}, o.State("w"))
	require.False(t, o.OnDevice("w"))
	o.ResetState()
	require.NoError(t, o.SetDeviceCopy("w", [][]float32{{9, 9}, {9, 9}}, false), "state forgotten since")
	require.Nil(t, o.State("w"))
	require.Empty(t, o.Keys())
}

// SGD's momentum buffer is fresh per parameter: a group without momentum
// needs no slot, and a parameter joining late starts its buffer from its
// gradient (DevicePlan's Fresh) while the others continue theirs.
func TestSGDDevicePlanFreshPerParam(t *testing.T) {
	o := optim.NewSGD(0.1, 0.9)
	pl, err := o.PlanDevice([]optim.DeviceParam{{Key: "a", N: 1}})
	require.NoError(t, err)
	require.NoError(t, o.CommitDevice(pl))
	pl, err = o.PlanDevice([]optim.DeviceParam{{Key: "a", N: 1}, {Key: "b", N: 1}})
	require.NoError(t, err)
	require.False(t, pl.Params[0].Fresh)
	require.True(t, pl.Params[1].Fresh)
	require.Equal(t, 1, pl.Slots)

	p := optim.NewSGD(0.1, 0)
	g := p.AddGroup("momentum", "m")
	g.Momentum = 0.9
	require.Equal(t, 1, p.StateSlots(), "a group's momentum counts")
	pl, err = p.PlanDevice([]optim.DeviceParam{{Key: "plain", N: 1}, {Key: "m", N: 1}})
	require.NoError(t, err)
	require.Len(t, pl.Groups, 2)
	require.Equal(t, 0.0, pl.Groups[pl.Params[0].Group].Momentum)
	require.Equal(t, 0.9, pl.Groups[pl.Params[1].Group].Momentum)
}

// ResetState starts over: no state, no steps, no norm.
func TestResetState(t *testing.T) {
	o := optim.NewAdam(1e-2)
	o.Clip.MaxNorm = 1
	require.NoError(t, o.Step([]optim.Param{{Key: "w", Data: []float32{1}, Grad: []float32{2}}}))
	_, err := o.LastGradNorm()
	require.NoError(t, err)
	o.ResetState()
	require.Zero(t, o.Steps())
	require.Nil(t, o.State("w"))
	_, err = o.LastGradNorm()
	require.True(t, errors.Is(err, optim.ErrNoGradNorm))
}
