package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Rotary family (kernels/rotary.cu): rotary and rotary_grad, one kernel
// rotating by ±θ from the float32 cos/sin table. No workspace.
var rotaryKernels = family{
	graph.OpRotary:     {run: rotary},
	graph.OpRotaryGrad: {run: rotary},
}

// rotHeads is ROT_HEADS: the heads a vector-path thread rotates with one
// read of the table.
const rotHeads = 4

// rotary runs rotary (by θ) or rotary_grad (by −θ) of x [B, T, N, d] with
// the table cs [T, d], or [T, 2d] in the full form (graph.OpRotary).
func rotary(k *kctx, in []operand, out operand) error {
	x, cs := in[0], in[1]
	dt, err := floatsOf(x, out)
	if err != nil {
		return err
	}
	if err := floats(cs); err != nil {
		return err
	}
	a, err := graph.RotaryDims(k.nd.Op, k.attrs().End,
		graph.Type{Shape: x.shape, DType: dt, BatchAxis: -1}, graph.Type{Shape: cs.shape, DType: cs.dt, BatchAxis: -1})
	if err != nil {
		return err
	}
	if out.n() != x.n() {
		return graph.Errorf(graph.ErrShape, "%s: x %v, output %v", k.nd.Op, x.shape, out.shape)
	}
	bt, t, n, d := int64(a.B*a.T), int64(a.T), int64(a.N), int64(a.D)
	w := d // the table's row width
	if a.Full {
		w = 2 * d
	}
	if bt*n*d == 0 {
		return nil
	}
	sign := float32(1)
	if k.nd.Op == graph.OpRotaryGrad {
		sign = -1
	}
	vec := rotaryVec(d, x.p, cs.p, out.p)
	work := bt * n * d / 2 // one thread a pair
	if vec {
		work = bt * ceilDiv(n, rotHeads) * (d / 16) // a pack of 8 pairs of rotHeads heads
	}
	return k.flat(typed(kRotary, dt), work, x.p, cs.p, out.p, bt, t, n, d, w, int64(a.End), sign, boolInt(vec))
}

// rotaryVec reports whether rotary_*'s vector path takes head dim d with
// these arrays: d a multiple of 16 (half a head is whole packs of 8) and
// every array 16-byte aligned.
func rotaryVec(d int64, ptrs ...alloc.Ptr) bool {
	if d%16 != 0 {
		return false
	}
	for _, p := range ptrs {
		if p%16 != 0 {
			return false
		}
	}
	return true
}
