package cpu

import (
	"math"

	"gonum.org/v1/gonum/blas"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Fused head and loss: linear_cross_entropy and its gradients, each over
// chunks of graph.LossChunkRows tokens, one logits chunk at a time (the
// workspace: its [T, V] values, in the dtype of h and W as the planner
// counts them; the kernel holds them in float32). Each node runs on its
// own (the CPU computes no companions): the gradients recompute the
// chunks' logits.
var linearCrossEntropyKernels = family{
	graph.OpLinearCrossEntropy: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return lceKernel(&nd.Attrs, in[0], in[1], in[2], optional(in, 3), 0, out, nil, nil)
	}, ws: exec.LossChunkWorkspace},
	graph.OpLinearCrossEntropyGradH: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return lceKernel(&nd.Attrs, in[1], in[2], in[3], optional(in, 4), float64(in[0].f[0]), nil, out, nil)
	}, ws: exec.LossChunkWorkspace},
	graph.OpLinearCrossEntropyGradW: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return lceKernel(&nd.Attrs, in[1], in[2], in[3], optional(in, 4), float64(in[0].f[0]), nil, nil, out)
	}, ws: exec.LossChunkWorkspace},
}

// lceKernel runs the chunks of linear_cross_entropy over h [N, C], W
// [V, C] and labels [N] (scale, when not nil, multiplies everything):
// with loss set, the loss into it; with dh or dw set, that gradient for
// upstream gradient g. Logits and their gradient are rounded to the
// node's 16-bit dtype where it has one, as a 16-bit linear's logits and
// cross_entropy_grad's gradient are; row sums are float64.
func lceKernel(a *graph.Attrs, h, w, labels, scale *buf, g float64, loss, dh, dw *buf) error {
	if len(h.shape) != 2 || len(w.shape) != 2 || labels.i == nil || len(labels.i) != h.shape[0] || h.shape[1] != w.shape[1] {
		return graph.Errorf(graph.ErrShape, "linear_cross_entropy needs h [N, C], W [V, C] and int64 labels [N], got %v, %v and %v",
			h.shape, w.shape, labels.shape)
	}
	n, c, v := h.shape[0], h.shape[1], w.shape[0]
	classes := graph.CrossEntropyClasses(a, v)
	dt := graph.LossChunkDType(a)
	sc := 1.0
	if scale != nil {
		sc = float64(scale.f[0])
	}
	s := g * a.Scalar * sc
	grads := dh != nil || dw != nil
	if dw != nil {
		clear(dw.f)
	}
	t := graph.LossChunkRows(a, n)
	var chunk []float32
	if t > 0 {
		chunk = make([]float32, t*v)
	}
	total := 0.0
	for t0 := 0; t0 < n; t0 += t {
		rows := min(t, n-t0)
		l := chunk[:rows*v]
		hc := h.f[t0*c : (t0+rows)*c]
		gemm(blas.NoTrans, blas.Trans, rows, v, c, hc, c, w.f, c, 0, l, v)
		exec.Round(dt, l)
		for r := range rows {
			row := l[r*v : (r+1)*v]
			k := labels.i[t0+r]
			if k == graph.IgnoreLabel {
				clear(row)
				continue
			}
			if k < 0 || k >= int64(classes) {
				return exec.BadValue("linear_cross_entropy", "label", 2, labels.shape, t0+r, k, classes)
			}
			m := math.Inf(-1)
			for _, x := range row[:classes] {
				m = max(m, float64(x))
			}
			z := 0.0
			for _, x := range row[:classes] {
				z += math.Exp(float64(x) - m)
			}
			lse := m + math.Log(z)
			total += lse - float64(row[k])
			if !grads {
				continue
			}
			for j, x := range row[:classes] {
				p := math.Exp(float64(x) - lse)
				if j == int(k) {
					p--
				}
				row[j] = float32(s * p)
			}
			clear(row[classes:])
		}
		if !grads {
			continue
		}
		exec.Round(dt, l)
		if dh != nil {
			gemm(blas.NoTrans, blas.NoTrans, rows, c, v, l, v, w.f, c, 0, dh.f[t0*c:(t0+rows)*c], c)
		}
		if dw != nil {
			gemm(blas.Trans, blas.NoTrans, v, c, rows, l, v, hc, c, 1, dw.f, c)
		}
	}
	if loss != nil {
		loss.f[0] = float32(total * a.Scalar * sc)
	}
	return nil
}
