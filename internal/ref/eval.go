package ref

import (
	"math"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Eval computes the values of outputs over the full batch. Source nodes
// take their data from override when it has their id, else from
// node.Value. Only ancestors of outputs are computed, so sources the
// outputs do not use need no data. The returned Values are fresh copies.
func Eval(g *graph.Graph, override map[int]Value, outputs ...int) ([]Value, error) {
	if g == nil {
		return nil, graph.Errorf(graph.ErrNilTensor, "nil *graph.Graph")
	}
	n := g.Len()
	for id, v := range override {
		if id < 0 || id >= n {
			return nil, graph.Errorf(graph.ErrArity, "override for id %d, which does not name a node", id)
		}
		nd := g.Node(id)
		if nd.Op.Category() != graph.CatSource {
			return nil, opError(nd, nil, graph.Errorf(graph.ErrAttr, "override of node %d, which is not a source", id))
		}
		if err := checkData(nd, v); err != nil {
			return nil, err
		}
	}
	need := make([]bool, n)
	for _, o := range outputs {
		if o < 0 || o >= n {
			return nil, graph.Errorf(graph.ErrArity, "output id %d does not name a node", o)
		}
		need[o] = true
	}
	for id := n - 1; id >= 0; id-- {
		if need[id] {
			for _, in := range g.Node(id).Inputs {
				need[in] = true
			}
		}
	}
	vals := make([]Value, n)
	for id := range n {
		if !need[id] {
			continue
		}
		nd := g.Node(id)
		v, err := evalNode(nd, g, override, vals)
		if err != nil {
			return nil, err
		}
		vals[id] = v
	}
	out := make([]Value, len(outputs))
	for i, o := range outputs {
		out[i] = vals[o].Clone()
	}
	return out, nil
}

func evalNode(nd *graph.Node, g *graph.Graph, override map[int]Value, vals []Value) (Value, error) {
	if nd.Op.Category() == graph.CatSource {
		if v, ok := override[nd.ID]; ok {
			return roundTo(nd.Type.DType, v), nil
		}
		if nd.Value == nil {
			return Value{}, opError(nd, nil, graph.Errorf(graph.ErrNoData, "%s node %d (%q) has no data and no override", nd.Op, nd.ID, nd.Name))
		}
		if (nd.Value.Dtype() == tensor.Int64) != (nd.Type.DType == graph.Int64) {
			return Value{}, opError(nd, nil, graph.Errorf(graph.ErrDType, "%s node %d is %s but holds %v data", nd.Op, nd.ID, nd.Type.DType, nd.Value.Dtype()))
		}
		v, err := FromTensor(nd.Value)
		if err != nil {
			return Value{}, opError(nd, nil, err)
		}
		if err := checkData(nd, v); err != nil {
			return Value{}, err
		}
		return roundTo(nd.Type.DType, v), nil
	}
	in := make([]Value, len(nd.Inputs))
	types := make([]graph.Type, len(nd.Inputs))
	shapes := make([][]int, len(nd.Inputs))
	for i, id := range nd.Inputs {
		in[i] = vals[id]
		types[i] = g.Node(id).Type
		shapes[i] = types[i].Shape
	}
	a, err := normalise(nd, types, g.Batch())
	if err != nil {
		return Value{}, opError(nd, shapes, err)
	}
	v, err := apply(nd, &a, in)
	if err != nil {
		return Value{}, opError(nd, shapes, err)
	}
	return roundTo(nd.Type.DType, v), nil
}

// roundTo rounds v to dt's precision where the executors round: every
// float16 or bfloat16 value, as a source enters and as an op stores its
// result. Kernels compute in float64 from the rounded inputs; the result
// goes through float32 first, as a device kernel's float32 result does.
// Other dtypes are left alone. Source data is copied, not changed.
func roundTo(dt graph.DType, v Value) Value {
	var r func(float32) float32
	switch dt {
	case graph.BFloat16:
		r = half.RoundBF16
	case graph.Float16:
		r = half.RoundF16
	default:
		return v
	}
	v = v.Clone()
	for i, x := range v.Data {
		v.Data[i] = float64(r(float32(x)))
	}
	return v
}

// normalise re-runs nd's shape rule on a copy of its attributes.
// graph.Graph.Append already typed the node by that rule, so this is a
// guard: a stored type that disagreed with its rule would be rejected here
// before any loop could index out of range. Scalar is kept as stored: it
// is the build-time 1/count.
func normalise(nd *graph.Node, in []graph.Type, batch int) (graph.Attrs, error) {
	a := nd.Attrs.Clone()
	t, err := shapeinfer.Rule(nd.Op, &a, in, batch)
	if err != nil {
		return a, err
	}
	if !slices.Equal(t.Shape, nd.Type.Shape) || t.DType != nd.Type.DType {
		return a, graph.Errorf(graph.ErrShape, "node %d is typed %s%v but its rule gives %s%v",
			nd.ID, nd.Type.DType, nd.Type.Shape, t.DType, t.Shape)
	}
	a.Scalar = nd.Attrs.Scalar
	return a, nil
}

// checkData validates a source value against its node's type.
func checkData(nd *graph.Node, v Value) error {
	if !slices.Equal(v.Shape, nd.Type.Shape) || len(v.Data) != graph.Numel(nd.Type.Shape) {
		return opError(nd, [][]int{v.Shape}, graph.Errorf(graph.ErrShape,
			"data of shape %v with %d elements for node %d of shape %v", v.Shape, len(v.Data), nd.ID, nd.Type.Shape))
	}
	if nd.Type.DType == graph.Int64 {
		for i, x := range v.Data {
			if x != math.Trunc(x) || math.IsInf(x, 0) {
				return opError(nd, [][]int{v.Shape}, graph.Errorf(graph.ErrDType, "int64 node %d holds %g at %d", nd.ID, x, i))
			}
		}
	}
	return nil
}

func opError(nd *graph.Node, shapes [][]int, err error) error {
	return &graph.OpError{Op: nd.Op.String(), Shapes: shapes, Site: nd.Site, Err: err}
}

// apply runs one non-source node's kernel from the table.
func apply(nd *graph.Node, a *graph.Attrs, in []Value) (Value, error) {
	var run kernel
	if int(nd.Op) < graph.NumOps {
		run = kernelTable[nd.Op]
	}
	if run == nil {
		return Value{}, graph.Errorf(graph.ErrAttr, "ref: no implementation of op %s", nd.Op)
	}
	if a.ChannelsLast {
		return applyChannelsLast(nd, a, in, run)
	}
	out := Zeros(nd.Type.Shape...)
	return out, run(nd, a, in, out)
}

// applyChannelsLast runs a channels-last node (graph.Attrs.ChannelsLast)
// by its NCHW kernel, written independently of the executors': its 4-D
// inputs transposed to NCHW, the result transposed back.
func applyChannelsLast(nd *graph.Node, a *graph.Attrs, in []Value, run kernel) (Value, error) {
	v, at := *nd, *a
	at.ChannelsLast = false
	at.Target = graph.ToNCHW(at.Target)
	v.Attrs, v.Type = at, graph.ToNCHW(nd.Type)
	ins := make([]Value, len(in))
	for i, x := range in {
		ins[i] = transpose4(x, graph.PermNCHW)
	}
	out := Zeros(v.Type.Shape...)
	if err := run(&v, &at, ins, out); err != nil {
		return Value{}, err
	}
	return transpose4(out, graph.PermNHWC), nil
}

// transpose4 is x with its axes in perm's order when x is 4-D, x itself
// otherwise.
func transpose4(x Value, perm []int) Value {
	if len(x.Shape) != 4 {
		return x
	}
	s := x.Shape
	shape := []int{s[perm[0]], s[perm[1]], s[perm[2]], s[perm[3]]}
	out := Zeros(shape...)
	strides := []int{s[1] * s[2] * s[3], s[2] * s[3], s[3], 1}
	i := 0
	for a := range shape[0] {
		for b := range shape[1] {
			for c := range shape[2] {
				for d := range shape[3] {
					out.Data[i] = x.Data[a*strides[perm[0]]+b*strides[perm[1]]+c*strides[perm[2]]+d*strides[perm[3]]]
					i++
				}
			}
		}
	}
	return out
}
