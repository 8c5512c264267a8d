package optim_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/optim"
)

// Hand-computed points of each schedule (base 1 unless said), within
// 1e-12: warmup fractions, the cosine's midpoint (half way between base
// and floor) and end (the floor), linear decay's end, StepLR's powers.
func TestSchedulesByHand(t *testing.T) {
	const tol = 1e-12
	for _, c := range []struct {
		name string
		s    optim.Schedule
		base float64
		step int
		want float64
	}{
		{"constant", optim.Constant{}, 0.5, 7, 0.5},
		{"constant warmup", optim.Constant{Warmup: 4}, 1, 1, 0.25},
		{"constant after warmup", optim.Constant{Warmup: 4}, 1, 4, 1},
		{"linear warmup start", optim.Linear{Start: 1.0 / 3, End: 1, Steps: 5}, 3, 0, 1},
		{"linear warmup mid", optim.Linear{Start: 0.5, End: 1, Steps: 4}, 1, 2, 0.75},
		{"linear warmup done", optim.Linear{Start: 0.5, End: 1, Steps: 4}, 1, 9, 1},
		{"linear decay end", optim.Linear{Start: 1, End: 0, Steps: 10}, 1, 10, 0},
		{"warmup-linear warmup", optim.WarmupLinear{Warmup: 10, Total: 110}, 1, 5, 0.5},
		{"warmup-linear peak", optim.WarmupLinear{Warmup: 10, Total: 110}, 1, 10, 1},
		{"warmup-linear mid decay", optim.WarmupLinear{Warmup: 10, Total: 110}, 1, 60, 0.5},
		{"warmup-linear past total", optim.WarmupLinear{Warmup: 10, Total: 110}, 1, 200, 0},
		{"cosine warmup from 0", optim.Cosine{Warmup: 10, Total: 100}, 1, 3, 0.3},
		{"cosine warmup from start", optim.Cosine{Warmup: 10, Total: 100, WarmupStart: 0.1}, 1, 5, 0.55},
		{"cosine peak", optim.Cosine{Warmup: 10, Total: 100}, 2, 10, 2},
		{"cosine mid", optim.Cosine{Warmup: 10, Total: 110}, 1, 60, 0.5},
		{"cosine mid with floor ratio", optim.Cosine{Warmup: 10, Total: 110, MinRatio: 0.2}, 1, 60, 0.6},
		{"cosine end at absolute floor", optim.Cosine{Total: 50, MinLR: 0.01}, 1, 50, 0.01},
		{"cosine quarter", optim.Cosine{Total: 100}, 1, 25, 0.5 * (1 + math.Cos(math.Pi/4))},
		{"step before", optim.StepDecay{Every: 30, Gamma: 0.1}, 1, 29, 1},
		{"step after two", optim.StepDecay{Every: 30, Gamma: 0.1}, 1, 60, 0.01},
	} {
		require.InDelta(t, c.want, c.s.LR(c.base, c.step), tol, c.name)
	}
}

// A schedule drives every group from its own base rate, at the
// optimizer's step count, and a rate it gives that is negative or not
// finite is an error of the step, naming the group.
func TestScheduleDrivesGroups(t *testing.T) {
	o := optim.NewSGD(1, 0)
	g := o.AddGroup("slow", "b")
	g.LR = 0.1
	o.Schedule = optim.Linear{Start: 1, End: 0, Steps: 4}
	a := optim.Param{Key: "a", Data: []float32{0}, Grad: []float32{1}}
	b := optim.Param{Key: "b", Data: []float32{0}, Grad: []float32{1}}
	for range 2 {
		require.NoError(t, o.Step([]optim.Param{a, b}))
	}
	// Steps 0 and 1 run at factors 1 and 0.75.
	near(t, -1.75, a.Data[0], "default group")
	near(t, -0.175, b.Data[0], "group slow")
	o.Schedule = badSchedule{}
	require.ErrorIs(t, o.Step([]optim.Param{a, b}), optim.ErrOptim)
	require.Equal(t, 2, o.Steps())
}

type badSchedule struct{}

func (badSchedule) LR(float64, int) float64 { return math.NaN() }
