package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Elementwise family: unary and scalar ops, broadcasting binary ops, the
// elementwise gradients, dropout, causal_mask and fill.
var elementwiseKernels = family{
	graph.OpNeg: {run: unary}, graph.OpExp: {run: unary}, graph.OpLog: {run: unary},
	graph.OpSqrt: {run: unary}, graph.OpAbs: {run: unary}, graph.OpTanh: {run: unary},
	graph.OpSigmoid: {run: unary}, graph.OpRelu: {run: unary}, graph.OpGelu: {run: unary},
	graph.OpSign: {run: unary}, graph.OpSilu: {run: unary},
	// cast copies; the runner rounds a float16 or bfloat16 result.
	graph.OpCast: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error {
		copy(out.f, in[0].f)
		return nil
	}},
	graph.OpSiluGrad: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error {
		g, x := in[0], in[1]
		for i, v := range x.f {
			s := sigmoid(float64(v))
			out.f[i] = float32(float64(g.f[i]) * s * (1 + float64(v)*(1-s)))
		}
		return nil
	}},

	// swiglu and its gradients: silu(gate)·up, g·up·silu'(gate), g·silu(gate).
	graph.OpSwiGLU: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error {
		gate, up := in[0], in[1]
		if len(up.f) != len(gate.f) || len(out.f) != len(gate.f) {
			return graph.Errorf(graph.ErrShape, "swiglu: gate %v, up %v, output %v", gate.shape, up.shape, out.shape)
		}
		for i, v := range gate.f {
			x := float64(v)
			out.f[i] = float32(x * sigmoid(x) * float64(up.f[i]))
		}
		return nil
	}},
	graph.OpSwiGLUGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		g, gate, up := in[0], in[1], in[2]
		if len(g.f) != len(gate.f) || len(up.f) != len(gate.f) || len(out.f) != len(gate.f) {
			return graph.Errorf(graph.ErrShape, "swiglu_grad: g %v, gate %v, up %v, output %v", g.shape, gate.shape, up.shape, out.shape)
		}
		for i, v := range gate.f {
			x := float64(v)
			s := sigmoid(x)
			if nd.Attrs.Axis == 0 {
				out.f[i] = float32(float64(g.f[i]) * float64(up.f[i]) * s * (1 + x*(1-s)))
			} else {
				out.f[i] = float32(float64(g.f[i]) * x * s)
			}
		}
		return nil
	}},

	graph.OpAddScalar: {run: unary}, graph.OpSubScalar: {run: unary}, graph.OpRSubScalar: {run: unary},
	graph.OpMulScalar: {run: unary}, graph.OpDivScalar: {run: unary}, graph.OpRDivScalar: {run: unary},
	graph.OpPowScalar: {run: unary}, graph.OpMaximumScalar: {run: unary},

	graph.OpAdd: {run: binary}, graph.OpSub: {run: binary}, graph.OpMul: {run: binary},
	graph.OpDiv: {run: binary}, graph.OpPow: {run: binary}, graph.OpMaximum: {run: binary},

	graph.OpDropout: {run: func(nd *graph.Node, in []*buf, out *buf, chunkStart int) error {
		return dropoutKernel(&nd.Attrs, nd.Type, chunkStart, in[0], out)
	}},
	graph.OpCausalMask: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return causalMaskKernel(nd.Attrs.Scalar, in[0], out)
	}},
	graph.OpFill: {run: func(nd *graph.Node, _ []*buf, out *buf, _ int) error {
		for i := range out.f {
			out.f[i] = float32(nd.Attrs.Scalar)
		}
		return nil
	}},

	graph.OpReluGrad: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error {
		g := in[0]
		for i, y := range in[1].f {
			out.f[i] = 0
			if y > 0 {
				out.f[i] = g.f[i]
			}
		}
		return nil
	}},
	graph.OpGeluGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		g := in[0]
		for i, x := range in[1].f {
			out.f[i] = g.f[i] * float32(geluDeriv(float64(x), nd.Attrs.Approx))
		}
		return nil
	}},
	graph.OpMaximumScalarGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		g, s := in[0], float32(nd.Attrs.Scalar)
		for i, x := range in[1].f {
			out.f[i] = maximumShare(x, s) * g.f[i]
		}
		return nil
	}},
	graph.OpMaximumGrad: {run: maximumGrad},
}

func unary(nd *graph.Node, in []*buf, out *buf, _ int) error {
	return unaryKernel(nd.Op, &nd.Attrs, in[0], out)
}

func binary(nd *graph.Node, in []*buf, out *buf, _ int) error {
	return binaryKernel(nd.Op, in[0], in[1], out)
}

// maximumGrad is maximum's gradient for operand Attrs.Axis (0 or 1) at the
// broadcast shape.
func maximumGrad(nd *graph.Node, in []*buf, out *buf, _ int) error {
	g := in[0]
	x0, err := broadcastIndex(in[1].shape, out.shape)
	if err != nil {
		return err
	}
	x1, err := broadcastIndex(in[2].shape, out.shape)
	if err != nil {
		return err
	}
	for i := range out.f {
		p, q := in[1].f[x0[i]], in[2].f[x1[i]]
		if nd.Attrs.Axis == 1 {
			p, q = q, p
		}
		out.f[i] = maximumShare(p, q) * g.f[i]
	}
	return nil
}

// unaryKernel applies a one-input elementwise op (CatUnary) or an op with a
// scalar operand (CatScalar, a.Scalar). Values are computed in float64 and
// rounded once to float32.
func unaryKernel(op graph.Op, a *graph.Attrs, x, out *buf) error {
	if len(x.f) != len(out.f) {
		return graph.Errorf(graph.ErrShape, "%s: input %v, output %v", op, x.shape, out.shape)
	}
	src, dst, s := x.f[:len(out.f)], out.f, a.Scalar
	// Cheap ops get their own loops; the rest pay one indirect call per
	// element, small next to the math call itself.
	switch op {
	case graph.OpNeg:
		for i, v := range src {
			dst[i] = -v
		}
	case graph.OpAbs:
		for i, v := range src {
			dst[i] = float32(math.Abs(float64(v)))
		}
	case graph.OpRelu:
		for i, v := range src {
			if v < 0 { // NaN passes through, as in PyTorch
				v = 0
			}
			dst[i] = v
		}
	case graph.OpAddScalar:
		for i, v := range src {
			dst[i] = float32(float64(v) + s)
		}
	case graph.OpSubScalar:
		for i, v := range src {
			dst[i] = float32(float64(v) - s)
		}
	case graph.OpRSubScalar:
		for i, v := range src {
			dst[i] = float32(s - float64(v))
		}
	case graph.OpMulScalar:
		for i, v := range src {
			dst[i] = float32(float64(v) * s)
		}
	case graph.OpDivScalar:
		for i, v := range src {
			dst[i] = float32(float64(v) / s)
		}
	case graph.OpRDivScalar:
		for i, v := range src {
			dst[i] = float32(s / float64(v))
		}
	case graph.OpMaximumScalar:
		for i, v := range src {
			dst[i] = float32(max(float64(v), s)) // builtin max propagates NaN
		}
	default:
		f := unaryFunc(op, a)
		if f == nil {
			return graph.Errorf(graph.ErrAttr, "%s is not an elementwise unary op", op)
		}
		for i, v := range src {
			dst[i] = float32(f(float64(v)))
		}
	}
	return nil
}

// unaryFunc returns the float64 function computing op, or nil.
func unaryFunc(op graph.Op, a *graph.Attrs) func(float64) float64 {
	switch op {
	case graph.OpExp:
		return math.Exp
	case graph.OpLog:
		return math.Log
	case graph.OpSqrt:
		return math.Sqrt
	case graph.OpTanh:
		return math.Tanh
	case graph.OpSigmoid:
		return sigmoid
	case graph.OpGelu:
		if a.Approx {
			return geluTanh
		}
		return gelu
	case graph.OpPowScalar:
		s := a.Scalar
		return func(v float64) float64 { return math.Pow(v, s) }
	case graph.OpSign:
		return sign
	case graph.OpSilu:
		return func(v float64) float64 { return v * sigmoid(v) }
	}
	return nil
}

// sign is −1, 0 or 1 (NaN stays NaN), as torch.sign.
func sign(v float64) float64 {
	switch {
	case v > 0:
		return 1
	case v < 0:
		return -1
	}
	return v
}

// sigmoid never evaluates exp of a large positive number, so it cannot
// overflow to Inf/Inf.
func sigmoid(v float64) float64 {
	if v >= 0 {
		return 1 / (1 + math.Exp(-v))
	}
	e := math.Exp(v)
	return e / (1 + e)
}

func gelu(v float64) float64 { return 0.5 * v * (1 + math.Erf(v/math.Sqrt2)) }

// geluTanh is the tanh approximation used by GPT-2 ("gelu_new").
func geluTanh(v float64) float64 {
	const c = 0.7978845608028654 // √(2/π)
	return 0.5 * v * (1 + math.Tanh(c*(v+0.044715*v*v*v)))
}

// binaryKernel applies a two-input elementwise op with NumPy broadcasting;
// out.shape is the broadcast shape. After newWalk drops size-1 axes and merges
// contiguous ones, same-shape operands are one row, a broadcast row vector is
// rows of a contiguous operand against one repeated row, and so on; only the
// outer odometer is general.
func binaryKernel(op graph.Op, x, y, out *buf) error {
	sx, err := graph.BroadcastStrides(x.shape, out.shape)
	if err != nil {
		return err
	}
	sy, err := graph.BroadcastStrides(y.shape, out.shape)
	if err != nil {
		return err
	}
	if binaryFunc(op) == nil {
		return graph.Errorf(graph.ErrAttr, "%s is not a binary elementwise op", op)
	}
	w := newWalk(out.shape, sx, sy, graph.ContiguousStrides(out.shape))
	w.rows(func(offs []int, n int, inner []int) {
		dst := out.f[offs[2] : offs[2]+n]
		a := x.f[offs[0]:]
		b := y.f[offs[1]:]
		binaryRow(op, dst, a, inner[0], b, inner[1])
	})
	return nil
}

// binaryRow computes dst[i] = a[i·sa] ∘ b[i·sb]. Along a merged row each
// operand's stride is 1 or 0 (broadcast), and not both 0 unless len(dst) is 1.
func binaryRow(op graph.Op, dst, a []float32, sa int, b []float32, sb int) {
	n := len(dst)
	switch {
	case sa != 0 && sb != 0:
		a, b = a[:n], b[:n]
		switch op {
		case graph.OpAdd:
			for i := range dst {
				dst[i] = a[i] + b[i]
			}
		case graph.OpSub:
			for i := range dst {
				dst[i] = a[i] - b[i]
			}
		case graph.OpMul:
			for i := range dst {
				dst[i] = a[i] * b[i]
			}
		case graph.OpDiv:
			for i := range dst {
				dst[i] = a[i] / b[i]
			}
		default:
			f := binaryFunc(op)
			for i := range dst {
				dst[i] = f(a[i], b[i])
			}
		}
	case sa == 0:
		s, b := a[0], b[:n] // sb is 0 too only when n is 1
		switch op {
		case graph.OpAdd:
			for i := range dst {
				dst[i] = s + b[i]
			}
		case graph.OpSub:
			for i := range dst {
				dst[i] = s - b[i]
			}
		case graph.OpMul:
			for i := range dst {
				dst[i] = s * b[i]
			}
		case graph.OpDiv:
			for i := range dst {
				dst[i] = s / b[i]
			}
		default:
			f := binaryFunc(op)
			for i := range dst {
				dst[i] = f(s, b[i])
			}
		}
	default: // sb == 0
		s, a := b[0], a[:n]
		switch op {
		case graph.OpAdd:
			for i := range dst {
				dst[i] = a[i] + s
			}
		case graph.OpSub:
			for i := range dst {
				dst[i] = a[i] - s
			}
		case graph.OpMul:
			for i := range dst {
				dst[i] = a[i] * s
			}
		case graph.OpDiv:
			for i := range dst {
				dst[i] = a[i] / s
			}
		default:
			f := binaryFunc(op)
			for i := range dst {
				dst[i] = f(a[i], s)
			}
		}
	}
}

// binaryFunc returns the scalar form of op, or nil.
func binaryFunc(op graph.Op) func(a, b float32) float32 {
	switch op {
	case graph.OpAdd:
		return func(a, b float32) float32 { return a + b }
	case graph.OpSub:
		return func(a, b float32) float32 { return a - b }
	case graph.OpMul:
		return func(a, b float32) float32 { return a * b }
	case graph.OpDiv:
		return func(a, b float32) float32 { return a / b }
	case graph.OpPow:
		return func(a, b float32) float32 { return float32(math.Pow(float64(a), float64(b))) }
	case graph.OpMaximum:
		return func(a, b float32) float32 { return max(a, b) } // builtin max propagates NaN
	}
	return nil
}

// causalMaskKernel copies x [..., T, S] and sets entries above the shifted
// diagonal (j > i + S − T) to fill.
func causalMaskKernel(fill float64, x, out *buf) error {
	r := len(x.shape)
	if r < 2 || len(x.f) != len(out.f) {
		return graph.Errorf(graph.ErrShape, "causal_mask of %v into %v", x.shape, out.shape)
	}
	t, s := x.shape[r-2], x.shape[r-1]
	copy(out.f, x.f)
	f := float32(fill)
	for m := 0; m < len(out.f); m += t * s {
		for i := range t {
			row := out.f[m+i*s : m+(i+1)*s]
			for j := max(i+s-t+1, 0); j < s; j++ {
				row[j] = f
			}
		}
	}
	return nil
}

// dropoutKernel applies dropout to x, a chunk whose first batch row is
// chunkStart·PerSample of the whole batch: each element is keyed by its
// global row along the batch axis and its index within the row, so the
// mask does not depend on how the batch was chunked.
func dropoutKernel(a *graph.Attrs, t graph.Type, chunkStart int, x, out *buf) error {
	if len(x.f) != len(out.f) {
		return graph.Errorf(graph.ErrShape, "dropout of %v into %v", x.shape, out.shape)
	}
	p := a.Scalar
	scale := float32(1 / (1 - p))
	ax := t.BatchAxis
	outer, rows, inner := 1, 1, graph.Numel(x.shape)
	rowOff := 0
	if ax >= 0 {
		outer, rows, inner = graph.Numel(x.shape[:ax]), x.shape[ax], graph.Numel(x.shape[ax+1:])
		rowOff = chunkStart * t.PerSample
	}
	for o := range outer {
		for r := range rows {
			base := (o*rows + r) * inner
			for k := range inner {
				i := base + k
				out.f[i] = 0
				if graph.DropoutKeep(a.Seed, a.Counter, int64(rowOff+r), int64(o*inner+k), p) {
					out.f[i] = x.f[i] * scale
				}
			}
		}
	}
	return nil
}

// maximumShare is ∂max(p, q)/∂p: 1 where p wins, ½ on ties (as PyTorch).
func maximumShare(p, q float32) float32 {
	switch {
	case p > q:
		return 1
	case p == q:
		return 0.5
	}
	return 0
}

// geluDeriv is d/dx of gelu(x), exact (erf) or tanh-approximated.
func geluDeriv(x float64, approx bool) float64 {
	if approx {
		const k, c = 0.7978845608028654, 0.044715 // √(2/π)
		t := math.Tanh(k * (x + c*x*x*x))
		return 0.5*(1+t) + 0.5*x*(1-t*t)*k*(1+3*c*x*x)
	}
	cdf := 0.5 * (1 + math.Erf(x/math.Sqrt2))
	pdf := math.Exp(-0.5*x*x) / math.Sqrt(2*math.Pi)
	return cdf + x*pdf
}

// broadcastIndex maps each flat index of outShape to the flat index of an
// operand of shape s broadcast to it (NumPy rules, s no longer than outShape).
func broadcastIndex(s, outShape []int) ([]int, error) {
	strides, err := graph.BroadcastStrides(s, outShape)
	if err != nil {
		return nil, err
	}
	r := len(outShape)
	idx := make([]int, graph.Numel(outShape))
	pos := make([]int, r)
	off := 0
	for i := range idx {
		idx[i] = off
		for d := r - 1; d >= 0; d-- { // odometer increment
			pos[d]++
			off += strides[d]
			if pos[d] < outShape[d] {
				break
			}
			off -= strides[d] * pos[d]
			pos[d] = 0
		}
	}
	return idx, nil
}
