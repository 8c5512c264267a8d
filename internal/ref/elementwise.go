package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Elementwise family: unary, scalar and binary ops, their gradients,
// dropout, causal_mask and fill.
var elementwiseKernels = family{
	graph.OpNeg: unaryOp, graph.OpExp: unaryOp, graph.OpLog: unaryOp, graph.OpSqrt: unaryOp,
	graph.OpAbs: unaryOp, graph.OpTanh: unaryOp, graph.OpSigmoid: unaryOp, graph.OpRelu: unaryOp,
	graph.OpGelu: unaryOp, graph.OpSign: unaryOp, graph.OpSilu: unaryOp,
	// cast copies; Eval rounds a float16 or bfloat16 result (roundTo).
	graph.OpCast: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		copy(out.Data, in[0].Data)
		return nil
	},

	graph.OpAddScalar: scalarOp, graph.OpSubScalar: scalarOp, graph.OpRSubScalar: scalarOp,
	graph.OpMulScalar: scalarOp, graph.OpDivScalar: scalarOp, graph.OpRDivScalar: scalarOp,
	graph.OpPowScalar: scalarOp, graph.OpMaximumScalar: scalarOp,

	graph.OpAdd: binaryOpKernel, graph.OpSub: binaryOpKernel, graph.OpMul: binaryOpKernel,
	graph.OpDiv: binaryOpKernel, graph.OpPow: binaryOpKernel, graph.OpMaximum: binaryOpKernel,

	graph.OpDropout:    dropout,
	graph.OpCausalMask: causalMask,
	graph.OpFill: func(_ *graph.Node, a *graph.Attrs, _ []Value, out Value) error {
		for i := range out.Data {
			out.Data[i] = a.Scalar
		}
		return nil
	},

	graph.OpReluGrad: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		for i, y := range in[1].Data {
			if y > 0 {
				out.Data[i] = in[0].Data[i]
			}
		}
		return nil
	},
	graph.OpGeluGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		for i, x := range in[1].Data {
			out.Data[i] = in[0].Data[i] * geluDeriv(x, a.Approx)
		}
		return nil
	},
	// d silu/dx = s + x·s·(1 − s) with s = 1/(1 + e^−x).
	graph.OpSiluGrad: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		for i, x := range in[1].Data {
			s := 1 / (1 + math.Exp(-x))
			out.Data[i] = in[0].Data[i] * (s + x*s*(1-s))
		}
		return nil
	},
	// swiglu: silu(gate)·up; its gradients d gate = g·up·silu'(gate) and
	// d up = g·silu(gate).
	graph.OpSwiGLU: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		for i, x := range in[0].Data {
			out.Data[i] = x / (1 + math.Exp(-x)) * in[1].Data[i]
		}
		return nil
	},
	graph.OpSwiGLUGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		g, gate, up := in[0], in[1], in[2]
		for i, x := range gate.Data {
			s := 1 / (1 + math.Exp(-x))
			if a.Axis == 0 {
				out.Data[i] = g.Data[i] * up.Data[i] * (s + x*s*(1-s))
			} else {
				out.Data[i] = g.Data[i] * x * s
			}
		}
		return nil
	},
	graph.OpMaximumGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		maximumGrad(out, in[0], in[1], in[2], a.Axis)
		return nil
	},
	graph.OpMaximumScalarGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		for i, x := range in[1].Data {
			out.Data[i] = in[0].Data[i] * tieShare(x, a.Scalar)
		}
		return nil
	},
}

func unaryOp(nd *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	for i, x := range in[0].Data {
		out.Data[i] = unary(nd.Op, a.Approx, x)
	}
	return nil
}

func scalarOp(nd *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	for i, x := range in[0].Data {
		out.Data[i] = withScalar(nd.Op, x, a.Scalar)
	}
	return nil
}

func binaryOpKernel(nd *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
	binary(out, in[0], in[1], func(x, y float64) float64 { return binaryOp(nd.Op, x, y) })
	return nil
}

// dropout keeps element k at batch row r = (k/inner) mod rows of outer
// block o = k/(rows·inner), keyed within the row by o·inner + k mod inner.
func dropout(nd *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	sh, ax := in[0].Shape, nd.Type.BatchAxis
	rows, inner := 1, len(in[0].Data)
	if ax >= 0 {
		rows, inner = sh[ax], 1
		for _, d := range sh[ax+1:] {
			inner *= d
		}
	}
	for k, x := range in[0].Data {
		o, r := k/(rows*inner), (k/inner)%rows
		if graph.DropoutKeep(a.Seed, a.Counter, int64(r), int64(o*inner+k%inner), a.Scalar) {
			out.Data[k] = x / (1 - a.Scalar)
		}
	}
	return nil
}

// causalMask: element k of x [..., T, S] sits at row i = (k/S) mod T,
// column j = k mod S.
func causalMask(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	sh := in[0].Shape
	t, s := sh[len(sh)-2], sh[len(sh)-1]
	for k, x := range in[0].Data {
		i, j := (k/s)%t, k%s
		out.Data[k] = x
		if j > i+s-t {
			out.Data[k] = a.Scalar
		}
	}
	return nil
}

func unary(op graph.Op, approx bool, x float64) float64 {
	switch op {
	case graph.OpNeg:
		return -x
	case graph.OpExp:
		return math.Exp(x)
	case graph.OpLog:
		return math.Log(x)
	case graph.OpSqrt:
		return math.Sqrt(x)
	case graph.OpAbs:
		return math.Abs(x)
	case graph.OpTanh:
		return math.Tanh(x)
	case graph.OpSigmoid:
		return 1 / (1 + math.Exp(-x))
	case graph.OpRelu:
		if x > 0 {
			return x
		}
		return 0
	case graph.OpGelu:
		return gelu(x, approx)
	case graph.OpSilu:
		return x / (1 + math.Exp(-x))
	case graph.OpSign:
		switch {
		case x > 0:
			return 1
		case x < 0:
			return -1
		}
		return x // ±0 and NaN keep themselves
	}
	return math.NaN()
}

// sqrt2OverPi is √(2/π), the scale of GELU's tanh form.
var sqrt2OverPi = math.Sqrt(2 / math.Pi)

// gelu is x·Φ(x) with Φ(x) = ½(1 + erf(x/√2)), or the tanh form
// ½x(1 + tanh(√(2/π)(x + 0.044715x³))).
func gelu(x float64, approx bool) float64 {
	if approx {
		return 0.5 * x * (1 + math.Tanh(sqrt2OverPi*(x+0.044715*x*x*x)))
	}
	return x * 0.5 * (1 + math.Erf(x/math.Sqrt2))
}

// geluDeriv is d gelu / dx: Φ(x) + x·φ(x) exactly, or the derivative of
// the tanh form, ½(1+t) + ½x(1−t²)·√(2/π)(1 + 3·0.044715x²).
func geluDeriv(x float64, approx bool) float64 {
	if approx {
		t := math.Tanh(sqrt2OverPi * (x + 0.044715*x*x*x))
		return 0.5*(1+t) + 0.5*x*(1-t*t)*sqrt2OverPi*(1+3*0.044715*x*x)
	}
	cdf := 0.5 * (1 + math.Erf(x/math.Sqrt2))
	pdf := math.Exp(-x*x/2) / math.Sqrt(2*math.Pi)
	return cdf + x*pdf
}

func withScalar(op graph.Op, x, s float64) float64 {
	switch op {
	case graph.OpAddScalar:
		return x + s
	case graph.OpSubScalar:
		return x - s
	case graph.OpRSubScalar:
		return s - x
	case graph.OpMulScalar:
		return x * s
	case graph.OpDivScalar:
		return x / s
	case graph.OpRDivScalar:
		return s / x
	case graph.OpPowScalar:
		return math.Pow(x, s)
	case graph.OpMaximumScalar:
		return math.Max(x, s)
	}
	return math.NaN()
}

func binaryOp(op graph.Op, x, y float64) float64 {
	switch op {
	case graph.OpAdd:
		return x + y
	case graph.OpSub:
		return x - y
	case graph.OpMul:
		return x * y
	case graph.OpDiv:
		return x / y
	case graph.OpPow:
		return math.Pow(x, y)
	case graph.OpMaximum:
		return math.Max(x, y)
	}
	return math.NaN()
}

// binary fills out (already of the broadcast shape) with f of the
// broadcast elements of x and y.
func binary(out, x, y Value, f func(x, y float64) float64) {
	idx := make([]int, len(out.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		out.Data[i] = f(x.Data[broadcastPos(idx, x.Shape)], y.Data[broadcastPos(idx, y.Shape)])
	}
}

// tieShare is the share of the gradient of max(x, s) that x receives:
// all when x wins, half on a tie, none when it loses.
func tieShare(x, s float64) float64 {
	switch {
	case x > s:
		return 1
	case x == s:
		return 0.5
	}
	return 0
}

// maximumGrad is the gradient of maximum(a, b) for operand 0 (a) or 1 (b),
// at the broadcast shape; autodiff sums it back to the operand's shape.
func maximumGrad(out, g, a, b Value, operand int) {
	idx := make([]int, len(out.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		av, bv := a.Data[broadcastPos(idx, a.Shape)], b.Data[broadcastPos(idx, b.Shape)]
		if operand == 1 {
			av, bv = bv, av
		}
		out.Data[i] = g.Data[i] * tieShare(av, bv)
	}
}
