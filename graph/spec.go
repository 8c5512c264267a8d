package graph

import (
	"math/bits"
)

// RuleFunc computes the type of op applied to inputs of types in, whose
// count the op's arity already admitted. It may normalise attrs in place
// (negative axes, reshape's −1, the 1/count scale of mean and mean-reduced
// losses, default strides) so that executors read canonical values. batch
// is the graph's full batch size N.
type RuleFunc func(op Op, attrs *Attrs, in []Type, batch int) (Type, error)

// Combine says how chunk partials of a cross-batch value merge.
type Combine uint8

const (
	CombineNone Combine = iota // not cross-batch
	CombineSum                 // partials add (sums; means scaled by 1/N with the full N)
	CombineMax                 // partials combine by max
	// CombineMoments: per-channel statistics [2, C] (mean, then unbiased
	// variance, as batch_norm_stats makes them) of the values each chunk
	// holds, merged exactly into the statistics of all of them by the
	// pairwise update (Chan, Golub and LeVeque), each chunk weighted by
	// its count of values per channel.
	CombineMoments
)

func (c Combine) String() string { return [...]string{"none", "sum", "max", "moments"}[c] }

// Linearity says how an op treats operands that are already cross-batch
// (chunk partials): what it makes of them decides whether its own output
// still combines across chunks. The zero value is the safe answer.
type Linearity uint8

const (
	// NonLinear: a cross-batch operand makes the graph not chunkable.
	NonLinear Linearity = iota
	// Moves: the op only moves elements, so sums stay sums and maxima maxima.
	Moves
	// Scales: linear in its one input; sums stay sums.
	Scales
	// KeepsMax: a max of maxima; maxima stay maxima.
	KeepsMax
	// Adds: its operands are added (or concatenated); every one of them must
	// be a cross-batch sum, since a batch-independent term would be added
	// once per chunk.
	Adds
	// Multiplies: linear in its one cross-batch operand when every other is
	// constant. An optional trailing input (linear's bias) is added, so the
	// op is linear only without it.
	Multiplies
	// Divides: linear in a cross-batch dividend over a constant divisor.
	Divides
	// Accumulates: the op sums over the batch axis of its per-sample
	// operands (its Consume says how) and adds its cross-batch operands,
	// every one a cross-batch sum: embedding_grad with an addend.
	Accumulates
)

// Chunk is an op's chunk behaviour: the facts package shapeinfer needs to
// class its node and say how its partials combine, as data and small
// functions over the node and its input types. An input's type says whether
// it is per-sample (it has a batch axis); shapeinfer supplies the rest of
// the classes.
type Chunk struct {
	// PerSample, when set, checks a node whose output keeps a batch axis
	// and returns why it would still mix samples, or "".
	PerSample func(n *Node, in []Type) string
	// Weights marks ops whose inputs after the first are shared by every
	// sample (weights, biases, statistics): a batched one mixes samples.
	Weights bool
	// Consume says how a cross-batch output computed from per-sample inputs
	// combines, or why it cannot (a non-empty reason). Nil means the op
	// mixes samples when it consumes the batch axis.
	Consume func(n *Node, in []Type) (Combine, string)
	// Linear is how the op treats operands that are already cross-batch.
	Linear Linearity
	// MinChunk, when set, is the fewest samples a chunk of the node may
	// hold (1 when unset): the planner splits no batch into a smaller one.
	// Per-chunk batch statistics need more than one value per channel in
	// every chunk, as in the whole batch.
	MinChunk func(n *Node, in []Type) int
	// Stats, when set, says whether the node normalises with statistics of
	// the samples it runs on, and which: plans and reports say so.
	Stats func(n *Node) Stats
}

// Stats is which samples' statistics a node normalises with.
type Stats uint8

const (
	NoStats Stats = iota // none: per-sample, or fixed (running) statistics
	// WholeStats: the whole batch's (batch_norm in training mode). Such a
	// node makes the graph not chunkable; its PerSample check says so.
	WholeStats
	// ChunkStats: the chunk's own (Attrs.PerChunk): the graph stays
	// chunkable, and its results depend on how the batch is split, as
	// gradient accumulation's do on its micro-batches.
	ChunkStats
)

// combines is a Consume for ops whose output always combines by c.
func combines(c Combine) func(*Node, []Type) (Combine, string) {
	return func(*Node, []Type) (Combine, string) { return c, "" }
}

// refuses is a Consume for ops that can never consume the batch axis exactly.
func refuses(reason string) func(*Node, []Type) (Combine, string) {
	return func(*Node, []Type) (Combine, string) { return CombineNone, reason }
}

// plainChunk is the chunk behaviour of ops with no special chunk facts:
// nothing to check while the batch axis is kept, non-linear in a
// cross-batch operand, and mixing samples if they ever consume the batch
// axis.
var plainChunk = &Chunk{}

// VJPFunc appends to b the vector-Jacobian product of forward node n given
// its upstream gradient g, accumulating one contribution per input that
// needs one (b.Wants).
type VJPFunc func(b VJPBuilder, n *Node, g int)

// VJPBuilder is what a VJP needs from the backward driver (package
// autodiff), declared here so that ops carry their VJP without graph
// importing autodiff. Errors stick inside the builder: after the first, ids
// are −1 and every call is a no-op.
type VJPBuilder interface {
	// Emit appends a typed node (tagged with the forward node's scope and
	// site) and returns its id.
	Emit(op Op, a Attrs, inputs ...int) int
	// Accumulate adds contribution c to the gradient of node id.
	Accumulate(id, c int)
	// AccumulateSlice defers gradient g of a slice of node x until every
	// consumer of x has contributed, so slices that tile an axis become
	// one concat.
	AccumulateSlice(x, g int)
	// SumTo reduces a broadcast gradient back to the shape of node id.
	SumTo(g, id int) int
	// Type is node id's type.
	Type(id int) Type
	// Wants reports whether input i of the forward node needs a gradient.
	Wants(i int) bool
}

// Small VJP vocabulary shared by the op families.
func mul(b VJPBuilder, x, y int) int { return b.Emit(OpMul, Attrs{}, x, y) }
func div(b VJPBuilder, x, y int) int { return b.Emit(OpDiv, Attrs{}, x, y) }
func neg(b VJPBuilder, x int) int    { return b.Emit(OpNeg, Attrs{}, x) }
func scalar(b VJPBuilder, op Op, x int, s float64) int {
	return b.Emit(op, Attrs{Scalar: s}, x)
}

// Why an op has no VJP; each row without one names its reason in NoVJP.
const (
	noVJPLeaf = "a leaf: its gradient is Backward's result, nothing flows further"
	noVJPGrad = "a gradient op: Backward does not differentiate its own output (no double backward)"
)

// Rule runs op's shape rule: the type of op applied to inputs of types in,
// with attrs normalised in place. Sources have no rule (their type is
// given), and an op without one is an error, so a new op cannot slip
// through untyped.
func (op Op) Rule(attrs *Attrs, in []Type, batch int) (Type, error) {
	if op.Category() == CatSource {
		return Type{}, Errorf(ErrArity, "%s is a source; sources are typed by their data", op)
	}
	if err := op.CheckArity(len(in)); err != nil {
		return Type{}, err
	}
	rule := op.row().Rule
	if rule == nil {
		return Type{}, Errorf(ErrAttr, "no shape rule for op %s", op)
	}
	return rule(op, attrs, in, batch)
}

// MaxBytes bounds the size of one value. Byte counts are int64; the bound
// leaves room to add up many values (a planner's totals) without overflow,
// and is far beyond any device.
const MaxBytes = 1 << 56

// CheckSize rejects negative dimensions and values larger than MaxBytes,
// computing the size without the silent wrap-around of Numel (a reshape of
// an empty tensor to [2⁴⁰, 1, 2⁴⁰] would otherwise count 0 elements). Zero
// dimensions are left out of the product, so reducing them away can never
// produce an oversized value.
func CheckSize(t Type) error {
	n := uint64(max(t.DType.Size(), 1))
	for _, d := range t.Shape {
		if d < 0 {
			return Errorf(ErrShape, "negative dimension in %v", t.Shape)
		}
	}
	for _, d := range t.Shape {
		if d == 0 {
			continue
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > MaxBytes {
			return Errorf(ErrShape, "%s%v is larger than %d bytes", t.DType, t.Shape, uint64(MaxBytes))
		}
		n = lo
	}
	return nil
}
