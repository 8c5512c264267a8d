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
	graph.OpAdd: {run: func(k *kctx, in []operand, out operand) error {
		if done, err := k.addLayerNorm(in[0], in[1], out); done || err != nil {
			return err
		}
		if done, err := k.addRMSNorm(in[0], in[1], out); done || err != nil {
			return err
		}
		return binary(binaryCodes.Code(graph.OpAdd, "")).run(k, in, out)
	}},
	graph.OpDropout:    {run: dropout},
	graph.OpCausalMask: {run: causalMask},
	graph.OpFill:       {run: fill},

	graph.OpReluGrad: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.map2(kReluGrad, dt, g, in[1], out)
	})},
	graph.OpGeluGrad: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.map2(kGeluGrad, dt, g, in[1], out, boolInt(k.attrs().Approx))
	})},
	graph.OpMaximumScalarGrad: {run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.map2(kMaximumScGrad, dt, g, in[1], out, float32(k.attrs().Scalar))
	})},
	graph.OpMaximumGrad: {run: typedGradOf(maximumGrad)},
	graph.OpCast:        {run: cast},
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
// code code, computed by unary_grad_* from the forward input x.
func unaryGrad(code opcode.Code) opKernel {
	return opKernel{run: typedGradOf(func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
		return k.map2(kUnaryGrad, dt, g, in[1], out, code)
	})}
}

// typedGradOf is the run function of a vector-Jacobian op (in[0] is the
// upstream gradient g) for kernels instantiated per float dtype: g and the
// output share one float dtype, dt.
func typedGradOf(run func(k *kctx, dt graph.DType, g operand, in []operand, out operand) error) func(*kctx, []operand, operand) error {
	return func(k *kctx, in []operand, out operand) error {
		dt, err := floatsOf(in[0], out)
		if err != nil {
			return err
		}
		return run(k, dt, in[0], in, out)
	}
}

// map2 launches an elementwise kernel of two inputs a, b of out's dtype dt
// and element count (kernels/common.cuh, map2), args following a, b, out, n.
func (k *kctx) map2(name string, dt graph.DType, a, b, out operand, args ...any) error {
	if _, err := floatsOf(a, b, out); err != nil {
		return err
	}
	if err := sameN(k.nd.Op, out, a, b); err != nil {
		return err
	}
	n := out.n()
	return k.packs(typed(name, dt), n, perPack(dt), append([]any{a.p, b.p, out.p, n}, args...)...)
}

func (k *kctx) unary(code opcode.Code, x, out operand) error {
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", k.nd.Op, x.shape, out.shape)
	}
	return k.packs(typed(kUnary, dt), out.n(), perPack(dt), x.p, out.p, out.n(), code)
}

// scalar is the entry of an op of x and Attrs.Scalar with op code code.
func scalar(code opcode.Code) opKernel {
	return opKernel{run: func(k *kctx, in []operand, out operand) error {
		x := in[0]
		dt, err := floatsOf(x, out)
		if err != nil {
			return err
		}
		if x.n() != out.n() {
			return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", k.nd.Op, x.shape, out.shape)
		}
		return k.packs(typed(kScalar, dt), out.n(), perPack(dt), x.p, out.p, out.n(), code, k.attrs().Scalar)
	}}
}

// binary is the entry of a broadcasting binary op with op code code: the
// vector kernel when no operand broadcasts. Operands of one float dtype
// give that dtype; operands of two float dtypes give float32 (the
// promoting instantiations, graph.Promote).
func binary(code opcode.Code) opKernel {
	return opKernel{run: func(k *kctx, in []operand, out operand) error {
		x, y := in[0], in[1]
		name, bcast, err := binaryKernels(x, y, out)
		if err != nil {
			return err
		}
		n := out.n()
		if slices.Equal(x.shape, out.shape) && slices.Equal(y.shape, out.shape) {
			return k.packs(name, n, perPack(x.dt, y.dt, out.dt), x.p, y.p, out.p, n, code)
		}
		geo, err := broadcastGeom(x.shape, y.shape, out.shape)
		if err != nil {
			return err
		}
		return k.flat(bcast, n, x.p, y.p, out.p, n, code, geo)
	}}
}

// binaryKernels names the binary kernels (contiguous, broadcasting) for
// operands x, y and result out.
func binaryKernels(x, y, out operand) (string, string, error) {
	if x.dt == y.dt {
		dt, err := floatsOf(x, y, out)
		return typed(kBinary, dt), typed(kBinaryBcast, dt), err
	}
	if !x.dt.IsFloat() || !y.dt.IsFloat() || out.dt != graph.Float32 {
		return "", "", graph.Errorf(graph.ErrDType, "operands %v %s and %v %s into %v %s: operands of two float dtypes give float32",
			x.shape, x.dt, y.shape, y.dt, out.shape, out.dt)
	}
	return typed(kBinary, x.dt, y.dt), typed(kBinaryBcast, x.dt, y.dt), nil
}

// mixedBinaryKernels lists the promoting instantiations (MIXED_FLOATS):
// every ordered pair of two float dtypes.
func mixedBinaryKernels() []string {
	var out []string
	for _, a := range floatDTypes {
		for _, b := range floatDTypes {
			if a != b {
				out = append(out, typed(kBinary, a, b), typed(kBinaryBcast, a, b))
			}
		}
	}
	return out
}

// cast converts between float dtypes (cast_<from>_<to>, rounding to
// nearest even into a narrower one).
func cast(k *kctx, in []operand, out operand) error {
	x := in[0]
	if !x.dt.IsFloat() || !out.dt.IsFloat() {
		return graph.Errorf(graph.ErrDType, "cast of %v %s to %s: float dtypes only", x.shape, x.dt, out.dt)
	}
	if x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "cast of %v into %v", x.shape, out.shape)
	}
	return k.packs(castKernel(x.dt, out.dt), out.n(), perPack(x.dt, out.dt), x.p, out.p, out.n())
}

func castKernel(from, to graph.DType) string { return "cast_" + suffixes[from] + "_" + suffixes[to] }

// castKernels lists every cast instantiation.
func castKernels() []string {
	var out []string
	for _, a := range floatDTypes {
		for _, b := range floatDTypes {
			out = append(out, castKernel(a, b))
		}
	}
	return out
}

func maximumGrad(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
	if err := sameN(k.nd.Op, out, g); err != nil {
		return err
	}
	if _, err := floatsOf(g, in[1], in[2]); err != nil {
		return err
	}
	geo, err := broadcastGeom(in[1].shape, in[2].shape, out.shape)
	if err != nil {
		return err
	}
	n := out.n()
	return k.flat(typed(kMaximumGrad, dt), n, g.p, in[1].p, in[2].p, out.p, n, int64(k.attrs().Axis), geo)
}

// dropout keys each element by its global row along the batch axis (chunk
// start · PerSample onwards) and its index within the row, as exec/cpu:
// every float dtype draws the same mask.
func dropout(k *kctx, in []operand, out operand) error {
	x, a, t := in[0], k.attrs(), k.nd.Type
	dt, err := floatsOf(x, out)
	if err != nil {
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
	return k.packs(typed(kDropout, dt), x.n(), perPack(dt), x.p, out.p, outer, rows, inner, rowOff, a.Seed, a.Counter, p, scale)
}

func causalMask(k *kctx, in []operand, out operand) error {
	x := in[0]
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	rk := len(x.shape)
	if rk < 2 || x.n() != out.n() {
		return graph.Errorf(graph.ErrShape, "causal_mask of %v into %v", x.shape, out.shape)
	}
	t, s := int64(x.shape[rk-2]), int64(x.shape[rk-1])
	return k.packs(typed(kCausalMask, dt), x.n(), perPack(dt), x.p, out.p, x.n(), t, s, float32(k.attrs().Scalar))
}

// fill sets every element to Attrs.Scalar: int64(Scalar) for int64, else
// float32(Scalar), rounded once more for a 16-bit output.
func fill(k *kctx, _ []operand, out operand) error {
	if out.dt == graph.Int64 {
		return k.flat(kFillI64, out.n(), out.p, out.n(), int64(k.attrs().Scalar))
	}
	dt, err := floatsOf(out)
	if err != nil {
		return err
	}
	return k.flat(typed(kFillF32, dt), out.n(), out.p, out.n(), float32(k.attrs().Scalar))
}
