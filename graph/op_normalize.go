package graph

import (
	"fmt"
	"math"
	"slices"
)

const (
	OpSoftmax    Op = endReduceOps + iota // Attrs.Axis
	OpLogSoftmax                          // Attrs.Axis
	// OpLayerNorm takes x[, weight[, bias]] and normalises Attrs.NormDims
	// trailing dims with Attrs.Eps. Attrs.Target.DType, when set, is the
	// output's dtype: a 16-bit one from float32 inputs, computed in float
	// and rounded once (as a cast of the float32 result rounds), for a
	// result only 16-bit GEMMs read (package precision).
	OpLayerNorm
	// OpBatchNorm normalises x [N, C, ...] per channel (axis 1), as
	// PyTorch's batch_norm. With Attrs.Training it uses the batch's mean and
	// biased variance over every axis but 1 and takes x[, weight[, bias]];
	// otherwise it uses running statistics and takes x, running_mean,
	// running_var[, weight[, bias]], all [C] (BatchNormAffine says where the
	// weight is). Attrs.Eps. The [C] inputs have x's dtype, or float32
	// when x is 16-bit (mixed precision: arithmetic in float32, output in
	// x's dtype). It updates no running statistics: graphs have no side
	// effects.
	//
	// Attrs.PerChunk (training mode only) is the opt-in to per-chunk
	// statistics: the node normalises with the mean and variance of the
	// samples it runs on, so a graph split into batch chunks normalises
	// each chunk with its own, as PyTorch's gradient accumulation does with
	// its micro-batches, and stays chunkable (its gradients are those of
	// the per-chunk forward; the parameter gradients sum over chunks). In
	// one chunk the statistics are the whole batch's. Without PerChunk a
	// training-mode node makes the graph not chunkable.
	OpBatchNorm
	// OpBatchNormStats is x [N, C, ...]'s per-channel mean and unbiased
	// variance over every axis but 1, as a [2, C] value (row 0 the mean,
	// row 1 the variance): what running statistics are updated with. Its
	// chunk partials merge exactly (CombineMoments), so it is chunkable
	// whatever the batch_norm nodes around it do.
	OpBatchNormStats
	// OpRMSNorm takes x[, weight] and divides each group of the
	// Attrs.NormDims trailing dims by its root mean square,
	// y = x·rsqrt(mean(x²) + Attrs.Eps)·weight (Llama's RMSNorm:
	// Hugging Face's LlamaRMSNorm, with no mean subtracted and no bias).
	// The arithmetic is float32 at least; Attrs.Target.DType, as
	// layer_norm's, may ask for a 16-bit output from float32 inputs,
	// rounded once, for a result only 16-bit GEMMs read.
	OpRMSNorm
	// OpRMSNormGradX is rms_norm's input gradient: g, x[, w]; NormDims,
	// Eps. With x̂ = x·rstd and ĝ = g·w, dx = rstd·(ĝ − x̂·mean(ĝ·x̂)).
	OpRMSNormGradX
	// OpRMSNormGradW is Σ over the leading axes of g·x̂: g, x; NormDims,
	// Eps.
	OpRMSNormGradW
	// OpRMSNormGradXAdd is add(r, rms_norm_grad_x(g, x[, w])) in one node:
	// g, x, r[, w]. Autodiff never emits it: FuseLayerNormGradAdd puts it
	// in place of an rms_norm_grad_x read only by an add of another
	// gradient (the residual stream's), as it does layer_norm_grad_x_add.
	OpRMSNormGradXAdd
	endNormalizeOps
)

// Normalisations: softmax and log_softmax along Attrs.Axis, layer_norm over
// trailing dims, batch_norm per channel. Their gradients read what
// PyTorch's backward saves: softmax's output, layer_norm's input.
var normalizeOps = []OpInfo{
	OpSoftmax: {Name: "softmax", Category: CatNormalize, MinArity: 1, Arity: 1, Attrs: []string{"axis"},
		Rule: softmax, Chunk: &Chunk{PerSample: notAlongBatch}, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) {
			b.Accumulate(n.Inputs[0], b.Emit(OpSoftmaxGrad, Attrs{Axis: n.Attrs.Axis}, g, n.ID))
		}},
	OpLogSoftmax: {Name: "log_softmax", Category: CatNormalize, MinArity: 1, Arity: 1, Attrs: []string{"axis"},
		Rule: softmax, Chunk: &Chunk{PerSample: notAlongBatch}, Saves: SavesOutput,
		VJP: func(b VJPBuilder, n *Node, g int) {
			b.Accumulate(n.Inputs[0], b.Emit(OpLogSoftmaxGrad, Attrs{Axis: n.Attrs.Axis}, g, n.ID))
		}},
	OpLayerNorm: {Name: "layer_norm", Category: CatNormalize, MinArity: 1, Arity: 1, MaxArity: 3, Attrs: []string{"normdims", "eps", "target"},
		Rule: layerNormRule, Saves: SavesInput(0, 1), VJP: layerNormVJP,
		Chunk: &Chunk{Weights: true, PerSample: func(n *Node, _ []Type) string {
			if n.Type.BatchAxis >= len(n.Type.Shape)-n.Attrs.NormDims {
				return "normalises over the batch axis"
			}
			return ""
		}}},
	// Saves over both modes: training reads x and the weight (inputs 0
	// and 1), evaluation x, the running statistics and the weight (0 to 3).
	OpBatchNorm: {Name: "batch_norm", Category: CatNormalize, MinArity: 1, Arity: 1, MaxArity: 5, Attrs: []string{"training", "per_chunk", "eps", "channels_last"},
		Rule: batchNormRule, Saves: SavesInput(0, 1, 2, 3), VJP: batchNormVJP,
		Chunk: &Chunk{Weights: true, PerSample: batchNormPerSample, MinChunk: batchNormMinChunk, Stats: func(n *Node) Stats {
			switch {
			case n.Attrs.Training && n.Attrs.PerChunk:
				return ChunkStats
			case n.Attrs.Training:
				return WholeStats
			}
			return NoStats
		}}},
	OpRMSNorm: {Name: "rms_norm", Category: CatNormalize, MinArity: 1, Arity: 1, MaxArity: 2, Attrs: []string{"normdims", "eps", "target"},
		Rule: rmsNormRule, Saves: SavesInput(0, 1), VJP: rmsNormVJP,
		Chunk: &Chunk{Weights: true, PerSample: normPerSample}},
	OpRMSNormGradX: {Name: "rms_norm_grad_x", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"normdims", "eps"},
		NoVJP: noVJPGrad, Chunk: &Chunk{PerSample: normPerSample},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := *attrs
			fwd, err := rmsNorm(op, &a, in[1:])
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			return sameShape(op, in[1], in[0])
		})},
	// Σ over the leading axes of g·x̂: a parameter gradient, a sum over samples.
	OpRMSNormGradW: {Name: "rms_norm_grad_w", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"normdims", "eps"},
		NoVJP: noVJPGrad, Chunk: &Chunk{Consume: combines(CombineSum)},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := *attrs
			fwd, err := rmsNorm(op, &a, in[1:2])
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			if in[0].DType != in[1].DType {
				return Type{}, Errorf(ErrDType, "%s: g is %s, x is %s", op, in[0].DType, in[1].DType)
			}
			x := in[1]
			return Type{Shape: slices.Clone(x.Shape[len(x.Shape)-attrs.NormDims:]), DType: x.DType, BatchAxis: -1, PerSample: 1}, nil
		})},
	OpRMSNormGradXAdd: {Name: "rms_norm_grad_x_add", Category: CatGrad, MinArity: 3, Arity: 3, MaxArity: 4, Attrs: []string{"normdims", "eps"},
		NoVJP: noVJPGrad, Chunk: &Chunk{PerSample: normPerSample},
		Rule: gradRule(func(op Op, attrs *Attrs, in []Type) (Type, error) {
			a := *attrs
			fwd, err := rmsNorm(op, &a, append([]Type{in[1]}, in[3:]...))
			if err := expect(op, "gradient", in[0], fwd, err); err != nil {
				return Type{}, err
			}
			return sameShape(op, in[1], in[0], in[2]) // x, g and r alike
		})},
	// Saves x, and its own output (the mean) for the variance's gradient.
	OpBatchNormStats: {Name: "batch_norm_stats", Category: CatNormalize, MinArity: 1, Arity: 1,
		Rule: batchNormStatsRule, Saves: SavesInput(0) | SavesOutput, VJP: batchNormStatsVJP,
		Chunk: &Chunk{Consume: combines(CombineMoments), MinChunk: func(n *Node, in []Type) int { return statsMinChunk(in[0]) }}},
}

func softmax(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	if err := needFloat(op, in[0]); err != nil {
		return Type{}, err
	}
	ax, err := normAxis(attrs.Axis, len(in[0].Shape), "axis")
	if err != nil {
		return Type{}, err
	}
	attrs.Axis = ax
	return in[0], nil
}

func notAlongBatch(n *Node, _ []Type) string {
	if n.Attrs.Axis == n.Type.BatchAxis {
		return "normalises along the batch axis"
	}
	return ""
}

func layerNormRule(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	t, err := layerNorm(attrs, in)
	if err != nil {
		return Type{}, err
	}
	// Only the target's dtype is read; the rule clears the rest so that
	// graph signatures stay canonical.
	switch to := attrs.Target.DType; {
	case to == InvalidDType || to == t.DType:
		attrs.Target = Type{}
	case to.IsHalf() && t.DType == Float32:
		attrs.Target = Type{DType: to}
		t.DType = to
	default:
		return Type{}, Errorf(ErrDType, "layer_norm of %s to %s: the output dtype is the input's, or 16-bit from float32", t.DType, to)
	}
	return t, nil
}

func layerNorm(attrs *Attrs, in []Type) (Type, error) {
	x := in[0]
	if err := needFloat(OpLayerNorm, in...); err != nil {
		return Type{}, err
	}
	k := attrs.NormDims
	if k < 1 || k > len(x.Shape) {
		return Type{}, Errorf(ErrAttr, "layer_norm over %d trailing dims of a rank-%d input", k, len(x.Shape))
	}
	if attrs.Eps <= 0 || math.IsNaN(attrs.Eps) {
		return Type{}, Errorf(ErrAttr, "layer_norm eps must be positive, got %g", attrs.Eps)
	}
	norm := x.Shape[len(x.Shape)-k:]
	for i, p := range in[1:] {
		if !slices.Equal(p.Shape, norm) {
			return Type{}, Errorf(ErrShape, "layer_norm %s shape %v, want %v",
				[]string{"weight", "bias"}[i], p.Shape, norm)
		}
		if p.DType != x.DType {
			return Type{}, Errorf(ErrDType, "layer_norm of %s with %s", x.DType, p.DType)
		}
	}
	return x, nil
}

// A 16-bit output of float32 inputs takes its gradient in float32, as the
// cast it replaces would have; the gradients read x, not the output.
func layerNormVJP(b VJPBuilder, n *Node, g int) {
	a := Attrs{NormDims: n.Attrs.NormDims, Eps: n.Attrs.Eps}
	x := n.Inputs[0]
	if dt := b.Type(x).DType; b.Type(g).DType != dt {
		g = b.Emit(OpCast, Attrs{Target: Type{DType: dt}}, g)
	}
	if b.Wants(0) {
		b.Accumulate(x, b.Emit(OpLayerNormGradX, a, append([]int{g}, n.Inputs[:min(2, len(n.Inputs))]...)...))
	}
	if b.Wants(1) {
		b.Accumulate(n.Inputs[1], b.Emit(OpLayerNormGradW, a, g, x))
	}
	if b.Wants(2) {
		b.Accumulate(n.Inputs[2], sumLeading(b, g, len(b.Type(x).Shape)-a.NormDims))
	}
}

// normPerSample serves the norms over trailing dims and their
// gradients: normalising over the batch axis mixes samples.
func normPerSample(n *Node, _ []Type) string {
	if n.Type.BatchAxis >= len(n.Type.Shape)-n.Attrs.NormDims {
		return "normalises over the batch axis"
	}
	return ""
}

// rmsNorm checks x[, weight] as rms_norm takes them and returns x's type.
func rmsNorm(op Op, attrs *Attrs, in []Type) (Type, error) {
	x := in[0]
	if err := needFloat(op, in...); err != nil {
		return Type{}, err
	}
	k := attrs.NormDims
	if k < 1 || k > len(x.Shape) {
		return Type{}, Errorf(ErrAttr, "%s over %d trailing dims of a rank-%d input %v", op, k, len(x.Shape), x.Shape)
	}
	if !(attrs.Eps > 0) || math.IsInf(attrs.Eps, 1) {
		return Type{}, Errorf(ErrAttr, "%s eps must be positive and finite, got %g", op, attrs.Eps)
	}
	if len(in) > 1 {
		norm, w := x.Shape[len(x.Shape)-k:], in[1]
		if !slices.Equal(w.Shape, norm) {
			return Type{}, Errorf(ErrShape, "%s weight shape %v, want %v (the normalised dims of x %v)", op, w.Shape, norm, x.Shape)
		}
		if w.DType != x.DType {
			return Type{}, Errorf(ErrDType, "%s of %s x with a %s weight (want one dtype; precision policies cast both to float32)", op, x.DType, w.DType)
		}
		if w.Batched() {
			return Type{}, Errorf(ErrShape, "%s weight %v carries the batch: one weight serves every sample", op, w.Shape)
		}
	}
	return x, nil
}

// rmsNormRule types rms_norm: x's type, or the 16-bit Target of a
// float32 one (as layerNormRule).
func rmsNormRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	t, err := rmsNorm(op, attrs, in)
	if err != nil {
		return Type{}, err
	}
	switch to := attrs.Target.DType; {
	case to == InvalidDType || to == t.DType:
		attrs.Target = Type{}
	case to.IsHalf() && t.DType == Float32:
		attrs.Target = Type{DType: to}
		t.DType = to
	default:
		return Type{}, Errorf(ErrDType, "%s of %s to %s: the output dtype is the input's, or 16-bit from float32", op, t.DType, to)
	}
	return t, nil
}

// rmsNormVJP: a 16-bit output of float32 inputs takes its gradient in
// float32 (as layerNormVJP); the gradients read x, not the output.
func rmsNormVJP(b VJPBuilder, n *Node, g int) {
	a := Attrs{NormDims: n.Attrs.NormDims, Eps: n.Attrs.Eps}
	x := n.Inputs[0]
	if dt := b.Type(x).DType; b.Type(g).DType != dt {
		g = b.Emit(OpCast, Attrs{Target: Type{DType: dt}}, g)
	}
	if b.Wants(0) {
		b.Accumulate(x, b.Emit(OpRMSNormGradX, a, append([]int{g}, n.Inputs...)...))
	}
	if b.Wants(1) {
		b.Accumulate(n.Inputs[1], b.Emit(OpRMSNormGradW, a, g, x))
	}
}

func batchNormRule(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) { return batchNorm(attrs, in) }

// batchNorm checks x [N, C, ...] and its per-channel inputs, laid out as
// OpBatchNorm says for the mode.
func batchNorm(attrs *Attrs, in []Type) (Type, error) {
	if attrs.ChannelsLast && len(in[0].Shape) != 4 {
		return Type{}, Errorf(ErrShape, "batch_norm channels last needs x [N, H, W, C], got %v", in[0].Shape)
	}
	return channelsLast(attrs, in, func(in []Type) (Type, error) { return batchNormNCHW(attrs, in) })
}

func batchNormNCHW(attrs *Attrs, in []Type) (Type, error) {
	x := in[0]
	aff := BatchNormAffine(attrs.Training)
	names := []string{"weight", "bias"}
	mode := "training mode takes x[, weight[, bias]]"
	if !attrs.Training {
		names = []string{"running_mean", "running_var", "weight", "bias"}
		mode = "evaluation mode takes x, running_mean, running_var[, weight[, bias]]"
	}
	if len(in) < aff || len(in) > aff+2 {
		return Type{}, Errorf(ErrArity, "batch_norm in %s, got %d inputs", mode, len(in))
	}
	if err := needFloat(OpBatchNorm, in...); err != nil {
		return Type{}, err
	}
	if len(x.Shape) < 2 {
		return Type{}, Errorf(ErrShape, "batch_norm needs x [N, C, ...] of rank ≥ 2, got %v", x.Shape)
	}
	if !(attrs.Eps > 0) {
		return Type{}, Errorf(ErrAttr, "batch_norm eps must be positive, got %g", attrs.Eps)
	}
	if attrs.PerChunk && !attrs.Training {
		return Type{}, Errorf(ErrAttr, "batch_norm per-chunk statistics exist in training mode only; evaluation mode uses the running statistics")
	}
	c := x.Shape[1]
	for i, p := range in[1:] {
		if !slices.Equal(p.Shape, []int{c}) {
			return Type{}, Errorf(ErrShape, "batch_norm %s shape %v, want [%d] (the channels of x %v)", names[i], p.Shape, c, x.Shape)
		}
		// 16-bit x with float32 per-channel values is autocast's batch
		// norm (cuDNN's, as PyTorch calls it): float32 weights and
		// running statistics, arithmetic in float32, x's dtype out.
		if p.DType != x.DType && !(x.DType.IsHalf() && p.DType == Float32) {
			return Type{}, Errorf(ErrDType, "batch_norm of %s with %s %s (want %s, or float32 for 16-bit x)", x.DType, names[i], p.DType, x.DType)
		}
	}
	// PyTorch refuses the same: one value per channel has no variance.
	if m := x.Shape[0] * Numel(x.Shape[2:]); attrs.Training && m <= 1 {
		return Type{}, Errorf(ErrShape, "batch_norm in training mode needs more than one value per channel, got x %v", x.Shape)
	}
	return x, nil
}

// batchNormPerSample serves batch_norm and its gradients.
func batchNormPerSample(n *Node, _ []Type) string {
	switch {
	case n.Attrs.Training && !n.Attrs.PerChunk:
		// Every output element depends on the whole batch's mean and
		// variance: a chunk would normalise with its own. With PerChunk
		// that is what the node asks for.
		return fmt.Sprintf("normalises with batch statistics (%s in training mode; per-chunk statistics opt in to chunks: Attrs.PerChunk, nn.BatchNorm2d.PerChunkStats)", n.Op)
	case n.Type.BatchAxis == 1 || n.Op == OpBatchNormGradW:
		return "batch axis is the channel axis: each chunk would need its slice of the per-channel values"
	}
	return ""
}

// batchNormMinChunk serves batch_norm and its gradients: with per-chunk
// statistics every chunk needs more than one value per channel.
func batchNormMinChunk(n *Node, in []Type) int {
	if !n.Attrs.PerChunk {
		return 1
	}
	x := in[0]
	if n.Op != OpBatchNorm {
		x = in[1] // the gradients take g first
	}
	if n.Attrs.ChannelsLast {
		x = ToNCHW(x)
	}
	return statsMinChunk(x)
}

// statsMinChunk is the fewest samples of x [N, C, ...] that hold more
// than one value per channel: 2 when a sample holds one (x [N, C]), else 1.
func statsMinChunk(x Type) int {
	if x.BatchAxis < 0 || x.BatchAxis == 1 || len(x.Shape) < 2 || x.Shape[1] == 0 {
		return 1 // chunks leave every channel's values whole
	}
	if Numel(x.AtBatch(1))/x.Shape[1] < 2 {
		return 2
	}
	return 1
}

// batchNormStatsRule: x [N, C, ...] with more than one value per channel
// gives [2, C]. A batch axis on the channels (axis 1) stays one (axis 1 of
// the result): each channel's statistics are its own.
func batchNormStatsRule(op Op, _ *Attrs, in []Type, _ int) (Type, error) {
	x := in[0]
	if err := needFloat(op, x); err != nil {
		return Type{}, err
	}
	if len(x.Shape) < 2 {
		return Type{}, Errorf(ErrShape, "batch_norm_stats needs x [N, C, ...] of rank ≥ 2, got %v", x.Shape)
	}
	if m := x.Shape[0] * Numel(x.Shape[2:]); m <= 1 {
		return Type{}, Errorf(ErrShape, "batch_norm_stats needs more than one value per channel for an unbiased variance, got x %v", x.Shape)
	}
	t := Type{Shape: []int{2, x.Shape[1]}, DType: x.DType, BatchAxis: -1, PerSample: 1}
	if x.BatchAxis == 1 {
		t.BatchAxis, t.PerSample = 1, x.PerSample
	}
	return t, nil
}

// batchNormStatsVJP: with M values per channel, d mean/dx = 1/M and
// d var/dx = 2·(x − mean)/(M − 1), so dx = g_mean/M + 2·g_var·(x − mean)/(M − 1)
// with g_mean and g_var rows 0 and 1 of g broadcast over x. (PyTorch keeps
// running statistics out of autograd; the op is differentiable anyway, so
// it can sit anywhere in a graph.)
func batchNormStatsVJP(b VJPBuilder, n *Node, g int) {
	x := n.Inputs[0]
	xt := b.Type(x)
	c := xt.Shape[1]
	m := float64(xt.Numel() / c)
	bc := make([]int, len(xt.Shape)) // [1, C, 1, …]
	for i := range bc {
		bc[i] = 1
	}
	bc[1] = c
	row := func(v, i int) int {
		return b.Emit(OpReshape, Attrs{Shape: bc}, b.Emit(OpSlice, Attrs{Axis: 0, Start: i, End: i + 1, Step: 1}, v))
	}
	gm, gv, mean := row(g, 0), row(g, 1), row(n.ID, 0)
	dv := scalar(b, OpMulScalar, mul(b, b.Emit(OpSub, Attrs{}, x, mean), gv), 2/(m-1))
	b.Accumulate(x, b.Emit(OpAdd, Attrs{}, dv, scalar(b, OpMulScalar, gm, 1/m)))
}

// batchNormVJP: y = x̂·w + b per channel, with x̂ = (x − mean)·rstd.
//
// Training mode: mean and rstd are the batch's, so every x moves them and
// dx is batch_norm_grad_x's (1/M)·rstd·(M·ĝ − Σĝ − x̂·Σ(ĝ·x̂)) with ĝ = g·w
// and M values per channel.
//
// Evaluation mode: mean and rstd come from the running statistics, so
// dx = g·w·rstd, a per-channel scale made from the [C] inputs alone (x is
// not saved for it). Gradients for the running statistics themselves, when
// asked for (PyTorch keeps them out of autograd), are
// d mean = −Σ g·w·rstd and d var = −½·Σ(g·x̂)·w·rstd².
// In both modes dw = Σ g·x̂ (batch_norm_grad_w) and db = Σ g over every
// axis but the channel axis.
func batchNormVJP(b VJPBuilder, n *Node, g int) {
	in := n.Inputs
	x := in[0]
	train := n.Attrs.Training
	a := Attrs{Training: train, PerChunk: n.Attrs.PerChunk, Eps: n.Attrs.Eps, ChannelsLast: n.Attrs.ChannelsLast}
	aff := BatchNormAffine(train)
	xt := b.Type(x)
	axes := []int{0} // every axis but the channels
	for i := 2; i < len(xt.Shape); i++ {
		axes = append(axes, i)
	}
	if a.ChannelsLast { // x [N, H, W, C]
		axes = []int{0, 1, 2}
	}
	var stats []int // running mean and variance, in evaluation mode
	if !train {
		stats = in[1:3]
	}
	w := -1
	if len(in) > aff {
		w = in[aff]
	}
	gw := -1 // Σ g·x̂, made once for whichever inputs need it
	gradW := func() int {
		if gw < 0 {
			gw = b.Emit(OpBatchNormGradW, a, append([]int{g, x}, stats...)...)
		}
		return gw
	}
	if train && b.Wants(0) {
		xs := []int{g, x}
		if w >= 0 {
			xs = append(xs, w)
		}
		b.Accumulate(x, b.Emit(OpBatchNormGradX, a, xs...))
	}
	if !train && (b.Wants(0) || b.Wants(1) || b.Wants(2)) {
		// rstd = (var + eps)^−½ and scale = w·rstd, both [C].
		rstd := scalar(b, OpPowScalar, scalar(b, OpAddScalar, stats[1], n.Attrs.Eps), -0.5)
		scale := rstd
		if w >= 0 {
			scale = mul(b, w, rstd)
		}
		if b.Wants(0) && a.ChannelsLast { // scale [C] broadcasts against x [N, H, W, C] as it is
			b.Accumulate(x, mul(b, g, scale))
		} else if b.Wants(0) { // scale broadcast as [C, 1, …, 1] against x [N, C, …]
			bc := make([]int, len(xt.Shape)-1)
			for i := range bc {
				bc[i] = 1
			}
			bc[0] = xt.Shape[1]
			b.Accumulate(x, mul(b, g, b.Emit(OpReshape, Attrs{Shape: bc}, scale)))
		}
		if b.Wants(1) {
			b.Accumulate(stats[0], neg(b, mul(b, b.Emit(OpSum, Attrs{Axes: axes}, g), scale)))
		}
		if b.Wants(2) {
			b.Accumulate(stats[1], scalar(b, OpMulScalar, mul(b, gradW(), mul(b, scale, rstd)), -0.5))
		}
	}
	if b.Wants(aff) {
		b.Accumulate(in[aff], gradW())
	}
	if b.Wants(aff + 1) {
		b.Accumulate(in[aff+1], b.Emit(OpSum, Attrs{Axes: axes}, g))
	}
}
