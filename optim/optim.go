package optim

import (
	"errors"
	"fmt"
	"math"
	"reflect"
)

// ErrOptim is wrapped by every error an optimizer returns.
var ErrOptim = errors.New("optimizer")

// Param is one parameter to update: its data and gradient of equal length.
// Key identifies the parameter across steps (its state is kept under it;
// groups list it); it must be comparable. Name is for messages.
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

// SGD is stochastic gradient descent with optional momentum, Nesterov
// momentum and L2 weight decay (PyTorch's torch.optim.SGD). Its fields are
// the default group's hyperparameters; Common adds groups, a schedule and
// clipping.
type SGD struct {
	LR, Momentum, Dampening, WeightDecay float64
	Nesterov                             bool
	Common
}

// NewSGD returns SGD with learning rate lr and the given momentum.
func NewSGD(lr, momentum float64) *SGD { return &SGD{LR: lr, Momentum: momentum} }

func (o *SGD) Name() string { return "sgd" }

// StateSlots is 1 (the momentum buffer) when the default group or any
// other has momentum, else 0.
func (o *SGD) StateSlots() int {
	if o.Momentum != 0 {
		return 1
	}
	for _, g := range o.Groups {
		if g != nil && g.Momentum != 0 {
			return 1
		}
	}
	return 0
}

// AddGroup adds a parameter group of keys with the optimizer's own
// hyperparameters, and returns it to change.
func (o *SGD) AddGroup(name string, keys ...any) *Group {
	g := &Group{Name: name, Keys: keys, LR: o.LR, WeightDecay: o.WeightDecay,
		Momentum: o.Momentum, Dampening: o.Dampening, Nesterov: o.Nesterov}
	o.Groups = append(o.Groups, g)
	return g
}

// hyper is group g's hyperparameters (nil: the default group's).
func (o *SGD) hyper(g *Group) (Hyper, string) {
	if g == nil {
		return Hyper{LR: o.LR, Momentum: o.Momentum, Dampening: o.Dampening, WeightDecay: o.WeightDecay, Nesterov: o.Nesterov}, "default"
	}
	return Hyper{LR: g.LR, Momentum: g.Momentum, Dampening: g.Dampening, WeightDecay: g.WeightDecay, Nesterov: g.Nesterov}, g.Name
}

func (o *SGD) rule() rule {
	return rule{name: o.Name(), slots: func(h Hyper) int {
		if h.Momentum != 0 {
			return 1
		}
		return 0
	}, hyper: o.hyper}
}

// Step: g ← g·coef (clipping); g ← g + wd·p; b ← μ·b + (1−τ)·g (b = g
// when the buffer is new); g ← g + μ·b (Nesterov) or b; p ← p − lr·g, with
// each parameter's group's hyperparameters and the scheduled lr.
func (o *SGD) Step(params []Param) error {
	return o.hostStep(o.rule(), params, func(h Hyper, u *ParamUpdate, p Param, st [][]float32, coef float32, clip bool) {
		for i := range p.Data {
			w, g := float64(p.Data[i]), gradAt(p.Grad, i, coef, clip)
			g += h.WeightDecay * w
			if h.Momentum != 0 {
				b := g
				if !u.Fresh {
					b = h.Momentum*float64(st[0][i]) + (1-h.Dampening)*g
				}
				st[0][i] = float32(b)
				if h.Nesterov {
					g += h.Momentum * b
				} else {
					g = b
				}
			}
			p.Data[i] = float32(w - h.LR*g)
		}
	})
}

// PlanDevice is Step's plan for an executor that runs the update on its
// device (see DevicePlan): it checks everything Step checks and changes
// nothing; CommitDevice applies it once the update is queued.
func (o *SGD) PlanDevice(params []DeviceParam) (*DevicePlan, error) {
	return o.planDevice(o.rule(), params)
}

// Adam is Adam with L2 weight decay added to the gradient
// (torch.optim.Adam); set Decoupled for AdamW's decoupled decay. Its
// fields are the default group's hyperparameters; Common adds groups, a
// schedule and clipping.
type Adam struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
	Decoupled                          bool
	Common
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

// AddGroup adds a parameter group of keys with the optimizer's own
// hyperparameters, and returns it to change.
func (o *Adam) AddGroup(name string, keys ...any) *Group {
	g := &Group{Name: name, Keys: keys, LR: o.LR, WeightDecay: o.WeightDecay, Beta1: o.Beta1, Beta2: o.Beta2, Eps: o.Eps}
	o.Groups = append(o.Groups, g)
	return g
}

func (o *Adam) hyper(g *Group) (Hyper, string) {
	if g == nil {
		return Hyper{LR: o.LR, Beta1: o.Beta1, Beta2: o.Beta2, Eps: o.Eps, WeightDecay: o.WeightDecay}, "default"
	}
	return Hyper{LR: g.LR, Beta1: g.Beta1, Beta2: g.Beta2, Eps: g.Eps, WeightDecay: g.WeightDecay}, g.Name
}

func (o *Adam) rule() rule {
	return rule{name: o.Name(), adam: true, decoupled: o.Decoupled, slots: func(Hyper) int { return 2 }, hyper: o.hyper}
}

// Step: g ← g·coef (clipping); m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²;
// p ← p − lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε), with t the parameter's own
// step count (PyTorch's state[p]["step"]) and decay either added to g
// (Adam) or applied as p ← p·(1 − lr·wd) first (AdamW), with each
// parameter's group's hyperparameters and the scheduled lr.
func (o *Adam) Step(params []Param) error {
	decoupled := o.Decoupled
	return o.hostStep(o.rule(), params, func(h Hyper, u *ParamUpdate, p Param, st [][]float32, coef float32, clip bool) {
		m, v := st[0], st[1]
		for i := range p.Data {
			w, g := float64(p.Data[i]), gradAt(p.Grad, i, coef, clip)
			if decoupled {
				w *= h.Decay
			} else {
				g += h.WeightDecay * w
			}
			mi := h.Beta1*float64(m[i]) + (1-h.Beta1)*g
			vi := h.Beta2*float64(v[i]) + (1-h.Beta2)*g*g
			m[i], v[i] = float32(mi), float32(vi)
			p.Data[i] = float32(w - h.LR*(mi/u.C1)/(math.Sqrt(vi/u.C2)+h.Eps))
		}
	})
}

// PlanDevice is Step's plan for an executor that runs the update on its
// device (see DevicePlan): it checks everything Step checks and changes
// nothing; CommitDevice applies it once the update is queued.
func (o *Adam) PlanDevice(params []DeviceParam) (*DevicePlan, error) {
	return o.planDevice(o.rule(), params)
}

// gradAt is gradient element i as the update reads it: times the clip
// coefficient in float32 when clipping.
func gradAt(g []float32, i int, coef float32, clip bool) float64 {
	if clip {
		return float64(g[i] * coef)
	}
	return float64(g[i])
}

// rule is what planning needs of an optimizer: its name, whether it is
// Adam (bias corrections, betas checked) and AdamW, the slots a group's
// hyperparameters need and each group's hyperparameters (nil: the
// default group).
type rule struct {
	name      string
	adam      bool
	decoupled bool // AdamW: Hyper.Decay is set
	slots     func(Hyper) int
	hyper     func(*Group) (Hyper, string)
}

// DeviceParam is a parameter as an executor that updates it on its device
// describes it: its key, name and size, no data.
type DeviceParam struct {
	Key  any
	Name string
	N    int
}

// DevicePlan is one step of an optimizer as an executor runs it on its
// device (exec/cuda): every value its kernels read. The plan changes
// nothing until CommitDevice.
type DevicePlan struct {
	// Groups are the hyperparameters of the groups the parameters are in,
	// the schedule applied, in order of first use; Names their names.
	Groups []Hyper
	Names  []string
	// Params are the parameters' updates, in the order given.
	Params []ParamUpdate
	// Clip is the checked clipping (NormType 2 or +Inf); off when
	// !Clip.On().
	Clip Clip
	// Slots is the state slots per parameter the update reads.
	Slots int
	steps int // Steps when planned
}

// ParamUpdate is one parameter's part of a step.
type ParamUpdate struct {
	Key  any
	Name string
	N    int
	// Group indexes DevicePlan.Groups.
	Group int
	// Step is the parameter's step count with this update: 1 on its first.
	Step int
	// C1 and C2 are Adam's bias corrections 1 − β₁ᵗ and 1 − β₂ᵗ at
	// t = Step (math.Pow in float64).
	C1, C2 float64
	// Fresh is set when the parameter has no state yet for the slots the
	// update reads: they start at zero, and SGD's momentum buffer starts
	// from the gradient.
	Fresh bool
	// Upload holds the slots' current values when only the host has them
	// (SetState, a host step, a state downloaded before): the executor
	// uploads them before the update. Nil when its device holds them, or
	// the state is Fresh.
	Upload [][]float32
}

// keyOK refuses a key that cannot index a map.
func keyOK(opt, name string, k any) error {
	if k == nil || !reflect.TypeOf(k).Comparable() {
		return fmt.Errorf("%w: %s: parameter %q has key %T, which is not comparable", ErrOptim, opt, name, k)
	}
	return nil
}

// plan resolves a step: each parameter's group, hyperparameters, step and
// state, checked. It changes nothing. With c.mu held.
func (c *Common) plan(r rule, params []DeviceParam, host bool) (*DevicePlan, error) {
	clip, err := c.Clip.check(r.name)
	if err != nil {
		return nil, err
	}
	idx, err := groupIndex(r.name, c.Groups)
	if err != nil {
		return nil, err
	}
	// Every group is checked, used or not: the default group's
	// hyperparameters are checked by a step without parameters too.
	hypers, names := make([]Hyper, len(c.Groups)+1), make([]string, len(c.Groups)+1)
	for gi := range hypers {
		var g *Group
		if gi > 0 {
			g = c.Groups[gi-1]
		}
		h, name := r.hyper(g)
		if h.LR, err = scheduled(c.Schedule, h.LR, c.steps, r.name, name); err != nil {
			return nil, err
		}
		if r.decoupled { // AdamW's factor, with the scheduled rate
			h.Decay = 1 - h.LR*h.WeightDecay
		}
		if err := h.check(r.name, name); err != nil {
			return nil, err
		}
		if r.adam && (h.Beta1 < 0 || h.Beta1 >= 1 || h.Beta2 < 0 || h.Beta2 >= 1) {
			return nil, fmt.Errorf("%w: %s group %q: betas (%g, %g) must lie in [0, 1)", ErrOptim, r.name, name, h.Beta1, h.Beta2)
		}
		hypers[gi], names[gi] = h, name
	}
	pl := &DevicePlan{Params: make([]ParamUpdate, len(params)), Clip: clip, steps: c.steps}
	used := map[int]int{} // group index + 1 → index in pl.Groups
	for i, p := range params {
		if err := keyOK(r.name, p.Name, p.Key); err != nil {
			return nil, err
		}
		gi := idx[p.Key]
		k, ok := used[gi]
		if !ok {
			k = len(pl.Groups)
			used[gi] = k
			pl.Groups, pl.Names = append(pl.Groups, hypers[gi]), append(pl.Names, names[gi])
		}
		h := pl.Groups[k]
		need := r.slots(h)
		pl.Slots = max(pl.Slots, need)
		u := ParamUpdate{Key: p.Key, Name: p.Name, N: p.N, Group: k, Step: 1}
		st := c.lookup(p.Key)
		if st != nil {
			switch {
			case st.n != p.N:
				return nil, fmt.Errorf("%w: %s: parameter %q changed size from %d to %d", ErrOptim, r.name, p.Name, st.n, p.N)
			case host && !st.host:
				return nil, fmt.Errorf("%w: %s: the state of parameter %q is on a device; sync it to the host first (batchfit.Session.SyncState)", ErrOptim, r.name, p.Name)
			case !st.host && !st.dev && st.made > 0:
				return nil, fmt.Errorf("%w: %s: the state of parameter %q was lost with the device that held it; restore it (SetState) or start over (ResetState)", ErrOptim, r.name, p.Name)
			}
			u.Step = st.step + 1
		}
		u.Fresh = st == nil || st.made < need
		if !host && !u.Fresh && !st.dev {
			u.Upload = st.slots[:st.made]
		}
		if r.adam {
			t := float64(u.Step)
			u.C1, u.C2 = 1-math.Pow(h.Beta1, t), 1-math.Pow(h.Beta2, t)
		}
		pl.Params[i] = u
	}
	return pl, nil
}

// hostStep runs a step on the host: plan, make the state, clip, update,
// count. A step that fails changes nothing.
func (c *Common) hostStep(r rule, params []Param, update func(h Hyper, u *ParamUpdate, p Param, st [][]float32, coef float32, clip bool)) error {
	dps := make([]DeviceParam, len(params))
	for i, p := range params {
		if len(p.Data) != len(p.Grad) {
			return fmt.Errorf("%w: parameter %q has %d elements but its gradient %d", ErrOptim, p.Name, len(p.Data), len(p.Grad))
		}
		dps[i] = DeviceParam{Key: p.Key, Name: p.Name, N: len(p.Data)}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	pl, err := c.plan(r, dps, true)
	if err != nil {
		return err
	}
	var coef float32
	if pl.Clip.On() {
		grads := make([][]float32, len(params))
		for i, p := range params {
			grads[i] = p.Grad
		}
		var norm float64
		if c.normOf != nil {
			if norm, err = c.normOf(grads, pl.Clip.Inf()); err != nil {
				return err
			}
		} else {
			norm = GradNorm(grads, pl.Clip.Inf())
		}
		coef = ClipCoef(norm, pl.Clip.MaxNorm)
		c.setNorm(gradNorm{set: true, v: norm})
	}
	for i, p := range params {
		u := &pl.Params[i]
		st := c.record(p.Key, len(p.Data))
		for len(st.slots) < r.slots(pl.Groups[u.Group]) {
			st.slots = append(st.slots, make([]float32, len(p.Data)))
		}
		st.made = max(st.made, len(st.slots))
		st.step, st.host, st.dev = u.Step, true, false
		update(pl.Groups[u.Group], u, p, st.slots, coef, pl.Clip.On())
	}
	c.steps++
	return nil
}

// planDevice is PlanDevice under c.mu.
func (c *Common) planDevice(r rule, params []DeviceParam) (*DevicePlan, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.plan(r, params, false)
}

// CommitDevice records that the executor has queued pl's update: each
// parameter's step count advances, its state is the device's (the host
// copies are dropped), and Steps advances. A plan made before another
// step committed is refused, since its step counts are stale.
func (c *Common) CommitDevice(pl *DevicePlan) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if pl.steps != c.steps {
		return fmt.Errorf("%w: a device plan made at step %d is committed at step %d", ErrOptim, pl.steps, c.steps)
	}
	for _, u := range pl.Params {
		st := c.record(u.Key, u.N)
		if need := pl.Slots; st.made < need {
			st.made = need
		}
		st.step, st.slots, st.host, st.dev = u.Step, nil, false, true
	}
	c.steps++
	return nil
}

// SetDeviceCopy is for executors that keep state on their device: slots
// are the device's current values of the state of the parameter with
// key, just downloaded, and the optimizer keeps them (it does not copy
// them). With kept the device still holds them too (a sync); otherwise
// the device copy is gone or will be overwritten (another optimizer takes
// the buffers, the executor closes), and the next device step uploads
// them. A copy of state the optimizer no longer takes from the device
// (set on the host with SetState, forgotten with ResetState, or lost
// since its last device step) is stale and is ignored: the host's state
// stands, and the next device step uploads it.
func (c *Common) SetDeviceCopy(key any, slots [][]float32, kept bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.lookup(key)
	if st == nil || !st.dev {
		return nil
	}
	for i, s := range slots {
		if len(s) != st.n {
			return fmt.Errorf("%w: device copy of slot %d holds %d values, the parameter %d", ErrOptim, i, len(s), st.n)
		}
	}
	st.slots, st.made, st.host, st.dev = slots, max(st.made, len(slots)), true, kept
	return nil
}

// OnDevice reports whether an executor's device holds the current state
// of the parameter with key (and the host perhaps none).
func (c *Common) OnDevice(key any) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.lookup(key)
	return st != nil && st.dev
}

// DeviceLost is for executors that keep state on their device: the
// device copy of key's state is gone without a download (a failed sync).
// A later step with it fails unless the state is set again.
func (c *Common) DeviceLost(key any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.lookup(key); st != nil && st.dev {
		st.dev = false
	}
}
