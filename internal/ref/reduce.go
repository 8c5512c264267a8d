package ref

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// reducedPos maps multi-index idx of the reduction input to the flat
// position of its output element in out (keepdim or not).
func reducedPos(idx, axes []int, keep bool, out []int) int {
	o := make([]int, 0, len(idx))
	for d, i := range idx {
		switch {
		case !slices.Contains(axes, d):
			o = append(o, i)
		case keep:
			o = append(o, 0)
		}
	}
	return ravel(o, out)
}

// reduce computes sum, mean (sum·Scalar) or max over a.Axes.
func reduce(out, x Value, op graph.Op, a *graph.Attrs) {
	if op == graph.OpMax {
		for i := range out.Data {
			out.Data[i] = math.Inf(-1)
		}
	}
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		p := reducedPos(idx, a.Axes, a.KeepDim, out.Shape)
		if op == graph.OpMax {
			out.Data[p] = math.Max(out.Data[p], v)
		} else {
			out.Data[p] += v
		}
	}
	if op == graph.OpMean {
		for i := range out.Data {
			out.Data[i] *= a.Scalar
		}
	}
}

// expand broadcasts g to out's shape (NumPy rules).
func expand(out, g Value) {
	idx := make([]int, len(out.Shape))
	for i := range out.Data {
		unravel(i, out.Shape, idx)
		out.Data[i] = g.Data[broadcastPos(idx, g.Shape)]
	}
}

// maxGrad gives each element of x equal to its group's maximum y an equal
// share of the group's gradient g.
func maxGrad(out, g, x, y Value, a *graph.Attrs) {
	ties := make([]int, len(y.Data))
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		if p := reducedPos(idx, a.Axes, a.KeepDim, y.Shape); v == y.Data[p] {
			ties[p]++
		}
	}
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		if p := reducedPos(idx, a.Axes, a.KeepDim, y.Shape); v == y.Data[p] {
			out.Data[i] = g.Data[p] / float64(ties[p])
		}
	}
}

// lines splits shape around axis: element k of line (o, in) sits at flat
// position (o·n + k)·inner + in.
func lines(shape []int, axis int) (outer, n, inner int) {
	return graph.Numel(shape[:axis]), shape[axis], graph.Numel(shape[axis+1:])
}

// softmax along axis, shifted by the line's maximum for stability; with
// logForm, log_softmax = x − max − log Σ exp(x − max).
func softmax(out, x Value, axis int, logForm bool) {
	outer, n, inner := lines(x.Shape, axis)
	for o := range outer {
		for in := range inner {
			at := func(k int) int { return (o*n+k)*inner + in }
			m := math.Inf(-1)
			for k := range n {
				m = math.Max(m, x.Data[at(k)])
			}
			s := 0.0
			for k := range n {
				s += math.Exp(x.Data[at(k)] - m)
			}
			for k := range n {
				if logForm {
					out.Data[at(k)] = x.Data[at(k)] - m - math.Log(s)
				} else {
					out.Data[at(k)] = math.Exp(x.Data[at(k)]-m) / s
				}
			}
		}
	}
}

// softmaxGrad is y·(g − Σ g·y) for softmax output y, or g − exp(y)·Σ g for
// log_softmax output y, along axis.
func softmaxGrad(out, g, y Value, axis int, logForm bool) {
	outer, n, inner := lines(y.Shape, axis)
	for o := range outer {
		for in := range inner {
			at := func(k int) int { return (o*n+k)*inner + in }
			s := 0.0
			for k := range n {
				if logForm {
					s += g.Data[at(k)]
				} else {
					s += g.Data[at(k)] * y.Data[at(k)]
				}
			}
			for k := range n {
				if logForm {
					out.Data[at(k)] = g.Data[at(k)] - math.Exp(y.Data[at(k)])*s
				} else {
					out.Data[at(k)] = y.Data[at(k)] * (g.Data[at(k)] - s)
				}
			}
		}
	}
}

// normRows splits x into rows of the trailing normDims axes and returns,
// per row, the mean and 1/√(biased variance + eps).
func normRows(x Value, normDims int, eps float64) (rows, m int, mean, rstd []float64) {
	m = graph.Numel(x.Shape[len(x.Shape)-normDims:])
	rows = graph.Numel(x.Shape[:len(x.Shape)-normDims])
	mean, rstd = make([]float64, rows), make([]float64, rows)
	for r := range rows {
		s := 0.0
		for j := range m {
			s += x.Data[r*m+j]
		}
		mu := s / float64(m)
		v := 0.0
		for j := range m {
			d := x.Data[r*m+j] - mu
			v += d * d
		}
		mean[r], rstd[r] = mu, 1/math.Sqrt(v/float64(m)+eps)
	}
	return rows, m, mean, rstd
}

// layerNorm is (x − mean)·rstd·w + b over the trailing NormDims axes.
func layerNorm(out Value, in []Value, a *graph.Attrs) {
	x := in[0]
	rows, m, mean, rstd := normRows(x, a.NormDims, a.Eps)
	for r := range rows {
		for j := range m {
			y := (x.Data[r*m+j] - mean[r]) * rstd[r]
			if len(in) > 1 {
				y *= in[1].Data[j]
			}
			if len(in) > 2 {
				y += in[2].Data[j]
			}
			out.Data[r*m+j] = y
		}
	}
}

// layerNormGradX: with x̂ = (x − mean)·rstd and d = g·w (g without w),
// dx = rstd·(d − mean(d) − x̂·mean(d·x̂)) per row.
func layerNormGradX(out Value, in []Value, a *graph.Attrs) {
	g, x := in[0], in[1]
	rows, m, mean, rstd := normRows(x, a.NormDims, a.Eps)
	for r := range rows {
		d := make([]float64, m)
		xh := make([]float64, m)
		sd, sdx := 0.0, 0.0
		for j := range m {
			d[j] = g.Data[r*m+j]
			if len(in) > 2 {
				d[j] *= in[2].Data[j]
			}
			xh[j] = (x.Data[r*m+j] - mean[r]) * rstd[r]
			sd += d[j]
			sdx += d[j] * xh[j]
		}
		for j := range m {
			out.Data[r*m+j] = rstd[r] * (d[j] - sd/float64(m) - xh[j]*sdx/float64(m))
		}
	}
}

// layerNormGradW is Σ over rows of g·x̂.
func layerNormGradW(out, g, x Value, a *graph.Attrs) {
	rows, m, mean, rstd := normRows(x, a.NormDims, a.Eps)
	for r := range rows {
		for j := range m {
			out.Data[j] += g.Data[r*m+j] * (x.Data[r*m+j] - mean[r]) * rstd[r]
		}
	}
}
