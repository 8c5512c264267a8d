package graph

import (
	"fmt"
	"slices"
)

// Op identifies an operation. Its properties live in its row of the op
// table (OpInfo), in the op_*.go file of its family.
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
	CatMovement                    // reshape, permute, slice, concat; rotary
	CatIndex                       // embedding
	CatConv                        // conv2d and pooling
	CatLoss                        // cross_entropy, mse
	CatGenerate                    // fill: no inputs, type from Attrs.Target
	CatGrad                        // vector-Jacobian products appended by autodiff
	CatFused                       // fused_pointwise: made by FusePointwise after autodiff
)

var categoryNames = [...]string{"source", "unary", "scalar", "binary", "contraction",
	"reduce", "normalize", "movement", "index", "conv", "loss", "generate", "grad", "fused"}

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

// Ops are declared family by family, each in the op_*.go file that holds
// its spec rows, so an op's constant sits beside its spec. Each block
// continues the numbering of the one before it (source, unary, binary,
// contraction, reduce, normalize, movement, index, conv, attention, loss,
// grad), so ids
// stay dense: tables indexed by Op hold numOps rows.

// OpInfo is one row of the op table: everything about an op but its
// executor kernels. Rows live in the op_*.go file of their family.
type OpInfo struct {
	Name     string
	Category Category
	MinArity int
	Arity    int      // exact arity, or Variadic
	MaxArity int      // for optional trailing inputs (linear bias); 0 means = Arity
	Attrs    []string // attributes the op reads, for documentation and printing

	// Rule types the node (see RuleFunc); nil only for sources, which
	// Graph.Append types from their data.
	Rule RuleFunc
	// Chunk is how the node is classed and its partials combine.
	Chunk *Chunk
	// VJP appends the node's vector-Jacobian product; nil exactly when
	// NoVJP says why the op has none.
	VJP   VJPFunc
	NoVJP string
	// Saves is the set of forward values the VJP reads besides the
	// upstream gradient: what backward keeps alive. Liveness follows the
	// graph's edges, not this field; TestSavesMatchVJP keeps the two in
	// step.
	Saves Saved
}

// Saved is a set of forward values a VJP reads: bit i is input i, SavesOutput
// the node's own output.
type Saved uint8

// SavesOutput marks a VJP that reads the forward node's output.
const SavesOutput Saved = 1 << 7

// SavesInput is the set holding the given inputs (indices 0 to 6).
func SavesInput(i ...int) Saved {
	var s Saved
	for _, k := range i {
		s |= 1 << k
	}
	return s
}

// opFamilies lists every family's rows, keyed by op. Each op appears in
// exactly one family (TestOpTableComplete checks).
var opFamilies = [][]OpInfo{sourceOps, unaryOps, scalarOps, castOps, binaryOps, contractionOps,
	reduceOps, normalizeOps, movementOps, indexOps, convOps, attentionOps, lossOps, linearCrossEntropyOps, gradOps, fusedOps}

// opTable is assembled from the families rather than written as one
// literal: rows refer to rule and VJP functions that themselves read the
// table (op names in messages), which a single initialised variable could
// not do without an initialisation cycle.
var opTable [numOps]OpInfo

func init() {
	opTable[OpInvalid] = OpInfo{Name: "invalid"}
	for _, fam := range opFamilies {
		for op, row := range fam {
			if row.Name != "" {
				opTable[op] = row
			}
		}
	}
}

// Info returns a copy of op's table row.
func (op Op) Info() OpInfo {
	if op >= numOps {
		return OpInfo{Name: fmt.Sprintf("Op(%d)", uint16(op))}
	}
	return opTable[op]
}

// noRow is the row of ops past the table: no name, rule, chunk facts or VJP.
var noRow OpInfo

// row is op's table row without the copy Info makes, for per-node paths.
func (op Op) row() *OpInfo {
	if op >= numOps {
		return &noRow
	}
	return &opTable[op]
}

func (op Op) String() string {
	if op >= numOps {
		return op.Info().Name
	}
	return opTable[op].Name
}

// Category is shorthand for op.Info().Category.
func (op Op) Category() Category { return op.row().Category }

// Chunk is shorthand for op.Info().Chunk: the op's chunk behaviour, nil
// only for ops past the table.
func (op Op) Chunk() *Chunk { return op.row().Chunk }

// NumOps is the number of declared ops, for tests that range over the table.
const NumOps = int(numOps)

// CheckArity reports whether n inputs suit op.
func (op Op) CheckArity(n int) error {
	in := op.row()
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
	return Errorf(ErrArity, "%s takes %s inputs, got %d", op, arityText(in), n)
}

func arityText(in *OpInfo) string {
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
	PerChunk  bool   // batch_norm (training) and its gradients: the statistics of the samples run, chunk by chunk (OpBatchNorm)
	Kernel    [2]int // pooling
	Stride    [2]int
	Padding   [2]int
	Dilation  [2]int
	Groups    int
	LossChunk int // linear_cross_entropy and its gradients: tokens per logits chunk (0: DefaultLossChunk)
	KVHeads   int // attention_qkv: key/value heads (0: as many as Groups, the query heads)
	Reduction Reduction
	TransA    bool // matmul: use the transpose of the last two axes of input 0
	TransB    bool // matmul: … of input 1
	Causal    bool // attention: query i sees keys j ≤ i
	Target    Type // output type of generators and gradients that restore a shape
	// Seed and Counter key dropout's mask (Counter is usually the training
	// step). They change no shape or byte count, so graph signatures leave
	// them out and a step with a new counter reuses the cached plan.
	Seed, Counter uint64

	// ChannelsLast: conv2d, pooling, batch_norm and their gradients store
	// their 4-D operands channels last (graph/layout.go, package layout).
	ChannelsLast bool

	// Pointwise is fused_pointwise's expression, shared by the nodes that
	// give its outputs and never changed once made.
	Pointwise *Pointwise
}

// Clone is a copy of a whose slices (Axes, Shape, Perm, Target.Shape) are
// its own, for passes that rebuild a graph and may normalise a node's
// attributes without touching the original's.
func (a Attrs) Clone() Attrs {
	a.Axes = slices.Clone(a.Axes)
	a.Shape = slices.Clone(a.Shape)
	a.Perm = slices.Clone(a.Perm)
	a.Target.Shape = slices.Clone(a.Target.Shape)
	return a
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
