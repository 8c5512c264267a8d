package optim

import (
	"fmt"
	"math"
)

// Schedule gives the learning rate of each step. Step is the number of
// the optimizer's completed steps (Steps): 0 for the first update, as a
// PyTorch scheduler stepped once after every optimizer.step(), or a
// transformers LambdaLR, gives. Base is the group's LR (PyTorch's
// initial_lr), so every group follows the schedule from its own rate.
type Schedule interface {
	LR(base float64, step int) float64
}

// Constant keeps the base rate, after a linear warmup from 0 over Warmup
// steps when Warmup > 0: transformers' get_constant_schedule and
// get_constant_schedule_with_warmup.
type Constant struct {
	Warmup int
}

func (s Constant) LR(base float64, step int) float64 {
	if step < s.Warmup {
		return base * float64(step) / float64(s.Warmup)
	}
	return base
}

// Linear scales the base rate by a factor that moves linearly from Start
// to End over Steps steps and stays at End after:
// torch.optim.lr_scheduler.LinearLR(start_factor=Start, end_factor=End,
// total_iters=Steps). Start 1/3, End 1 (its defaults) is a warmup; Start
// 1, End 0 a linear decay to 0.
type Linear struct {
	Start, End float64
	Steps      int
}

func (s Linear) LR(base float64, step int) float64 {
	if s.Steps <= 0 || step >= s.Steps {
		return base * s.End
	}
	return base * (s.Start + (s.End-s.Start)*float64(step)/float64(s.Steps))
}

// WarmupLinear warms up linearly from 0 to the base rate over Warmup
// steps, then decays linearly to 0 at step Total and stays there:
// transformers' get_linear_schedule_with_warmup(num_warmup_steps=Warmup,
// num_training_steps=Total).
type WarmupLinear struct {
	Warmup, Total int
}

func (s WarmupLinear) LR(base float64, step int) float64 {
	if step < s.Warmup {
		return base * float64(step) / float64(max(1, s.Warmup))
	}
	return base * max(0, float64(s.Total-step)/float64(max(1, s.Total-s.Warmup)))
}

// Cosine warms up linearly over Warmup steps, from WarmupStart·base (0
// when WarmupStart is 0) to the base rate, then follows half a cosine from
// the base rate down to the floor at step Total:
//
//	lr = floor + (base − floor)·(1 + cos(π·(step − Warmup)/(Total − Warmup)))/2
//
// with floor = MinLR + MinRatio·base (set one of them). It is
// transformers' get_cosine_schedule_with_warmup (floor 0) and
// get_cosine_with_min_lr_schedule_with_warmup (MinRatio = min_lr_rate),
// and torch's SequentialLR([LinearLR(start_factor=WarmupStart,
// total_iters=Warmup), CosineAnnealingLR(T_max=Total−Warmup,
// eta_min=MinLR)], milestones=[Warmup]), or CosineAnnealingLR alone with
// Warmup 0. Past Total the cosine goes on (rising again), as both
// libraries' do; schedule Total as the last step.
type Cosine struct {
	Warmup, Total int
	WarmupStart   float64
	MinLR         float64
	MinRatio      float64
}

func (s Cosine) LR(base float64, step int) float64 {
	if step < s.Warmup {
		f := float64(step) / float64(max(1, s.Warmup))
		return base * (s.WarmupStart + (1-s.WarmupStart)*f)
	}
	progress := float64(step-s.Warmup) / float64(max(1, s.Total-s.Warmup))
	c := 0.5 * (1 + math.Cos(math.Pi*progress))
	floor := s.MinLR + s.MinRatio*base
	return floor + (base-floor)*c
}

// StepDecay multiplies the base rate by Gamma every Every steps:
// torch.optim.lr_scheduler.StepLR(step_size=Every, gamma=Gamma).
type StepDecay struct {
	Every int
	Gamma float64
}

func (s StepDecay) LR(base float64, step int) float64 {
	if s.Every <= 0 {
		return base
	}
	return base * math.Pow(s.Gamma, float64(step/s.Every))
}

// scheduled is base at step under s (base itself without a schedule),
// refused when it is not a finite non-negative rate.
func scheduled(s Schedule, base float64, step int, opt, group string) (float64, error) {
	if s == nil {
		return base, nil
	}
	lr := s.LR(base, step)
	if lr < 0 || math.IsNaN(lr) || math.IsInf(lr, 0) {
		return 0, fmt.Errorf("%w: %s group %q: schedule %T gives learning rate %g at step %d from %g", ErrOptim, opt, group, s, lr, step, base)
	}
	return lr, nil
}
