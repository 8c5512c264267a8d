package graph

import (
	"fmt"
	"slices"
)

const (
	OpAdd Op = endUnaryOps + iota
	OpSub
	OpMul
	OpDiv
	OpPow
	OpMaximum
	// OpSwiGLU is silu(gate)·up of two inputs of one shape and dtype (no
	// broadcasting): Llama's feed-forward gate, act_fn(gate_proj(x)) ·
	// up_proj(x), in one pass computed in float32 and rounded once. The
	// gate and up projections stay two GEMMs with their weights as they
	// are (Hugging Face's gate_proj and up_proj), rather than one GEMM of
	// [gate; up] concatenated each step: that concat and the slices of its
	// gradient would move the two weights through memory every step (at
	// the Llama-3.2-1B shape 2·128 MiB of float32 a layer each way), more
	// than one wider GEMM saves. Its backward pass is one pass too (the
	// two gradients, SwiGLUGradProducer).
	OpSwiGLU
	// OpSwiGLUGrad is a gradient of swiglu: g, gate, up; Attrs.Axis 0 gives
	// d gate = g·up·s·(1 + gate·(1 − s)) (s = sigmoid(gate)), Axis 1 d up
	// = g·silu(gate).
	OpSwiGLUGrad
	endBinaryOps
)

// Elementwise ops of two inputs with NumPy broadcasting. A broadcast
// operand's gradient is summed back to its own shape.
var binaryOps = []OpInfo{
	OpAdd: {Name: "add", Category: CatBinary, MinArity: 2, Arity: 2, Rule: binaryRule,
		Chunk: &Chunk{PerSample: noSpan, Linear: Adds},
		VJP:   binaryVJP(func(b VJPBuilder, n *Node, g int) (int, int) { return g, g })},
	OpSub: {Name: "sub", Category: CatBinary, MinArity: 2, Arity: 2, Rule: binaryRule,
		Chunk: &Chunk{PerSample: noSpan, Linear: Adds},
		VJP: binaryVJP(func(b VJPBuilder, n *Node, g int) (g0, g1 int) {
			if b.Wants(1) {
				g1 = neg(b, g)
			}
			return g, g1
		})},
	OpMul: {Name: "mul", Category: CatBinary, MinArity: 2, Arity: 2, Rule: binaryRule,
		Chunk: &Chunk{PerSample: noSpan, Linear: Multiplies}, Saves: SavesInput(0, 1),
		VJP: binaryVJP(func(b VJPBuilder, n *Node, g int) (g0, g1 int) {
			if b.Wants(0) {
				g0 = mul(b, g, n.Inputs[1])
			}
			if b.Wants(1) {
				g1 = mul(b, g, n.Inputs[0])
			}
			return g0, g1
		})},
	OpDiv: {Name: "div", Category: CatBinary, MinArity: 2, Arity: 2, Rule: binaryRule,
		Chunk: &Chunk{PerSample: noSpan, Linear: Divides}, Saves: SavesInput(1) | SavesOutput,
		VJP: binaryVJP(func(b VJPBuilder, n *Node, g int) (g0, g1 int) { // d/da = 1/b; d/db = −y/b
			if b.Wants(0) {
				g0 = div(b, g, n.Inputs[1])
			}
			if b.Wants(1) {
				g1 = neg(b, div(b, mul(b, g, n.ID), n.Inputs[1]))
			}
			return g0, g1
		})},
	OpPow: {Name: "pow", Category: CatBinary, MinArity: 2, Arity: 2, Rule: binaryRule,
		Chunk: &Chunk{PerSample: noSpan}, Saves: SavesInput(0, 1) | SavesOutput,
		VJP: binaryVJP(func(b VJPBuilder, n *Node, g int) (g0, g1 int) { // d/da = b·a^(b−1); d/db = y·ln a
			x0, x1 := n.Inputs[0], n.Inputs[1]
			if b.Wants(0) {
				g0 = mul(b, g, mul(b, x1, b.Emit(OpPow, Attrs{}, x0, scalar(b, OpSubScalar, x1, 1))))
			}
			if b.Wants(1) {
				g1 = mul(b, g, mul(b, n.ID, b.Emit(OpLog, Attrs{}, x0)))
			}
			return g0, g1
		})},
	OpMaximum: {Name: "maximum", Category: CatBinary, MinArity: 2, Arity: 2, Rule: binaryRule,
		Chunk: &Chunk{PerSample: noSpan}, Saves: SavesInput(0, 1),
		VJP: binaryVJP(func(b VJPBuilder, n *Node, g int) (g0, g1 int) {
			x0, x1 := n.Inputs[0], n.Inputs[1]
			if b.Wants(0) {
				g0 = b.Emit(OpMaximumGrad, Attrs{Axis: 0}, g, x0, x1)
			}
			if b.Wants(1) {
				g1 = b.Emit(OpMaximumGrad, Attrs{Axis: 1}, g, x0, x1)
			}
			return g0, g1
		})},
	OpSwiGLU: {Name: "swiglu", Category: CatBinary, MinArity: 2, Arity: 2, Rule: swigluRule,
		Chunk: &Chunk{PerSample: noSpan}, Saves: SavesInput(0, 1),
		VJP: func(b VJPBuilder, n *Node, g int) {
			for i := range 2 {
				if b.Wants(i) {
					b.Accumulate(n.Inputs[i], b.Emit(OpSwiGLUGrad, Attrs{Axis: i}, g, n.Inputs[0], n.Inputs[1]))
				}
			}
		}},
	OpSwiGLUGrad: {Name: "swiglu_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"axis"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{PerSample: noSpan},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			fwd, err := swigluRule(OpSwiGLU, nil, in[1:], 0)
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			if attrs.Axis != 0 && attrs.Axis != 1 {
				return Type{}, Errorf(ErrAttr, "%s operand %d (want 0 for the gate, 1 for up)", op, attrs.Axis)
			}
			return sameShape(op, in[0], fwd)
		})},
}

// swigluRule: gate and up of one shape and dtype give that type.
func swigluRule(op Op, _ *Attrs, in []Type, _ int) (Type, error) {
	if err := needFloat(op, in...); err != nil {
		return Type{}, err
	}
	gate, up := in[0], in[1]
	if !slices.Equal(gate.Shape, up.Shape) {
		return Type{}, Errorf(ErrShape, "%s: gate %v and up %v must have one shape (no broadcasting)", op, gate.Shape, up.Shape)
	}
	if gate.DType != up.DType {
		return Type{}, Errorf(ErrDType, "%s: gate is %s, up is %s (want one dtype)", op, gate.DType, up.DType)
	}
	return sameShape(op, gate, up)
}

// binaryVJP accumulates the gradients f makes for the two operands (each
// only computed when wanted), summed back to each operand's shape.
func binaryVJP(f func(b VJPBuilder, n *Node, g int) (g0, g1 int)) VJPFunc {
	return func(b VJPBuilder, n *Node, g int) {
		g0, g1 := f(b, n, g)
		for i, gi := range []int{g0, g1} {
			if b.Wants(i) {
				b.Accumulate(n.Inputs[i], b.SumTo(gi, n.Inputs[i]))
			}
		}
	}
}

// noSpan rejects an operand without a batch axis whose extent along the
// output's batch axis is not 1: each chunk would need a slice of it, which
// executors do not take.
func noSpan(n *Node, in []Type) string {
	rank, g := len(n.Type.Shape), n.Type.BatchAxis
	for _, t := range in {
		if spans(t, rank, g) {
			return fmt.Sprintf("operand %v without a batch axis spans the batch axis", t.Shape)
		}
	}
	return ""
}

// spans reports an operand without a batch axis whose extent along output
// axis g (of an output of the given rank) is not 1.
func spans(t Type, rank, g int) bool {
	return t.BatchAxis < 0 && dimFromRight(t.Shape, rank-1-g) != 1
}

// BroadcastShapes applies NumPy broadcasting to two shapes.
func BroadcastShapes(a, b []int) ([]int, error) {
	r := max(len(a), len(b))
	out := make([]int, r)
	for i := range r {
		da, db := dimFromRight(a, r-1-i), dimFromRight(b, r-1-i)
		switch {
		case da == db || db == 1:
			out[i] = da
		case da == 1:
			out[i] = db
		default:
			return nil, Errorf(ErrShape, "cannot broadcast %v with %v: dimension %d is %d vs %d",
				a, b, i, da, db)
		}
	}
	return out, nil
}

// dimFromRight returns the size of the k-th dim from the right (0 = last), or 1 past the rank.
func dimFromRight(s []int, k int) int {
	if k >= len(s) {
		return 1
	}
	return s[len(s)-1-k]
}

// alignBatch maps the batch axes of operands broadcast into rank r. Both
// operands may be batched only when their batch axes coincide.
func alignBatch(r int, ts ...Type) (axis, per int, err error) {
	axis, per = -1, 1
	for _, t := range ts {
		if t.BatchAxis < 0 {
			continue
		}
		a := t.BatchAxis + r - len(t.Shape)
		if axis >= 0 && (a != axis || t.PerSample != per) {
			return 0, 0, Errorf(ErrShape, "batch axes do not line up (output axes %d and %d)", axis, a)
		}
		axis, per = a, t.PerSample
	}
	return axis, per, nil
}

func binaryRule(op Op, _ *Attrs, in []Type, _ int) (Type, error) {
	a, b := in[0], in[1]
	if err := needFloat(op, a, b); err != nil {
		return Type{}, err
	}
	dt, err := Promote(op, a.DType, b.DType)
	if err != nil {
		return Type{}, err
	}
	s, err := BroadcastShapes(a.Shape, b.Shape)
	if err != nil {
		return Type{}, err
	}
	ax, per, err := alignBatch(len(s), a, b)
	if err != nil {
		return Type{}, err
	}
	// A batch of one broadcast along a longer axis of the other operand no
	// longer counts samples there: the output has no batch axis.
	for _, t := range []Type{a, b} {
		if t.BatchAxis >= 0 && t.Shape[t.BatchAxis] != s[ax] {
			ax, per = -1, 1
		}
	}
	return Type{Shape: s, DType: dt, BatchAxis: ax, PerSample: per}, nil
}
