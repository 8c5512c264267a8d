package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// gradKernel runs the vector-Jacobian ops that autodiff appends. in[0] is
// always the upstream gradient g.
func gradKernel(nd *graph.Node, in []*buf, out *buf) error {
	a := &nd.Attrs
	g := in[0]
	switch nd.Op {
	case graph.OpReluGrad:
		for i, y := range in[1].f {
			out.f[i] = 0
			if y > 0 {
				out.f[i] = g.f[i]
			}
		}
	case graph.OpGeluGrad:
		for i, x := range in[1].f {
			out.f[i] = g.f[i] * float32(geluDeriv(float64(x), a.Approx))
		}
	case graph.OpMaximumScalarGrad:
		s := float32(a.Scalar)
		for i, x := range in[1].f {
			out.f[i] = maximumShare(x, s) * g.f[i]
		}
	case graph.OpMaximumGrad:
		x0, err := broadcastIndex(in[1].shape, out.shape)
		if err != nil {
			return err
		}
		x1, err := broadcastIndex(in[2].shape, out.shape)
		if err != nil {
			return err
		}
		for i := range out.f {
			p, q := in[1].f[x0[i]], in[2].f[x1[i]]
			if a.Axis == 1 {
				p, q = q, p
			}
			out.f[i] = maximumShare(p, q) * g.f[i]
		}
	case graph.OpExpand:
		idx, err := broadcastIndex(g.shape, out.shape)
		if err != nil {
			return err
		}
		for i, j := range idx {
			out.f[i] = g.f[j]
		}
	case graph.OpMaxGrad:
		return maxGrad(a, g, in[1], in[2], out)
	case graph.OpSoftmaxGrad, graph.OpLogSoftmaxGrad:
		softmaxGrad(nd.Op == graph.OpLogSoftmaxGrad, a.Axis, g, in[1], out)
	case graph.OpLayerNormGradX:
		layerNormGradX(a, g, in[1], optional(in, 2), out)
	case graph.OpLayerNormGradW:
		layerNormGradW(a, g, in[1], out)
	case graph.OpBatchNormGradX:
		return batchNormGradX(a, g, in[1], optional(in, 2), out)
	case graph.OpBatchNormGradW:
		return batchNormGradW(a, in, out)
	case graph.OpSliceGrad:
		sliceGrad(a, g, out)
	case graph.OpEmbeddingGrad:
		return embeddingGrad(g, in[1], out)
	case graph.OpConv2dGradInput:
		return conv2dGradInputKernel(a, g, in[1], out)
	case graph.OpConv2dGradWeight:
		return conv2dGradWeightKernel(a, g, in[1], out)
	case graph.OpMaxPool2dGrad:
		maxPool2dGrad(a, g, in[1], out)
	case graph.OpAvgPool2dGrad:
		avgPool2dGrad(a, g, out)
	case graph.OpCrossEntropyGrad:
		return crossEntropyGrad(a, g, in[1], in[2], out)
	case graph.OpMSEGrad:
		s := 2 * a.Scalar * float64(g.f[0])
		for i, p := range in[1].f {
			out.f[i] = float32(s * float64(p-in[2].f[i]))
		}
	default:
		return graph.Errorf(graph.ErrAttr, "cpu executor has no kernel for gradient op %s", nd.Op)
	}
	return nil
}

// maximumShare is ∂max(p, q)/∂p: 1 where p wins, ½ on ties (as PyTorch).
func maximumShare(p, q float32) float32 {
	switch {
	case p > q:
		return 1
	case p == q:
		return 0.5
	}
	return 0
}

// geluDeriv is d/dx of gelu(x), exact (erf) or tanh-approximated.
func geluDeriv(x float64, approx bool) float64 {
	if approx {
		const k, c = 0.7978845608028654, 0.044715 // √(2/π)
		t := math.Tanh(k * (x + c*x*x*x))
		return 0.5*(1+t) + 0.5*x*(1-t*t)*k*(1+3*c*x*x)
	}
	cdf := 0.5 * (1 + math.Erf(x/math.Sqrt2))
	pdf := math.Exp(-0.5*x*x) / math.Sqrt(2*math.Pi)
	return cdf + x*pdf
}

// broadcastIndex maps each flat index of outShape to the flat index of an
// operand of shape s broadcast to it (NumPy rules, s no longer than outShape).
func broadcastIndex(s, outShape []int) ([]int, error) {
	strides, err := graph.BroadcastStrides(s, outShape)
	if err != nil {
		return nil, err
	}
	r := len(outShape)
	idx := make([]int, graph.Numel(outShape))
	pos := make([]int, r)
	off := 0
	for i := range idx {
		idx[i] = off
		for d := r - 1; d >= 0; d-- { // odometer increment
			pos[d]++
			off += strides[d]
			if pos[d] < outShape[d] {
				break
			}
			off -= strides[d] * pos[d]
			pos[d] = 0
		}
	}
	return idx, nil
}

// keepDimShape is x's shape with the reduced axes set to 1.
func keepDimShape(x []int, axes []int) []int {
	s := append([]int(nil), x...)
	for _, a := range axes {
		s[a] = 1
	}
	return s
}

// maxGrad shares each reduced gradient evenly among the tied maxima.
func maxGrad(a *graph.Attrs, g, x, y, out *buf) error {
	// y's flat order is the keepdim order whether or not dims were kept.
	idx, err := broadcastIndex(keepDimShape(x.shape, a.Axes), x.shape)
	if err != nil {
		return err
	}
	count := make([]float32, len(y.f))
	for i, j := range idx {
		if x.f[i] == y.f[j] {
			count[j]++
		}
	}
	for i, j := range idx {
		out.f[i] = 0
		if x.f[i] == y.f[j] {
			out.f[i] = g.f[j] / count[j]
		}
	}
	return nil
}

// axisSplit views shape as [outer, n, inner] around axis.
func axisSplit(shape []int, axis int) (outer, n, inner int) {
	return graph.Numel(shape[:axis]), shape[axis], graph.Numel(shape[axis+1:])
}

// softmaxGrad: y·(g − Σ g·y) for softmax; g − exp(y)·Σ g for log_softmax.
func softmaxGrad(logForm bool, axis int, g, y, out *buf) {
	outer, n, inner := axisSplit(y.shape, axis)
	for o := range outer {
		for in := range inner {
			base := o*n*inner + in
			var dot float64
			for k := range n {
				i := base + k*inner
				if logForm {
					dot += float64(g.f[i])
				} else {
					dot += float64(g.f[i]) * float64(y.f[i])
				}
			}
			for k := range n {
				i := base + k*inner
				if logForm {
					out.f[i] = float32(float64(g.f[i]) - math.Exp(float64(y.f[i]))*dot)
				} else {
					out.f[i] = float32(float64(y.f[i]) * (float64(g.f[i]) - dot))
				}
			}
		}
	}
}

// normRows splits x into rows of the normalised size and returns per-row
// mean and 1/σ (biased variance, as PyTorch).
func normRows(a *graph.Attrs, x *buf) (rows, d int, mean, rstd []float64) {
	d = graph.Numel(x.shape[len(x.shape)-a.NormDims:])
	if d > 0 {
		rows = len(x.f) / d
	}
	mean, rstd = make([]float64, rows), make([]float64, rows)
	for r := range rows {
		row := x.f[r*d : (r+1)*d]
		var s, ss float64
		for _, v := range row {
			s += float64(v)
		}
		m := s / float64(d)
		for _, v := range row {
			ss += (float64(v) - m) * (float64(v) - m)
		}
		mean[r], rstd[r] = m, 1/math.Sqrt(ss/float64(d)+a.Eps)
	}
	return rows, d, mean, rstd
}

// layerNormGradX: with x̂ = (x−μ)·rstd and ĝ = g·w,
// dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)).
func layerNormGradX(a *graph.Attrs, g, x, w, out *buf) {
	rows, d, mean, rstd := normRows(a, x)
	gh := make([]float64, d)
	for r := range rows {
		off := r * d
		var sg, sgx float64
		for j := range d {
			gh[j] = float64(g.f[off+j])
			if w != nil {
				gh[j] *= float64(w.f[j])
			}
			xh := (float64(x.f[off+j]) - mean[r]) * rstd[r]
			sg += gh[j]
			sgx += gh[j] * xh
		}
		sg /= float64(d)
		sgx /= float64(d)
		for j := range d {
			xh := (float64(x.f[off+j]) - mean[r]) * rstd[r]
			out.f[off+j] = float32(rstd[r] * (gh[j] - sg - xh*sgx))
		}
	}
}

// layerNormGradW: Σ over rows of g·x̂.
func layerNormGradW(a *graph.Attrs, g, x, out *buf) {
	rows, d, mean, rstd := normRows(a, x)
	acc := make([]float64, d)
	for r := range rows {
		off := r * d
		for j := range d {
			acc[j] += float64(g.f[off+j]) * (float64(x.f[off+j]) - mean[r]) * rstd[r]
		}
	}
	for j, v := range acc {
		out.f[j] = float32(v)
	}
}

// sliceGrad scatters g into zeros at the sliced positions.
func sliceGrad(a *graph.Attrs, g, out *buf) {
	clear(out.f)
	outer, n, inner := axisSplit(out.shape, a.Axis)
	m := g.shape[a.Axis]
	for o := range outer {
		for k := range m {
			src := (o*m + k) * inner
			dst := (o*n + a.Start + k*a.Step) * inner
			copy(out.f[dst:dst+inner], g.f[src:src+inner])
		}
	}
}

// embeddingGrad scatter-adds rows of g into the weight's gradient.
func embeddingGrad(g, idx, out *buf) error {
	v, d := out.shape[0], out.shape[1]
	clear(out.f)
	for i, k := range idx.i {
		if k < 0 || int(k) >= v {
			return graph.Errorf(graph.ErrAttr, "embedding index %d at position %d outside [0, %d)", k, i, v)
		}
		row := out.f[int(k)*d : (int(k)+1)*d]
		for j := range row {
			row[j] += g.f[i*d+j]
		}
	}
	return nil
}

// poolWindows calls visit(n·c plane, output index, input index) for every
// in-bounds input position of every window, windows in row-major order and
// positions row-major within each window.
func poolWindows(a *graph.Attrs, in, out []int, visit func(plane, o, i int)) {
	h, w, ho, wo := in[2], in[3], out[2], out[3]
	for p := range in[0] * in[1] {
		for oy := range ho {
			for ox := range wo {
				o := (p*ho+oy)*wo + ox
				for ky := range a.Kernel[0] {
					iy := oy*a.Stride[0] - a.Padding[0] + ky*a.Dilation[0]
					if iy < 0 || iy >= h {
						continue
					}
					for kx := range a.Kernel[1] {
						ix := ox*a.Stride[1] - a.Padding[1] + kx*a.Dilation[1]
						if ix < 0 || ix >= w {
							continue
						}
						visit(p, o, (p*h+iy)*w+ix)
					}
				}
			}
		}
	}
}

// maxPool2dGrad routes each window's gradient to its first maximum.
func maxPool2dGrad(a *graph.Attrs, g, x, out *buf) {
	clear(out.f)
	best := make([]int, len(g.f))
	for i := range best {
		best[i] = -1
	}
	poolWindows(a, x.shape, g.shape, func(_, o, i int) {
		if best[o] < 0 || x.f[i] > x.f[best[o]] {
			best[o] = i
		}
	})
	for o, i := range best {
		if i >= 0 {
			out.f[i] += g.f[o]
		}
	}
}

// avgPool2dGrad spreads each window's gradient over its kh·kw positions
// (padding included in the divisor, as in the forward op).
func avgPool2dGrad(a *graph.Attrs, g, out *buf) {
	clear(out.f)
	inv := 1 / float32(a.Kernel[0]*a.Kernel[1])
	poolWindows(a, out.shape, g.shape, func(_, o, i int) {
		out.f[i] += g.f[o] * inv
	})
}

// crossEntropyGrad: g·Scalar·(softmax(logits) − onehot(label)).
func crossEntropyGrad(a *graph.Attrs, g, logits, labels, out *buf) error {
	n, c := logits.shape[0], logits.shape[1]
	s := a.Scalar * float64(g.f[0])
	for r := range n {
		k := labels.i[r]
		if k < 0 || int(k) >= c {
			return graph.Errorf(graph.ErrAttr, "cross_entropy label %d at row %d outside [0, %d)", k, r, c)
		}
		row := logits.f[r*c : (r+1)*c]
		m := math.Inf(-1)
		for _, v := range row {
			m = math.Max(m, float64(v))
		}
		var z float64
		for _, v := range row {
			z += math.Exp(float64(v) - m)
		}
		for j, v := range row {
			p := math.Exp(float64(v)-m) / z
			if j == int(k) {
				p--
			}
			out.f[r*c+j] = float32(s * p)
		}
	}
	return nil
}

// batchNormGradX is the training-mode gradient of batch_norm's input: with
// ĝ = g·w, x̂ = (x − mean)·rstd and M values per channel,
// dx = rstd·(ĝ − Σĝ/M − x̂·Σ(ĝ·x̂)/M).
func batchNormGradX(a *graph.Attrs, g, x, w, out *buf) error {
	mean, rstd, err := batchNormStats(a, x, nil, nil)
	if err != nil {
		return err
	}
	n, c, inner := channelLayout(x)
	if len(g.f) != len(x.f) || len(out.f) != len(x.f) || w != nil && len(w.f) != c {
		return graph.Errorf(graph.ErrShape, "batch_norm_grad_x: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	m := float64(n * inner)
	for k := range c {
		wk := 1.0
		if w != nil {
			wk = float64(w.f[k])
		}
		var sg, sgx float64
		for i := range n {
			off := (i*c + k) * inner
			for j, v := range x.f[off : off+inner] {
				gh := float64(g.f[off+j]) * wk
				sg += gh
				sgx += gh * (float64(v) - mean[k]) * rstd[k]
			}
		}
		sg /= m
		sgx /= m
		for i := range n {
			off := (i*c + k) * inner
			for j, v := range x.f[off : off+inner] {
				xh := (float64(v) - mean[k]) * rstd[k]
				out.f[off+j] = float32(rstd[k] * (float64(g.f[off+j])*wk - sg - xh*sgx))
			}
		}
	}
	return nil
}

// batchNormGradW is Σ g·x̂ per channel, x̂ normalised as the forward op did.
func batchNormGradW(a *graph.Attrs, in []*buf, out *buf) error {
	g, x := in[0], in[1]
	mean, rstd, err := batchNormStats(a, x, optional(in, 2), optional(in, 3))
	if err != nil {
		return err
	}
	n, c, inner := channelLayout(x)
	if len(g.f) != len(x.f) || len(out.f) != c {
		return graph.Errorf(graph.ErrShape, "batch_norm_grad_w: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	for k := range c {
		var s float64
		for i := range n {
			off := (i*c + k) * inner
			for j, v := range x.f[off : off+inner] {
				s += float64(g.f[off+j]) * (float64(v) - mean[k])
			}
		}
		out.f[k] = float32(s * rstd[k])
	}
	return nil
}
