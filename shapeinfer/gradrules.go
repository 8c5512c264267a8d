package shapeinfer

import (
	"slices"

	"github.com/batchfit/batchfit/graph"
)

func fill(attrs *graph.Attrs) (graph.Type, error) {
	t := attrs.Target
	if !t.DType.IsFloat() {
		return graph.Type{}, graph.Errorf(graph.ErrDType, "fill of %s", t.DType)
	}
	for _, d := range t.Shape {
		if d < 0 {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "fill with negative dimension in %v", t.Shape)
		}
	}
	if t.Shape == nil {
		t.Shape = []int{}
	}
	t.BatchAxis, t.PerSample = -1, 1
	attrs.Target = t
	return t, nil
}

// sameShape checks that every input has ts[0]'s shape and dtype and returns
// that type, batched when any input is.
func sameShape(op graph.Op, ts ...graph.Type) (graph.Type, error) {
	for i, t := range ts {
		if !slices.Equal(t.Shape, ts[0].Shape) || t.DType != ts[0].DType {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "%s input %d is %s%v, input 0 is %s%v", op, i, t.DType, t.Shape, ts[0].DType, ts[0].Shape)
		}
	}
	out := ts[0]
	ax, per, err := alignBatch(len(out.Shape), ts...)
	if err != nil {
		return graph.Type{}, err
	}
	out.BatchAxis, out.PerSample = ax, per
	return out, nil
}

// expect checks that a gradient input has the shape the forward op produced.
func expect(op graph.Op, what string, got graph.Type, want graph.Type, err error) error {
	if err != nil {
		return err
	}
	if !slices.Equal(got.Shape, want.Shape) {
		return graph.Errorf(graph.ErrShape, "%s: %s has shape %v, the forward op gives %v", op, what, got.Shape, want.Shape)
	}
	return nil
}

// target validates Attrs.Target as the output type of a gradient.
func target(op graph.Op, attrs *graph.Attrs) (graph.Type, error) {
	t := attrs.Target
	if !t.DType.IsFloat() || t.BatchAxis >= len(t.Shape) || t.BatchAxis < -1 {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "%s: invalid target type %s%v (batch axis %d)", op, t.DType, t.Shape, t.BatchAxis)
	}
	if t.BatchAxis < 0 {
		t.BatchAxis, t.PerSample = -1, 1
	} else if t.PerSample < 1 {
		t.PerSample = 1
	}
	attrs.Target = t
	return t, nil
}

func gradRule(op graph.Op, attrs *graph.Attrs, in []graph.Type, batch int) (graph.Type, error) {
	g := in[0]
	if err := needFloat(op, g); err != nil {
		return graph.Type{}, err
	}
	switch op {
	case graph.OpReluGrad, graph.OpGeluGrad, graph.OpMaximumScalarGrad:
		return sameShape(op, g, in[1])
	case graph.OpSoftmaxGrad, graph.OpLogSoftmaxGrad:
		t, err := sameShape(op, g, in[1])
		if err != nil {
			return t, err
		}
		attrs.Axis, err = normAxis(attrs.Axis, len(t.Shape), "axis")
		return t, err
	case graph.OpMaximumGrad:
		fwd, err := binary(graph.OpMaximum, in[1], in[2])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		if attrs.Axis != 0 && attrs.Axis != 1 {
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "maximum_grad operand %d (want 0 or 1)", attrs.Axis)
		}
		return sameShape(op, g, fwd)
	case graph.OpExpand:
		t, err := target(op, attrs)
		if err != nil {
			return t, err
		}
		if s, err := BroadcastShapes(g.Shape, t.Shape); err != nil || !slices.Equal(s, t.Shape) || len(g.Shape) > len(t.Shape) {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "expand of %v to %v", g.Shape, t.Shape)
		}
		return t, nil
	case graph.OpMaxGrad:
		a := *attrs
		fwd, err := reduce(graph.OpMax, &a, in[1])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		if err := expect(op, "max output", in[2], fwd, nil); err != nil {
			return graph.Type{}, err
		}
		attrs.Axes = a.Axes
		return in[1], nil
	case graph.OpLayerNormGradX:
		a := *attrs
		fwd, err := layerNorm(&a, in[1:])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		return sameShape(op, in[1], g)
	case graph.OpLayerNormGradW:
		a := *attrs
		fwd, err := layerNorm(&a, in[1:2])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		x := in[1]
		return graph.Type{Shape: slices.Clone(x.Shape[len(x.Shape)-attrs.NormDims:]), DType: x.DType, BatchAxis: -1, PerSample: 1}, nil
	case graph.OpBatchNormGradX:
		if !attrs.Training {
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "batch_norm_grad_x is the training-mode gradient; in evaluation mode dx is g·weight·rstd")
		}
		a := *attrs
		fwd, err := batchNorm(&a, in[1:])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		return sameShape(op, in[1], g)
	case graph.OpBatchNormGradW:
		if want := graph.BatchNormAffine(attrs.Training) + 1; len(in) != want {
			return graph.Type{}, graph.Errorf(graph.ErrArity, "batch_norm_grad_w takes g, x and, in evaluation mode, the running statistics: %d inputs, got %d", want, len(in))
		}
		a := *attrs
		fwd, err := batchNorm(&a, in[1:])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		x := in[1]
		t := graph.Type{Shape: []int{x.Shape[1]}, DType: x.DType, BatchAxis: -1, PerSample: 1}
		if x.BatchAxis == 1 { // samples on the channel axis: not summed over
			t.BatchAxis, t.PerSample = 0, x.PerSample
		}
		return t, nil
	case graph.OpSliceGrad:
		t, err := target(op, attrs)
		if err != nil {
			return t, err
		}
		fwd, err := slice(attrs, t)
		return t, expect(op, "gradient", g, fwd, err)
	case graph.OpEmbeddingGrad:
		t, err := target(op, attrs)
		if err != nil {
			return t, err
		}
		fwd, err := embedding(in[1], t)
		return t, expect(op, "gradient", g, fwd, err)
	case graph.OpConv2dGradInput:
		t, err := target(op, attrs)
		if err != nil {
			return t, err
		}
		fwd, err := conv2d(attrs, []graph.Type{t, in[1]})
		return t, expect(op, "gradient", g, fwd, err)
	case graph.OpConv2dGradWeight:
		t, err := target(op, attrs)
		if err != nil {
			return t, err
		}
		fwd, err := conv2d(attrs, []graph.Type{in[1], t})
		return t, expect(op, "gradient", g, fwd, err)
	case graph.OpMaxPool2dGrad:
		fwd, err := pool2d(graph.OpMaxPool2d, attrs, in[1])
		return in[1], expect(op, "gradient", g, fwd, err)
	case graph.OpAvgPool2dGrad:
		t, err := target(op, attrs)
		if err != nil {
			return t, err
		}
		fwd, err := pool2d(graph.OpAvgPool2d, attrs, t)
		return t, expect(op, "gradient", g, fwd, err)
	case graph.OpCrossEntropyGrad:
		a := *attrs
		fwd, err := crossEntropy(&a, in[1], in[2])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		return in[1], nil
	case graph.OpMSEGrad:
		a := *attrs
		fwd, err := mse(&a, in[1], in[2])
		if err := expect(op, "gradient", g, fwd, err); err != nil {
			return graph.Type{}, err
		}
		return sameShape(op, in[1], in[2])
	}
	return graph.Type{}, graph.Errorf(graph.ErrAttr, "no shape rule for gradient op %s", op)
}
