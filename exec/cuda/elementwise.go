package cuda

import (
	"slices"

	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
	"github.com/batchfit/batchfit/graph"
)

// Device op codes of the elementwise kernels, declared here once: an op's
// code is its position in its list, and go generate writes the lists into
// kernels/opcodes.cuh (OpcodeHeader). Every plain entry is also the op's
// table entry (withCodes), and a Grad op is computed by unary_grad_f32
// from the forward op's input, so a new unary op is one line here and its
// case in elementwise.cu.
var (
	unaryCodes = opcode.Enum{Prefix: "U_", List: "UNARY_OPS",
		Doc: "Unary op codes (unary_f32's op; unary_grad_f32's for ops with a Grad).", Names: []opcode.Name{
			{Op: graph.OpNeg}, {Op: graph.OpExp}, {Op: graph.OpLog}, {Op: graph.OpSqrt}, {Op: graph.OpAbs},
			{Op: graph.OpTanh}, {Op: graph.OpSigmoid}, {Op: graph.OpRelu},
			{Op: graph.OpGelu, Note: "exact, with erf"},
			{Op: graph.OpGelu, Variant: "tanh", Note: "tanh approximation (Attrs.Approx)"},
			{Op: graph.OpSign}, {Op: graph.OpSilu, Grad: graph.OpSiluGrad},
		}}
	scalarCodes = opcode.Enum{Prefix: "S_", List: "SCALAR_OPS", Doc: "Scalar op codes (scalar_f32's op): x ∘ s.", Names: []opcode.Name{
		{Op: graph.OpAddScalar, Note: "x + s"}, {Op: graph.OpSubScalar, Note: "x − s"},
		{Op: graph.OpRSubScalar, Note: "s − x"}, {Op: graph.OpMulScalar, Note: "x · s"},
		{Op: graph.OpDivScalar, Note: "x / s"}, {Op: graph.OpRDivScalar, Note: "s / x"},
		{Op: graph.OpPowScalar, Note: "x ^ s"}, {Op: graph.OpMaximumScalar, Note: "max(x, s)"},
	}}
	binaryCodes = opcode.Enum{Prefix: "B_", List: "BINARY_OPS",
		Doc: "Binary op codes (binary_f32's and binary_bcast_f32's op).", Names: []opcode.Name{
			{Op: graph.OpAdd}, {Op: graph.OpSub}, {Op: graph.OpMul}, {Op: graph.OpDiv}, {Op: graph.OpPow}, {Op: graph.OpMaximum},
		}}
)

// Elementwise family (kernels/elementwise.cu, dropout.cu, and fill from
// accumulate.cu): unary, scalar and broadcasting binary ops by their codes
// above, the elementwise gradients, dropout, causal_mask and fill.
var elementwiseKernels = withCodes(family{
	graph.OpGelu: {run: func(k *kctx, in []operand, out operand) error {
		variant := ""
		if k.attrs().Approx {
			variant = "tanh"
		}
		return k.unary(unaryCodes.Code(graph.OpGelu, variant), in[0], out)
	}},
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
}, unaryCodes, scalarCodes, binaryCodes)

// withCodes adds to f the entries of the coded ops: unary, scalar or binary
// by the enum, and unaryGrad for a unary code's Grad op. Ops that need
// more than their code (gelu picks its variant) keep their entry in f.
func withCodes(f family, unaryE, scalarE, binaryE opcode.Enum) family {
	for _, c := range []struct {
		e     opcode.Enum
		entry func(opcode.Code) opKernel
	}{{unaryE, unary}, {scalarE, scalar}, {binaryE, binary}} {
		for i, n := range c.e.Names {
			if _, ok := f[n.Op]; !ok && n.Variant == "" {
				f[n.Op] = c.entry(opcode.Code(i))
			}
			if n.Grad != 0 {
				f[n.Grad] = unaryGrad(opcode.Code(i))
			}
		}
	}
	return f
}

// unary is the entry of a unary op with op code code.
func unary(code opcode.Code) opKernel {
	return opKernel{run: func(k *kctx, in []operand, out operand) error { return k.unary(code, in[0], out) }}
}

// unaryGrad is the entry of the gradient op g · f'(x) of the unary op with
// code code, computed by unary_grad_f32 from the forward input x.
func unaryGrad(code opcode.Code) opKernel {
	return opKernel{run: gradOf(func(k *kctx, g operand, in []operand, out operand) error {
		if err := sameN(k.nd.Op, out, g, in[1]); err != nil {
			return err
		}
		return k.quads(kUnaryGrad, out.n(), g.p, in[1].p, out.p, out.n(), code)
	})}
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
