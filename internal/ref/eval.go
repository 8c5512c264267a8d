package ref

import (
	"math"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
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
			return v, nil
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
		return v, nil
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
	return v, nil
}

// normalise re-runs nd's shape rule on a copy of its attributes.
// graph.Graph.Append already typed the node by that rule, so this is a
// guard: a stored type that disagreed with its rule would be rejected here
// before any loop could index out of range. Scalar is kept as stored: it
// is the build-time 1/count.
func normalise(nd *graph.Node, in []graph.Type, batch int) (graph.Attrs, error) {
	a := nd.Attrs
	a.Axes = slices.Clone(a.Axes)
	a.Shape = slices.Clone(a.Shape)
	a.Perm = slices.Clone(a.Perm)
	a.Target.Shape = slices.Clone(a.Target.Shape)
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

// apply dispatches one non-source node. Every op of the table has a case.
func apply(nd *graph.Node, a *graph.Attrs, in []Value) (Value, error) {
	out := Zeros(nd.Type.Shape...)
	switch op := nd.Op; op {
	case graph.OpNeg, graph.OpExp, graph.OpLog, graph.OpSqrt, graph.OpAbs, graph.OpTanh,
		graph.OpSigmoid, graph.OpRelu, graph.OpGelu, graph.OpSign:
		for i, x := range in[0].Data {
			out.Data[i] = unary(op, a.Approx, x)
		}
	case graph.OpDropout:
		// Element k sits at batch row r = (k/inner) mod rows of outer block
		// o = k/(rows·inner); its key within the row is o·inner + k mod inner.
		sh, ax := in[0].Shape, nd.Type.BatchAxis
		rows, inner := 1, len(in[0].Data)
		if ax >= 0 {
			rows, inner = sh[ax], 1
			for _, d := range sh[ax+1:] {
				inner *= d
			}
		}
		for k, x := range in[0].Data {
			o, r := k/(rows*inner), (k/inner)%rows
			if graph.DropoutKeep(a.Seed, a.Counter, int64(r), int64(o*inner+k%inner), a.Scalar) {
				out.Data[k] = x / (1 - a.Scalar)
			}
		}
	case graph.OpCausalMask:
		// Element k of x [..., T, S] sits at row i = (k/S) mod T, column j = k mod S.
		sh := in[0].Shape
		t, s := sh[len(sh)-2], sh[len(sh)-1]
		for k, x := range in[0].Data {
			i, j := (k/s)%t, k%s
			out.Data[k] = x
			if j > i+s-t {
				out.Data[k] = a.Scalar
			}
		}
	case graph.OpAddScalar, graph.OpSubScalar, graph.OpRSubScalar, graph.OpMulScalar,
		graph.OpDivScalar, graph.OpRDivScalar, graph.OpPowScalar, graph.OpMaximumScalar:
		for i, x := range in[0].Data {
			out.Data[i] = withScalar(op, x, a.Scalar)
		}
	case graph.OpAdd, graph.OpSub, graph.OpMul, graph.OpDiv, graph.OpPow, graph.OpMaximum:
		binary(out, in[0], in[1], func(x, y float64) float64 { return binaryOp(op, x, y) })
	case graph.OpMatMul:
		matmul(out, in[0], in[1], a.TransA, a.TransB)
	case graph.OpLinear:
		linear(out, in)
	case graph.OpSum, graph.OpMean, graph.OpMax:
		reduce(out, in[0], op, a)
	case graph.OpSoftmax:
		softmax(out, in[0], a.Axis, false)
	case graph.OpLogSoftmax:
		softmax(out, in[0], a.Axis, true)
	case graph.OpLayerNorm:
		layerNorm(out, in, a)
	case graph.OpBatchNorm:
		batchNorm(out, in, a)
	case graph.OpReshape:
		copy(out.Data, in[0].Data)
	case graph.OpPermute:
		permute(out, in[0], a.Perm)
	case graph.OpSlice:
		slice(out, in[0], a)
	case graph.OpConcat:
		concat(out, in, a.Axis)
	case graph.OpEmbedding:
		return out, embedding(out, in[0], in[1])
	case graph.OpConv2d:
		conv2d(out, in, a)
	case graph.OpMaxPool2d:
		maxPool(out, in[0], a)
	case graph.OpAvgPool2d:
		avgPool(out, in[0], a)
	case graph.OpCrossEntropy:
		return out, crossEntropy(out, in[0], in[1], a.Scalar)
	case graph.OpMSE:
		mse(out, in[0], in[1], a.Scalar)
	case graph.OpFill:
		for i := range out.Data {
			out.Data[i] = a.Scalar
		}
	case graph.OpReluGrad:
		for i, y := range in[1].Data {
			if y > 0 {
				out.Data[i] = in[0].Data[i]
			}
		}
	case graph.OpGeluGrad:
		for i, x := range in[1].Data {
			out.Data[i] = in[0].Data[i] * geluDeriv(x, a.Approx)
		}
	case graph.OpMaximumGrad:
		maximumGrad(out, in[0], in[1], in[2], a.Axis)
	case graph.OpMaximumScalarGrad:
		for i, x := range in[1].Data {
			out.Data[i] = in[0].Data[i] * tieShare(x, a.Scalar)
		}
	case graph.OpExpand:
		expand(out, in[0])
	case graph.OpMaxGrad:
		maxGrad(out, in[0], in[1], in[2], a)
	case graph.OpSoftmaxGrad:
		softmaxGrad(out, in[0], in[1], a.Axis, false)
	case graph.OpLogSoftmaxGrad:
		softmaxGrad(out, in[0], in[1], a.Axis, true)
	case graph.OpLayerNormGradX:
		layerNormGradX(out, in, a)
	case graph.OpLayerNormGradW:
		layerNormGradW(out, in[0], in[1], a)
	case graph.OpBatchNormGradX:
		batchNormGradX(out, in, a)
	case graph.OpBatchNormGradW:
		batchNormGradW(out, in, a)
	case graph.OpSliceGrad:
		sliceGrad(out, in[0], a)
	case graph.OpEmbeddingGrad:
		return out, embeddingGrad(out, in[0], in[1])
	case graph.OpConv2dGradInput:
		conv2dGradInput(out, in[0], in[1], a)
	case graph.OpConv2dGradWeight:
		conv2dGradWeight(out, in[0], in[1], a)
	case graph.OpMaxPool2dGrad:
		maxPoolGrad(out, in[0], in[1], a)
	case graph.OpAvgPool2dGrad:
		avgPoolGrad(out, in[0], a)
	case graph.OpCrossEntropyGrad:
		return out, crossEntropyGrad(out, in[0], in[1], in[2], a.Scalar)
	case graph.OpMSEGrad:
		mseGrad(out, in[0], in[1], in[2], a.Scalar)
	default:
		return Value{}, graph.Errorf(graph.ErrAttr, "ref: no implementation of op %s", op)
	}
	return out, nil
}
