package graph

const (
	OpInvalid Op = iota
	OpInput      // batched user input (lazy.Wrap)
	OpParam      // trainable parameter
	OpConst      // constant tensor
	OpFill       // Attrs.Target filled with Attrs.Scalar (gradient seeds, zero gradients)
	endSourceOps
)

// Sources take no inputs. Input, param and const are typed by their data
// (Graph.Append runs sourceType instead of a rule); fill is typed by its
// Target attribute.
var sourceOps = []OpInfo{
	OpInput: {Name: "input", Category: CatSource, Chunk: plainChunk, NoVJP: noVJPLeaf},
	OpParam: {Name: "param", Category: CatSource, Chunk: plainChunk, NoVJP: noVJPLeaf},
	OpConst: {Name: "const", Category: CatSource, Chunk: plainChunk, NoVJP: noVJPLeaf},
	OpFill: {Name: "fill", Category: CatGenerate, Attrs: []string{"target", "scalar"},
		Rule: fill, Chunk: plainChunk, NoVJP: noVJPLeaf},
}

// sourceType checks the type given for an input, parameter or constant and
// returns the one to store. An input's batch axis fixes the graph's batch
// size; a parameter or constant never has one, whatever t says.
func (g *Graph) sourceType(t Type, op Op) (Type, error) {
	if !t.DType.IsFloat() && t.DType != Int64 {
		return Type{}, Errorf(ErrDType, "unsupported dtype %s", t.DType)
	}
	if err := CheckSize(t); err != nil {
		return Type{}, err
	}
	if op != OpInput {
		t.BatchAxis, t.PerSample = -1, 1
		return t, nil
	}
	if t.BatchAxis < 0 || t.BatchAxis >= len(t.Shape) {
		return Type{}, Errorf(ErrAttr, "batch axis %d out of range for shape %v", t.BatchAxis, t.Shape)
	}
	if t.Shape[t.BatchAxis] == 0 {
		return Type{}, Errorf(ErrShape, "batch axis %d of %v is empty", t.BatchAxis, t.Shape)
	}
	if err := g.SetBatch(t.Shape[t.BatchAxis]); err != nil {
		return Type{}, err
	}
	t.PerSample = 1
	return t, nil
}

func fill(op Op, attrs *Attrs, _ []Type, _ int) (Type, error) {
	t := attrs.Target
	if !t.DType.IsFloat() {
		return Type{}, Errorf(ErrDType, "fill of %s", t.DType)
	}
	for _, d := range t.Shape {
		if d < 0 {
			return Type{}, Errorf(ErrShape, "fill with negative dimension in %v", t.Shape)
		}
	}
	if t.Shape == nil {
		t.Shape = []int{}
	}
	t.BatchAxis, t.PerSample = -1, 1
	attrs.Target = t
	return t, nil
}
