package optim

import (
	"fmt"
	"slices"
	"sync"
)

// paramState is one parameter's state, PyTorch's state[p]: its own step
// count and its state slots.
//
// The slots' current values live on the host (host set), on an executor's
// device (dev set), or in both after a sync. A host step needs them on the
// host; a device step uploads them first when only the host has them.
type paramState struct {
	n     int         // elements
	step  int         // updates of this parameter so far (state[p]["step"])
	made  int         // slots made: 0 before the first step that needs them
	slots [][]float32 // host values of the made slots when host is set
	host  bool        // slots holds the current values
	dev   bool        // an executor's device holds the current values
}

// Common is what SGD and Adam share: parameter groups, the learning-rate
// schedule, gradient clipping, and the per-parameter state with its step
// counts. Its methods are promoted to both.
//
// State is kept per parameter, by Param.Key, as PyTorch's state[p]: each
// parameter has its own step count, so one first trained at the
// optimizer's fifth step gets Adam's bias correction of a first step, as
// in PyTorch. Steps counts the optimizer's own steps: the schedule's
// position.
type Common struct {
	// Groups are the parameter groups with hyperparameters of their own
	// (PyTorch's param_groups beyond the first). A parameter in none is
	// in the default group, whose hyperparameters are the optimizer's own
	// fields. A key in two groups is an error of the next Step.
	Groups []*Group
	// Schedule sets every group's learning rate at each step from the
	// group's LR, the base rate, and Steps (nil: the base rate throughout).
	Schedule Schedule
	// Clip clips the gradients' global norm before each update, when its
	// MaxNorm is positive (torch.nn.utils.clip_grad_norm_).
	Clip Clip

	mu    sync.Mutex
	state map[any]*paramState
	order []any // keys in the order first stepped
	steps int
	norm  gradNorm
	// normOf, when set, is a host step's total gradient norm in place of
	// GradNorm (SetNormOf).
	normOf func(grads [][]float32, inf bool) (float64, error)
}

// Steps is the number of the optimizer's completed steps: the position
// of its schedule. A step whose update did not run (a failed Step, or one
// a loss scaler skipped) does not count. Each parameter also has a step
// count of its own (ParamStep).
func (c *Common) Steps() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.steps
}

// SetSteps sets Steps, as a resume from a checkpoint does: the next step
// takes its learning rate from the schedule at n.
func (c *Common) SetSteps(n int) error {
	if n < 0 {
		return fmt.Errorf("%w: step count %d is negative", ErrOptim, n)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.steps = n
	return nil
}

// ParamStep is how many updates the parameter with key has had
// (PyTorch's state[p]["step"]), 0 before its first.
func (c *Common) ParamStep(key any) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.state[key]; st != nil {
		return st.step
	}
	return 0
}

// State returns the state slots of the parameter with key (see each
// optimizer's StateSlots for their meaning), nil before its first step.
// Key is the parameter's Param.Key: in a batchfit.Session, the
// parameter's host tensor (lazy.Tensor.Value()). When an executor keeps
// the state on its device (CUDA), the host has no current copy and State
// returns nil until the executor syncs it (batchfit.Session.SyncState).
// The slices are the optimizer's own: copy them to keep them.
func (c *Common) State(key any) [][]float32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.state[key]; st != nil && st.host && st.made > 0 {
		return st.slots[:st.made]
	}
	return nil
}

// Keys lists the parameters that have state, by key, in the order of
// their first step: what a checkpoint saves.
func (c *Common) Keys() []any {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.order)
}

// SetState gives the parameter with key the state a checkpoint saved: its
// step count and its slots (each of n elements, the parameter's size;
// none for a parameter without slots, such as plain SGD's). The slots are
// copied. The next step continues from it exactly; an executor that keeps
// state on its device uploads it first.
func (c *Common) SetState(key any, n, step int, slots [][]float32) error {
	if step < 0 || n < 0 {
		return fmt.Errorf("%w: state of %v: step %d and size %d must be non-negative", ErrOptim, key, step, n)
	}
	cp := make([][]float32, len(slots))
	for i, s := range slots {
		if len(s) != n {
			return fmt.Errorf("%w: state of %v: slot %d holds %d values, the parameter %d", ErrOptim, key, i, len(s), n)
		}
		cp[i] = slices.Clone(s)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.record(key, n)
	st.n, st.step, st.made, st.slots, st.host, st.dev = n, step, len(cp), cp, true, false
	return nil
}

// ResetState forgets every parameter's state and sets Steps to 0, as a
// fresh optimizer of the same hyperparameters.
func (c *Common) ResetState() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.state, c.order, c.steps = nil, nil, 0
	c.norm = gradNorm{gen: c.norm.gen + 1}
}

// record is key's state, made (empty) on first use. With c.mu held.
func (c *Common) record(key any, n int) *paramState {
	if c.state == nil {
		c.state = map[any]*paramState{}
	}
	st := c.state[key]
	if st == nil {
		st = &paramState{n: n, host: true}
		c.state[key] = st
		c.order = append(c.order, key)
	}
	return st
}

// lookup is key's state, nil before its first step. With c.mu held.
func (c *Common) lookup(key any) *paramState { return c.state[key] }

// Clipping is the optimizer's gradient clipping (Clip), for callers that
// must know whether a step clips by the global norm (a sharded step, whose
// rank sees only part of the gradients).
func (c *Common) Clipping() Clip { return c.Clip }

// SetNormOf makes host steps that clip take the total gradient norm from
// f, given the step's gradients and whether the norm is the largest
// magnitude (NormType +Inf), in place of GradNorm of them: a rank of
// sharded data parallel is given only its shard of the gradients and
// combines every rank's part (package dist sets it around its step). An
// error from f fails the step before anything is updated. nil restores
// GradNorm. Device steps are not affected.
func (c *Common) SetNormOf(f func(grads [][]float32, inf bool) (float64, error)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.normOf = f
}
