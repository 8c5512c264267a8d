package optim

import (
	"errors"
	"fmt"
	"math"
)

// ErrOptim is wrapped by every error an optimizer returns.
var ErrOptim = errors.New("optimizer")

// Param is one parameter to update: its data and gradient of equal length.
// Key identifies the parameter across steps (its state is kept under it);
// Name is for messages.
type Param struct {
	Key  any
	Name string
	Data []float32
	Grad []float32
}

// Optimizer updates parameters from their gradients.
type Optimizer interface {
	// Name is a short identifier such as "adamw".
	Name() string
	// StateSlots is how many parameter-sized tensors of state the optimizer
	// keeps per parameter.
	StateSlots() int
	// Step applies one update to every parameter.
	Step(params []Param) error
	// State returns the state tensors of the parameter with key, nil before
	// its first step.
	State(key any) [][]float32
	// Steps is the number of completed steps.
	Steps() int
}

// store keeps per-parameter state slots.
type store struct {
	state map[any][][]float32
	steps int
}

func (s *store) State(key any) [][]float32 { return s.state[key] }
func (s *store) Steps() int                { return s.steps }

// check rejects a step before it changes anything: every gradient must
// match its parameter, and a parameter must keep the size of its state.
func (s *store) check(params []Param) error {
	for _, p := range params {
		if len(p.Data) != len(p.Grad) {
			return fmt.Errorf("%w: parameter %q has %d elements but its gradient %d", ErrOptim, p.Name, len(p.Data), len(p.Grad))
		}
		if st := s.state[p.Key]; len(st) > 0 && len(st[0]) != len(p.Data) {
			return fmt.Errorf("%w: parameter %q changed size from %d to %d", ErrOptim, p.Name, len(st[0]), len(p.Data))
		}
	}
	return nil
}

// get returns p's state, making zeroed slots where it has fewer than
// slots (its first step, or SGD's momentum switched on); fresh reports
// that it made them.
func (s *store) get(p Param, slots int) (st [][]float32, fresh bool) {
	if s.state == nil {
		s.state = map[any][][]float32{}
	}
	st = s.state[p.Key]
	for len(st) < slots {
		st = append(st, make([]float32, len(p.Data)))
		fresh = true
	}
	s.state[p.Key] = st
	return st, fresh
}

func checkHyper(name string, vals map[string]float64) error {
	for k, v := range vals {
		if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%w: %s %s = %g must be finite and non-negative", ErrOptim, name, k, v)
		}
	}
	return nil
}

// SGD is stochastic gradient descent with optional momentum, Nesterov
// momentum and L2 weight decay (PyTorch's torch.optim.SGD).
type SGD struct {
	LR, Momentum, Dampening, WeightDecay float64
	Nesterov                             bool
	store
}

// NewSGD returns SGD with learning rate lr and the given momentum.
func NewSGD(lr, momentum float64) *SGD { return &SGD{LR: lr, Momentum: momentum} }

func (o *SGD) Name() string { return "sgd" }

// StateSlots is 1 (the momentum buffer) with momentum, else 0.
func (o *SGD) StateSlots() int {
	if o.Momentum != 0 {
		return 1
	}
	return 0
}

// Step: g ← g + wd·p; b ← μ·b + (1−τ)·g (b = g when the buffer is new);
// g ← g + μ·b (Nesterov) or b; p ← p − lr·g.
func (o *SGD) Step(params []Param) error {
	if err := checkHyper("sgd", map[string]float64{"lr": o.LR, "momentum": o.Momentum, "dampening": o.Dampening, "weight_decay": o.WeightDecay}); err != nil {
		return err
	}
	if err := o.check(params); err != nil {
		return err
	}
	for _, p := range params {
		st, fresh := o.get(p, o.StateSlots())
		for i := range p.Data {
			w, g := float64(p.Data[i]), float64(p.Grad[i])
			g += o.WeightDecay * w
			if o.Momentum != 0 {
				b := g
				if !fresh {
					b = o.Momentum*float64(st[0][i]) + (1-o.Dampening)*g
				}
				st[0][i] = float32(b)
				if o.Nesterov {
					g += o.Momentum * b
				} else {
					g = b
				}
			}
			p.Data[i] = float32(w - o.LR*g)
		}
	}
	o.steps++
	return nil
}

// Adam is Adam with L2 weight decay added to the gradient
// (torch.optim.Adam); set Decoupled for AdamW's decoupled decay.
type Adam struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
	Decoupled                          bool
	store
}

// NewAdam returns Adam with PyTorch's defaults (β = 0.9, 0.999; ε = 1e-8).
func NewAdam(lr float64) *Adam {
	return &Adam{LR: lr, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8}
}

// NewAdamW returns AdamW with PyTorch's defaults (weight decay 0.01).
func NewAdamW(lr float64) *Adam {
	a := NewAdam(lr)
	a.WeightDecay, a.Decoupled = 0.01, true
	return a
}

// StateSlots is 2: the first and second moments.
func (o *Adam) StateSlots() int { return 2 }

func (o *Adam) Name() string {
	if o.Decoupled {
		return "adamw"
	}
	return "adam"
}

// Step: m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²;
// p ← p − lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε), with decay either added to
// g (Adam) or applied as p ← p·(1 − lr·wd) first (AdamW).
func (o *Adam) Step(params []Param) error {
	if err := checkHyper(o.Name(), map[string]float64{"lr": o.LR, "eps": o.Eps, "weight_decay": o.WeightDecay}); err != nil {
		return err
	}
	if o.Beta1 < 0 || o.Beta1 >= 1 || o.Beta2 < 0 || o.Beta2 >= 1 {
		return fmt.Errorf("%w: %s betas (%g, %g) must lie in [0, 1)", ErrOptim, o.Name(), o.Beta1, o.Beta2)
	}
	t := float64(o.steps + 1)
	c1, c2 := 1-math.Pow(o.Beta1, t), 1-math.Pow(o.Beta2, t)
	if err := o.check(params); err != nil {
		return err
	}
	for _, p := range params {
		st, _ := o.get(p, o.StateSlots())
		m, v := st[0], st[1]
		for i := range p.Data {
			w, g := float64(p.Data[i]), float64(p.Grad[i])
			if o.Decoupled {
				w *= 1 - o.LR*o.WeightDecay
			} else {
				g += o.WeightDecay * w
			}
			mi := o.Beta1*float64(m[i]) + (1-o.Beta1)*g
			vi := o.Beta2*float64(v[i]) + (1-o.Beta2)*g*g
			m[i], v[i] = float32(mi), float32(vi)
			p.Data[i] = float32(w - o.LR*(mi/c1)/(math.Sqrt(vi/c2)+o.Eps))
		}
	}
	o.steps++
	return nil
}
