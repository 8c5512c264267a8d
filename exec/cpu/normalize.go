package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Normalisation family: softmax and log_softmax, layer_norm and
// batch_norm, and their gradients.
var normKernels = family{
	graph.OpSoftmax:    {run: softmax},
	graph.OpLogSoftmax: {run: softmax},
	graph.OpLayerNorm: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return layerNormKernel(&nd.Attrs, in[0], optional(in, 1), optional(in, 2), out)
	}},
	graph.OpBatchNorm:      {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return batchNormKernel(&nd.Attrs, in, out) }},
	graph.OpBatchNormStats: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error { return batchNormStatsKernel(in[0], out) }},

	graph.OpSoftmaxGrad:    {run: softmaxGradKernel},
	graph.OpLogSoftmaxGrad: {run: softmaxGradKernel},
	graph.OpLayerNormGradX: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		layerNormGradX(&nd.Attrs, in[0], in[1], optional(in, 2), nil, out)
		return nil
	}},
	graph.OpLayerNormGradXAdd: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		layerNormGradX(&nd.Attrs, in[0], in[1], optional(in, 3), in[2], out)
		return nil
	}},
	graph.OpLayerNormGradW: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		layerNormGradW(&nd.Attrs, in[0], in[1], out)
		return nil
	}},
	graph.OpRMSNorm: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return rmsNormKernel(&nd.Attrs, in[0], optional(in, 1), out)
	}},
	graph.OpRMSNormGradX: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return rmsNormGradX(&nd.Attrs, in[0], in[1], optional(in, 2), nil, out)
	}},
	graph.OpRMSNormGradXAdd: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return rmsNormGradX(&nd.Attrs, in[0], in[1], optional(in, 3), in[2], out)
	}},
	graph.OpRMSNormGradW: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return rmsNormGradW(&nd.Attrs, in[0], in[1], out)
	}},
	graph.OpBatchNormGradX: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return batchNormGradX(&nd.Attrs, in[0], in[1], optional(in, 2), out)
	}},
	graph.OpBatchNormGradW: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return batchNormGradW(&nd.Attrs, in, out) }},
}

func softmax(nd *graph.Node, in []*buf, out *buf, _ int) error {
	return softmaxKernel(nd.Op == graph.OpLogSoftmax, nd.Attrs.Axis, in[0], out)
}

func softmaxGradKernel(nd *graph.Node, in []*buf, out *buf, _ int) error {
	softmaxGrad(nd.Op == graph.OpLogSoftmaxGrad, nd.Attrs.Axis, in[0], in[1], out)
	return nil
}

// softmaxKernel computes softmax (or log_softmax when log is set) along axis,
// subtracting each line's max first so exp never overflows.
func softmaxKernel(log bool, axis int, x, out *buf) error {
	if axis < 0 || axis >= len(x.shape) {
		return graph.Errorf(graph.ErrAttr, "softmax axis %d out of range for rank %d", axis, len(x.shape))
	}
	if len(x.f) != len(out.f) {
		return graph.Errorf(graph.ErrShape, "softmax: input %v, output %v", x.shape, out.shape)
	}
	n := x.shape[axis]
	inner := graph.Numel(x.shape[axis+1:])
	if n == 0 || inner == 0 {
		return nil
	}
	if inner == 1 {
		for start := 0; start < len(x.f); start += n {
			softmaxRow(log, x.f[start:start+n], out.f[start:start+n])
		}
		return nil
	}
	// The axis is strided: handle a whole [n, inner] block at a time, walking
	// it row by row with one running max and sum per inner position.
	m := make([]float64, inner)
	s := make([]float64, inner)
	block := n * inner
	for start := 0; start < len(x.f); start += block {
		src, dst := x.f[start:start+block], out.f[start:start+block]
		for j := range m {
			m[j], s[j] = math.Inf(-1), 0
		}
		for k := 0; k < block; k += inner {
			for j, v := range src[k : k+inner] {
				m[j] = max(m[j], float64(v))
			}
		}
		// Softmax keeps exp(x − max) in dst for the final scaling, so exp
		// runs once per element.
		for k := 0; k < block; k += inner {
			d := dst[k : k+inner]
			for j, v := range src[k : k+inner] {
				e := math.Exp(float64(v) - m[j])
				s[j] += e
				d[j] = float32(e)
			}
		}
		if log {
			for j := range m {
				m[j] += math.Log(s[j]) // m becomes log-sum-exp
			}
			for k := 0; k < block; k += inner {
				d := dst[k : k+inner]
				for j, v := range src[k : k+inner] {
					d[j] = float32(float64(v) - m[j])
				}
			}
			continue
		}
		for j := range s {
			s[j] = 1 / s[j]
		}
		for k := 0; k < block; k += inner {
			d := dst[k : k+inner]
			for j, v := range d {
				d[j] = float32(float64(v) * s[j])
			}
		}
	}
	return nil
}

// softmaxRow handles one contiguous line.
func softmaxRow(log bool, src, dst []float32) {
	dst = dst[:len(src)]
	m := math.Inf(-1)
	for _, v := range src {
		m = max(m, float64(v))
	}
	var s float64
	if log {
		for _, v := range src {
			s += math.Exp(float64(v) - m)
		}
		lse := m + math.Log(s)
		for i, v := range src {
			dst[i] = float32(float64(v) - lse)
		}
		return
	}
	for i, v := range src {
		e := math.Exp(float64(v) - m)
		s += e
		dst[i] = float32(e)
	}
	inv := 1 / s
	for i, v := range dst {
		dst[i] = float32(float64(v) * inv)
	}
}

// layerNormKernel normalises each group of the trailing a.NormDims axes to
// zero mean and unit variance (biased variance, as PyTorch), then applies the
// optional weight and bias, which have the shape of those axes.
func layerNormKernel(a *graph.Attrs, x, w, b *buf, out *buf) error {
	k := a.NormDims
	if k < 1 || k > len(x.shape) {
		return graph.Errorf(graph.ErrAttr, "layer_norm over %d trailing dims of a rank-%d input", k, len(x.shape))
	}
	if len(x.f) != len(out.f) {
		return graph.Errorf(graph.ErrShape, "layer_norm: input %v, output %v", x.shape, out.shape)
	}
	inner := graph.Numel(x.shape[len(x.shape)-k:])
	for _, p := range []*buf{w, b} {
		if p != nil && len(p.f) != inner {
			return graph.Errorf(graph.ErrShape, "layer_norm parameter %v does not match normalised dims %v", p.shape, x.shape[len(x.shape)-k:])
		}
	}
	if inner == 0 {
		return nil
	}
	for start := 0; start < len(x.f); start += inner {
		src, dst := x.f[start:start+inner], out.f[start:start+inner]
		var sum float64
		for _, v := range src {
			sum += float64(v)
		}
		mean := sum / float64(inner)
		// Two passes: the variance of centred values does not cancel.
		var sq float64
		for _, v := range src {
			d := float64(v) - mean
			sq += d * d
		}
		rstd := 1 / math.Sqrt(sq/float64(inner)+a.Eps)
		for i, v := range src {
			y := (float64(v) - mean) * rstd
			if w != nil {
				y *= float64(w.f[i])
			}
			if b != nil {
				y += float64(b.f[i])
			}
			dst[i] = float32(y)
		}
	}
	return nil
}

// channelLayout views x [N, C, ...] as [n, c, inner] for batch_norm.
func channelLayout(x *buf) (n, c, inner int) {
	return x.shape[0], x.shape[1], graph.Numel(x.shape[2:])
}

// batchNormStats returns per-channel mean and 1/√(var + eps): the batch's
// (biased variance, two passes so centred values do not cancel) in training
// mode, else from the running statistics mean and variance.
func batchNormStats(a *graph.Attrs, x, runMean, runVar *buf) (mean, rstd []float64, err error) {
	if len(x.shape) < 2 {
		return nil, nil, graph.Errorf(graph.ErrShape, "batch_norm needs [N, C, ...], got %v", x.shape)
	}
	n, c, inner := channelLayout(x)
	mean, rstd = make([]float64, c), make([]float64, c)
	if !a.Training {
		if runMean == nil || runVar == nil || len(runMean.f) != c || len(runVar.f) != c {
			return nil, nil, graph.Errorf(graph.ErrShape, "batch_norm in evaluation mode needs running statistics of [%d]", c)
		}
		for k := range c {
			mean[k] = float64(runMean.f[k])
			rstd[k] = 1 / math.Sqrt(float64(runVar.f[k])+a.Eps)
		}
		return mean, rstd, nil
	}
	m := float64(n * inner)
	if m == 0 {
		return mean, rstd, nil
	}
	mean, sq := channelMoments(x)
	for k := range rstd {
		rstd[k] = 1 / math.Sqrt(sq[k]/m+a.Eps)
	}
	return mean, rstd, nil
}

// batchNormStatsKernel writes x's per-channel mean (row 0) and unbiased
// variance (row 1) into out [2, C], from the sums the training-mode
// statistics use.
func batchNormStatsKernel(x, out *buf) error {
	if len(x.shape) < 2 {
		return graph.Errorf(graph.ErrShape, "batch_norm_stats needs [N, C, ...], got %v", x.shape)
	}
	n, c, inner := channelLayout(x)
	if len(out.f) != 2*c {
		return graph.Errorf(graph.ErrShape, "batch_norm_stats: input %v, output %v", x.shape, out.shape)
	}
	m := n * inner
	if m <= 1 {
		return graph.Errorf(graph.ErrShape, "batch_norm_stats needs more than one value per channel, got x %v", x.shape)
	}
	mean, sq := channelMoments(x)
	for k := range c {
		out.f[k] = float32(mean[k])
		out.f[c+k] = float32(sq[k] / float64(m-1))
	}
	return nil
}

// channelMoments returns per channel of x [N, C, ...] the mean and the sum
// of squared deviations from it, in float64, in two passes so centred
// values do not cancel.
func channelMoments(x *buf) (mean, sq []float64) {
	n, c, inner := channelLayout(x)
	mean, sq = make([]float64, c), make([]float64, c)
	m := float64(n * inner)
	if m == 0 {
		return mean, sq
	}
	for i := range n {
		for k := range c {
			var s float64
			for _, v := range x.f[(i*c+k)*inner : (i*c+k+1)*inner] {
				s += float64(v)
			}
			mean[k] += s
		}
	}
	for k := range mean {
		mean[k] /= m
	}
	for i := range n {
		for k := range c {
			for _, v := range x.f[(i*c+k)*inner : (i*c+k+1)*inner] {
				d := float64(v) - mean[k]
				sq[k] += d * d
			}
		}
	}
	return mean, sq
}

// batchNormKernel is (x − mean)·rstd·w + b per channel; in lays out as
// graph.OpBatchNorm says for the mode.
func batchNormKernel(a *graph.Attrs, in []*buf, out *buf) error {
	x := in[0]
	aff := graph.BatchNormAffine(a.Training)
	var runMean, runVar *buf
	if !a.Training {
		runMean, runVar = optional(in, 1), optional(in, 2)
	}
	mean, rstd, err := batchNormStats(a, x, runMean, runVar)
	if err != nil {
		return err
	}
	w, b := optional(in, aff), optional(in, aff+1)
	n, c, inner := channelLayout(x)
	for _, p := range []*buf{w, b} {
		if p != nil && len(p.f) != c {
			return graph.Errorf(graph.ErrShape, "batch_norm parameter %v, want [%d]", p.shape, c)
		}
	}
	if len(out.f) != len(x.f) {
		return graph.Errorf(graph.ErrShape, "batch_norm: input %v, output %v", x.shape, out.shape)
	}
	for k := range c {
		// y = x·scale + shift per channel.
		scale := rstd[k]
		if w != nil {
			scale *= float64(w.f[k])
		}
		shift := -mean[k] * scale
		if b != nil {
			shift += float64(b.f[k])
		}
		for i := range n {
			off := (i*c + k) * inner
			dst := out.f[off : off+inner]
			for j, v := range x.f[off : off+inner] {
				dst[j] = float32(float64(v)*scale + shift)
			}
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
// dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)), plus res when non-nil.
func layerNormGradX(a *graph.Attrs, g, x, w, res, out *buf) {
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
			if res != nil { // layer_norm_grad_x_add: rounded, then added, as the add it replaces
				out.f[off+j] += res.f[off+j]
			}
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

// rmsGeometry views x as [rows, d] over its trailing a.NormDims axes and
// gives each row's 1/√(mean(x²) + eps), summed in float64.
func rmsGeometry(a *graph.Attrs, x *buf) (rows, d int, rstd []float64, err error) {
	k := a.NormDims
	if k < 1 || k > len(x.shape) {
		return 0, 0, nil, graph.Errorf(graph.ErrAttr, "rms_norm over %d trailing dims of a rank-%d input", k, len(x.shape))
	}
	d = graph.Numel(x.shape[len(x.shape)-k:])
	if d > 0 {
		rows = len(x.f) / d
	}
	rstd = make([]float64, rows)
	for r := range rows {
		var s float64
		for _, v := range x.f[r*d : (r+1)*d] {
			s += float64(v) * float64(v)
		}
		rstd[r] = 1 / math.Sqrt(s/float64(d)+a.Eps)
	}
	return rows, d, rstd, nil
}

// rmsNormKernel: y = x·rstd·w per row (w optional).
func rmsNormKernel(a *graph.Attrs, x, w, out *buf) error {
	rows, d, rstd, err := rmsGeometry(a, x)
	if err != nil {
		return err
	}
	if len(out.f) != len(x.f) || w != nil && len(w.f) != d {
		return graph.Errorf(graph.ErrShape, "rms_norm: x %v, output %v, weight of %d for rows of %d", x.shape, out.shape, wlen(w), d)
	}
	for r := range rows {
		off := r * d
		for j, v := range x.f[off : off+d] {
			y := float64(v) * rstd[r]
			if w != nil {
				y *= float64(w.f[j])
			}
			out.f[off+j] = float32(y)
		}
	}
	return nil
}

// rmsNormGradX: with x̂ = x·rstd and ĝ = g·w, dx = rstd·(ĝ − x̂·mean(ĝ·x̂)),
// plus res when non-nil (rms_norm_grad_x_add: rounded, then added, as the
// add it replaces).
func rmsNormGradX(a *graph.Attrs, g, x, w, res, out *buf) error {
	rows, d, rstd, err := rmsGeometry(a, x)
	if err != nil {
		return err
	}
	if len(g.f) != len(x.f) || len(out.f) != len(x.f) || w != nil && len(w.f) != d || res != nil && len(res.f) != len(x.f) {
		return graph.Errorf(graph.ErrShape, "rms_norm_grad_x: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	gh := make([]float64, d)
	for r := range rows {
		off := r * d
		var dot float64
		for j := range d {
			gh[j] = float64(g.f[off+j])
			if w != nil {
				gh[j] *= float64(w.f[j])
			}
			dot += gh[j] * float64(x.f[off+j]) * rstd[r]
		}
		dot /= float64(d)
		for j := range d {
			out.f[off+j] = float32(rstd[r] * (gh[j] - float64(x.f[off+j])*rstd[r]*dot))
			if res != nil {
				out.f[off+j] += res.f[off+j]
			}
		}
	}
	return nil
}

// rmsNormGradW: Σ over rows of g·x̂.
func rmsNormGradW(a *graph.Attrs, g, x, out *buf) error {
	rows, d, rstd, err := rmsGeometry(a, x)
	if err != nil {
		return err
	}
	if len(g.f) != len(x.f) || len(out.f) != d {
		return graph.Errorf(graph.ErrShape, "rms_norm_grad_w: g %v, x %v, output %v", g.shape, x.shape, out.shape)
	}
	acc := make([]float64, d)
	for r := range rows {
		off := r * d
		for j := range d {
			acc[j] += float64(g.f[off+j]) * float64(x.f[off+j]) * rstd[r]
		}
	}
	for j, v := range acc {
		out.f[j] = float32(v)
	}
	return nil
}

// wlen is an optional buffer's length, −1 without one.
func wlen(w *buf) int {
	if w == nil {
		return -1
	}
	return len(w.f)
}
