package cpu

import "github.com/batchfit/batchfit/graph"

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
			return graph.Errorf(graph.ErrAttr, "embedding index %d (position %d) out of range for %d rows", ix, k, v)
		}
		copy(out.f[k*d:(k+1)*d], w.f[int(ix)*d:int(ix+1)*d])
	}
	return nil
}
