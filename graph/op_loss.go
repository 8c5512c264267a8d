package graph

import (
	"fmt"
	"slices"
)

const (
	// OpCrossEntropy: inputs logits [N, C], labels int64 [N]; Reduction,
	// End (classes, 0 = C). A row whose label is IgnoreLabel takes no part:
	// its loss and gradient are 0 (a mean still divides by N, the rows'
	// count fixed at the full batch, so chunk partials add; a mean over
	// the rows that count is a sum times 1/count, as models.CausalLMLoss
	// makes it).
	OpCrossEntropy Op = endAttentionOps + iota
	OpMSE             // inputs pred, target (same shape); Reduction
	endLossOps
)

// IgnoreLabel is the label cross_entropy skips: PyTorch's default
// ignore_index, which Hugging Face's causal language-model losses put at
// padding and prompt positions.
const IgnoreLabel = -100

// Losses reduce to a scalar. With ReduceMean, Attrs.Scalar is 1/count fixed
// at the full batch, so chunk partials add.
var lossOps = []OpInfo{
	// cross_entropy's gradient recomputes the softmax from the logits.
	// With Attrs.End = C' in (0, C) only the first C' columns are classes:
	// the rest (a padded linear's extra outputs, precision's alignedLinear)
	// take no part in the loss and get exactly zero gradient.
	OpCrossEntropy: {Name: "cross_entropy", Category: CatLoss, MinArity: 2, Arity: 2, Attrs: []string{"reduction", "end"},
		Rule: crossEntropyRule, Saves: SavesInput(0, 1),
		Chunk: &Chunk{Consume: func(n *Node, in []Type) (Combine, string) {
			// Per-sample losses summed, times 1/count fixed at the full
			// batch, when every row of logits and labels is one sample's.
			logits, labels := in[0], in[1]
			if logits.BatchAxis == 0 && labels.BatchAxis == 0 {
				return CombineSum, ""
			}
			return CombineNone, fmt.Sprintf("logits (batch axis %d) and labels (batch axis %d) must both carry the batch on axis 0", logits.BatchAxis, labels.BatchAxis)
		}},
		VJP: func(b VJPBuilder, n *Node, g int) {
			x := n.Inputs[0]
			b.Accumulate(x, b.Emit(OpCrossEntropyGrad, Attrs{Scalar: n.Attrs.Scalar, End: n.Attrs.End}, g, x, n.Inputs[1]))
		}},
	OpMSE: {Name: "mse", Category: CatLoss, MinArity: 2, Arity: 2, Attrs: []string{"reduction"},
		Rule: mseRule, Saves: SavesInput(0, 1),
		Chunk: &Chunk{Consume: func(n *Node, in []Type) (Combine, string) {
			if in[0].BatchAxis == in[1].BatchAxis {
				return CombineSum, ""
			}
			return CombineNone, "an operand without a batch axis spans the batch axis"
		}},
		VJP: func(b VJPBuilder, n *Node, g int) {
			x, y := n.Inputs[0], n.Inputs[1]
			gp := b.Emit(OpMSEGrad, Attrs{Scalar: n.Attrs.Scalar}, g, x, y)
			if b.Wants(0) {
				b.Accumulate(x, gp)
			}
			if b.Wants(1) {
				b.Accumulate(y, neg(b, gp))
			}
		}},
}

func lossScale(attrs *Attrs, count int) {
	attrs.Scalar = 1
	if attrs.Reduction == ReduceMean {
		attrs.Scalar = 1 / float64(count)
	}
}

func crossEntropyRule(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	return crossEntropy(attrs, in[0], in[1])
}

func crossEntropy(attrs *Attrs, logits, labels Type) (Type, error) {
	if err := needFloat(OpCrossEntropy, logits); err != nil {
		return Type{}, err
	}
	if labels.DType != Int64 {
		return Type{}, Errorf(ErrDType, "cross_entropy labels must be int64 class indices, got %s", labels.DType)
	}
	if len(logits.Shape) != 2 || len(labels.Shape) != 1 || logits.Shape[0] != labels.Shape[0] {
		return Type{}, Errorf(ErrShape, "cross_entropy needs logits [N, C] and labels [N], got %v and %v", logits.Shape, labels.Shape)
	}
	if logits.Shape[0] == 0 || logits.Shape[1] == 0 {
		return Type{}, Errorf(ErrShape, "cross_entropy of an empty batch or zero classes: %v", logits.Shape)
	}
	if attrs.End < 0 || attrs.End > logits.Shape[1] {
		return Type{}, Errorf(ErrShape, "cross_entropy of %d classes (end) out of logits %v: want 0 (all columns) up to %d", attrs.End, logits.Shape, logits.Shape[1])
	}
	lossScale(attrs, logits.Shape[0])
	return Type{Shape: []int{}, DType: crossEntropyDType(logits.DType), BatchAxis: -1, PerSample: 1}, nil
}

// CrossEntropyClasses is the number of classes a cross_entropy or
// cross_entropy_grad with attributes a scores in logits of c columns:
// a.End, or c when End is 0.
func CrossEntropyClasses(a *Attrs, c int) int {
	if a.End > 0 {
		return a.End
	}
	return c
}

// crossEntropyDType is the loss's dtype for logits of dtype dt: a 16-bit
// cross_entropy reads its logits widened and computes in float32, and its
// loss is float32 (the values autocast's cast-then-fp32 loss gives, since
// widening is exact, without the float32 copy of the logits); its gradient
// has the logits' dtype, rounded once.
func crossEntropyDType(dt DType) DType {
	if dt == BFloat16 || dt == Float16 {
		return Float32
	}
	return dt
}

func mseRule(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) { return mse(attrs, in[0], in[1]) }

func mse(attrs *Attrs, pred, target Type) (Type, error) {
	if err := needFloat(OpMSE, pred, target); err != nil {
		return Type{}, err
	}
	if !slices.Equal(pred.Shape, target.Shape) || pred.DType != target.DType {
		return Type{}, Errorf(ErrShape, "mse needs prediction and target of one shape and dtype, got %s%v and %s%v", pred.DType, pred.Shape, target.DType, target.Shape)
	}
	if pred.Numel() == 0 {
		return Type{}, Errorf(ErrShape, "mse of an empty tensor %v", pred.Shape)
	}
	if pred.BatchAxis != target.BatchAxis && pred.BatchAxis >= 0 && target.BatchAxis >= 0 {
		return Type{}, Errorf(ErrShape, "mse batch axes differ: %d and %d", pred.BatchAxis, target.BatchAxis)
	}
	lossScale(attrs, pred.Numel())
	return Type{Shape: []int{}, DType: pred.DType, BatchAxis: -1, PerSample: 1}, nil
}
