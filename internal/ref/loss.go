package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Loss family: cross_entropy and mse, and their gradients.
var lossKernels = family{
	graph.OpCrossEntropy: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		return crossEntropy(out, in[0], in[1], a)
	},
	graph.OpMSE: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		mse(out, in[0], in[1], a.Scalar)
		return nil
	},
	graph.OpCrossEntropyGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		return crossEntropyGrad(out, in[0], in[1], in[2], a)
	},
	graph.OpMSEGrad: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		mseGrad(out, in[0], in[1], in[2], a.Scalar)
		return nil
	},
}

// crossEntropy is Scalar·Σ_rows −log_softmax(logits[row, :classes])[label],
// classes = End (all columns when 0), over the rows not labelled
// graph.IgnoreLabel.
func crossEntropy(out, logits, labels Value, a *graph.Attrs) error {
	n, ld := logits.Shape[0], logits.Shape[1]
	c := graph.CrossEntropyClasses(a, ld)
	total := 0.0
	for r := range n {
		if labels.Data[r] == graph.IgnoreLabel {
			continue
		}
		k, err := index(labels.Data[r], c, "cross_entropy label")
		if err != nil {
			return err
		}
		row := logits.Data[r*ld : r*ld+c]
		total += logSumExp(row) - row[k]
	}
	out.Data[0] = a.Scalar * total
	return nil
}

// crossEntropyGrad is g·Scalar·(softmax(logits[:, :classes]) −
// onehot(labels)), and 0 in the columns past classes.
func crossEntropyGrad(out, g, logits, labels Value, a *graph.Attrs) error {
	n, ld := logits.Shape[0], logits.Shape[1]
	c := graph.CrossEntropyClasses(a, ld)
	for r := range n {
		if labels.Data[r] == graph.IgnoreLabel { // out is zeroed
			continue
		}
		k, err := index(labels.Data[r], c, "cross_entropy label")
		if err != nil {
			return err
		}
		row := logits.Data[r*ld : r*ld+c]
		lse := logSumExp(row)
		for j := range ld {
			p := 0.0
			if j < c {
				p = math.Exp(row[j] - lse)
			}
			if j == k {
				p--
			}
			out.Data[r*ld+j] = g.Data[0] * a.Scalar * p
		}
	}
	return nil
}

// logSumExp is log Σ exp(x), shifted by max(x) for stability.
func logSumExp(x []float64) float64 {
	m := math.Inf(-1)
	for _, v := range x {
		m = math.Max(m, v)
	}
	s := 0.0
	for _, v := range x {
		s += math.Exp(v - m)
	}
	return m + math.Log(s)
}

// mse is Scalar·Σ(p − t)².
func mse(out, p, t Value, scale float64) {
	s := 0.0
	for i := range p.Data {
		d := p.Data[i] - t.Data[i]
		s += d * d
	}
	out.Data[0] = scale * s
}

// mseGrad is g·Scalar·2(p − t).
func mseGrad(out, g, p, t Value, scale float64) {
	for i := range p.Data {
		out.Data[i] = g.Data[0] * scale * 2 * (p.Data[i] - t.Data[i])
	}
}
