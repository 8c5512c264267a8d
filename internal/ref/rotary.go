package ref

import "github.com/batchfit/batchfit/graph"

// Rotary family: the rotary position embedding (rotary, rotary_grad),
// each pair (i, i + d/2) of a head rotated by the table's angles.
var rotaryKernels = family{
	graph.OpRotary: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		rotary(out, in[0], in[1], a.End, 1)
		return nil
	},
	graph.OpRotaryGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		rotary(out, in[0], in[1], a.End, -1)
		return nil
	},
}

// rotary rotates heads below end of x [B, T, N, d] by the angles of cs
// [T, d] (cos, then sin), each pair (i, i + d/2), by sign·θ; the other
// heads are copied.
func rotary(out, x, cs Value, end int, sign float64) {
	b, t, n, d := x.Shape[0], x.Shape[1], x.Shape[2], x.Shape[3]
	h := d / 2
	for r := range b * t * n {
		row := x.Data[r*d : (r+1)*d]
		dst := out.Data[r*d : (r+1)*d]
		if r%n >= end {
			copy(dst, row)
			continue
		}
		pos := r / n % t
		for i := range h {
			c, s := cs.Data[pos*d+i], sign*cs.Data[pos*d+h+i]
			dst[i] = row[i]*c - row[i+h]*s
			dst[i+h] = row[i+h]*c + row[i]*s
		}
	}
}
