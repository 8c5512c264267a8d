package cpu

import (
	"math"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Loss family: cross_entropy and mse, and their gradients.
var lossKernels = family{
	graph.OpCrossEntropy: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return crossEntropyKernel(&nd.Attrs, in[0], in[1], out)
	}},
	graph.OpMSE: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error { return mseKernel(&nd.Attrs, in[0], in[1], out) }},
	graph.OpCrossEntropyGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return crossEntropyGrad(&nd.Attrs, in[0], in[1], in[2], out)
	}},
	graph.OpMSEGrad: {run: mseGrad},
}

// mseGrad is g·Scalar·2·(pred − target).
func mseGrad(nd *graph.Node, in []*buf, out *buf, _ int) error {
	g := in[0]
	s := 2 * nd.Attrs.Scalar * float64(g.f[0])
	for i, p := range in[1].f {
		out.f[i] = float32(s * float64(p-in[2].f[i]))
	}
	return nil
}

// crossEntropyKernel sums −log_softmax(logits)[n, labels[n]] over the rows
// (but those labelled graph.IgnoreLabel) and multiplies by a.Scalar: 1/N of the full batch for a mean (fixed when the
// graph was built, so chunk results add up), 1 for a sum. A row's classes
// are its first a.End columns (all when 0): a row of logits is ld long.
func crossEntropyKernel(a *graph.Attrs, logits, labels, out *buf) error {
	if len(logits.shape) != 2 || labels.i == nil || len(labels.i) != logits.shape[0] || len(out.f) != 1 {
		return graph.Errorf(graph.ErrShape, "cross_entropy needs logits [N, C], int64 labels [N] and a scalar output, got %v, %v, %v", logits.shape, labels.shape, out.shape)
	}
	ld := logits.shape[1]
	c := graph.CrossEntropyClasses(a, ld)
	var total float64
	for n, label := range labels.i {
		if label == graph.IgnoreLabel {
			continue
		}
		if label < 0 || label >= int64(c) {
			return exec.BadValue("cross_entropy", "label", 1, labels.shape, n, label, c)
		}
		row := logits.f[n*ld : n*ld+c]
		m := math.Inf(-1)
		for _, v := range row {
			m = max(m, float64(v))
		}
		var s float64
		for _, v := range row {
			s += math.Exp(float64(v) - m)
		}
		total += m + math.Log(s) - float64(row[label])
	}
	out.f[0] = float32(total * a.Scalar)
	return nil
}

// mseKernel sums squared differences and multiplies by a.Scalar (1/count
// fixed at build time for a mean, 1 for a sum).
func mseKernel(a *graph.Attrs, pred, target, out *buf) error {
	if len(pred.f) != len(target.f) || len(out.f) != 1 {
		return graph.Errorf(graph.ErrShape, "mse of %v and %v into %v", pred.shape, target.shape, out.shape)
	}
	t := target.f[:len(pred.f)]
	var total float64
	for i, p := range pred.f {
		d := float64(p) - float64(t[i])
		total += d * d
	}
	out.f[0] = float32(total * a.Scalar)
	return nil
}

// crossEntropyGrad: g·Scalar·(softmax(logits) − onehot(label)) over a
// row's first a.End columns (all when 0), exactly 0 past them.
func crossEntropyGrad(a *graph.Attrs, g, logits, labels, out *buf) error {
	n, ld := logits.shape[0], logits.shape[1]
	c := graph.CrossEntropyClasses(a, ld)
	s := a.Scalar * float64(g.f[0])
	for r := range n {
		k := labels.i[r]
		if k == graph.IgnoreLabel {
			clear(out.f[r*ld : (r+1)*ld])
			continue
		}
		if k < 0 || int(k) >= c {
			return exec.BadValue("cross_entropy", "label", 2, labels.shape, r, k, c)
		}
		row := logits.f[r*ld : r*ld+c]
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
			out.f[r*ld+j] = float32(s * p)
		}
		clear(out.f[r*ld+c : (r+1)*ld])
	}
	return nil
}
