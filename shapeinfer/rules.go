package shapeinfer

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// Rule computes the type of op applied to inputs of types in. It may
// normalise attrs in place (negative axes, reshape's −1, the 1/count scale of
// mean and mean-reduced losses, default strides) so that executors read
// canonical values. batch is the graph's full batch size N.
//
// The switch is exhaustive: an op without a rule is an error, so a new op
// cannot slip through unhandled.
func Rule(op graph.Op, attrs *graph.Attrs, in []graph.Type, batch int) (graph.Type, error) {
	if op == graph.OpFill {
		if err := op.CheckArity(len(in)); err != nil {
			return graph.Type{}, err
		}
		return fill(attrs)
	}
	if op.Category() == graph.CatSource {
		return graph.Type{}, graph.Errorf(graph.ErrArity, "%s is a source; sources are typed by their data", op)
	}
	if err := op.CheckArity(len(in)); err != nil {
		return graph.Type{}, err
	}
	switch op.Category() {
	case graph.CatUnary, graph.CatScalar:
		if err := needFloat(op, in[0]); err != nil {
			return graph.Type{}, err
		}
		if op == graph.OpDropout && !(attrs.Scalar >= 0 && attrs.Scalar < 1) {
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "dropout probability %g must lie in [0, 1)", attrs.Scalar)
		}
		if op == graph.OpCausalMask && len(in[0].Shape) < 2 {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "causal_mask needs rank ≥ 2 [..., T, S], got %v", in[0].Shape)
		}
		return in[0], nil
	case graph.CatBinary:
		return binary(op, in[0], in[1])
	case graph.CatGrad:
		return gradRule(op, attrs, in, batch)
	}
	switch op {
	case graph.OpMatMul:
		a, b := in[0], in[1]
		if attrs.TransA {
			a = transposeLast2(a)
		}
		if attrs.TransB {
			b = transposeLast2(b)
		}
		return matmul(a, b)
	case graph.OpLinear:
		return linear(in)
	case graph.OpSum, graph.OpMean, graph.OpMax:
		return reduce(op, attrs, in[0])
	case graph.OpSoftmax, graph.OpLogSoftmax:
		if err := needFloat(op, in[0]); err != nil {
			return graph.Type{}, err
		}
		ax, err := normAxis(attrs.Axis, len(in[0].Shape), "axis")
		if err != nil {
			return graph.Type{}, err
		}
		attrs.Axis = ax
		return in[0], nil
	case graph.OpLayerNorm:
		return layerNorm(attrs, in)
	case graph.OpBatchNorm:
		return batchNorm(attrs, in)
	case graph.OpReshape:
		return reshape(attrs, in[0], batch)
	case graph.OpPermute:
		return permute(attrs, in[0])
	case graph.OpSlice:
		return slice(attrs, in[0])
	case graph.OpConcat:
		return concat(attrs, in)
	case graph.OpEmbedding:
		return embedding(in[0], in[1])
	case graph.OpConv2d:
		return conv2d(attrs, in)
	case graph.OpMaxPool2d, graph.OpAvgPool2d:
		return pool2d(op, attrs, in[0])
	case graph.OpCrossEntropy:
		return crossEntropy(attrs, in[0], in[1])
	case graph.OpMSE:
		return mse(attrs, in[0], in[1])
	}
	return graph.Type{}, graph.Errorf(graph.ErrAttr, "no shape rule for op %s", op)
}

func needFloat(op graph.Op, ts ...graph.Type) error {
	for i, t := range ts {
		if !t.DType.IsFloat() {
			return graph.Errorf(graph.ErrDType, "%s needs floating-point input %d, got %s", op, i, t.DType)
		}
	}
	return nil
}

func normAxis(ax, rank int, what string) (int, error) {
	if ax < -rank || ax >= rank {
		return 0, graph.Errorf(graph.ErrAttr, "%s %d out of range for rank %d", what, ax, rank)
	}
	if ax < 0 {
		ax += rank
	}
	return ax, nil
}

// BroadcastShapes applies NumPy broadcasting to two shapes.
func BroadcastShapes(a, b []int) ([]int, error) {
	r := max(len(a), len(b))
	out := make([]int, r)
	for i := range r {
		da, db := dimFromRight(a, r-1-i), dimFromRight(b, r-1-i)
		switch {
		case da == db || db == 1:
			out[i] = da
		case da == 1:
			out[i] = db
		default:
			return nil, graph.Errorf(graph.ErrShape, "cannot broadcast %v with %v: dimension %d is %d vs %d",
				a, b, i, da, db)
		}
	}
	return out, nil
}

// dimFromRight returns the size of the k-th dim from the right (0 = last), or 1 past the rank.
func dimFromRight(s []int, k int) int {
	if k >= len(s) {
		return 1
	}
	return s[len(s)-1-k]
}

// alignBatch maps the batch axes of operands broadcast into rank r. Both
// operands may be batched only when their batch axes coincide.
func alignBatch(r int, ts ...graph.Type) (axis, per int, err error) {
	axis, per = -1, 1
	for _, t := range ts {
		if t.BatchAxis < 0 {
			continue
		}
		a := t.BatchAxis + r - len(t.Shape)
		if axis >= 0 && (a != axis || t.PerSample != per) {
			return 0, 0, graph.Errorf(graph.ErrShape, "batch axes do not line up (output axes %d and %d)", axis, a)
		}
		axis, per = a, t.PerSample
	}
	return axis, per, nil
}

func binary(op graph.Op, a, b graph.Type) (graph.Type, error) {
	if err := needFloat(op, a, b); err != nil {
		return graph.Type{}, err
	}
	if a.DType != b.DType {
		return graph.Type{}, graph.Errorf(graph.ErrDType, "%s of %s and %s", op, a.DType, b.DType)
	}
	s, err := BroadcastShapes(a.Shape, b.Shape)
	if err != nil {
		return graph.Type{}, err
	}
	ax, per, err := alignBatch(len(s), a, b)
	if err != nil {
		return graph.Type{}, err
	}
	// A batch of one broadcast along a longer axis of the other operand no
	// longer counts samples there: the output has no batch axis.
	for _, t := range []graph.Type{a, b} {
		if t.BatchAxis >= 0 && t.Shape[t.BatchAxis] != s[ax] {
			ax, per = -1, 1
		}
	}
	return graph.Type{Shape: s, DType: a.DType, BatchAxis: ax, PerSample: per}, nil
}

func matmul(a, b graph.Type) (graph.Type, error) {
	if err := needFloat(graph.OpMatMul, a, b); err != nil {
		return graph.Type{}, err
	}
	if a.DType != b.DType {
		return graph.Type{}, graph.Errorf(graph.ErrDType, "matmul of %s and %s", a.DType, b.DType)
	}
	ra, rb := len(a.Shape), len(b.Shape)
	if ra < 2 || rb < 2 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "matmul needs rank ≥ 2 operands, got ranks %d and %d", ra, rb)
	}
	m, k := a.Shape[ra-2], a.Shape[ra-1]
	k2, n := b.Shape[rb-2], b.Shape[rb-1]
	if k != k2 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "matmul inner dimensions differ: %d vs %d", k, k2)
	}
	lead, err := BroadcastShapes(a.Shape[:ra-2], b.Shape[:rb-2])
	if err != nil {
		return graph.Type{}, err
	}
	out := append(lead, m, n)
	r := len(out)
	t := graph.Type{Shape: out, DType: a.DType, BatchAxis: -1, PerSample: 1}
	// Where each operand's batch axis lands in the output (−1: contracted).
	land := func(x graph.Type, rowAxis, colAxis int) int {
		switch ax := x.BatchAxis; {
		case ax < 0:
			return -2 // unbatched
		case ax == len(x.Shape)-2:
			return rowAxis
		case ax == len(x.Shape)-1:
			return colAxis
		default:
			return ax + r - len(x.Shape)
		}
	}
	la := land(a, r-2, -1)
	lb := land(b, -1, r-1)
	per := a.PerSample
	if a.BatchAxis < 0 {
		per = b.PerSample
	}
	switch {
	case la >= 0 && lb >= 0 && la != lb:
		return graph.Type{}, graph.Errorf(graph.ErrShape, "matmul operands' batch axes land on different output axes (%d and %d)", la, lb)
	case la >= 0:
		t.BatchAxis, t.PerSample = la, per
	case lb >= 0:
		t.BatchAxis, t.PerSample = lb, per
	}
	// A batch of one broadcast along a longer leading axis of the other
	// operand no longer counts samples there.
	for _, x := range []graph.Type{a, b} {
		if t.BatchAxis >= 0 && x.BatchAxis >= 0 && x.Shape[x.BatchAxis] != out[t.BatchAxis] {
			t.BatchAxis, t.PerSample = -1, 1
		}
	}
	return t, nil
}

// transposeLast2 is t with its last two axes swapped (ranks < 2 unchanged).
func transposeLast2(t graph.Type) graph.Type {
	r := len(t.Shape)
	if r < 2 {
		return t
	}
	t.Shape = slices.Clone(t.Shape)
	t.Shape[r-2], t.Shape[r-1] = t.Shape[r-1], t.Shape[r-2]
	switch t.BatchAxis {
	case r - 2:
		t.BatchAxis = r - 1
	case r - 1:
		t.BatchAxis = r - 2
	}
	return t
}

func linear(in []graph.Type) (graph.Type, error) {
	x, w := in[0], in[1]
	if err := needFloat(graph.OpLinear, in...); err != nil {
		return graph.Type{}, err
	}
	if len(x.Shape) < 1 || len(w.Shape) != 2 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "linear needs x of rank ≥ 1 and a 2-D weight [out, in], got ranks %d and %d", len(x.Shape), len(w.Shape))
	}
	if x.Shape[len(x.Shape)-1] != w.Shape[1] {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "linear: input features %d do not match weight [out=%d, in=%d]",
			x.Shape[len(x.Shape)-1], w.Shape[0], w.Shape[1])
	}
	if len(in) == 3 && !slices.Equal(in[2].Shape, []int{w.Shape[0]}) {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "linear: bias shape %v, want [%d]", in[2].Shape, w.Shape[0])
	}
	for _, t := range in[1:] {
		if t.DType != x.DType {
			return graph.Type{}, graph.Errorf(graph.ErrDType, "linear of %s with %s", x.DType, t.DType)
		}
	}
	out := append(slices.Clone(x.Shape[:len(x.Shape)-1]), w.Shape[0])
	t := graph.Type{Shape: out, DType: x.DType, BatchAxis: x.BatchAxis, PerSample: x.PerSample}
	if x.BatchAxis == len(x.Shape)-1 {
		t.BatchAxis, t.PerSample = -1, 1 // contracted; chunkability analysis reports it
	}
	return t, nil
}

func reduce(op graph.Op, attrs *graph.Attrs, x graph.Type) (graph.Type, error) {
	if err := needFloat(op, x); err != nil {
		return graph.Type{}, err
	}
	rank := len(x.Shape)
	axes := attrs.Axes
	if len(axes) == 0 { // no axes: reduce everything
		axes = make([]int, rank)
		for i := range axes {
			axes[i] = i
		}
	}
	norm := make([]int, len(axes))
	for i, a := range axes {
		ax, err := normAxis(a, rank, "reduce axis")
		if err != nil {
			return graph.Type{}, err
		}
		norm[i] = ax
	}
	slices.Sort(norm)
	if len(slices.Compact(slices.Clone(norm))) != len(norm) {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "%s: repeated axis in %v", op, axes)
	}
	attrs.Axes = norm
	t := graph.Type{DType: x.DType, BatchAxis: -1, PerSample: 1}
	count := 1
	for i, d := range x.Shape {
		reduced := slices.Contains(norm, i)
		if reduced {
			count *= d
			if attrs.KeepDim {
				t.Shape = append(t.Shape, 1)
			}
			continue
		}
		if i == x.BatchAxis {
			t.BatchAxis, t.PerSample = len(t.Shape), x.PerSample
		}
		t.Shape = append(t.Shape, d)
	}
	if t.Shape == nil {
		t.Shape = []int{}
	}
	if count == 0 && op != graph.OpSum {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "%s over an empty axis", op)
	}
	if op == graph.OpMean {
		attrs.Scalar = 1 / float64(count)
	}
	return t, nil
}

func layerNorm(attrs *graph.Attrs, in []graph.Type) (graph.Type, error) {
	x := in[0]
	if err := needFloat(graph.OpLayerNorm, in...); err != nil {
		return graph.Type{}, err
	}
	k := attrs.NormDims
	if k < 1 || k > len(x.Shape) {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "layer_norm over %d trailing dims of a rank-%d input", k, len(x.Shape))
	}
	if attrs.Eps <= 0 || math.IsNaN(attrs.Eps) {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "layer_norm eps must be positive, got %g", attrs.Eps)
	}
	norm := x.Shape[len(x.Shape)-k:]
	for i, p := range in[1:] {
		if !slices.Equal(p.Shape, norm) {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "layer_norm %s shape %v, want %v",
				[]string{"weight", "bias"}[i], p.Shape, norm)
		}
		if p.DType != x.DType {
			return graph.Type{}, graph.Errorf(graph.ErrDType, "layer_norm of %s with %s", x.DType, p.DType)
		}
	}
	return x, nil
}

// batchNorm checks x [N, C, ...] and its per-channel inputs, laid out as
// graph.OpBatchNorm says for the mode.
func batchNorm(attrs *graph.Attrs, in []graph.Type) (graph.Type, error) {
	x := in[0]
	aff := graph.BatchNormAffine(attrs.Training)
	names := []string{"weight", "bias"}
	mode := "training mode takes x[, weight[, bias]]"
	if !attrs.Training {
		names = []string{"running_mean", "running_var", "weight", "bias"}
		mode = "evaluation mode takes x, running_mean, running_var[, weight[, bias]]"
	}
	if len(in) < aff || len(in) > aff+2 {
		return graph.Type{}, graph.Errorf(graph.ErrArity, "batch_norm in %s, got %d inputs", mode, len(in))
	}
	if err := needFloat(graph.OpBatchNorm, in...); err != nil {
		return graph.Type{}, err
	}
	if len(x.Shape) < 2 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "batch_norm needs x [N, C, ...] of rank ≥ 2, got %v", x.Shape)
	}
	if !(attrs.Eps > 0) {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "batch_norm eps must be positive, got %g", attrs.Eps)
	}
	c := x.Shape[1]
	for i, p := range in[1:] {
		if !slices.Equal(p.Shape, []int{c}) {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "batch_norm %s shape %v, want [%d] (the channels of x %v)", names[i], p.Shape, c, x.Shape)
		}
		if p.DType != x.DType {
			return graph.Type{}, graph.Errorf(graph.ErrDType, "batch_norm of %s with %s %s", x.DType, names[i], p.DType)
		}
	}
	// PyTorch refuses the same: one value per channel has no variance.
	if m := x.Shape[0] * graph.Numel(x.Shape[2:]); attrs.Training && m <= 1 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "batch_norm in training mode needs more than one value per channel, got x %v", x.Shape)
	}
	return x, nil
}

func reshape(attrs *graph.Attrs, x graph.Type, batch int) (graph.Type, error) {
	target := slices.Clone(attrs.Shape)
	if target == nil {
		target = []int{}
	}
	infer, known := -1, 1
	for i, d := range target {
		switch {
		case d == -1 && infer < 0:
			infer = i
		case d == -1:
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "reshape to %v: more than one -1", attrs.Shape)
		case d < 0:
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "reshape to %v: negative size", attrs.Shape)
		default:
			known *= d
		}
	}
	n := x.Numel()
	if infer >= 0 {
		if known == 0 || n%known != 0 {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "reshape of %d elements to %v", n, attrs.Shape)
		}
		target[infer] = n / known
	}
	if graph.Numel(target) != n {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "reshape of %d elements to %v (%d elements)", n, attrs.Shape, graph.Numel(target))
	}
	attrs.Shape = target
	t := graph.Type{Shape: target, DType: x.DType, BatchAxis: -1, PerSample: 1}
	if x.BatchAxis < 0 || batch <= 0 {
		return t, nil
	}
	// Samples stay a clean outer factor of some output axis e only if the
	// elements before the batch axis keep their extent: prod(out[:e]) ==
	// prod(in[:d]). Otherwise the batch is folded under a leading axis and
	// the result has no batch axis (chunkability analysis reports it).
	pre := graph.Numel(x.Shape[:x.BatchAxis])
	p := 1
	for e, d := range target {
		if p == pre && d%batch == 0 && d >= batch {
			t.BatchAxis, t.PerSample = e, d/batch
			break
		}
		p *= d
		if p > pre {
			break
		}
	}
	return t, nil
}

func permute(attrs *graph.Attrs, x graph.Type) (graph.Type, error) {
	rank := len(x.Shape)
	if len(attrs.Perm) != rank {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "permute %v of a rank-%d input", attrs.Perm, rank)
	}
	perm := make([]int, rank)
	seen := make([]bool, rank)
	t := graph.Type{Shape: make([]int, rank), DType: x.DType, BatchAxis: -1, PerSample: x.PerSample}
	for i, p := range attrs.Perm {
		ax, err := normAxis(p, rank, "permute axis")
		if err != nil {
			return graph.Type{}, err
		}
		if seen[ax] {
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "permute %v repeats axis %d", attrs.Perm, ax)
		}
		seen[ax] = true
		perm[i] = ax
		t.Shape[i] = x.Shape[ax]
		if ax == x.BatchAxis {
			t.BatchAxis = i
		}
	}
	attrs.Perm = perm
	return t, nil
}

func slice(attrs *graph.Attrs, x graph.Type) (graph.Type, error) {
	ax, err := normAxis(attrs.Axis, len(x.Shape), "slice axis")
	if err != nil {
		return graph.Type{}, err
	}
	attrs.Axis = ax
	if attrs.Step == 0 {
		attrs.Step = 1
	}
	d := x.Shape[ax]
	if attrs.Step < 0 || attrs.Start < 0 || attrs.End > d || attrs.Start > attrs.End {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "slice [%d:%d:%d] of axis %d (size %d)", attrs.Start, attrs.End, attrs.Step, ax, d)
	}
	t := x
	t.Shape = slices.Clone(x.Shape)
	t.Shape[ax] = (attrs.End - attrs.Start + attrs.Step - 1) / attrs.Step
	if ax == x.BatchAxis {
		t.BatchAxis, t.PerSample = -1, 1 // selecting samples: not chunkable, reported by analysis
	}
	return t, nil
}

func concat(attrs *graph.Attrs, in []graph.Type) (graph.Type, error) {
	first := in[0]
	ax, err := normAxis(attrs.Axis, len(first.Shape), "concat axis")
	if err != nil {
		return graph.Type{}, err
	}
	attrs.Axis = ax
	t := graph.Type{Shape: slices.Clone(first.Shape), DType: first.DType, BatchAxis: -1, PerSample: 1}
	t.Shape[ax] = 0
	for i, x := range in {
		if len(x.Shape) != len(first.Shape) {
			return graph.Type{}, graph.Errorf(graph.ErrShape, "concat input %d is %v, input 0 is %v", i, x.Shape, first.Shape)
		}
		if x.DType != first.DType {
			return graph.Type{}, graph.Errorf(graph.ErrDType, "concat input %d is %s, input 0 is %s", i, x.DType, first.DType)
		}
		for j, d := range x.Shape {
			if j != ax && d != first.Shape[j] {
				return graph.Type{}, graph.Errorf(graph.ErrShape, "concat along axis %d: input %d has size %d at axis %d, input 0 has %d", ax, i, d, j, first.Shape[j])
			}
		}
		t.Shape[ax] += x.Shape[ax]
	}
	bax, per, err := alignBatch(len(t.Shape), in...)
	if err != nil {
		return graph.Type{}, err
	}
	if bax != ax {
		t.BatchAxis, t.PerSample = bax, per
	}
	return t, nil
}

func embedding(idx, w graph.Type) (graph.Type, error) {
	if idx.DType != graph.Int64 {
		return graph.Type{}, graph.Errorf(graph.ErrDType, "embedding indices must be int64, got %s", idx.DType)
	}
	if err := needFloat(graph.OpEmbedding, w); err != nil {
		return graph.Type{}, err
	}
	if len(w.Shape) != 2 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "embedding weight must be [num, dim], got %v", w.Shape)
	}
	return graph.Type{Shape: append(slices.Clone(idx.Shape), w.Shape[1]), DType: w.DType,
		BatchAxis: idx.BatchAxis, PerSample: idx.PerSample}, nil
}

// ConvOut is the output extent of a convolution or pooling window along one axis.
func ConvOut(in, kernel, stride, pad, dil int) int {
	return (in+2*pad-dil*(kernel-1)-1)/stride + 1
}

func normWindow(attrs *graph.Attrs) error {
	for i := range 2 {
		if attrs.Stride[i] == 0 {
			attrs.Stride[i] = 1
		}
		if attrs.Dilation[i] == 0 {
			attrs.Dilation[i] = 1
		}
		if attrs.Stride[i] < 0 || attrs.Dilation[i] < 0 || attrs.Padding[i] < 0 {
			return graph.Errorf(graph.ErrAttr, "stride %v, padding %v, dilation %v must not be negative", attrs.Stride, attrs.Padding, attrs.Dilation)
		}
	}
	return nil
}

func windowOut(op graph.Op, attrs *graph.Attrs, h, w, kh, kw int) (int, int, error) {
	if kh < 1 || kw < 1 {
		return 0, 0, graph.Errorf(graph.ErrShape, "%s kernel %dx%d is empty", op, kh, kw)
	}
	// Compare extents directly: ConvOut's division truncates toward zero, so
	// a kernel wider than the input by less than the stride would give 1.
	ph, pw := h+2*attrs.Padding[0], w+2*attrs.Padding[1]
	if attrs.Dilation[0]*(kh-1)+1 > ph || attrs.Dilation[1]*(kw-1)+1 > pw {
		return 0, 0, graph.Errorf(graph.ErrShape, "%s kernel %dx%d (dilation %v) is larger than the padded input %dx%d",
			op, kh, kw, attrs.Dilation, ph, pw)
	}
	ho := ConvOut(h, kh, attrs.Stride[0], attrs.Padding[0], attrs.Dilation[0])
	wo := ConvOut(w, kw, attrs.Stride[1], attrs.Padding[1], attrs.Dilation[1])
	return ho, wo, nil
}

func conv2d(attrs *graph.Attrs, in []graph.Type) (graph.Type, error) {
	x, w := in[0], in[1]
	if err := needFloat(graph.OpConv2d, in...); err != nil {
		return graph.Type{}, err
	}
	if len(x.Shape) != 4 || len(w.Shape) != 4 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "conv2d needs NCHW input and [out, in/groups, kh, kw] weight, got ranks %d and %d", len(x.Shape), len(w.Shape))
	}
	if err := normWindow(attrs); err != nil {
		return graph.Type{}, err
	}
	if attrs.Groups == 0 {
		attrs.Groups = 1
	}
	g, c, o := attrs.Groups, x.Shape[1], w.Shape[0]
	if g < 0 || c%g != 0 || o%g != 0 {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "conv2d groups %d must divide input channels %d and output channels %d", g, c, o)
	}
	if w.Shape[1] != c/g {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "conv2d weight has %d input channels per group, input has %d channels in %d groups", w.Shape[1], c, g)
	}
	if len(in) == 3 && !slices.Equal(in[2].Shape, []int{o}) {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "conv2d bias shape %v, want [%d]", in[2].Shape, o)
	}
	for _, t := range in[1:] {
		if t.DType != x.DType {
			return graph.Type{}, graph.Errorf(graph.ErrDType, "conv2d of %s with %s", x.DType, t.DType)
		}
	}
	ho, wo, err := windowOut(graph.OpConv2d, attrs, x.Shape[2], x.Shape[3], w.Shape[2], w.Shape[3])
	if err != nil {
		return graph.Type{}, err
	}
	t := graph.Type{Shape: []int{x.Shape[0], o, ho, wo}, DType: x.DType, BatchAxis: -1, PerSample: 1}
	if x.BatchAxis == 0 {
		t.BatchAxis, t.PerSample = 0, x.PerSample
	}
	return t, nil
}

func pool2d(op graph.Op, attrs *graph.Attrs, x graph.Type) (graph.Type, error) {
	if err := needFloat(op, x); err != nil {
		return graph.Type{}, err
	}
	if len(x.Shape) != 4 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "%s needs an NCHW input, got rank %d", op, len(x.Shape))
	}
	if attrs.Kernel[0] < 1 || attrs.Kernel[1] < 1 {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "%s kernel %v must be positive", op, attrs.Kernel)
	}
	if attrs.Stride == [2]int{} {
		attrs.Stride = attrs.Kernel // PyTorch's default
	}
	if op == graph.OpAvgPool2d && attrs.Dilation != [2]int{} && attrs.Dilation != [2]int{1, 1} {
		return graph.Type{}, graph.Errorf(graph.ErrAttr, "avg_pool2d has no dilation, got %v", attrs.Dilation)
	}
	if err := normWindow(attrs); err != nil {
		return graph.Type{}, err
	}
	for i := range 2 {
		if 2*attrs.Padding[i] > attrs.Kernel[i] {
			return graph.Type{}, graph.Errorf(graph.ErrAttr, "%s padding %v must be at most half the kernel %v", op, attrs.Padding, attrs.Kernel)
		}
	}
	ho, wo, err := windowOut(op, attrs, x.Shape[2], x.Shape[3], attrs.Kernel[0], attrs.Kernel[1])
	if err != nil {
		return graph.Type{}, err
	}
	t := x
	t.Shape = []int{x.Shape[0], x.Shape[1], ho, wo}
	if x.BatchAxis > 1 {
		t.BatchAxis, t.PerSample = -1, 1
	}
	return t, nil
}

func lossScale(attrs *graph.Attrs, count int) {
	attrs.Scalar = 1
	if attrs.Reduction == graph.ReduceMean {
		attrs.Scalar = 1 / float64(count)
	}
}

func crossEntropy(attrs *graph.Attrs, logits, labels graph.Type) (graph.Type, error) {
	if err := needFloat(graph.OpCrossEntropy, logits); err != nil {
		return graph.Type{}, err
	}
	if labels.DType != graph.Int64 {
		return graph.Type{}, graph.Errorf(graph.ErrDType, "cross_entropy labels must be int64 class indices, got %s", labels.DType)
	}
	if len(logits.Shape) != 2 || len(labels.Shape) != 1 || logits.Shape[0] != labels.Shape[0] {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "cross_entropy needs logits [N, C] and labels [N], got %v and %v", logits.Shape, labels.Shape)
	}
	if logits.Shape[0] == 0 || logits.Shape[1] == 0 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "cross_entropy of an empty batch or zero classes: %v", logits.Shape)
	}
	lossScale(attrs, logits.Shape[0])
	return graph.Type{Shape: []int{}, DType: logits.DType, BatchAxis: -1, PerSample: 1}, nil
}

func mse(attrs *graph.Attrs, pred, target graph.Type) (graph.Type, error) {
	if err := needFloat(graph.OpMSE, pred, target); err != nil {
		return graph.Type{}, err
	}
	if !slices.Equal(pred.Shape, target.Shape) || pred.DType != target.DType {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "mse needs prediction and target of one shape and dtype, got %s%v and %s%v", pred.DType, pred.Shape, target.DType, target.Shape)
	}
	if pred.Numel() == 0 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "mse of an empty tensor %v", pred.Shape)
	}
	if pred.BatchAxis != target.BatchAxis && pred.BatchAxis >= 0 && target.BatchAxis >= 0 {
		return graph.Type{}, graph.Errorf(graph.ErrShape, "mse batch axes differ: %d and %d", pred.BatchAxis, target.BatchAxis)
	}
	lossScale(attrs, pred.Numel())
	return graph.Type{Shape: []int{}, DType: pred.DType, BatchAxis: -1, PerSample: 1}, nil
}
