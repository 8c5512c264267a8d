package graph

import "fmt"

// Op identifies an operation. Its properties live in the op table below.
type Op uint16

// Category groups ops that share shape and chunking behaviour.
type Category uint8

const (
	CatSource      Category = iota // Input, Param, Const: no inputs
	CatUnary                       // elementwise, one input, same shape
	CatScalar                      // elementwise with a scalar attribute
	CatBinary                      // elementwise, two inputs, NumPy broadcasting
	CatContraction                 // matmul, linear
	CatReduce                      // sum, mean, max over axes
	CatNormalize                   // softmax, log_softmax, layer_norm
	CatMovement                    // reshape, permute, slice, concat
	CatIndex                       // embedding
	CatConv                        // conv2d and pooling
	CatLoss                        // cross_entropy, mse
	CatGenerate                    // fill: no inputs, type from Attrs.Target
	CatGrad                        // vector-Jacobian products appended by autodiff
)

var categoryNames = [...]string{"source", "unary", "scalar", "binary", "contraction",
	"reduce", "normalize", "movement", "index", "conv", "loss", "generate", "grad"}

func (c Category) String() string {
	if int(c) < len(categoryNames) {
		return categoryNames[c]
	}
	return fmt.Sprintf("Category(%d)", uint8(c))
}

// Leaf reports whether ops of the category take no inputs.
func (c Category) Leaf() bool { return c == CatSource || c == CatGenerate }

// Variadic marks an op that takes any number (≥ MinArity) of inputs.
const Variadic = -1

const (
	OpInvalid Op = iota
	// sources
	OpInput // batched user input (lazy.Wrap)
	OpParam // trainable parameter
	OpConst // constant tensor
	// unary
	OpNeg
	OpExp
	OpLog
	OpSqrt
	OpAbs
	OpTanh
	OpSigmoid
	OpRelu
	OpGelu // Attrs.Approx: tanh approximation instead of erf
	// scalar forms: x ∘ Attrs.Scalar
	OpAddScalar     // x + s
	OpSubScalar     // x − s
	OpRSubScalar    // s − x
	OpMulScalar     // x · s
	OpDivScalar     // x / s
	OpRDivScalar    // s / x
	OpPowScalar     // x ^ s
	OpMaximumScalar // max(x, s)
	// binary with broadcasting
	OpAdd
	OpSub
	OpMul
	OpDiv
	OpPow
	OpMaximum
	// contraction
	OpMatMul // 2-D or batched, broadcasting batch dims; TransA/TransB transpose the last two axes
	OpLinear // x·Wᵀ (+ b): inputs x, W[, b]
	// reduce
	OpSum  // Attrs.Axes, Attrs.KeepDim
	OpMean // as OpSum, scaled by Attrs.Scalar = 1/count fixed at build time (full N)
	OpMax
	// normalize
	OpSoftmax    // Attrs.Axis
	OpLogSoftmax // Attrs.Axis
	OpLayerNorm  // inputs x[, weight[, bias]]; Attrs.NormDims trailing dims, Attrs.Eps
	// OpBatchNorm normalises x [N, C, ...] per channel (axis 1), as
	// PyTorch's batch_norm. With Attrs.Training it uses the batch's mean and
	// biased variance over every axis but 1 and takes x[, weight[, bias]];
	// otherwise it uses running statistics and takes x, running_mean,
	// running_var[, weight[, bias]], all [C] (BatchNormAffine says where the
	// weight is). Attrs.Eps. It updates no running statistics: graphs have
	// no side effects.
	OpBatchNorm
	// movement
	OpReshape // Attrs.Shape (full-batch sizes, no −1 left)
	OpPermute // Attrs.Perm
	OpSlice   // Attrs.Axis, Attrs.Start, Attrs.End, Attrs.Step
	OpConcat  // Attrs.Axis, variadic
	// index
	OpEmbedding // inputs indices (int64), weight [V, D]
	// conv
	OpConv2d    // inputs x[N,C,H,W], w[O,C/g,kh,kw][, b[O]]; Stride, Padding, Dilation, Groups
	OpMaxPool2d // Kernel, Stride, Padding, Dilation
	OpAvgPool2d // Kernel, Stride, Padding (zero padding counted in the divisor)
	// loss
	OpCrossEntropy // inputs logits [N, C], labels int64 [N]; Reduction
	OpMSE          // inputs pred, target (same shape); Reduction

	// generate
	OpFill // Attrs.Target filled with Attrs.Scalar (gradient seeds, zero gradients)
	// elementwise helpers used by gradients
	OpSign // sign(x) ∈ {−1, 0, 1}
	// OpCausalMask sets x[..., i, j] to Attrs.Scalar where j > i + (S − T)
	// for x [..., T, S]: −inf before attention's softmax, 0 in its gradient.
	OpCausalMask
	// OpDropout zeroes elements with probability Attrs.Scalar and scales
	// the rest by 1/(1−p); the mask comes from DropoutKeep keyed by
	// (Attrs.Seed, Attrs.Counter, global batch row, element), so chunked
	// runs draw the whole batch's mask. Its gradient is the same op on g.
	OpDropout
	// vector-Jacobian products. The first input is always the upstream
	// gradient g. Ops whose output shape cannot be derived from their inputs
	// take it from Attrs.Target (shape, dtype and batch axis of the value the
	// gradient is for).
	OpReluGrad          // g, y: g where y > 0 (y is relu's output, as PyTorch saves)
	OpGeluGrad          // g, x; Approx
	OpMaximumGrad       // g, a, b; Axis 0 → gradient for a, 1 → for b; ties split evenly
	OpMaximumScalarGrad // g, x; Scalar; ties get half
	OpExpand            // g broadcast to Attrs.Target (backward of reductions)
	OpMaxGrad           // g, x, y; Axes, KeepDim: g shared evenly among tied maxima
	OpSoftmaxGrad       // g, y; Axis: y·(g − Σ g·y)
	OpLogSoftmaxGrad    // g, y; Axis: g − exp(y)·Σ g
	OpLayerNormGradX    // g, x[, w]; NormDims, Eps
	OpLayerNormGradW    // g, x; NormDims, Eps: Σ over leading axes of g·x̂
	OpBatchNormGradX    // g, x[, w]; Eps; Training only: the batch-statistics backward of x
	OpBatchNormGradW    // g, x[, running_mean, running_var]; Training, Eps: Σ over all axes but 1 of g·x̂
	OpSliceGrad         // g; Axis, Start, End, Step, Target: g scattered into zeros
	OpEmbeddingGrad     // g, indices; Target [V, D]: rows scatter-added
	OpConv2dGradInput   // g, w; conv attrs, Target = input type
	OpConv2dGradWeight  // g, x; conv attrs, Target = weight type
	OpMaxPool2dGrad     // g, x; pool attrs: g routed to the first maximum of each window
	OpAvgPool2dGrad     // g; pool attrs, Target = input type
	OpCrossEntropyGrad  // g, logits, labels; Scalar: g·Scalar·(softmax − onehot)
	OpMSEGrad           // g, pred, target; Scalar: g·Scalar·2·(pred − target)

	numOps
)

// OpInfo is one row of the op table.
type OpInfo struct {
	Name     string
	Category Category
	MinArity int
	Arity    int      // exact arity, or Variadic
	MaxArity int      // for optional trailing inputs (linear bias); 0 means = Arity
	Attrs    []string // attributes the op reads, for documentation and printing
}

var opTable = [numOps]OpInfo{
	OpInvalid: {Name: "invalid"},

	OpInput: {Name: "input", Category: CatSource},
	OpParam: {Name: "param", Category: CatSource},
	OpConst: {Name: "const", Category: CatSource},

	OpNeg:     {Name: "neg", Category: CatUnary, MinArity: 1, Arity: 1},
	OpExp:     {Name: "exp", Category: CatUnary, MinArity: 1, Arity: 1},
	OpLog:     {Name: "log", Category: CatUnary, MinArity: 1, Arity: 1},
	OpSqrt:    {Name: "sqrt", Category: CatUnary, MinArity: 1, Arity: 1},
	OpAbs:     {Name: "abs", Category: CatUnary, MinArity: 1, Arity: 1},
	OpTanh:    {Name: "tanh", Category: CatUnary, MinArity: 1, Arity: 1},
	OpSigmoid: {Name: "sigmoid", Category: CatUnary, MinArity: 1, Arity: 1},
	OpRelu:    {Name: "relu", Category: CatUnary, MinArity: 1, Arity: 1},
	OpGelu:    {Name: "gelu", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"approx"}},

	OpAddScalar:     {Name: "add_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpSubScalar:     {Name: "sub_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpRSubScalar:    {Name: "rsub_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpMulScalar:     {Name: "mul_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpDivScalar:     {Name: "div_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpRDivScalar:    {Name: "rdiv_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpPowScalar:     {Name: "pow_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpMaximumScalar: {Name: "maximum_scalar", Category: CatScalar, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},

	OpAdd:     {Name: "add", Category: CatBinary, MinArity: 2, Arity: 2},
	OpSub:     {Name: "sub", Category: CatBinary, MinArity: 2, Arity: 2},
	OpMul:     {Name: "mul", Category: CatBinary, MinArity: 2, Arity: 2},
	OpDiv:     {Name: "div", Category: CatBinary, MinArity: 2, Arity: 2},
	OpPow:     {Name: "pow", Category: CatBinary, MinArity: 2, Arity: 2},
	OpMaximum: {Name: "maximum", Category: CatBinary, MinArity: 2, Arity: 2},

	OpMatMul: {Name: "matmul", Category: CatContraction, MinArity: 2, Arity: 2, Attrs: []string{"trans_a", "trans_b"}},
	OpLinear: {Name: "linear", Category: CatContraction, MinArity: 2, Arity: 2, MaxArity: 3},

	OpSum:  {Name: "sum", Category: CatReduce, MinArity: 1, Arity: 1, Attrs: []string{"axes", "keepdim"}},
	OpMean: {Name: "mean", Category: CatReduce, MinArity: 1, Arity: 1, Attrs: []string{"axes", "keepdim", "scalar"}},
	OpMax:  {Name: "max", Category: CatReduce, MinArity: 1, Arity: 1, Attrs: []string{"axes", "keepdim"}},

	OpSoftmax:    {Name: "softmax", Category: CatNormalize, MinArity: 1, Arity: 1, Attrs: []string{"axis"}},
	OpLogSoftmax: {Name: "log_softmax", Category: CatNormalize, MinArity: 1, Arity: 1, Attrs: []string{"axis"}},
	OpLayerNorm:  {Name: "layer_norm", Category: CatNormalize, MinArity: 1, Arity: 1, MaxArity: 3, Attrs: []string{"normdims", "eps"}},
	OpBatchNorm:  {Name: "batch_norm", Category: CatNormalize, MinArity: 1, Arity: 1, MaxArity: 5, Attrs: []string{"training", "eps"}},

	OpReshape: {Name: "reshape", Category: CatMovement, MinArity: 1, Arity: 1, Attrs: []string{"shape"}},
	OpPermute: {Name: "permute", Category: CatMovement, MinArity: 1, Arity: 1, Attrs: []string{"perm"}},
	OpSlice:   {Name: "slice", Category: CatMovement, MinArity: 1, Arity: 1, Attrs: []string{"axis", "start", "end", "step"}},
	OpConcat:  {Name: "concat", Category: CatMovement, MinArity: 1, Arity: Variadic, Attrs: []string{"axis"}},

	OpEmbedding: {Name: "embedding", Category: CatIndex, MinArity: 2, Arity: 2},

	OpConv2d:    {Name: "conv2d", Category: CatConv, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"stride", "padding", "dilation", "groups"}},
	OpMaxPool2d: {Name: "max_pool2d", Category: CatConv, MinArity: 1, Arity: 1, Attrs: []string{"kernel", "stride", "padding", "dilation"}},
	OpAvgPool2d: {Name: "avg_pool2d", Category: CatConv, MinArity: 1, Arity: 1, Attrs: []string{"kernel", "stride", "padding"}},

	OpCrossEntropy: {Name: "cross_entropy", Category: CatLoss, MinArity: 2, Arity: 2, Attrs: []string{"reduction"}},
	OpMSE:          {Name: "mse", Category: CatLoss, MinArity: 2, Arity: 2, Attrs: []string{"reduction"}},

	OpFill:       {Name: "fill", Category: CatGenerate, Attrs: []string{"target", "scalar"}},
	OpSign:       {Name: "sign", Category: CatUnary, MinArity: 1, Arity: 1},
	OpCausalMask: {Name: "causal_mask", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"scalar"}},
	OpDropout:    {Name: "dropout", Category: CatUnary, MinArity: 1, Arity: 1, Attrs: []string{"scalar", "seed", "counter"}},

	OpReluGrad:          {Name: "relu_grad", Category: CatGrad, MinArity: 2, Arity: 2},
	OpGeluGrad:          {Name: "gelu_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"approx"}},
	OpMaximumGrad:       {Name: "maximum_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"axis"}},
	OpMaximumScalarGrad: {Name: "maximum_scalar_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"scalar"}},
	OpExpand:            {Name: "expand", Category: CatGrad, MinArity: 1, Arity: 1, Attrs: []string{"target"}},
	OpMaxGrad:           {Name: "max_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"axes", "keepdim"}},
	OpSoftmaxGrad:       {Name: "softmax_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"axis"}},
	OpLogSoftmaxGrad:    {Name: "log_softmax_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"axis"}},
	OpLayerNormGradX:    {Name: "layer_norm_grad_x", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"normdims", "eps"}},
	OpLayerNormGradW:    {Name: "layer_norm_grad_w", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"normdims", "eps"}},
	OpBatchNormGradX:    {Name: "batch_norm_grad_x", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"training", "eps"}},
	OpBatchNormGradW:    {Name: "batch_norm_grad_w", Category: CatGrad, MinArity: 2, Arity: 2, MaxArity: 4, Attrs: []string{"training", "eps"}},
	OpSliceGrad:         {Name: "slice_grad", Category: CatGrad, MinArity: 1, Arity: 1, Attrs: []string{"axis", "start", "end", "step", "target"}},
	OpEmbeddingGrad:     {Name: "embedding_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"target"}},
	OpConv2dGradInput:   {Name: "conv2d_grad_input", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"stride", "padding", "dilation", "groups", "target"}},
	OpConv2dGradWeight:  {Name: "conv2d_grad_weight", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"stride", "padding", "dilation", "groups", "target"}},
	OpMaxPool2dGrad:     {Name: "max_pool2d_grad", Category: CatGrad, MinArity: 2, Arity: 2, Attrs: []string{"kernel", "stride", "padding", "dilation"}},
	OpAvgPool2dGrad:     {Name: "avg_pool2d_grad", Category: CatGrad, MinArity: 1, Arity: 1, Attrs: []string{"kernel", "stride", "padding", "target"}},
	OpCrossEntropyGrad:  {Name: "cross_entropy_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"scalar"}},
	OpMSEGrad:           {Name: "mse_grad", Category: CatGrad, MinArity: 3, Arity: 3, Attrs: []string{"scalar"}},
}

// Info returns op's table row.
func (op Op) Info() OpInfo {
	if op >= numOps {
		return OpInfo{Name: fmt.Sprintf("Op(%d)", uint16(op))}
	}
	return opTable[op]
}

func (op Op) String() string { return op.Info().Name }

// Category is shorthand for op.Info().Category.
func (op Op) Category() Category { return op.Info().Category }

// NumOps is the number of declared ops, for tests that range over the table.
const NumOps = int(numOps)

// CheckArity reports whether n inputs suit op.
func (op Op) CheckArity(n int) error {
	in := op.Info()
	maxA := in.MaxArity
	if maxA == 0 {
		maxA = in.Arity
	}
	switch {
	case in.Arity == Variadic && n >= in.MinArity:
		return nil
	case in.Arity != Variadic && n >= in.MinArity && n <= maxA:
		return nil
	}
	return Errorf(ErrArity, "%s takes %s inputs, got %d", in.Name, arityText(in), n)
}

func arityText(in OpInfo) string {
	switch {
	case in.Arity == Variadic:
		return fmt.Sprintf("at least %d", in.MinArity)
	case in.MaxArity > in.Arity:
		return fmt.Sprintf("%d to %d", in.MinArity, in.MaxArity)
	}
	return fmt.Sprint(in.Arity)
}

// Reduction selects how a loss combines per-sample values.
type Reduction uint8

const (
	ReduceMean Reduction = iota
	ReduceSum
)

func (r Reduction) String() string {
	if r == ReduceSum {
		return "sum"
	}
	return "mean"
}

// Attrs is the union of all op attributes; each op reads the fields its
// table row names and ignores the rest.
type Attrs struct {
	Scalar    float64 // scalar operand; for mean and losses with mean, 1/count
	Approx    bool    // gelu: tanh approximation
	Axes      []int   // reduce axes, normalised to non-negative and sorted
	KeepDim   bool
	Axis      int   // softmax, slice, concat
	Start     int   // slice
	End       int   // slice (exclusive)
	Step      int   // slice (≥ 1)
	Shape     []int // reshape target
	Perm      []int // permute
	NormDims  int   // layer_norm: number of trailing dims normalised
	Eps       float64
	Training  bool   // batch_norm: normalise with the batch's statistics, not running ones
	Kernel    [2]int // pooling
	Stride    [2]int
	Padding   [2]int
	Dilation  [2]int
	Groups    int
	Reduction Reduction
	TransA    bool // matmul: use the transpose of the last two axes of input 0
	TransB    bool // matmul: … of input 1
	Target    Type // output type of generators and gradients that restore a shape
	// Seed and Counter key dropout's mask (Counter is usually the training
	// step). They change no shape or byte count, so graph signatures leave
	// them out and a step with a new counter reuses the cached plan.
	Seed, Counter uint64
}

// BatchNormAffine is the index of batch_norm's optional weight input (the
// bias follows it): 1 in training mode, 3 in evaluation mode, after the
// running mean and variance.
func BatchNormAffine(training bool) int {
	if training {
		return 1
	}
	return 3
}
