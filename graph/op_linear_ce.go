package graph

import "fmt"

const (
	// OpLinearCrossEntropy is cross_entropy(linear(h, W)) without the
	// logits: inputs h [N, C] (float), W [V, C] (h's dtype: the layout of
	// a linear's weight, Hugging Face's lm_head or a tied embedding),
	// labels int64 [N], and an optional float32 scalar scale; Reduction,
	// End (classes, 0 = V), LossChunk (tokens per logits chunk, 0 =
	// DefaultLossChunk). The loss is scale·Scalar·Σ over rows whose label
	// is not IgnoreLabel of logsumexp(l) − l[label], l = h·Wᵀ over the
	// first End columns, in float32: the value cross_entropy gives over
	// linear(h, W)'s logits (Scalar is 1/N for a mean, as there: the rows'
	// count fixed at the full batch; 1 for a sum). A kernel runs over
	// chunks of LossChunk rows: the chunk's logits [T, V] in its
	// workspace (GEMM from h's dtype with float32 sums), row
	// log-sum-exps, the loss, and, when the program pairs the gradients
	// with it (LinearCrossEntropyGradProducer), the chunk's softmax −
	// onehot in place, dh = dl·W and dW += dlᵀ·h, so no [N, V] value is
	// ever stored.
	OpLinearCrossEntropy Op = endLossOps + iota
	// OpLinearCrossEntropyGradH is linear_cross_entropy's gradient for h:
	// inputs g (scalar, float32), h, W, labels[, scale]; the forward op's
	// attributes. g·scale·Scalar·(softmax(l) − onehot(label))·W, 0 for
	// ignored rows, h's type.
	OpLinearCrossEntropyGradH
	// OpLinearCrossEntropyGradW is its gradient for W: the same inputs and
	// attributes; g·scale·Scalar·Σ over rows of (softmax − onehot)ᵀ·h, W's
	// type, rows past End zero.
	OpLinearCrossEntropyGradW
	endLinearCrossEntropyOps
)

// Token-chunk bounds of linear_cross_entropy (Attrs.LossChunk): the
// a Session picks a power of two between them (batchfit.Options.LossChunk);
// DefaultLossChunk is the chunk of a node made with LossChunk 0.
const (
	MinLossChunk     = 256
	MaxLossChunk     = 8192
	DefaultLossChunk = 2048
)

var linearCrossEntropyOps = []OpInfo{
	OpLinearCrossEntropy: {Name: "linear_cross_entropy", Category: CatLoss, MinArity: 3, Arity: 3, MaxArity: 4,
		Attrs: []string{"reduction", "end", "loss_chunk", "target"},
		Rule:  linearCrossEntropyRule, Saves: SavesInput(0, 1, 2, 3),
		Chunk: &Chunk{Consume: lceConsume},
		VJP: func(b VJPBuilder, n *Node, g int) {
			a := Attrs{Reduction: n.Attrs.Reduction, Scalar: n.Attrs.Scalar, End: n.Attrs.End, LossChunk: n.Attrs.LossChunk}
			ins := append([]int{g}, n.Inputs...)
			if b.Wants(0) {
				b.Accumulate(n.Inputs[0], b.Emit(OpLinearCrossEntropyGradH, a, ins...))
			}
			if b.Wants(1) {
				b.Accumulate(n.Inputs[1], b.Emit(OpLinearCrossEntropyGradW, a, ins...))
			}
			if len(n.Inputs) > 3 && b.Wants(3) {
				// d loss / d scale: the loss without its scale.
				un := b.Emit(OpLinearCrossEntropy, a, n.Inputs[:3]...)
				b.Accumulate(n.Inputs[3], mul(b, g, un))
			}
		}},
	OpLinearCrossEntropyGradH: {Name: "linear_cross_entropy_grad_h", Category: CatGrad, MinArity: 4, Arity: 4, MaxArity: 5,
		Attrs: []string{"reduction", "end", "loss_chunk", "target"}, NoVJP: noVJPGrad, Chunk: plainChunk,
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			fwd, err := lceGradCheck(op, attrs, in)
			if err != nil {
				return fwd, err
			}
			return in[1], nil
		})},
	OpLinearCrossEntropyGradW: {Name: "linear_cross_entropy_grad_w", Category: CatGrad, MinArity: 4, Arity: 4, MaxArity: 5,
		Attrs: []string{"reduction", "end", "loss_chunk", "target"}, NoVJP: noVJPGrad,
		Chunk: &Chunk{Consume: func(n *Node, in []Type) (Combine, string) { return lceConsume(n, in[1:]) }},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			fwd, err := lceGradCheck(op, attrs, in)
			if err != nil {
				return fwd, err
			}
			return in[2], nil
		})},
}

// lceConsume: the per-row losses (and W's gradient) are sums over rows, so
// chunk partials add when h and the labels carry the batch on axis 0 and
// W and the scale are shared.
func lceConsume(_ *Node, in []Type) (Combine, string) {
	h, w, labels := in[0], in[1], in[2]
	if len(in) > 3 && in[3].Batched() {
		return CombineNone, "linear_cross_entropy's scale has a batch axis"
	}
	if h.BatchAxis == 0 && labels.BatchAxis == 0 && !w.Batched() {
		return CombineSum, ""
	}
	return CombineNone, fmt.Sprintf("h (batch axis %d) and labels (batch axis %d) must carry the batch on axis 0, W (batch axis %d) none",
		h.BatchAxis, labels.BatchAxis, w.BatchAxis)
}

func lceGradCheck(op Op, attrs *Attrs, in []Type) (Type, error) {
	a := *attrs
	fwd, err := linearCrossEntropy(&a, in[1:])
	if err := expect(op, "gradient", in[0], fwd, err); err != nil {
		return Type{}, err
	}
	if in[0].DType != Float32 {
		return Type{}, Errorf(ErrDType, "%s needs a float32 upstream gradient, got %s", op, in[0].DType)
	}
	*attrs = a
	return fwd, nil
}

func linearCrossEntropyRule(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	return linearCrossEntropy(attrs, in)
}

func linearCrossEntropy(attrs *Attrs, in []Type) (Type, error) {
	h, w, labels := in[0], in[1], in[2]
	op := OpLinearCrossEntropy
	if err := needFloat(op, h, w); err != nil {
		return Type{}, err
	}
	if h.DType != w.DType {
		return Type{}, Errorf(ErrDType, "linear_cross_entropy needs h and W of one dtype, got %s and %s", h.DType, w.DType)
	}
	if labels.DType != Int64 {
		return Type{}, Errorf(ErrDType, "linear_cross_entropy labels must be int64 class indices, got %s", labels.DType)
	}
	if len(h.Shape) != 2 || len(w.Shape) != 2 || len(labels.Shape) != 1 || h.Shape[1] != w.Shape[1] || labels.Shape[0] != h.Shape[0] {
		return Type{}, Errorf(ErrShape, "linear_cross_entropy needs h [N, C], W [V, C] and labels [N], got %v, %v and %v", h.Shape, w.Shape, labels.Shape)
	}
	if h.Shape[0] == 0 || w.Shape[0] == 0 || h.Shape[1] == 0 {
		return Type{}, Errorf(ErrShape, "linear_cross_entropy of an empty batch, zero classes or zero features: h %v, W %v", h.Shape, w.Shape)
	}
	if w.Batched() {
		return Type{}, Errorf(ErrShape, "linear_cross_entropy's W %v has a batch axis (%d): it must be shared by every row", w.Shape, w.BatchAxis)
	}
	if len(in) > 3 {
		if s := in[3]; s.DType != Float32 || len(s.Shape) != 0 {
			return Type{}, Errorf(ErrShape, "linear_cross_entropy's scale must be a float32 scalar, got %s%v", s.DType, s.Shape)
		}
	}
	if attrs.End < 0 || attrs.End > w.Shape[0] {
		return Type{}, Errorf(ErrShape, "linear_cross_entropy of %d classes (end) out of W %v: want 0 (all rows) up to %d", attrs.End, w.Shape, w.Shape[0])
	}
	if attrs.LossChunk == 0 {
		attrs.LossChunk = DefaultLossChunk
	}
	if attrs.LossChunk < 1 || attrs.LossChunk > 1<<20 {
		return Type{}, Errorf(ErrAttr, "linear_cross_entropy chunk of %d tokens: want 1 to %d (0 for %d)", attrs.LossChunk, 1<<20, DefaultLossChunk)
	}
	lossScale(attrs, h.Shape[0])
	// Target records h's dtype, the logits chunk's (LossChunkDType), for
	// kernels that see the node and not its inputs.
	attrs.Target = Type{Shape: []int{}, DType: h.DType, BatchAxis: -1, PerSample: 1}
	return Type{Shape: []int{}, DType: Float32, BatchAxis: -1, PerSample: 1}, nil
}

// LossChunkRows is the rows of one logits chunk of linear_cross_entropy
// node attributes a over rows rows of h: LossChunk, at most rows.
func LossChunkRows(a *Attrs, rows int) int {
	t := a.LossChunk
	if t <= 0 {
		t = DefaultLossChunk
	}
	return max(min(t, rows), 0)
}

// LossChunkPitch is the row pitch, in elements, of a logits chunk over
// a W of v rows: v rounded up to a multiple of 8, so that every row of
// 16-bit values starts on a 16-byte boundary (the GEMMs' and the row
// kernels' vector loads); the columns past v are zero in a gradient.
func LossChunkPitch(v int) int { return (v + 7) &^ 7 }

// LossChunkWorkspace is the scratch of a linear_cross_entropy node, or
// of a gradient of one that computes its chunks itself, with attributes a
// when rows rows of h (the chunk's) run over a W of v rows, as both
// executors declare it: one logits chunk of t = LossChunkRows(a, rows)
// rows, [t, LossChunkPitch(v)] in the node's dtype (LossChunkDType),
// from byte 0; the chunk's rows' float64 losses from LossRowsOffset; then
// a float64 sum of the losses and an int64 flag for a bad label. It grows
// with the rows up to the chunk's and stays there: the planner declares
// it as a bounded workspace (planner.WorkspaceBound).
func LossChunkWorkspace(a *Attrs, rows, v int) int64 {
	t := int64(LossChunkRows(a, rows))
	return t*(int64(LossChunkPitch(v))*int64(LossChunkDType(a).Size())+8) + 16
}

// LossRowsOffset is the byte offset in LossChunkWorkspace of the chunk's
// rows' losses (the loss sum follows them, then the flag).
func LossRowsOffset(a *Attrs, rows, v int) int64 {
	return int64(LossChunkRows(a, rows)) * int64(LossChunkPitch(v)) * int64(LossChunkDType(a).Size())
}

// LossChunkDType is the dtype of a linear_cross_entropy node's h and W
// (with attributes a), in which its logits chunks are computed: float32
// sums of GEMM products rounded to it, as linear's logits are.
func LossChunkDType(a *Attrs) DType {
	if a.Target.DType.IsFloat() {
		return a.Target.DType
	}
	return Float32
}

// IsLinearCrossEntropy reports whether op is linear_cross_entropy or one
// of its gradients (the ops with a token chunk, Attrs.LossChunk).
func IsLinearCrossEntropy(op Op) bool {
	return op == OpLinearCrossEntropy || op == OpLinearCrossEntropyGradH || op == OpLinearCrossEntropyGradW
}

// LinearCrossEntropyGradProducer returns the node whose pass can also give
// linear_cross_entropy_grad_h or _grad_w node m: the linear_cross_entropy
// of the same h, W, labels (and scale) and attributes when m's upstream
// gradient is a fill (a constant seed, known before the forward pass runs:
// the loss is the graph's output, as Liger's fused loss assumes), so the
// forward pass over each logits chunk writes both gradients too; else,
// for a _grad_w, the _grad_h of the same inputs, whose pass recomputes
// the chunks and gives both. −1 otherwise.
func LinearCrossEntropyGradProducer(g *Graph, m int) int {
	if m < 0 || m >= g.Len() {
		return -1
	}
	gr := g.Node(m)
	if gr.Op != OpLinearCrossEntropyGradH && gr.Op != OpLinearCrossEntropyGradW || len(gr.Inputs) < 4 {
		return -1
	}
	same := func(n *Node, ins []int) bool {
		if len(ins) != len(n.Inputs) || n.Attrs.Scalar != gr.Attrs.Scalar || n.Attrs.End != gr.Attrs.End || n.Attrs.LossChunk != gr.Attrs.LossChunk {
			return false
		}
		for k, in := range ins {
			if n.Inputs[k] != in {
				return false
			}
		}
		return true
	}
	if seed := g.Node(gr.Inputs[0]); seed.Op == OpFill && len(seed.Inputs) == 0 {
		for id := m - 1; id >= 0; id-- {
			if n := g.Node(id); n.Op == OpLinearCrossEntropy && same(n, gr.Inputs[1:]) {
				return id
			}
		}
	}
	if gr.Op == OpLinearCrossEntropyGradW {
		for id := m - 1; id > gr.Inputs[0]; id-- {
			if n := g.Node(id); n.Op == OpLinearCrossEntropyGradH && same(n, gr.Inputs) {
				return id
			}
		}
	}
	return -1
}
