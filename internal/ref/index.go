package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Index family: the embedding lookup and its gradient.
var indexKernels = family{
	graph.OpEmbedding: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		return embedding(out, in[0], in[1])
	},
	graph.OpEmbeddingGrad: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		if len(in) > 2 { // onto r
			copy(out.Data, in[2].Data)
		}
		return embeddingGrad(out, in[0], in[1])
	},
}

// index converts an integral float64 to an index below size.
func index(v float64, size int, what string) (int, error) {
	if v != math.Trunc(v) || v < 0 || v >= float64(size) {
		return 0, graph.Errorf(graph.ErrShape, "%s %g out of range [0, %d)", what, v, size)
	}
	return int(v), nil
}

// embedding: out[s…, d] = w[idx[s…], d].
func embedding(out, idx, w Value) error {
	v, d := w.Shape[0], w.Shape[1]
	for s, x := range idx.Data {
		row, err := index(x, v, "embedding index")
		if err != nil {
			return err
		}
		for j := range d {
			out.Data[s*d+j] = w.Data[row*d+j]
		}
	}
	return nil
}

// embeddingGrad scatter-adds row s of g into row idx[s] of a zero [V, D].
func embeddingGrad(out, g, idx Value) error {
	v, d := out.Shape[0], out.Shape[1]
	for s, x := range idx.Data {
		row, err := index(x, v, "embedding index")
		if err != nil {
			return err
		}
		for j := range d {
			out.Data[row*d+j] += g.Data[s*d+j]
		}
	}
	return nil
}
