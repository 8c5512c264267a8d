package graph

import (
	"fmt"
	"slices"
)

const (
	// vector-Jacobian products. The first input is always the upstream
	// gradient g. Ops whose output shape cannot be derived from their inputs
	// take it from Attrs.Target (shape, dtype and batch axis of the value the
	// gradient is for).
	OpReluGrad          Op = endLinearCrossEntropyOps + iota // g, y: g where y > 0 (y is relu's output, as PyTorch saves)
	OpGeluGrad                                               // g, x; Approx
	OpMaximumGrad                                            // g, a, b; Axis 0 → gradient for a, 1 → for b; ties split evenly
	OpMaximumScalarGrad                                      // g, x; Scalar; ties get half
	OpExpand                                                 // g broadcast to Attrs.Target (backward of reductions)
	OpMaxGrad                                                // g, x, y; Axes, KeepDim: g shared evenly among tied maxima
	OpSoftmaxGrad                                            // g, y; Axis: y·(g − Σ g·y)
	OpLogSoftmaxGrad                                         // g, y; Axis: g − exp(y)·Σ g
	OpLayerNormGradX                                         // g, x[, w]; NormDims, Eps
	OpLayerNormGradW                                         // g, x; NormDims, Eps: Σ over leading axes of g·x̂
	OpBatchNormGradX                                         // g, x[, w]; Eps, PerChunk; Training only: the batch-statistics backward of x
	OpBatchNormGradW                                         // g, x[, running_mean, running_var]; Training, PerChunk, Eps: Σ over all axes but 1 of g·x̂
	OpSliceGrad                                              // g; Axis, Start, End, Step, Target: g scattered into zeros
	OpEmbeddingGrad                                          // g, indices[, r]; Target [V, D]: rows scatter-added (onto r, FuseEmbeddingGradAdd)
	OpConv2dGradInput                                        // g, w; conv attrs, Target = input type
	OpConv2dGradWeight                                       // g, x; conv attrs, Target = weight type
	OpMaxPool2dGrad                                          // g, x; pool attrs: g routed to the first maximum of each window
	OpAvgPool2dGrad                                          // g; pool attrs, Target = input type
	OpCrossEntropyGrad                                       // g, logits, labels; Scalar, End: g·Scalar·(softmax − onehot), 0 past End
	OpMSEGrad                                                // g, pred, target; Scalar: g·Scalar·2·(pred − target)
	// OpMatMulGeluGrad is gelu_grad(matmul(a, b), x) in one node: a, b, x;
	// TransA, TransB, Approx. Autodiff never emits it: FuseGeluGrad puts
	// it in place of a matmul read only by a gelu_grad, so an executor can
	// run the product and GELU's derivative as one GEMM with an epilogue
	// (cuBLASLt's DGELU) and the product is never stored.
	OpMatMulGeluGrad
	// OpLayerNormGradXAdd is add(r, layer_norm_grad_x(g, x[, w])) in one
	// node: g, x, r[, w]; NormDims, Eps. Autodiff never emits it:
	// FuseLayerNormGradAdd puts it in place of a layer_norm_grad_x read
	// only by an add of another gradient (a residual stream's gradient
	// meeting the block's), so the layer norm's backward pass adds r in
	// registers and its own gradient is never stored.
	OpLayerNormGradXAdd
	// OpFusedPointwise computes one output of the expression DAG
	// Attrs.Pointwise over its inputs (Attrs.Axis names which): elementwise
	// ops, constants, broadcasts, casts and reductions of rows. Autodiff
	// never emits it: FusePointwise puts it in place of a connected group
	// of such ops after autodiff, one node for each value the group gives
	// to the rest of the graph.
	OpFusedPointwise
	numOps
)

// Vector-Jacobian products appended by autodiff. The first input is always
// the upstream gradient g. Ops whose output shape cannot be derived from
// their inputs take it from Attrs.Target. Each rule re-runs its forward
// op's rule, so a gradient node is typed exactly when its forward node
// would be. Gradient ops have no VJP of their own (noVJPGrad).
var gradOps = []OpInfo{
	OpReluGrad: {Name: "relu_grad", Category: CatGrad, MinArity: 2, Arity: 2, NoVJP: noVJPGrad,
		Rule: gradRule(sameAsGrad), Chunk: plainChunk},
	OpGeluGrad: {Name: "gelu_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"approx"}, NoVJP: noVJPGrad,
		Rule: gradRule(sameAsGrad), Chunk: plainChunk},
	OpMaximumScalarGrad: {Name: "maximum_scalar_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"scalar"}, NoVJP: noVJPGrad,
		Rule: gradRule(sameAsGrad), Chunk: plainChunk},
	OpMaximumGrad: {Name: "maximum_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"axis"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			g := in[0]
			fwd, err := binaryRule(OpMaximum, nil, in[1:3], 0)
			if err := expect(op, "gradient", g, fwd, err); err != nil {
				return Type{}, err
			}
			if attrs.Axis != 0 && attrs.Axis != 1 {
				return Type{}, Errorf(ErrAttr, "maximum_grad operand %d (want 0 or 1)", attrs.Axis)
			}
			return sameShape(op, g, fwd)
		})},
	// expand broadcasts g to Attrs.Target: the backward of reductions, linear in g.
	OpExpand: {Name: "expand", Category: CatGrad, MinArity: 1, Arity: 1, Attrs: []string{"target"}, NoVJP: noVJPGrad,
		Chunk: scales,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			g := in[0]
			t, err := target(op, attrs)
			if err != nil {
				return t, err
			}
			if s, err := BroadcastShapes(g.Shape, t.Shape); err != nil || !slices.Equal(s, t.Shape) || len(g.Shape) > len(t.Shape) {
				return Type{}, Errorf(ErrShape, "expand of %v to %v", g.Shape, t.Shape)
			}
			return t, nil
		})},
	OpMaxGrad: {Name: "max_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"axes", "keepdim"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			g := in[0]
			a := *attrs
			fwd, err := reduce(OpMax, &a, in[1:2], 0)
			if err := expect(op, "gradient", g, fwd, err); err != nil {
				return Type{}, err
			}
			if err := expect(op, "max output", in[2], fwd, nil); err != nil {
				return Type{}, err
			}
			attrs.Axes = a.Axes
			return in[1], nil
		})},
	OpSoftmaxGrad: {Name: "softmax_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"axis"}, NoVJP: noVJPGrad,
		Rule: gradRule(softmaxGrad), Chunk: plainChunk},
	OpLogSoftmaxGrad: {Name: "log_softmax_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"axis"}, NoVJP: noVJPGrad,
		Rule: gradRule(softmaxGrad), Chunk: plainChunk},
	OpLayerNormGradX: {Name: "layer_norm_grad_x", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"normdims", "eps"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			g := in[0]
			a := *attrs
			fwd, err := layerNorm(&a, in[1:])
			if err := expect(op, "gradient", g, fwd, err); err != nil {
				return Type{}, err
			}
			return sameShape(op, in[1], g)
		})},
	// Σ over the leading axes of g·x̂: a parameter gradient, a sum over samples.
	OpLayerNormGradW: {Name: "layer_norm_grad_w", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"normdims", "eps"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{Consume: combines(CombineSum)},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			g := in[0]
			a := *attrs
			fwd, err := layerNorm(&a, in[1:2])
			if err := expect(op, "gradient", g, fwd, err); err != nil {
				return Type{}, err
			}
			x := in[1]
			return Type{Shape: slices.Clone(x.Shape[len(x.Shape)-attrs.NormDims:]), DType: x.DType, BatchAxis: -1, PerSample: 1}, nil
		})},
	// Training mode only: the batch-statistics backward of x.
	OpBatchNormGradX: {Name: "batch_norm_grad_x", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"training", "per_chunk", "eps", "channels_last"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{PerSample: batchNormPerSample, MinChunk: batchNormMinChunk},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			if !attrs.Training {
				return Type{}, Errorf(ErrAttr, "batch_norm_grad_x is the training-mode gradient; in evaluation mode dx is g·weight·rstd")
			}
			g := in[0]
			a := *attrs
			fwd, err := batchNorm(&a, in[1:])
			if err := expect(op, "gradient", g, fwd, err); err != nil {
				return Type{}, err
			}
			return sameShape(op, in[1], g)
		})},
	// Σ over every axis but 1 of g·x̂: a sum over samples when x̂ comes from
	// the running statistics, or from each chunk's own (PerChunk: the sum
	// of the chunks' gradients is gradient accumulation's).
	OpBatchNormGradW: {Name: "batch_norm_grad_w", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 4, Attrs: []string{"training", "per_chunk", "eps", "channels_last"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{PerSample: batchNormPerSample, MinChunk: batchNormMinChunk, Consume: func(n *Node, _ []Type) (Combine, string) {
			if !n.Attrs.Training || n.Attrs.PerChunk {
				return CombineSum, ""
			}
			return CombineNone, fmt.Sprintf("normalises with batch statistics (%s in training mode; per-chunk statistics opt in to chunks: Attrs.PerChunk, nn.BatchNorm2d.PerChunkStats)", n.Op)
		}},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			if want := BatchNormAffine(attrs.Training) + 1; len(in) != want {
				return Type{}, Errorf(ErrArity, "batch_norm_grad_w takes g, x and, in evaluation mode, the running statistics: %d inputs, got %d", want, len(in))
			}
			g := in[0]
			a := *attrs
			fwd, err := batchNorm(&a, in[1:])
			if err := expect(op, "gradient", g, fwd, err); err != nil {
				return Type{}, err
			}
			x := in[1]
			if attrs.ChannelsLast {
				x = ToNCHW(x)
			}
			t := Type{Shape: []int{x.Shape[1]}, DType: x.DType, BatchAxis: -1, PerSample: 1}
			if x.BatchAxis == 1 { // samples on the channel axis: not summed over
				t.BatchAxis, t.PerSample = 0, x.PerSample
			}
			return t, nil
		})},
	// g scattered into zeros of Attrs.Target: linear in g.
	OpSliceGrad: {Name: "slice_grad", Category: CatGrad, MinArity: 1, Arity: 1, Attrs: []string{"axis", "start", "end", "step", "target"}, NoVJP: noVJPGrad,
		Chunk: scales,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			t, err := target(op, attrs)
			if err != nil {
				return t, err
			}
			fwd, err := sliceOf(attrs, t)
			return t, expect(op, "gradient", in[0], fwd, err)
		})},
	// Rows scatter-added into Target [V, D]: a parameter gradient.
	// With the optional r (FuseEmbeddingGradAdd: a tied embedding's other
	// gradient) the rows are scatter-added onto r: r + embedding_grad(g,
	// indices), with no [V, D] value of its own.
	OpEmbeddingGrad: {Name: "embedding_grad", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"target"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{Consume: combines(CombineSum), Linear: Accumulates},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			t, err := target(op, attrs)
			if err != nil {
				return t, err
			}
			fwd, err := embedding(in[1], t)
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return t, err
			}
			if len(in) > 2 && (!slices.Equal(in[2].Shape, t.Shape) || in[2].DType != t.DType || in[2].Batched()) {
				return Type{}, Errorf(ErrShape, "%s onto %s%v (batch axis %d): want the gradient's %s%v without a batch axis",
					op, in[2].DType, in[2].Shape, in[2].BatchAxis, t.DType, t.Shape)
			}
			return t, nil
		})},
	OpConv2dGradInput: {Name: "conv2d_grad_input", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"stride", "padding", "dilation", "groups", "target", "channels_last"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			t, err := target(op, attrs)
			if err != nil {
				return t, err
			}
			fwd, err := conv2d(attrs, []Type{t, in[1]})
			return t, expect(op, "gradient", in[0], fwd, err)
		})},
	// A parameter gradient: a sum over samples.
	OpConv2dGradWeight: {Name: "conv2d_grad_weight", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"stride", "padding", "dilation", "groups", "target", "channels_last"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{Consume: combines(CombineSum)},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			t, err := target(op, attrs)
			if err != nil {
				return t, err
			}
			fwd, err := conv2d(attrs, []Type{in[1], t})
			return t, expect(op, "gradient", in[0], fwd, err)
		})},
	OpMaxPool2dGrad: {Name: "max_pool2d_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"kernel", "stride", "padding", "dilation", "channels_last"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			fwd, err := pool2d(OpMaxPool2d, attrs, in[1])
			return in[1], expect(op, "gradient", in[0], fwd, err)
		})},
	OpAvgPool2dGrad: {Name: "avg_pool2d_grad", Category: CatGrad, MinArity: 1, Arity: 1, Attrs: []string{"kernel", "stride", "padding", "target", "channels_last"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			t, err := target(op, attrs)
			if err != nil {
				return t, err
			}
			fwd, err := pool2d(OpAvgPool2d, attrs, t)
			return t, expect(op, "gradient", in[0], fwd, err)
		})},
	OpCrossEntropyGrad: {Name: "cross_entropy_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"scalar", "end"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := *attrs
			fwd, err := crossEntropy(&a, in[1], in[2])
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			return in[1], nil
		})},
	OpMSEGrad: {Name: "mse_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"scalar"}, NoVJP: noVJPGrad,
		Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := *attrs
			fwd, err := mse(&a, in[1], in[2])
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			return sameShape(op, in[1], in[2])
		})},
	OpLayerNormGradXAdd: {Name: "layer_norm_grad_x_add", Category: CatGrad, MinArity: 3, Arity: 3, MaxArity: 4, Attrs: []string{"normdims", "eps"},
		NoVJP: noVJPGrad, Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := *attrs
			fwd, err := layerNorm(&a, append([]Type{in[1]}, in[3:]...))
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			return sameShape(op, in[1], in[0], in[2]) // x, g and r alike
		})},
	OpMatMulGeluGrad: {Name: "matmul_gelu_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"trans_a", "trans_b", "approx"},
		NoVJP: noVJPGrad, Chunk: &Chunk{PerSample: matmulPerSample},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := Attrs{TransA: attrs.TransA, TransB: attrs.TransB}
			t, err := matmulRule(OpMatMul, &a, in[:2], 0)
			if err != nil {
				return Type{}, err
			}
			if err := expect(op, "the GELU input", in[2], t, nil); err != nil {
				return Type{}, err
			}
			if in[2].DType != t.DType {
				return Type{}, Errorf(ErrDType, "%s: product of %s, GELU input of %s", op, t.DType, in[2].DType)
			}
			return t, nil
		})},
}

// gradRule checks the upstream gradient, which every gradient op takes
// first, before the op's own rule.
func gradRule(f func(op Op, attrs *Attrs, in []Type) (Type, error)) RuleFunc {
	return func(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
		if err := needFloat(op, in[0]); err != nil {
			return Type{}, err
		}
		return f(op, attrs, in)
	}
}

// sameAsGrad types g, x gradients of plainChunk ops: both of one shape.
func sameAsGrad(op Op, _ *Attrs, in []Type) (Type, error) { return sameShape(op, in[0], in[1]) }

func softmaxGrad(op Op, attrs *Attrs, in []Type) (Type, error) {
	t, err := sameShape(op, in[0], in[1])
	if err != nil {
		return t, err
	}
	attrs.Axis, err = normAxis(attrs.Axis, len(t.Shape), "axis")
	return t, err
}

// sameShape checks that every input has ts[0]'s shape and dtype and returns
// that type, batched when any input is.
func sameShape(op Op, ts ...Type) (Type, error) {
	for i, t := range ts {
		if !slices.Equal(t.Shape, ts[0].Shape) || t.DType != ts[0].DType {
			return Type{}, Errorf(ErrShape, "%s input %d is %s%v, input 0 is %s%v", op, i, t.DType, t.Shape, ts[0].DType, ts[0].Shape)
		}
	}
	out := ts[0]
	ax, per, err := alignBatch(len(out.Shape), ts...)
	if err != nil {
		return Type{}, err
	}
	out.BatchAxis, out.PerSample = ax, per
	return out, nil
}

// expect checks that a gradient input has the shape the forward op produced.
func expect(op Op, what string, got Type, want Type, err error) error {
	if err != nil {
		return err
	}
	if !slices.Equal(got.Shape, want.Shape) {
		return Errorf(ErrShape, "%s: %s has shape %v, the forward op gives %v", op, what, got.Shape, want.Shape)
	}
	return nil
}

// target validates Attrs.Target as the output type of a gradient.
func target(op Op, attrs *Attrs) (Type, error) {
	t := attrs.Target
	if !t.DType.IsFloat() || t.BatchAxis >= len(t.Shape) || t.BatchAxis < -1 {
		return Type{}, Errorf(ErrAttr, "%s: invalid target type %s%v (batch axis %d)", op, t.DType, t.Shape, t.BatchAxis)
	}
	if t.BatchAxis < 0 {
		t.BatchAxis, t.PerSample = -1, 1
	} else if t.PerSample < 1 {
		t.PerSample = 1
	}
	attrs.Target = t
	return t, nil
}
