package cuda

import (
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// SwiGLU family (kernels/swiglu.cu): swiglu, and swiglu_grad whose gate
// gradient (Axis 0) also writes its up-gradient companion
// (graph.SwiGLUGradProducer) in the same pass. No workspace.
var swigluKernels = family{
	graph.OpSwiGLU: {run: func(k *kctx, in []operand, out operand) error {
		dt, err := floatsOf(in[0], in[1], out)
		if err != nil {
			return err
		}
		if err := sameN(k.nd.Op, out, in[0], in[1]); err != nil {
			return err
		}
		return k.packs(typed(kSwiGLU, dt), out.n(), perPack(dt), in[0].p, in[1].p, out.p, out.n())
	}},
	graph.OpSwiGLUGrad: {run: typedGradOf(swigluGrad)},
}

// swigluGrad runs swiglu_grad: the gate's gradient (with up's, when it is
// the companion) or up's alone.
func swigluGrad(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
	gate, up := in[1], in[2]
	if _, err := floatsOf(g, gate, up, out); err != nil {
		return err
	}
	if err := sameN(k.nd.Op, out, g, gate, up); err != nil {
		return err
	}
	var dg, du alloc.Ptr
	var done *bool
	if k.attrs().Axis == 0 {
		dg = out.p
		if co, d := k.companionOf(graph.OpSwiGLUGrad); co != nil && co.dt == dt && co.n() == out.n() {
			du, done = co.p, d
		}
	} else {
		du = out.p
	}
	if err := k.packs(typed(kSwiGLUGrad, dt), out.n(), perPack(dt), g.p, gate.p, up.p, dg, du, out.n()); err != nil {
		return err
	}
	if done != nil {
		*done = true
		fusedSwiGLUGrads.Add(1)
	}
	return nil
}

// fusedSwiGLUGrads counts the gate-gradient launches that gave up's
// gradient too (tests read it).
var fusedSwiGLUGrads atomic.Int64
