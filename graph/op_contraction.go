package graph

import (
	"fmt"
	"slices"
)

const (
	// OpMatMul is a 2-D or batched product, broadcasting batch dims;
	// TransA/TransB transpose the last two axes. Attrs.Target.DType, when
	// set, is the output's dtype: float32 from 16-bit operands (accumulated
	// in float32 and rounded once, to float32) instead of a 16-bit result
	// that a cast would widen again (package precision folds such casts).
	OpMatMul Op = endBinaryOps + iota
	OpLinear    // x·Wᵀ (+ b): inputs x, W[, b]
	endContractionOps
)

var contractionOps = []OpInfo{
	OpMatMul: {Name: "matmul", Category: CatContraction, MinArity: 2, Arity: 2, Attrs: []string{"trans_a", "trans_b", "target"},
		Rule: matmulRule, Saves: SavesInput(0, 1), VJP: matmulVJP,
		Chunk: &Chunk{PerSample: matmulPerSample, Linear: Multiplies,
			// Reached only when the output has no batch axis, so a batched
			// operand carried it on the contracted axis: when both do, the
			// product is a sum over samples.
			Consume: func(n *Node, in []Type) (Combine, string) {
				if in[0].Batched() && in[1].Batched() {
					return CombineSum, ""
				}
				return CombineNone, "contracts the batch axis with an unbatched operand"
			}}},
	OpLinear: {Name: "linear", Category: CatContraction, MinArity: 2, Arity: 2, MaxArity: 3,
		Rule: linear, Saves: SavesInput(0, 1), VJP: linearVJP,
		Chunk: &Chunk{Weights: true, Linear: Multiplies,
			Consume: refuses("contracts the batch axis with an unbatched weight")}},
}

func matmulRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	a, b := in[0], in[1]
	if attrs.TransA {
		a = transposeLast2(a)
	}
	if attrs.TransB {
		b = transposeLast2(b)
	}
	t, err := matmul(a, b)
	if err != nil {
		return Type{}, err
	}
	// Only the target's dtype is read; the rule clears the rest so that
	// graph signatures stay canonical.
	switch to := attrs.Target.DType; {
	case to == InvalidDType || to == t.DType:
		attrs.Target = Type{}
	case to == Float32:
		attrs.Target = Type{DType: to}
		t.DType = to
	default:
		return Type{}, Errorf(ErrDType, "matmul of %s operands to %s: the output dtype is the operands' or float32", t.DType, to)
	}
	return t, nil
}

func matmul(a, b Type) (Type, error) {
	if err := needFloat(OpMatMul, a, b); err != nil {
		return Type{}, err
	}
	if a.DType != b.DType {
		return Type{}, Errorf(ErrDType, "matmul of %s and %s", a.DType, b.DType)
	}
	ra, rb := len(a.Shape), len(b.Shape)
	if ra < 2 || rb < 2 {
		return Type{}, Errorf(ErrShape, "matmul needs rank ≥ 2 operands, got ranks %d and %d", ra, rb)
	}
	m, k := a.Shape[ra-2], a.Shape[ra-1]
	k2, n := b.Shape[rb-2], b.Shape[rb-1]
	if k != k2 {
		return Type{}, Errorf(ErrShape, "matmul inner dimensions differ: %d vs %d", k, k2)
	}
	lead, err := BroadcastShapes(a.Shape[:ra-2], b.Shape[:rb-2])
	if err != nil {
		return Type{}, err
	}
	out := append(lead, m, n)
	r := len(out)
	t := Type{Shape: out, DType: a.DType, BatchAxis: -1, PerSample: 1}
	// Where each operand's batch axis lands in the output (−1: contracted).
	land := func(x Type, rowAxis, colAxis int) int {
		switch ax := x.BatchAxis; {
		case ax < 0:
			return -2 // unbatched
		case ax == len(x.Shape)-2:
			return rowAxis
		case ax == len(x.Shape)-1:
			return colAxis
		default:
			return ax + r - len(x.Shape)
		}
	}
	la := land(a, r-2, -1)
	lb := land(b, -1, r-1)
	per := a.PerSample
	if a.BatchAxis < 0 {
		per = b.PerSample
	}
	switch {
	case la >= 0 && lb >= 0 && la != lb:
		return Type{}, Errorf(ErrShape, "matmul operands' batch axes land on different output axes (%d and %d)", la, lb)
	case la >= 0:
		t.BatchAxis, t.PerSample = la, per
	case lb >= 0:
		t.BatchAxis, t.PerSample = lb, per
	}
	// A batch of one broadcast along a longer leading axis of the other
	// operand no longer counts samples there.
	for _, x := range []Type{a, b} {
		if t.BatchAxis >= 0 && x.BatchAxis >= 0 && x.Shape[x.BatchAxis] != out[t.BatchAxis] {
			t.BatchAxis, t.PerSample = -1, 1
		}
	}
	return t, nil
}

// transposeLast2 is t with its last two axes swapped (ranks < 2 unchanged).
func transposeLast2(t Type) Type {
	r := len(t.Shape)
	if r < 2 {
		return t
	}
	t.Shape = slices.Clone(t.Shape)
	t.Shape[r-2], t.Shape[r-1] = t.Shape[r-1], t.Shape[r-2]
	switch t.BatchAxis {
	case r - 2:
		t.BatchAxis = r - 1
	case r - 1:
		t.BatchAxis = r - 2
	}
	return t
}

func matmulPerSample(n *Node, in []Type) string {
	x, y := in[0], in[1]
	if n.Attrs.TransA {
		x = transposeLast2(x)
	}
	if n.Attrs.TransB {
		y = transposeLast2(y)
	}
	if x.BatchAxis == len(x.Shape)-1 || y.BatchAxis == len(y.Shape)-2 {
		return "contracts one operand's batch axis while the output keeps the other's"
	}
	rank, g := len(n.Type.Shape), n.Type.BatchAxis
	for _, t := range []Type{x, y} {
		if g < rank-2 && spans(t, rank, g) {
			return fmt.Sprintf("operand %v without a batch axis spans the batch axis", t.Shape)
		}
	}
	return ""
}

// matmulVJP: y = op(a)·op(b) with op a transpose when the flag is set.
// d op(a) = g·op(b)ᵀ and d op(b) = op(a)ᵀ·g, re-expressed with transpose
// flags so no transposed copy is made.
//
// A matmul with a float32 output from 16-bit operands takes its gradient
// in the operands' dtype, as the cast it replaces would have.
func matmulVJP(b VJPBuilder, n *Node, g int) {
	x0, x1 := n.Inputs[0], n.Inputs[1]
	if dt := b.Type(x0).DType; b.Type(g).DType != dt {
		g = b.Emit(OpCast, Attrs{Target: Type{DType: dt}}, g)
	}
	ta, tb := n.Attrs.TransA, n.Attrs.TransB
	mm := func(p, q int, tp, tq bool) int {
		return b.Emit(OpMatMul, Attrs{TransA: tp, TransB: tq}, p, q)
	}
	if b.Wants(0) {
		var ga int
		if !ta {
			ga = mm(g, x1, false, !tb)
		} else {
			ga = mm(x1, g, tb, true)
		}
		b.Accumulate(x0, b.SumTo(ga, x0))
	}
	if b.Wants(1) {
		var gb int
		if flat := flatWeightGrad(b, g, x0, x1, ta, tb); flat >= 0 {
			gb = flat
		} else if !tb {
			gb = mm(x0, g, !ta, false)
		} else {
			gb = mm(g, x0, true, ta)
		}
		b.Accumulate(x1, b.SumTo(gb, x1))
	}
}

// flatWeightGrad handles the common x[..., k] · W[k, n] with W 2-D: the
// gradient of W is one [k, M]·[M, n] product over the flattened leading
// axes, instead of a per-batch product followed by a sum. It returns −1
// when the pattern does not apply.
func flatWeightGrad(b VJPBuilder, g, x0, x1 int, ta, tb bool) int {
	xt, wt := b.Type(x0), b.Type(x1)
	if ta || len(wt.Shape) != 2 || len(xt.Shape) <= 2 {
		return -1
	}
	gs := b.Type(g).Shape
	k, n := xt.Shape[len(xt.Shape)-1], gs[len(gs)-1]
	xf := b.Emit(OpReshape, Attrs{Shape: []int{-1, k}}, x0)
	gf := b.Emit(OpReshape, Attrs{Shape: []int{-1, n}}, g)
	if tb { // W is [n, k]: dW = gᵀ·x
		return b.Emit(OpMatMul, Attrs{TransA: true}, gf, xf)
	}
	return b.Emit(OpMatMul, Attrs{TransA: true}, xf, gf)
}

func linear(op Op, _ *Attrs, in []Type, _ int) (Type, error) {
	x, w := in[0], in[1]
	if err := needFloat(OpLinear, in...); err != nil {
		return Type{}, err
	}
	if len(x.Shape) < 1 || len(w.Shape) != 2 {
		return Type{}, Errorf(ErrShape, "linear needs x of rank ≥ 1 and a 2-D weight [out, in], got ranks %d and %d", len(x.Shape), len(w.Shape))
	}
	if x.Shape[len(x.Shape)-1] != w.Shape[1] {
		return Type{}, Errorf(ErrShape, "linear: input features %d do not match weight [out=%d, in=%d]",
			x.Shape[len(x.Shape)-1], w.Shape[0], w.Shape[1])
	}
	if len(in) == 3 && !slices.Equal(in[2].Shape, []int{w.Shape[0]}) {
		return Type{}, Errorf(ErrShape, "linear: bias shape %v, want [%d]", in[2].Shape, w.Shape[0])
	}
	for _, t := range in[1:] {
		if t.DType != x.DType {
			return Type{}, Errorf(ErrDType, "linear of %s with %s", x.DType, t.DType)
		}
	}
	out := append(slices.Clone(x.Shape[:len(x.Shape)-1]), w.Shape[0])
	t := Type{Shape: out, DType: x.DType, BatchAxis: x.BatchAxis, PerSample: x.PerSample}
	if x.BatchAxis == len(x.Shape)-1 {
		t.BatchAxis, t.PerSample = -1, 1 // contracted; chunkability analysis reports it
	}
	return t, nil
}

// linearVJP: y = x·Wᵀ + b.
func linearVJP(b VJPBuilder, n *Node, g int) {
	x, w := n.Inputs[0], n.Inputs[1]
	xt := b.Type(x)
	gt := b.Type(g)
	out := b.Type(w).Shape[0]
	if b.Wants(0) {
		if len(xt.Shape) == 1 { // [out] · [out, in] as a row vector
			r := b.Emit(OpReshape, Attrs{Shape: []int{1, out}}, g)
			b.Accumulate(x, b.Emit(OpReshape, Attrs{Shape: slices.Clone(xt.Shape)}, b.Emit(OpMatMul, Attrs{}, r, w)))
		} else {
			b.Accumulate(x, b.Emit(OpMatMul, Attrs{}, g, w))
		}
	}
	if b.Wants(1) {
		gf, xf := g, x
		if len(gt.Shape) != 2 {
			gf = b.Emit(OpReshape, Attrs{Shape: []int{-1, out}}, g)
			xf = b.Emit(OpReshape, Attrs{Shape: []int{-1, xt.Shape[len(xt.Shape)-1]}}, x)
		}
		b.Accumulate(w, b.Emit(OpMatMul, Attrs{TransA: true}, gf, xf))
	}
	if b.Wants(2) {
		b.Accumulate(n.Inputs[2], sumLeading(b, g, len(gt.Shape)-1))
	}
}

// sumLeading sums g over its first lead axes (a bias gradient); with none
// it is g itself.
func sumLeading(b VJPBuilder, g, lead int) int {
	if lead <= 0 {
		return g
	}
	axes := make([]int, lead)
	for i := range axes {
		axes[i] = i
	}
	return b.Emit(OpSum, Attrs{Axes: axes}, g)
}
