package nn

import (
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// SetFrozen freezes the parameter (on) or makes it trainable again. A
// frozen parameter listed in a batchfit.Session's Step is left out of the
// step as if it were not listed (lazy.Tensor.SetFrozen): no gradient, no
// gradient buffer, no update and no optimizer state, so the step's plan
// is smaller by them. Its value is used as before.
func (p *Param) SetFrozen(on bool) { p.t.SetFrozen(on) }

// Frozen reports whether the parameter is frozen.
func (p *Param) Frozen() bool { return p.t.Frozen() }

// Freeze freezes every parameter of ps (Param.SetFrozen): freezing by an
// explicit list rather than by leaving parameters out of a step's list.
//
//	nn.Freeze(model.Params()[:4]...)           // the first layers
//	s.Step(ctx, loss, nn.ParamTensors(model), opt) // frozen ones are left out
func Freeze(ps ...*Param) {
	for _, p := range ps {
		if p != nil {
			p.SetFrozen(true)
		}
	}
}

// FreezeAs freezes ps and stores each in dt, graph.BFloat16 or
// graph.Float16: on the device a frozen weight then takes half the memory,
// its float32 data rounded to nearest even as executors read it (the host
// data is not changed), and under a mixed precision policy its matrix
// products read it without a cast copy. The parameter's lazy tensor is
// made anew (Param.Tensor returns the new one), so freeze before building
// the graphs that use it. A 16-bit parameter is not trained: a Step that
// lists it unfrozen fails with graph.ErrDType (trained parameters stay
// float32 master weights). dt Float32 only freezes. Shape-only parameters
// take the dtype too. Another dtype is an error, and nothing is changed.
func FreezeAs(dt graph.DType, ps ...*Param) error {
	if dt != graph.Float32 && !dt.IsHalf() {
		return graph.Errorf(graph.ErrDType, "nn.FreezeAs: frozen parameters are stored as float32, bfloat16 or float16, not %s", dt)
	}
	for _, p := range ps {
		if p == nil || p.Err() != nil {
			continue
		}
		p.SetFrozen(true)
		if p.t.DType() != dt {
			p.remake(dt)
		}
	}
	return nil
}

// as is the parameter as a layer applied to x reads it: its own tensor,
// widened to x's float dtype when it is a 16-bit frozen parameter
// (FreezeAs) and x is not 16-bit. Under a mixed precision policy the
// matrix product then reads the stored 16-bit value itself (the policy's
// pass drops a cast back to the dtype a value was widened from).
func (p *Param) as(x *lazy.Tensor) *lazy.Tensor {
	t := p.Tensor()
	if dt := x.DType(); p.Frozen() && t.DType().IsHalf() && dt.IsFloat() && dt != t.DType() {
		return t.Cast(dt)
	}
	return t
}

// Trainable lists m's parameters that are not frozen, as lazy tensors, in
// Params order: the list to give an optimizer's parameter groups (a
// Session's Step leaves frozen ones out of any list by itself).
func Trainable(m Module) []*lazy.Tensor {
	var ts []*lazy.Tensor
	for _, p := range m.Params() {
		if !p.Frozen() {
			ts = append(ts, p.Tensor())
		}
	}
	return ts
}
