package cuda

import (
	"slices"

	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
	"github.com/batchfit/batchfit/graph"
)

// Elementwise family (kernels/elementwise.cu, dropout.cu, and fill from
// accumulate.cu): unary, scalar and broadcasting binary ops with their
// op codes (internal/opcode), the elementwise gradients, dropout,
// causal_mask and fill.
var elementwiseKernels = family{
	graph.OpNeg:     unary(opcode.Neg),
	graph.OpExp:     unary(opcode.Exp),
	graph.OpLog:     unary(opcode.Log),
	graph.OpSqrt:    unary(opcode.Sqrt),
	graph.OpAbs:     unary(opcode.Abs),
	graph.OpTanh:    unary(opcode.Tanh),
	graph.OpSigmoid: unary(opcode.Sigmoid),
	graph.OpRelu:    unary(opcode.Relu),
	graph.OpGelu: {run: func(k *kctx, in []operand, out operand) error {
		if k.attrs().Approx {
			return k.unary(opcode.GeluTanh, in[0], out)
		}
		return k.unary(opcode.Gelu, in[0], out)
	}},
	graph.OpSign: unary(opcode.Sign),

	graph.OpAddScalar:     scalar(opcode.AddScalar),
	graph.OpSubScalar:     scalar(opcode.SubScalar),
	graph.OpRSubScalar:    scalar(opcode.RSubScalar),
	graph.OpMulScalar:     scalar(opcode.MulScalar),
	graph.OpDivScalar:     scalar(opcode.DivScalar),
	graph.OpRDivScalar:    scalar(opcode.RDivScalar),
	graph.OpPowScalar:     scalar(opcode.PowScalar),
	graph.OpMaximumScalar: scalar(opcode.MaximumScalar),

	graph.OpAdd:     binary(opcode.Add),
	graph.OpSub:     binary(opcode.Sub),
	graph.OpMul:     binary(opcode.Mul),
	graph.OpDiv:     binary(opcode.Div),
	graph.OpPow:     binary(opcode.Pow),
	graph.OpMaximum: binary(opcode.Maximum),

	graph.OpDropout:    {run: dropout},
	graph.OpCausalMask: {run: causalMask},
	graph.OpFill:       {run: fill},

	graph.OpReluGrad: {run: gradOf(func(k *kctx, g operand, in []operand, out operand) error {
		if err := sameN(k.nd.Op, out, g, in[1]); err != nil {
			return err
		}
		return k.quads(kReluGrad, out.n(), g.p, in[1].p, out.p, out.n())
	})},
	graph.OpGeluGrad: {run: gradOf(func(k *kctx, g operand, in []operand, out operand) error {
		if err := sameN(k.nd.Op, out, g, in[1]); err != nil {
			return err
		}
		return k.quads(kGeluGrad, out.n(), g.p, in[1].p, out.p, out.n(), boolInt(k.attrs().Approx))
	})},
	graph.OpMaximumScalarGrad: {run: gradOf(func(k *kctx, g operand, in []operand, out operand) error {
		if err := sameN(k.nd.Op, out, g, in[1]); err != nil {
			return err
		}
		return k.quads(kMaximumScGrad, out.n(), g.p, in[1].p, out.p, out.n(), float32(k.attrs().Scalar))
	})},
	graph.OpMaximumGrad: {run: gradOf(maximumGrad)},
}

// unary is the entry of a unary op with op code code.
func unary(code opcode.Code) opKernel {
	return opKernel{run: func(k *kctx, in []operand, out operand) error { return k.unary(code, in[0], out) }}
}

func (k *kctx) unary(code opcode.Code, x, out operand) error {
	if err := floats(x, out); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", k.nd.Op, x.shape, out.shape)
	}
	return k.quads(kUnary, out.n(), x.p, out.p, out.n(), code)
}

// scalar is the entry of an op of x and Attrs.Scalar with op code code.
func scalar(code opcode.Code) opKernel {
	return opKernel{run: func(k *kctx, in []operand, out operand) error {
		x := in[0]
		if err := floats(x, out); err != nil {
			return err
		}
		if x.n() != out.n() {
			return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", k.nd.Op, x.shape, out.shape)
		}
		return k.quads(kScalar, out.n(), x.p, out.p, out.n(), code, k.attrs().Scalar)
	}}
}

// binary is the entry of a broadcasting binary op with op code code: the
// four-wide kernel when no operand broadcasts.
func binary(code opcode.Code) opKernel {
	return opKernel{run: func(k *kctx, in []operand, out operand) error {
		x, y := in[0], in[1]
		if err := floats(x, y, out); err != nil {
			return err
		}
		n := out.n()
		if slices.Equal(x.shape, out.shape) && slices.Equal(y.shape, out.shape) {
			return k.quads(kBinary, n, x.p, y.p, out.p, n, code)
		}
		geo, err := broadcastGeom(x.shape, y.shape, out.shape)
		if err != nil {
			return err
		}
		return k.flat(kBinaryBcast, n, x.p, y.p, out.p, n, code, geo)
	}}
}

func maximumGrad(k *kctx, g operand, in []operand, out operand) error {
	if err := sameN(k.nd.Op, out, g); err != nil {
		return err
	}
	if err := floats(in[1], in[2]); err != nil {
		return err
	}
	geo, err := broadcastGeom(in[1].shape, in[2].shape, out.shape)
	if err != nil {
		return err
	}
	n := out.n()
	return k.flat(kMaximumGrad, n, g.p, in[1].p, in[2].p, out.p, n, int64(k.attrs().Axis), geo)
}

// dropout keys each element by its global row along the batch axis (chunk
// start · PerSample onwards) and its index within the row, as exec/cpu.
func dropout(k *kctx, in []operand, out operand) error {
	x, a, t := in[0], k.attrs(), k.nd.Type
	if err := floats(x, out); err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "dropout of %v into %v", x.shape, out.shape)
	}
	p := a.Scalar
	scale := float32(1 / (1 - p))
	outer, rows, inner := int64(1), int64(1), x.n()
	rowOff := int64(0)
	if ax := t.BatchAxis; ax >= 0 {
		outer, rows, inner = int64(graph.Numel(x.shape[:ax])), int64(x.shape[ax]), int64(graph.Numel(x.shape[ax+1:]))
		rowOff = int64(k.c.Start * t.PerSample)
	}
	return k.flat(kDropout, x.n(), x.p, out.p, outer, rows, inner, rowOff, a.Seed, a.Counter, p, scale)
}

func causalMask(k *kctx, in []operand, out operand) error {
	x := in[0]
	if err := floats(x, out); err != nil {
		return err
	}
	rk := len(x.shape)
	if rk < 2 || x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "causal_mask of %v into %v", x.shape, out.shape)
	}
	t, s := int64(x.shape[rk-2]), int64(x.shape[rk-1])
	return k.flat(kCausalMask, x.n(), x.p, out.p, x.n(), t, s, float32(k.attrs().Scalar))
}

func fill(k *kctx, _ []operand, out operand) error {
	if out.dt == graph.Int64 {
		return k.flat(kFillI64, out.n(), out.p, out.n(), int64(k.attrs().Scalar))
	}
	return k.flat(kFillF32, out.n(), out.p, out.n(), float32(k.attrs().Scalar))
}
