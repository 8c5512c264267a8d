package cpu

import (
	"math"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
)

// Fused family: fused_pointwise, an interpreter over its expression
// (graph.Pointwise) that computes in float32 as the generated CUDA
// kernels do, one row (the iteration shape's last axis) at a time: each
// node's per-element values for the row, or its one per-row value.
// Reductions accumulate in float64, a column sum (PWOut.ColSum) over
// every row. No workspace (the row buffers are the
// kernel's own, as an unfolded convolution's are not: they are a few rows).
var fusedKernels = family{
	graph.OpFusedPointwise: {run: fusedPointwise},
}

func fusedPointwise(nd *graph.Node, in []*buf, out *buf, _ int) error {
	p := nd.Attrs.Pointwise
	if p == nil {
		return graph.Errorf(graph.ErrAttr, "fused_pointwise: no expression")
	}
	shapes := make([][]int, len(in))
	var s []int
	for i, b := range in {
		shapes[i] = b.shape
		var err error
		if s, err = graph.BroadcastShapes(s, b.shape); err != nil {
			return err
		}
	}
	row, err := p.Rows(graph.RowInputs(shapes, s))
	if err != nil {
		return err
	}
	c := 1
	if len(s) > 0 {
		c = s[len(s)-1]
	}
	numel := graph.Numel(s)
	if c == 0 || numel == 0 {
		clear(out.f) // a column sum over no rows
		return nil
	}
	rows := numel / c
	// idx[i][r·c + j] is input i's flat index at row r, column j.
	idx := make([][]int, len(in))
	for i, b := range in {
		if idx[i], err = broadcastIndex(b.shape, s); err != nil {
			return err
		}
	}
	o := p.Outs[nd.Attrs.Axis]
	want := numel
	switch {
	case o.ColSum:
		want = c
	case row[o.Node]:
		want = rows
	}
	if len(out.f) != want {
		return graph.Errorf(graph.ErrShape, "fused_pointwise: output of %d elements for %d rows of %v", len(out.f), rows, s)
	}
	var colSum []float64
	if o.ColSum {
		colSum = make([]float64, c)
	}
	vec := make([][]float32, len(p.Nodes))
	sc := make([]float32, len(p.Nodes))
	for k := range p.Nodes {
		if !row[k] {
			vec[k] = make([]float32, c)
		}
	}
	for r := range rows {
		for k, n := range p.Nodes {
			switch {
			case n.Op == graph.PWInput:
				ix, f := idx[n.In], in[n.In].f
				if row[k] {
					sc[k] = f[ix[r*c]]
					continue
				}
				for j := range c {
					vec[k][j] = f[ix[r*c+j]]
				}
			case n.Op == graph.PWConst:
				sc[k] = float32(n.Scalar)
			case n.Op.IsReduce():
				a := vec[n.A]
				if n.Op == graph.PWRowMax {
					m := a[0]
					for _, v := range a[1:] {
						m = max(m, v)
					}
					sc[k] = m
					continue
				}
				var sum float64
				for _, v := range a {
					sum += float64(v)
				}
				sc[k] = float32(sum * n.Scalar)
			case row[k]:
				sc[k] = pwApply(n, sc[n.A], sc[n.B])
			default:
				va, vb := vec[n.A], []float32(nil)
				if n.Op.Args() == 2 {
					vb = vec[n.B]
				}
				for j := range c {
					a, b := sc[n.A], float32(0)
					if va != nil {
						a = va[j]
					}
					if vb != nil {
						b = vb[j]
					} else if n.Op.Args() == 2 {
						b = sc[n.B]
					}
					vec[k][j] = pwApply(n, a, b)
				}
			}
		}
		switch {
		case o.ColSum:
			for j, v := range vec[o.Node] {
				colSum[j] += float64(v)
			}
		case row[o.Node]:
			out.f[r] = sc[o.Node]
		default:
			copy(out.f[r*c:(r+1)*c], vec[o.Node])
		}
	}
	for j, v := range colSum {
		out.f[j] = float32(v)
	}
	return nil
}

// pwApply is one expression node on float32 operands (b unused by ops of
// one argument), rounded to float32.
func pwApply(n graph.PWNode, a, b float32) float32 {
	x, y := float64(a), float64(b)
	switch n.Op {
	case graph.PWNeg:
		return -a
	case graph.PWExp:
		return float32(math.Exp(x))
	case graph.PWLog:
		return float32(math.Log(x))
	case graph.PWSqrt:
		return float32(math.Sqrt(x))
	case graph.PWRsqrt:
		return float32(1 / math.Sqrt(x))
	case graph.PWAbs:
		return float32(math.Abs(x))
	case graph.PWTanh:
		return float32(math.Tanh(x))
	case graph.PWSigmoid:
		return float32(sigmoid(x))
	case graph.PWRelu:
		if a > 0 {
			return a
		}
		return 0
	case graph.PWGelu:
		return float32(gelu(x))
	case graph.PWGeluTanh:
		return float32(geluTanh(x))
	case graph.PWSign:
		return float32(sign(x))
	case graph.PWSilu:
		return float32(x * sigmoid(x))
	case graph.PWCast:
		switch n.DType {
		case graph.BFloat16:
			return half.RoundBF16(a)
		case graph.Float16:
			return half.RoundF16(a)
		}
		return a
	case graph.PWExpand:
		return a
	case graph.PWAdd:
		return a + b
	case graph.PWSub:
		return a - b
	case graph.PWMul:
		return a * b
	case graph.PWDiv:
		return a / b
	case graph.PWPow:
		return float32(math.Pow(x, y))
	case graph.PWMax:
		return max(a, b)
	case graph.PWSiluGrad:
		s := sigmoid(y)
		return float32(x * s * (1 + y*(1-s)))
	case graph.PWGeluGrad:
		return float32(x * geluDeriv(y, false))
	case graph.PWGeluTanhGrad:
		return float32(x * geluDeriv(y, true))
	case graph.PWReluGrad:
		if b > 0 {
			return a
		}
		return 0
	}
	return float32(math.NaN())
}
