package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// channelStats returns per channel (axis 1 of x) the mean and
// 1/√(variance + eps): in training mode the batch's, with the biased
// variance over every other axis; otherwise from the running mean and
// variance given. m is the number of values per channel.
func channelStats(x Value, training bool, running []Value, eps float64) (mean, rstd []float64, m int) {
	c := x.Shape[1]
	mean, rstd = make([]float64, c), make([]float64, c)
	if !training {
		for k := range c {
			mean[k] = running[0].Data[k]
			rstd[k] = 1 / math.Sqrt(running[1].Data[k]+eps)
		}
		return mean, rstd, len(x.Data) / max(c, 1)
	}
	count := make([]int, c)
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		mean[idx[1]] += v
		count[idx[1]]++
	}
	for k := range mean {
		mean[k] /= float64(count[k])
	}
	sq := make([]float64, c)
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		d := v - mean[idx[1]]
		sq[idx[1]] += d * d
	}
	for k := range rstd {
		rstd[k] = 1 / math.Sqrt(sq[k]/float64(count[k])+eps)
	}
	return mean, rstd, len(x.Data) / max(c, 1)
}

// batchNormStats writes x's per-channel mean and unbiased variance into
// out [2, C].
func batchNormStats(out, x Value) {
	c := x.Shape[1]
	mean, _, m := channelStats(x, true, nil, 0)
	sq := make([]float64, c)
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		d := v - mean[idx[1]]
		sq[idx[1]] += d * d
	}
	for k := range c {
		out.Data[k] = mean[k]
		out.Data[c+k] = sq[k] / float64(m-1)
	}
}

// batchNormParts splits batch_norm's inputs after x: the running statistics
// (evaluation mode) and the optional weight and bias.
func batchNormParts(in []Value, training bool) (running []Value, w, b *Value) {
	aff := graph.BatchNormAffine(training)
	running = in[1:min(aff, len(in))]
	if len(in) > aff {
		w = &in[aff]
	}
	if len(in) > aff+1 {
		b = &in[aff+1]
	}
	return running, w, b
}

// batchNorm is (x − mean)·rstd·w + b per channel.
func batchNorm(out Value, in []Value, a *graph.Attrs) {
	x := in[0]
	running, w, b := batchNormParts(in, a.Training)
	mean, rstd, _ := channelStats(x, a.Training, running, a.Eps)
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		k := idx[1]
		y := (v - mean[k]) * rstd[k]
		if w != nil {
			y *= w.Data[k]
		}
		if b != nil {
			y += b.Data[k]
		}
		out.Data[i] = y
	}
}

// batchNormGradX is the training-mode gradient of x: with ĝ = g·w and
// x̂ = (x − mean)·rstd, dx = rstd·(ĝ − Σĝ/M − x̂·Σ(ĝ·x̂)/M) per channel.
func batchNormGradX(out Value, in []Value, a *graph.Attrs) {
	g, x := in[0], in[1]
	mean, rstd, m := channelStats(x, true, nil, a.Eps)
	c := x.Shape[1]
	gh := make([]float64, len(g.Data))
	xh := make([]float64, len(x.Data))
	sg, sgx := make([]float64, c), make([]float64, c)
	idx := make([]int, len(x.Shape))
	for i := range x.Data {
		unravel(i, x.Shape, idx)
		k := idx[1]
		gh[i] = g.Data[i]
		if len(in) > 2 {
			gh[i] *= in[2].Data[k]
		}
		xh[i] = (x.Data[i] - mean[k]) * rstd[k]
		sg[k] += gh[i]
		sgx[k] += gh[i] * xh[i]
	}
	for i := range x.Data {
		unravel(i, x.Shape, idx)
		k := idx[1]
		out.Data[i] = rstd[k] * (gh[i] - sg[k]/float64(m) - xh[i]*sgx[k]/float64(m))
	}
}

// batchNormGradW is Σ g·x̂ per channel, x̂ normalised as the forward op did.
func batchNormGradW(out Value, in []Value, a *graph.Attrs) {
	g, x := in[0], in[1]
	mean, rstd, _ := channelStats(x, a.Training, in[2:], a.Eps)
	idx := make([]int, len(x.Shape))
	for i, v := range x.Data {
		unravel(i, x.Shape, idx)
		k := idx[1]
		out.Data[k] += g.Data[i] * (v - mean[k]) * rstd[k]
	}
}
