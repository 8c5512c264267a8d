package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Normalisation family: softmax and log_softmax, layer_norm and their
// gradients here; batch_norm in batchnorm.go.
var normKernels = family{
	graph.OpSoftmax: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		softmax(out, in[0], a.Axis, false)
		return nil
	},
	graph.OpLogSoftmax: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		softmax(out, in[0], a.Axis, true)
		return nil
	},
	graph.OpLayerNorm: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		layerNorm(out, in, a)
		return nil
	},
	graph.OpBatchNorm: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		batchNorm(out, in, a)
		return nil
	},
	graph.OpBatchNormStats: func(_ *graph.Node, _ *graph.Attrs, in []Value, out Value) error {
		batchNormStats(out, in[0])
		return nil
	},
	graph.OpSoftmaxGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		softmaxGrad(out, in[0], in[1], a.Axis, false)
		return nil
	},
	graph.OpLogSoftmaxGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		softmaxGrad(out, in[0], in[1], a.Axis, true)
		return nil
	},
	graph.OpLayerNormGradX: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		layerNormGradX(out, in, a)
		return nil
	},
	graph.OpLayerNormGradXAdd: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		layerNormGradX(out, append([]Value{in[0], in[1]}, in[3:]...), a) // g, x[, w]
		for i, r := range in[2].Data {
			out.Data[i] += r
		}
		return nil
	},
	graph.OpLayerNormGradW: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		layerNormGradW(out, in[0], in[1], a)
		return nil
	},
	graph.OpRMSNorm: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		x := in[0]
		rows, d, rstd := rmsRows(x, a)
		for r := range rows {
			for j := range d {
				y := x.Data[r*d+j] * rstd[r]
				if len(in) > 1 {
					y *= in[1].Data[j]
				}
				out.Data[r*d+j] = y
			}
		}
		return nil
	},
	graph.OpRMSNormGradX: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		rmsNormGradX(out, in[0], in[1], optionalValue(in, 2), a)
		return nil
	},
	graph.OpRMSNormGradXAdd: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		rmsNormGradX(out, in[0], in[1], optionalValue(in, 3), a)
		for i, r := range in[2].Data {
			out.Data[i] += r
		}
		return nil
	},
	graph.OpRMSNormGradW: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		g, x := in[0], in[1]
		rows, d, rstd := rmsRows(x, a)
		for r := range rows {
			for j := range d {
				out.Data[j] += g.Data[r*d+j] * x.Data[r*d+j] * rstd[r]
			}
		}
		return nil
	},
	graph.OpBatchNormGradX: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		batchNormGradX(out, in, a)
		return nil
	},
	graph.OpBatchNormGradW: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		batchNormGradW(out, in, a)
		return nil
	},
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

// rmsRows views x as rows of the a.NormDims trailing dims and gives each
// row's 1/√(mean(x²) + eps).
func rmsRows(x Value, a *graph.Attrs) (rows, d int, rstd []float64) {
	d = graph.Numel(x.Shape[len(x.Shape)-a.NormDims:])
	if d > 0 {
		rows = len(x.Data) / d
	}
	rstd = make([]float64, rows)
	for r := range rows {
		s := 0.0
		for _, v := range x.Data[r*d : (r+1)*d] {
			s += v * v
		}
		rstd[r] = 1 / math.Sqrt(s/float64(d)+a.Eps)
	}
	return rows, d, rstd
}

// rmsNormGradX: with x̂ = x·rstd and ĝ = g·w (g without w),
// dx = rstd·(ĝ − x̂·mean(ĝ·x̂)).
func rmsNormGradX(out, g, x Value, w *Value, a *graph.Attrs) {
	rows, d, rstd := rmsRows(x, a)
	gh := make([]float64, d)
	for r := range rows {
		dot := 0.0
		for j := range d {
			gh[j] = g.Data[r*d+j]
			if w != nil {
				gh[j] *= w.Data[j]
			}
			dot += gh[j] * x.Data[r*d+j] * rstd[r]
		}
		dot /= float64(d)
		for j := range d {
			out.Data[r*d+j] = rstd[r] * (gh[j] - x.Data[r*d+j]*rstd[r]*dot)
		}
	}
}

// optionalValue is &in[i], or nil past the inputs.
func optionalValue(in []Value, i int) *Value {
	if i < len(in) {
		return &in[i]
	}
	return nil
}
