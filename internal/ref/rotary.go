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
// heads are copied. A table [T, 2d] is the full form (cos of every
// element, then sin): pair (i, i + d/2) maps by [[c_i, −s_i], [s_{i+h},
// c_{i+h}]] (h = d/2), and sign −1 applies that map's transpose.
func rotary(out, x, cs Value, end int, sign float64) {
	b, t, n, d := x.Shape[0], x.Shape[1], x.Shape[2], x.Shape[3]
	h, w := d/2, cs.Shape[1]
	for r := range b * t * n {
		row := x.Data[r*d : (r+1)*d]
		dst := out.Data[r*d : (r+1)*d]
		if r%n >= end {
			copy(dst, row)
			continue
		}
		tab := cs.Data[r/n%t*w:][:w]
		for i := range h {
			cLo, cHi, sLo, sHi := tab[i], tab[i], tab[h+i], tab[h+i]
			if w == 2*d {
				cHi, sLo, sHi = tab[h+i], tab[d+i], tab[d+h+i]
			}
			a, c := row[i], row[i+h]
			if sign > 0 {
				dst[i] = a*cLo - c*sLo
				dst[i+h] = c*cHi + a*sHi
			} else {
				dst[i] = a*cLo + c*sHi
				dst[i+h] = c*cHi - a*sLo
			}
		}
	}
}
