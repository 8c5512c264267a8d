package ref

import (
	"math"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
)

// Fused family: fused_pointwise evaluated node by node over whole values
// in float64: a per-element node is a value of the iteration shape S, a
// per-row node one of S with its last dimension 1, and a reduction sums
// (or takes the max of) each row; a column sum output (PWOut.ColSum) sums
// its node over the rows. A cast rounds through float32 to its
// dtype, as Eval rounds a stored 16-bit value.
var fusedKernels = family{
	graph.OpFusedPointwise: fusedPointwise,
}

func fusedPointwise(_ *graph.Node, a *graph.Attrs, in []Value, out Value) error {
	p := a.Pointwise
	var s []int
	shapes := make([][]int, len(in))
	for i, v := range in {
		shapes[i] = v.Shape
		var err error
		if s, err = graph.BroadcastShapes(s, v.Shape); err != nil {
			return err
		}
	}
	row, err := p.Rows(graph.RowInputs(shapes, s))
	if err != nil {
		return err
	}
	rs := append([]int(nil), s...) // the per-row shape
	if len(rs) > 0 {
		rs[len(rs)-1] = 1
	}
	vals := make([]Value, len(p.Nodes))
	shapeOf := func(k int) []int {
		if row[k] {
			return rs
		}
		return s
	}
	for k, n := range p.Nodes {
		v := Zeros(shapeOf(k)...)
		idx := make([]int, len(v.Shape))
		at := func(arg, i int) float64 { // arg's value at v's flat index i
			unravel(i, v.Shape, idx)
			return vals[arg].Data[broadcastPos(idx, vals[arg].Shape)]
		}
		switch {
		case n.Op == graph.PWInput:
			x := in[n.In]
			for i := range v.Data {
				unravel(i, v.Shape, idx)
				v.Data[i] = x.Data[broadcastPos(idx, x.Shape)]
			}
		case n.Op == graph.PWConst:
			for i := range v.Data {
				v.Data[i] = n.Scalar
			}
		case n.Op.IsReduce():
			x := vals[n.A]
			c := s[len(s)-1]
			for r := range v.Data {
				acc := 0.0
				if n.Op == graph.PWRowMax {
					acc = math.Inf(-1)
				}
				for j := range c {
					e := x.Data[r*c+j]
					if n.Op == graph.PWRowMax {
						acc = math.Max(acc, e)
					} else {
						acc += e
					}
				}
				if n.Op == graph.PWRowSum {
					acc *= n.Scalar
				}
				v.Data[r] = acc
			}
		default:
			for i := range v.Data {
				x := at(n.A, i)
				y := 0.0
				if n.Op.Args() == 2 {
					y = at(n.B, i)
				}
				v.Data[i] = pwOp(n, x, y)
			}
		}
		vals[k] = v
	}
	o := p.Outs[a.Axis]
	v := vals[o.Node]
	if !o.ColSum {
		copy(out.Data, v.Data)
		return nil
	}
	clear(out.Data)
	if c := s[len(s)-1]; c > 0 {
		for i, x := range v.Data {
			out.Data[i%c] += x
		}
	}
	return nil
}

// pwOp is one expression node in float64.
func pwOp(n graph.PWNode, x, y float64) float64 {
	switch n.Op {
	case graph.PWNeg:
		return -x
	case graph.PWExp, graph.PWLog, graph.PWSqrt, graph.PWAbs, graph.PWTanh, graph.PWSigmoid, graph.PWRelu, graph.PWSign, graph.PWSilu:
		return unary(map[graph.PWOp]graph.Op{graph.PWExp: graph.OpExp, graph.PWLog: graph.OpLog, graph.PWSqrt: graph.OpSqrt,
			graph.PWAbs: graph.OpAbs, graph.PWTanh: graph.OpTanh, graph.PWSigmoid: graph.OpSigmoid, graph.PWRelu: graph.OpRelu,
			graph.PWSign: graph.OpSign, graph.PWSilu: graph.OpSilu}[n.Op], false, x)
	case graph.PWRsqrt:
		return 1 / math.Sqrt(x)
	case graph.PWGelu:
		return gelu(x, false)
	case graph.PWGeluTanh:
		return gelu(x, true)
	case graph.PWCast:
		switch n.DType {
		case graph.BFloat16:
			return float64(half.RoundBF16(float32(x)))
		case graph.Float16:
			return float64(half.RoundF16(float32(x)))
		}
		return x
	case graph.PWExpand:
		return x
	case graph.PWAdd:
		return x + y
	case graph.PWSub:
		return x - y
	case graph.PWMul:
		return x * y
	case graph.PWDiv:
		return x / y
	case graph.PWPow:
		return math.Pow(x, y)
	case graph.PWMax:
		return math.Max(x, y)
	case graph.PWSiluGrad:
		s := 1 / (1 + math.Exp(-y))
		return x * (s + y*s*(1-s))
	case graph.PWGeluGrad:
		return x * geluDeriv(y, false)
	case graph.PWGeluTanhGrad:
		return x * geluDeriv(y, true)
	case graph.PWReluGrad:
		if y > 0 {
			return x
		}
		return 0
	}
	return math.NaN()
}
