package graph

const (
	OpNeg Op = endSourceOps + iota
	OpExp
	OpLog
	OpSqrt
	OpAbs
	OpTanh
	OpSigmoid
	OpRelu
	OpGelu // Attrs.Approx: tanh approximation instead of erf
	OpSign // sign(x) ∈ {−1, 0, 1}
	// OpCausalMask sets x[..., i, j] to Attrs.Scalar where j > i + (S − T)
	// for x [..., T, S]: −inf before attention's softmax, 0 in its gradient.
	OpCausalMask
	// OpDropout zeroes elements with probability Attrs.Scalar and scales
	// the rest by 1/(1−p); the mask comes from DropoutKeep keyed by
	// (Attrs.Seed, Attrs.Counter, global batch row, element), so chunked
	// runs draw the whole batch's mask. Its gradient is the same op on g.
	OpDropout
	OpSilu          // x·sigmoid(x) (SiLU, "swish"), as Llama's MLP uses
	OpSiluGrad      // g, x: g·s·(1 + x·(1 − s)) with s = sigmoid(x); silu's gradient op
	OpAddScalar     // x + s
	OpSubScalar     // x − s
	OpRSubScalar    // s − x
	OpMulScalar     // x · s
	OpDivScalar     // x / s
	OpRDivScalar    // s / x
	OpPowScalar     // x ^ s
	OpMaximumScalar // max(x, s)
	// OpCast converts x to the floating-point dtype Attrs.Target.DType,
	// rounding to nearest even when it narrows (see package half). Its
	// gradient is the upstream gradient cast back to x's dtype.
	OpCast
	endUnaryOps
)

// Elementwise ops of one input: the output has the input's type. The
// scalar forms read Attrs.Scalar as their second operand.
var unaryOps = []OpInfo{
	OpNeg: {Name: "neg", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: scales,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], neg(b, g)) }},
	OpExp: {Name: "exp", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], mul(b, g, n.ID)) }},
	OpLog: {Name: "log", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], div(b, g, n.Inputs[0])) }},
	OpSqrt: {Name: "sqrt", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) {
			b.Accumulate(n.Inputs[0], scalar(b, OpMulScalar, div(b, g, n.ID), 0.5))
		}},
	OpAbs: {Name: "abs", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, mul(b, g, b.Emit(OpSign, Attrs{}, x)))
		}},
	OpTanh: {Name: "tanh", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) { // g·(1 − y²)
			y := n.ID
			b.Accumulate(n.Inputs[0], mul(b, g, scalar(b, OpRSubScalar, mul(b, y, y), 1)))
		}},
	OpSigmoid: {Name: "sigmoid", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) { // g·y·(1 − y)
			y := n.ID
			b.Accumulate(n.Inputs[0], mul(b, g, mul(b, y, scalar(b, OpRSubScalar, y, 1))))
		}},
	// relu's gradient reads relu's output, as PyTorch saves.
	OpRelu: {Name: "relu", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], b.Emit(OpReluGrad, Attrs{}, g, n.ID)) }},
	OpGelu: {Name: "gelu", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"approx"}, Rule: unary, Chunk: plainChunk, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpGeluGrad, Attrs{Approx: n.Attrs.Approx}, g, x))
		}},
	// sign is zero almost everywhere: its VJP contributes nothing.
	OpSign: {Name: "sign", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk,
		VJP: func(VJPBuilder, *Node, int) {}},
	// Masked positions pass no gradient: the gradient is g masked with 0.
	OpCausalMask: {Name: "causal_mask", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: causalMask, Chunk: plainChunk,
		VJP: func(b VJPBuilder, n *Node, g int) {
			b.Accumulate(n.Inputs[0], b.Emit(OpCausalMask, Attrs{Scalar: 0}, g))
		}},
	// The gradient redraws the same mask and scale from the node's key.
	OpDropout: {Name: "dropout", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"scalar", "seed", "counter"}, Rule: dropout, Chunk: plainChunk,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], b.Emit(OpDropout, n.Attrs, g)) }},
	// silu keeps its input for backward, whose one fused op recomputes the
	// sigmoid rather than keeping it.
	OpSilu: {Name: "silu", Category: CatUnary, MinArity: 1, Arity: 1, Rule: unary, Chunk: plainChunk, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpSiluGrad, Attrs{}, g, x))
		}},
	OpSiluGrad: {Name: "silu_grad", Category: CatGrad, MinArity: 2, Arity: 2, NoVJP: noVJPGrad,
		Rule: gradRule(sameAsGrad), Chunk: plainChunk},
}

// castOps: the one conversion op. It moves no element and is linear, so
// partial sums stay sums (up to the rounding a narrowing cast makes).
var castOps = []OpInfo{
	OpCast: {Name: "cast", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"target"}, Rule: castRule, Chunk: scales,
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpCast, Attrs{Target: Type{DType: b.Type(x).DType}}, g))
		}},
}

// castRule: x's type with Attrs.Target's dtype. Only the target's dtype is
// read; the rule clears the rest so that graph signatures stay canonical.
func castRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	if err := needFloat(op, in[0]); err != nil {
		return Type{}, err
	}
	to := attrs.Target.DType
	if !to.IsFloat() {
		return Type{}, Errorf(ErrDType, "cast to %s: the target must be a floating-point dtype", to)
	}
	*attrs = Attrs{Target: Type{DType: to, BatchAxis: -1, PerSample: 1}}
	t := in[0]
	t.DType = to
	return t, nil
}

var scalarOps = []OpInfo{
	OpAddScalar: {Name: "add_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: plainChunk,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], g) }},
	OpSubScalar: {Name: "sub_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: plainChunk,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], g) }},
	OpRSubScalar: {Name: "rsub_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: plainChunk,
		VJP: func(b VJPBuilder, n *Node, g int) { b.Accumulate(n.Inputs[0], neg(b, g)) }},
	OpMulScalar: {Name: "mul_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: scales,
		VJP: vjpScale},
	OpDivScalar: {Name: "div_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: scales,
		VJP: vjpScale},
	OpRDivScalar: {Name: "rdiv_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: plainChunk,
		Saves: SavesInput(0) | SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) { // d(s/x) = −y/x
			x := n.Inputs[0]
			b.Accumulate(x, neg(b, div(b, mul(b, g, n.ID), x)))
		}},
	OpPowScalar: {Name: "pow_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: plainChunk, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) { // s·x^(s−1)
			x, s := n.Inputs[0], n.Attrs.Scalar
			b.Accumulate(x, mul(b, g, scalar(b, OpMulScalar, scalar(b, OpPowScalar, x, s-1), s)))
		}},
	OpMaximumScalar: {Name: "maximum_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}, Rule: unary, Chunk: plainChunk, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpMaximumScalarGrad, Attrs{Scalar: n.Attrs.Scalar}, g, x))
		}},
}

// scales is the chunk behaviour of ops linear in their one input.
var scales = &Chunk{Linear: Scales}

// vjpScale: x·s and x/s have gradient g·s and g/s, the same op on g.
func vjpScale(b VJPBuilder, n *Node, g int) {
	b.Accumulate(n.Inputs[0], scalar(b, n.Op, g, n.Attrs.Scalar))
}

func unary(op Op, _ *Attrs, in []Type, _ int) (Type, error) {
	if err := needFloat(op, in[0]); err != nil {
		return Type{}, err
	}
	return in[0], nil
}

func dropout(op Op, attrs *Attrs, in []Type, batch int) (Type, error) {
	if err := needFloat(op, in[0]); err != nil {
		return Type{}, err
	}
	if !(attrs.Scalar >= 0 && attrs.Scalar < 1) {
		return Type{}, Errorf(ErrAttr, "dropout probability %g must lie in [0, 1)", attrs.Scalar)
	}
	return in[0], nil
}

func causalMask(op Op, attrs *Attrs, in []Type, batch int) (Type, error) {
	if err := needFloat(op, in[0]); err != nil {
		return Type{}, err
	}
	if len(in[0].Shape) < 2 {
		return Type{}, Errorf(ErrShape, "causal_mask needs rank ≥ 2 [..., T, S], got %v", in[0].Shape)
	}
	return in[0], nil
}

func needFloat(op Op, ts ...Type) error {
	for i, t := range ts {
		if !t.DType.IsFloat() {
			return Errorf(ErrDType, "%s needs floating-point input %d, got %s", op, i, t.DType)
		}
	}
	return nil
}

func normAxis(ax, rank int, what string) (int, error) {
	if ax < -rank || ax >= rank {
		return 0, Errorf(ErrAttr, "%s %d out of range for rank %d", what, ax, rank)
	}
	if ax < 0 {
		ax += rank
	}
	return ax, nil
}
