package graph

import "slices"

const (
	OpReshape Op = endNormalizeOps + iota // Attrs.Shape (full-batch sizes, no −1 left)
	OpPermute                             // Attrs.Perm
	OpSlice                               // Attrs.Axis, Attrs.Start, Attrs.End, Attrs.Step
	OpConcat                              // Attrs.Axis, variadic
	endMovementOps
)

// Movement ops rearrange elements without arithmetic, so chunk partials
// pass through them unchanged (Moves); concat adds its operands' extents.
var movementOps = []OpInfo{
	OpReshape: {Name: "reshape", Category: CatMovement, MinArity: 1, Arity: 1, Attrs: []string{"shape"},
		Rule:  reshape,
		Chunk: &Chunk{Linear: Moves, Consume: refuses("folds the batch axis under a leading axis")},
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpReshape, Attrs{Shape: slices.Clone(b.Type(x).Shape)}, g))
		}},
	OpPermute: {Name: "permute", Category: CatMovement, MinArity: 1, Arity: 1, Attrs: []string{"perm"},
		Rule: permute, Chunk: &Chunk{Linear: Moves},
		VJP: func(b VJPBuilder, n *Node, g int) {
			inv := make([]int, len(n.Attrs.Perm))
			for i, p := range n.Attrs.Perm {
				inv[p] = i
			}
			b.Accumulate(n.Inputs[0], b.Emit(OpPermute, Attrs{Perm: inv}, g))
		}},
	// A slice's gradient waits for its siblings: slices tiling an axis
	// become one concat (see VJPBuilder.AccumulateSlice).
	OpSlice: {Name: "slice", Category: CatMovement, MinArity: 1, Arity: 1, Attrs: []string{"axis", "start", "end", "step"},
		Rule:  slice,
		Chunk: &Chunk{Linear: Moves, Consume: refuses("selects along the batch axis")},
		VJP:   func(b VJPBuilder, n *Node, g int) { b.AccumulateSlice(n.Inputs[0], g) }},
	OpConcat: {Name: "concat", Category: CatMovement, MinArity: 1, Arity: Variadic, Attrs: []string{"axis"},
		Rule:  concat,
		Chunk: &Chunk{PerSample: noSpan, Linear: Adds, Consume: refuses("concatenates along the batch axis")},
		VJP: func(b VJPBuilder, n *Node, g int) {
			ax, off := n.Attrs.Axis, 0
			for i, id := range n.Inputs {
				size := b.Type(id).Shape[ax]
				if b.Wants(i) {
					b.Accumulate(id, b.Emit(OpSlice, Attrs{Axis: ax, Start: off, End: off + size, Step: 1}, g))
				}
				off += size
			}
		}},
}

func reshape(_ Op, attrs *Attrs, in []Type, batch int) (Type, error) {
	x := in[0]
	target := slices.Clone(attrs.Shape)
	if target == nil {
		target = []int{}
	}
	infer, known := -1, 1
	for i, d := range target {
		switch {
		case d == -1 && infer < 0:
			infer = i
		case d == -1:
			return Type{}, Errorf(ErrAttr, "reshape to %v: more than one -1", attrs.Shape)
		case d < 0:
			return Type{}, Errorf(ErrAttr, "reshape to %v: negative size", attrs.Shape)
		default:
			known *= d
		}
	}
	n := x.Numel()
	if infer >= 0 {
		if known == 0 || n%known != 0 {
			return Type{}, Errorf(ErrShape, "reshape of %d elements to %v", n, attrs.Shape)
		}
		target[infer] = n / known
	}
	if Numel(target) != n {
		return Type{}, Errorf(ErrShape, "reshape of %d elements to %v (%d elements)", n, attrs.Shape, Numel(target))
	}
	attrs.Shape = target
	t := Type{Shape: target, DType: x.DType, BatchAxis: -1, PerSample: 1}
	if x.BatchAxis < 0 || batch <= 0 {
		return t, nil
	}
	// Samples stay a clean outer factor of some output axis e only if the
	// elements before the batch axis keep their extent: prod(out[:e]) ==
	// prod(in[:d]). Otherwise the batch is folded under a leading axis and
	// the result has no batch axis (chunkability analysis reports it).
	pre := Numel(x.Shape[:x.BatchAxis])
	p := 1
	for e, d := range target {
		if p == pre && d%batch == 0 && d >= batch {
			t.BatchAxis, t.PerSample = e, d/batch
			break
		}
		p *= d
		if p > pre {
			break
		}
	}
	return t, nil
}

func permute(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	x := in[0]
	rank := len(x.Shape)
	if len(attrs.Perm) != rank {
		return Type{}, Errorf(ErrAttr, "permute %v of a rank-%d input", attrs.Perm, rank)
	}
	perm := make([]int, rank)
	seen := make([]bool, rank)
	t := Type{Shape: make([]int, rank), DType: x.DType, BatchAxis: -1, PerSample: x.PerSample}
	for i, p := range attrs.Perm {
		ax, err := normAxis(p, rank, "permute axis")
		if err != nil {
			return Type{}, err
		}
		if seen[ax] {
			return Type{}, Errorf(ErrAttr, "permute %v repeats axis %d", attrs.Perm, ax)
		}
		seen[ax] = true
		perm[i] = ax
		t.Shape[i] = x.Shape[ax]
		if ax == x.BatchAxis {
			t.BatchAxis = i
		}
	}
	attrs.Perm = perm
	return t, nil
}

func slice(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) { return sliceOf(attrs, in[0]) }

func sliceOf(attrs *Attrs, x Type) (Type, error) {
	ax, err := normAxis(attrs.Axis, len(x.Shape), "slice axis")
	if err != nil {
		return Type{}, err
	}
	attrs.Axis = ax
	if attrs.Step == 0 {
		attrs.Step = 1
	}
	d := x.Shape[ax]
	if attrs.Step < 0 || attrs.Start < 0 || attrs.End > d || attrs.Start > attrs.End {
		return Type{}, Errorf(ErrAttr, "slice [%d:%d:%d] of axis %d (size %d)", attrs.Start, attrs.End, attrs.Step, ax, d)
	}
	t := x
	t.Shape = slices.Clone(x.Shape)
	t.Shape[ax] = (attrs.End - attrs.Start + attrs.Step - 1) / attrs.Step
	if ax == x.BatchAxis {
		t.BatchAxis, t.PerSample = -1, 1 // selecting samples: not chunkable, reported by analysis
	}
	return t, nil
}

func concat(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	first := in[0]
	ax, err := normAxis(attrs.Axis, len(first.Shape), "concat axis")
	if err != nil {
		return Type{}, err
	}
	attrs.Axis = ax
	t := Type{Shape: slices.Clone(first.Shape), DType: first.DType, BatchAxis: -1, PerSample: 1}
	t.Shape[ax] = 0
	for i, x := range in {
		if len(x.Shape) != len(first.Shape) {
			return Type{}, Errorf(ErrShape, "concat input %d is %v, input 0 is %v", i, x.Shape, first.Shape)
		}
		if x.DType != first.DType {
			return Type{}, Errorf(ErrDType, "concat input %d is %s, input 0 is %s", i, x.DType, first.DType)
		}
		for j, d := range x.Shape {
			if j != ax && d != first.Shape[j] {
				return Type{}, Errorf(ErrShape, "concat along axis %d: input %d has size %d at axis %d, input 0 has %d", ax, i, d, j, first.Shape[j])
			}
		}
		t.Shape[ax] += x.Shape[ax]
	}
	bax, per, err := alignBatch(len(t.Shape), in...)
	if err != nil {
		return Type{}, err
	}
	if bax != ax {
		t.BatchAxis, t.PerSample = bax, per
	}
	return t, nil
}
