package graph

import "slices"

const (
	OpSum  Op = endContractionOps + iota // Attrs.Axes, Attrs.KeepDim
	OpMean                               // as OpSum, scaled by Attrs.Scalar = 1/count fixed at build time (full N)
	OpMax
	endReduceOps
)

// Reductions over Attrs.Axes (all axes when empty). A reduction over the
// batch axis is a cross-batch value whose chunk partials add (sum, and mean
// with its 1/count fixed at the full batch) or combine by max.
var reduceOps = []OpInfo{
	OpSum: {Name: "sum", Category: CatReduce, MinArity: 1, Arity: 1, Attrs: []string{"axes", "keepdim"},
		Rule: reduce, Chunk: &Chunk{Consume: combines(CombineSum), Linear: Scales}, VJP: sumVJP},
	OpMean: {Name: "mean", Category: CatReduce, MinArity: 1, Arity: 1, Attrs: []string{"axes", "keepdim", "scalar"},
		Rule: reduce, Chunk: &Chunk{Consume: combines(CombineSum), Linear: Scales}, VJP: sumVJP},
	OpMax: {Name: "max", Category: CatReduce, MinArity: 1, Arity: 1, Attrs: []string{"axes", "keepdim"},
		Rule: reduce, Chunk: &Chunk{Consume: combines(CombineMax), Linear: KeepsMax}, Saves: SavesInput(0) | SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpMaxGrad, Attrs{Axes: n.Attrs.Axes, KeepDim: n.Attrs.KeepDim}, g, x, n.ID))
		}},
}

// sumVJP expands g back over the reduced axes (mean scales it by 1/count).
func sumVJP(b VJPBuilder, n *Node, g int) {
	x := n.Inputs[0]
	gk := keepDims(b, g, b.Type(x), n.Attrs)
	if n.Op == OpMean {
		gk = scalar(b, OpMulScalar, gk, n.Attrs.Scalar)
	}
	b.Accumulate(x, b.Emit(OpExpand, Attrs{Target: b.Type(x)}, gk))
}

// keepDims reshapes a reduction's gradient to the keepdim shape so it
// broadcasts against the reduced input.
func keepDims(b VJPBuilder, g int, x Type, a Attrs) int {
	if a.KeepDim {
		return g
	}
	s := slices.Clone(x.Shape)
	for _, ax := range a.Axes {
		s[ax] = 1
	}
	return b.Emit(OpReshape, Attrs{Shape: s}, g)
}

func reduce(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	x := in[0]
	if err := needFloat(op, x); err != nil {
		return Type{}, err
	}
	rank := len(x.Shape)
	axes := attrs.Axes
	if len(axes) == 0 { // no axes: reduce everything
		axes = make([]int, rank)
		for i := range axes {
			axes[i] = i
		}
	}
	norm := make([]int, len(axes))
	for i, a := range axes {
		ax, err := normAxis(a, rank, "reduce axis")
		if err != nil {
			return Type{}, err
		}
		norm[i] = ax
	}
	slices.Sort(norm)
	if len(slices.Compact(slices.Clone(norm))) != len(norm) {
		return Type{}, Errorf(ErrAttr, "%s: repeated axis in %v", op, axes)
	}
	attrs.Axes = norm
	t := Type{DType: x.DType, BatchAxis: -1, PerSample: 1}
	count := 1
	for i, d := range x.Shape {
		reduced := slices.Contains(norm, i)
		if reduced {
			count *= d
			if attrs.KeepDim {
				t.Shape = append(t.Shape, 1)
			}
			continue
		}
		if i == x.BatchAxis {
			t.BatchAxis, t.PerSample = len(t.Shape), x.PerSample
		}
		t.Shape = append(t.Shape, d)
	}
	if t.Shape == nil {
		t.Shape = []int{}
	}
	if count == 0 && op != OpSum {
		return Type{}, Errorf(ErrShape, "%s over an empty axis", op)
	}
	if op == OpMean {
		attrs.Scalar = 1 / float64(count)
	}
	return t, nil
}
