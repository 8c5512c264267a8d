package cpu

import (
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Index family: the embedding lookup and its gradient.
var indexKernels = family{
	graph.OpEmbedding: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error { return embeddingKernel(in[0], in[1], out) }},
	graph.OpEmbeddingGrad: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error {
		return embeddingGrad(in[0], in[1], optional(in, 2), out)
	}},
}

// embeddingKernel copies row idx[k] of w [V, D] to output row k. The indices
// are data, not shapes, so only this kernel can reject one out of range.
func embeddingKernel(idx, w, out *buf) error {
	if len(w.shape) != 2 || idx.i == nil {
		return graph.Errorf(graph.ErrShape, "embedding needs int64 indices and a [V, D] weight, got %v and %v", idx.shape, w.shape)
	}
	v, d := w.shape[0], w.shape[1]
	if len(out.f) != len(idx.i)*d {
		return graph.Errorf(graph.ErrShape, "embedding of indices %v with weight %v into %v", idx.shape, w.shape, out.shape)
	}
	for k, ix := range idx.i {
		if ix < 0 || ix >= int64(v) {
			return exec.BadValue("embedding", "index", 0, idx.shape, k, ix, v)
		}
		copy(out.f[k*d:(k+1)*d], w.f[int(ix)*d:int(ix+1)*d])
	}
	return nil
}

// embeddingGrad scatter-adds rows of g into the weight's gradient.
func embeddingGrad(g, idx, onto, out *buf) error {
	v, d := out.shape[0], out.shape[1]
	if onto != nil {
		copy(out.f, onto.f)
	} else {
		clear(out.f)
	}
	for i, k := range idx.i {
		if k < 0 || int(k) >= v {
			return exec.BadValue("embedding", "index", 1, idx.shape, i, k, v)
		}
		row := out.f[int(k)*d : (int(k)+1)*d]
		for j := range row {
			row[j] += g.f[i*d+j]
		}
	}
	return nil
}
