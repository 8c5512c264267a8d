package ref

import "github.com/batchfit/batchfit/graph"

// Contraction family: matmul and linear.
var contractionKernels = family{
	graph.OpMatMul: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		matmul(out, in[0], in[1], a.TransA, a.TransB)
		return nil
	},
	graph.OpLinear: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		linear(out, in)
		return nil
	},
	graph.OpMatMulGeluGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		matmul(out, in[0], in[1], a.TransA, a.TransB)
		for i, x := range in[2].Data {
			out.Data[i] *= geluDeriv(x, a.Approx)
		}
		return nil
	},
}

// matmul computes out[..., i, j] = Σ_p A[..., i, p]·B[..., p, j] where A is
// a or, with transA, a with its last two axes swapped (B likewise); the
// leading axes broadcast.
func matmul(out, a, b Value, transA, transB bool) {
	r := len(out.Shape)
	k := a.Shape[len(a.Shape)-1]
	if transA {
		k = a.Shape[len(a.Shape)-2]
	}
	idx := make([]int, r)
	for o := range out.Data {
		unravel(o, out.Shape, idx)
		lead, i, j := idx[:r-2], idx[r-2], idx[r-1]
		s := 0.0
		for p := range k {
			var av, bv float64
			if transA {
				av = at2(a, lead, p, i)
			} else {
				av = at2(a, lead, i, p)
			}
			if transB {
				bv = at2(b, lead, j, p)
			} else {
				bv = at2(b, lead, p, j)
			}
			s += av * bv
		}
		out.Data[o] = s
	}
}

// at2 reads v[lead…, row, col] where lead broadcasts onto v's leading axes.
func at2(v Value, lead []int, row, col int) float64 {
	r := len(v.Shape)
	rows, cols := v.Shape[r-2], v.Shape[r-1]
	m := broadcastPos(lead, v.Shape[:r-2])
	return v.Data[(m*rows+row)*cols+col]
}

// linear computes out[..., o] = Σ_k x[..., k]·W[o, k] + b[o].
func linear(out Value, in []Value) {
	x, w := in[0], in[1]
	nOut, nIn := w.Shape[0], w.Shape[1]
	for r := range graph.Numel(x.Shape[:len(x.Shape)-1]) {
		for o := range nOut {
			s := 0.0
			for k := range nIn {
				s += x.Data[r*nIn+k] * w.Data[o*nIn+k]
			}
			if len(in) == 3 {
				s += in[2].Data[o]
			}
			out.Data[r*nOut+o] = s
		}
	}
}
