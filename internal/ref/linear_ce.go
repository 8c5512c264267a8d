package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
)

// Fused head and loss: linear_cross_entropy and its gradients, computed
// as written (the whole [N, V] logits in float64, no chunks), the
// independent reference for the executors' chunked kernels. Where the op's
// dtype (graph.LossChunkDType) is 16-bit, the logits and their gradient
// round to it, as the values of the linear and cross_entropy_grad nodes
// the op stands for do (roundTo).
var linearCrossEntropyKernels = family{
	graph.OpLinearCrossEntropy: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		l, err := lceRows(in[0], in[1], in[2], a, nil)
		if err != nil {
			return err
		}
		out.Data[0] = l * a.Scalar * lceScale(in, 3)
		return nil
	},
	graph.OpLinearCrossEntropyGradH: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		return lceGrad(out, Value{}, in, a)
	},
	graph.OpLinearCrossEntropyGradW: func(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
		return lceGrad(Value{}, out, in, a)
	},
}

func lceScale(in []Value, i int) float64 {
	if i < len(in) {
		return in[i].Data[0]
	}
	return 1
}

// lceRows is Σ over rows not labelled graph.IgnoreLabel of
// logsumexp(l) − l[label], l = h·Wᵀ over W's first classes rows; with
// each set, each(r, k, p) gets row r's label k and softmax p.
func lceRows(h, w, labels Value, a *graph.Attrs, each func(r, k int, p []float64)) (float64, error) {
	n, c, v := h.Shape[0], h.Shape[1], w.Shape[0]
	classes := graph.CrossEntropyClasses(a, v)
	total := 0.0
	l := make([]float64, classes)
	for r := range n {
		if labels.Data[r] == graph.IgnoreLabel {
			continue
		}
		k, err := index(labels.Data[r], classes, "linear_cross_entropy label")
		if err != nil {
			return 0, err
		}
		hr := h.Data[r*c : (r+1)*c]
		for j := range classes {
			s := 0.0
			for i, x := range hr {
				s += x * w.Data[j*c+i]
			}
			l[j] = roundOne(graph.LossChunkDType(a), s)
		}
		lse := logSumExp(l)
		total += lse - l[k]
		if each != nil {
			for j := range l {
				l[j] = math.Exp(l[j] - lse)
			}
			each(r, k, l)
		}
	}
	return total, nil
}

// lceGrad: with s = g·Scalar·scale and d = s·(softmax − onehot) per
// counted row, dh = d·W (when dh has data) and dW = dᵀ·h (when dW has
// data); ignored rows and W's rows past the classes get 0.
func lceGrad(dh, dw Value, in []Value, a *graph.Attrs) error {
	g, h, w, labels := in[0], in[1], in[2], in[3]
	s := g.Data[0] * a.Scalar * lceScale(in, 4)
	c := h.Shape[1]
	_, err := lceRows(h, w, labels, a, func(r, k int, p []float64) {
		p[k]--
		for j, pj := range p {
			d := roundOne(graph.LossChunkDType(a), s*pj)
			for i := range c {
				if dh.Data != nil {
					dh.Data[r*c+i] += d * w.Data[j*c+i]
				}
				if dw.Data != nil {
					dw.Data[j*c+i] += d * h.Data[r*c+i]
				}
			}
		}
	})
	return err
}

// roundOne rounds x through float32 to dt where dt is 16-bit.
func roundOne(dt graph.DType, x float64) float64 {
	switch dt {
	case graph.BFloat16:
		return float64(half.RoundBF16(float32(x)))
	case graph.Float16:
		return float64(half.RoundF16(float32(x)))
	}
	return x
}
