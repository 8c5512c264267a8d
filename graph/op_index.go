package graph

import "slices"

const (
	OpEmbedding Op = endMovementOps + iota // inputs indices (int64), weight [V, D]
	endIndexOps
)

var indexOps = []OpInfo{
	// embedding gathers rows of weight [V, D] at int64 indices; only the
	// weight has a gradient (rows scatter-added).
	OpEmbedding: {Name: "embedding", Category: CatIndex, MinArity: 2, Arity: 2,
		Rule: embeddingRule, Chunk: &Chunk{Weights: true}, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) {
			if w := n.Inputs[1]; b.Wants(1) {
				b.Accumulate(w, b.Emit(OpEmbeddingGrad, Attrs{Target: b.Type(w)}, g, n.Inputs[0]))
			}
		}},
}

func embeddingRule(_ Op, _ *Attrs, in []Type, _ int) (Type, error) { return embedding(in[0], in[1]) }

func embedding(idx, w Type) (Type, error) {
	if idx.DType != Int64 {
		return Type{}, Errorf(ErrDType, "embedding indices must be int64, got %s", idx.DType)
	}
	if err := needFloat(OpEmbedding, w); err != nil {
		return Type{}, err
	}
	if len(w.Shape) != 2 {
		return Type{}, Errorf(ErrShape, "embedding weight must be [num, dim], got %v", w.Shape)
	}
	return Type{Shape: append(slices.Clone(idx.Shape), w.Shape[1]), DType: w.DType,
		BatchAxis: idx.BatchAxis, PerSample: idx.PerSample}, nil
}
