package ref

import (
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/shapeinfer"
)

// PointwiseCase is a random fused_pointwise graph (RandomPointwise): its
// sources, one fused node for each output of one expression, and data for
// every source.
type PointwiseCase struct {
	Graph *graph.Graph
	Vals  map[int]Value // data of every source
	Outs  []int         // the fused nodes
	Expr  *graph.Pointwise
	Shape []int // the iteration shape
	// Half: a 16-bit dtype appears (an input, a cast or an output), so
	// results differ from the reference where float32 and float64 round to
	// two sides of a 16-bit boundary.
	Half bool
	// ColScale[k], for a column sum output k, is Σ |term| over the rows of
	// each column (float64): the scale of that sum's rounding errors, which
	// cancellation does not shrink as it shrinks the sum.
	ColScale [][]float64
}

func (c *PointwiseCase) String() string {
	return fmt.Sprintf("shape %v: %s", c.Shape, c.Expr.Text())
}

// RandomPointwise draws an expression DAG and the graph around it: an
// iteration shape of rank 1 to 4 (a long last axis at times, for several
// warps and 16-byte vectors, and odd sizes for their tails), 1 to 4
// inputs of float32, bfloat16 or float16 with some dimensions broadcast
// (size 1, or dropped from the front), 3 to 16 ops of every kind (logs,
// roots, quotients and powers of positive values only), up to two row
// reductions (needing a rank of at least 2, the batch axis first), and 1
// to 3 outputs stored as float32, bfloat16 or float16, a per-element one
// summed over the rows at times (PWOut.ColSum, at rank 2 or more).
func RandomPointwise(rng *rand.Rand) (*PointwiseCase, error) {
	rank := 1 + rng.IntN(4)
	reduce := rank >= 2 && rng.IntN(3) > 0
	s := make([]int, rank)
	for i := range s {
		s[i] = 1 + rng.IntN(5)
	}
	switch rng.IntN(4) {
	case 0:
		s[rank-1] = 8 * (1 + rng.IntN(40)) // vector-friendly rows
	case 1:
		s[rank-1] = 1 + rng.IntN(700) // long or odd rows
	}
	dtypes := []graph.DType{graph.Float32, graph.BFloat16, graph.Float16}
	half := false
	g := graph.New()
	vals := map[int]Value{}
	nin := 1 + rng.IntN(4)
	var inputs []int
	var rowIn []bool
	for i := range nin {
		dt := dtypes[rng.IntN(3)]
		if i == 0 && rng.IntN(2) == 0 {
			dt = graph.Float32
		}
		half = half || dt.IsHalf()
		sh := append([]int(nil), s...)
		if i > 0 {
			for d := range sh {
				if rng.IntN(3) == 0 {
					sh[d] = 1
				}
			}
			if k := rng.IntN(len(sh) + 1); k > 0 && rng.IntN(3) == 0 {
				sh = sh[k:]
			}
		}
		var id int
		var err error
		if i == 0 {
			id, err = g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: sh, DType: dt, BatchAxis: 0, PerSample: 1}})
		} else {
			id, err = shapeinfer.AppendSource(g, graph.Node{Op: graph.OpParam, Name: fmt.Sprintf("p%d", i), Type: graph.Type{Shape: sh, DType: dt}})
		}
		if err != nil {
			return nil, err
		}
		inputs = append(inputs, id)
		vals[id] = uniform(rng, -1, 1, sh...)
		rowIn = append(rowIn, len(sh) == 0 || (sh[len(sh)-1] == 1 && s[rank-1] != 1))
	}
	var nodes []graph.PWNode
	var row []bool
	add := func(n graph.PWNode, r bool) int {
		nodes = append(nodes, n)
		row = append(row, r)
		return len(nodes) - 1
	}
	for i := range inputs {
		add(graph.PWNode{Op: graph.PWInput, In: i}, rowIn[i])
	}
	if rowIn[0] { // the first input spans S unless S's last axis is 1
		return RandomPointwise(rng)
	}
	pick := func() int { return rng.IntN(len(nodes)) }
	positive := func(a int) int { // |a| + ½
		return add(graph.PWNode{Op: graph.PWAdd, A: add(graph.PWNode{Op: graph.PWAbs, A: a}, row[a]),
			B: add(graph.PWNode{Op: graph.PWConst, Scalar: 0.5}, true)}, row[a])
	}
	reductions := 0
	ops := 3 + rng.IntN(14)
	for range ops {
		a, b := pick(), pick()
		rab := row[a] && row[b]
		switch k := rng.IntN(22); {
		case k < 8:
			op := []graph.PWOp{graph.PWNeg, graph.PWAbs, graph.PWTanh, graph.PWSigmoid, graph.PWRelu, graph.PWGelu,
				graph.PWGeluTanh, graph.PWSilu}[k]
			add(graph.PWNode{Op: op, A: a}, row[a])
		case k == 8:
			add(graph.PWNode{Op: graph.PWExp, A: add(graph.PWNode{Op: graph.PWTanh, A: a}, row[a])}, row[a])
		case k == 9:
			op := []graph.PWOp{graph.PWLog, graph.PWSqrt, graph.PWRsqrt}[rng.IntN(3)]
			add(graph.PWNode{Op: op, A: positive(a)}, row[a])
		case k == 10:
			add(graph.PWNode{Op: graph.PWDiv, A: a, B: positive(b)}, rab)
		case k == 11:
			e := add(graph.PWNode{Op: graph.PWConst, Scalar: float64(rng.IntN(9)-4) / 2}, true)
			add(graph.PWNode{Op: graph.PWPow, A: positive(a), B: e}, row[a])
		case k == 12:
			dt := []graph.DType{graph.BFloat16, graph.Float16, graph.Float32}[rng.IntN(3)]
			half = half || dt.IsHalf()
			add(graph.PWNode{Op: graph.PWCast, A: a, DType: dt}, row[a])
		case k == 13 && reduce && reductions < 2 && !row[a]:
			reductions++
			if rng.IntN(2) == 0 {
				add(graph.PWNode{Op: graph.PWRowMax, A: a}, true)
			} else {
				add(graph.PWNode{Op: graph.PWRowSum, A: a, Scalar: 1 / float64(s[rank-1])}, true)
			}
		case k == 14 && row[a]:
			add(graph.PWNode{Op: graph.PWExpand, A: a}, false)
		case k == 15:
			add(graph.PWNode{Op: graph.PWConst, Scalar: float64(rng.IntN(21)-10) / 4}, true)
		case k == 16:
			op := []graph.PWOp{graph.PWSiluGrad, graph.PWGeluGrad, graph.PWGeluTanhGrad, graph.PWReluGrad}[rng.IntN(4)]
			add(graph.PWNode{Op: op, A: a, B: b}, rab)
		default:
			op := []graph.PWOp{graph.PWAdd, graph.PWSub, graph.PWMul, graph.PWMax}[rng.IntN(4)]
			add(graph.PWNode{Op: op, A: a, B: b}, rab)
		}
	}
	// Outputs: the last node and up to two others, not the constants.
	var outs []graph.PWOut
	seen := map[int]bool{}
	for k := range 1 + rng.IntN(3) {
		n := len(nodes) - 1
		if k > 0 {
			n = pick()
		}
		if seen[n] || nodes[n].Op == graph.PWConst {
			continue
		}
		seen[n] = true
		dt := dtypes[rng.IntN(3)]
		half = half || dt.IsHalf()
		outs = append(outs, graph.PWOut{Node: n, DType: dt, ColSum: rank >= 2 && !row[n] && rng.IntN(3) == 0})
	}
	if len(outs) == 0 {
		return RandomPointwise(rng)
	}
	p, err := graph.NewPointwise(nodes, outs)
	if err != nil {
		return nil, err
	}
	c := &PointwiseCase{Graph: g, Vals: vals, Expr: p, Shape: s, Half: half}
	if c.ColScale, err = colScales(g, vals, inputs, nodes, outs); err != nil {
		return nil, fmt.Errorf("%v: %w", c, err)
	}
	for k := range outs {
		id, err := g.Append(graph.Node{Op: graph.OpFusedPointwise, Inputs: inputs, Attrs: graph.Attrs{Pointwise: p, Axis: k}})
		if err != nil {
			return nil, fmt.Errorf("%v: %w", c, err)
		}
		c.Outs = append(c.Outs, id)
	}
	return c, nil
}

// colScales is, for each column sum of outs, Σ |term| over the rows of
// each column, evaluated in float64 on a copy of g: the expression with
// |node| summed in place of each such output's node.
func colScales(g *graph.Graph, vals map[int]Value, inputs []int, nodes []graph.PWNode, outs []graph.PWOut) ([][]float64, error) {
	scales := make([][]float64, len(outs))
	g = g.Clone()
	for k, o := range outs {
		if !o.ColSum {
			continue
		}
		abs := append(slices.Clone(nodes), graph.PWNode{Op: graph.PWAbs, A: o.Node})
		p, err := graph.NewPointwise(abs, []graph.PWOut{{Node: len(abs) - 1, DType: graph.Float32, ColSum: true}})
		if err != nil {
			return nil, err
		}
		id, err := g.Append(graph.Node{Op: graph.OpFusedPointwise, Inputs: inputs, Attrs: graph.Attrs{Pointwise: p}})
		if err != nil {
			return nil, err
		}
		v, err := Eval(g, vals, id)
		if err != nil {
			return nil, err
		}
		scales[k] = v[0].Data
	}
	return scales, nil
}
