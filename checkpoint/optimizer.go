package checkpoint

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/safetensors"
)

// saveOptimizer is o's manifest entry and its state slots as tensors
// named "<parameter>.<slot>" (PyTorch's slot names: exp_avg, exp_avg_sq,
// momentum_buffer), streamed from the optimizer's own slices.
func saveOptimizer(o optim.Optimizer, ps []param) (*OptimizerState, []safetensors.Tensor, error) {
	c, h, err := common(o)
	if err != nil {
		return nil, nil, err
	}
	byKey := make(map[any]*param, len(ps))
	for i := range ps {
		byKey[ps[i].p.Value()] = &ps[i]
	}
	e := &OptimizerState{Name: o.Name(), Steps: c.Steps(), Hyper: h, Clip: Clip{MaxNorm: c.Clip.MaxNorm, NormType: normTypeName(c.Clip)}, State: []ParamState{}}
	if c.Schedule != nil {
		e.Schedule = fmt.Sprintf("%#v", c.Schedule)
	}
	for gi, g := range c.Groups {
		if g == nil {
			return nil, nil, fmt.Errorf("%w: optimizer group %d is nil", ErrTraining, gi)
		}
		eg := Group{Name: g.Name, Params: make([]string, 0, len(g.Keys)), Hyper: groupHyper(g)}
		for _, k := range g.Keys {
			p := byKey[k]
			if p == nil {
				return nil, nil, fmt.Errorf("%w: optimizer group %q lists a parameter that is not among the training's", ErrTraining, g.Name)
			}
			eg.Params = append(eg.Params, p.name)
		}
		e.Groups = append(e.Groups, eg)
	}
	names := slotNames(o)
	var ts []safetensors.Tensor
	for _, k := range c.Keys() {
		p := byKey[k]
		if p == nil {
			return nil, nil, fmt.Errorf("%w: the optimizer holds state of a parameter that is not among the training's (%T)", ErrTraining, k)
		}
		st := ParamState{Param: p.name, Step: c.ParamStep(k)}
		slots := c.State(k)
		if slots == nil && c.OnDevice(k) {
			return nil, nil, fmt.Errorf("%w: the optimizer's state of %q is on the device; set Training.Session so that Save syncs it", ErrTraining, p.name)
		}
		for i, s := range slots {
			name := p.name + ".slot" + strconv.Itoa(i)
			if i < len(names) {
				name = p.name + "." + names[i]
			}
			if len(s) != len(p.data) {
				return nil, nil, fmt.Errorf("%w: the optimizer's state %q holds %d values, the parameter %d", ErrTraining, name, len(s), len(p.data))
			}
			st.Slots = append(st.Slots, name)
			ts = append(ts, safetensors.Tensor{Name: name, DType: safetensors.F32, Shape: p.shape, Float32: s})
		}
		e.State = append(e.State, st)
	}
	return e, ts, nil
}

// optimizerLoad is a checked restore of an optimizer's state, ready to
// apply.
type optimizerLoad struct {
	c     *optim.Common
	e     *OptimizerState
	byKey map[string]*param
	clip  optim.Clip
}

// checkOptimizer checks e against o and the training's parameters.
func checkOptimizer(path string, o optim.Optimizer, e *OptimizerState, files map[string]*safetensors.File, ps []param) (*optimizerLoad, error) {
	c, _, err := common(o)
	if err != nil {
		return nil, err
	}
	if e == nil {
		return nil, fmt.Errorf("%w: %s holds no optimizer state; a run resumed without it would restart %s", ErrMismatch, path, o.Name())
	}
	if e.Name != o.Name() {
		return nil, fmt.Errorf("%w: %s holds %s's state; the training's optimizer is %s", ErrMismatch, path, e.Name, o.Name())
	}
	nt, err := normType(e.Clip.NormType)
	if err != nil {
		return nil, err
	}
	byName := make(map[string]*param, len(ps))
	for i := range ps {
		byName[ps[i].name] = &ps[i]
	}
	known := func(what, name string) (*param, error) {
		if p := byName[name]; p != nil {
			return p, nil
		}
		return nil, fmt.Errorf("%w: %s: %s names parameter %q, which the training does not have", ErrMismatch, path, what, name)
	}
	for _, g := range e.Groups {
		for _, n := range g.Params {
			if _, err := known(fmt.Sprintf("optimizer group %q", g.Name), n); err != nil {
				return nil, err
			}
		}
	}
	seen := map[string]bool{}
	for _, st := range e.State {
		p, err := known("the optimizer's state", st.Param)
		if err != nil {
			return nil, err
		}
		if seen[st.Param] {
			return nil, fmt.Errorf("%w: %s: optimizer state of %q listed twice", ErrCorrupt, path, st.Param)
		}
		seen[st.Param] = true
		for _, s := range st.Slots {
			info, _ := files[e.File].Tensor(s)
			if !slices.Equal(info.Shape, p.shape) {
				return nil, &ShapeError{Path: path, Tensor: s, Want: p.shape, Got: info.Shape}
			}
			if info.DType != safetensors.F32 {
				return nil, fmt.Errorf("%w: %s: optimizer state %q is %s, not F32", ErrCorrupt, path, s, info.DType)
			}
		}
	}
	return &optimizerLoad{c: c, e: e, byKey: byName, clip: optim.Clip{MaxNorm: e.Clip.MaxNorm, NormType: nt}}, nil
}

// apply restores the checked state into o: its hyperparameters, groups
// (those of the same names in the same order are updated in place, so
// pointers the caller holds stay live), clipping, each parameter's state,
// read from f one parameter at a time, and the schedule's position.
func (l *optimizerLoad) apply(o optim.Optimizer, f *safetensors.File) error {
	setHyper(o, l.e.Hyper)
	c := l.c
	same := len(c.Groups) == len(l.e.Groups)
	for i := 0; same && i < len(c.Groups); i++ {
		same = c.Groups[i] != nil && c.Groups[i].Name == l.e.Groups[i].Name
	}
	if !same {
		c.Groups = make([]*optim.Group, len(l.e.Groups))
		for i := range c.Groups {
			c.Groups[i] = &optim.Group{}
		}
	}
	for i, eg := range l.e.Groups {
		g := c.Groups[i]
		g.Name, g.Keys = eg.Name, make([]any, len(eg.Params))
		for j, n := range eg.Params {
			g.Keys[j] = l.byKey[n].p.Value()
		}
		setGroupHyper(g, eg.Hyper)
	}
	c.Clip = l.clip
	c.ResetState()
	for _, st := range l.e.State {
		p := l.byKey[st.Param]
		slots := make([][]float32, len(st.Slots))
		for i, s := range st.Slots {
			slots[i] = make([]float32, len(p.data))
			if err := f.ReadFloat32(s, slots[i]); err != nil {
				return fmt.Errorf("checkpoint: %w", err)
			}
		}
		if err := c.SetState(p.p.Value(), len(p.data), st.Step, slots); err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
	}
	return c.SetSteps(l.e.Steps)
}
