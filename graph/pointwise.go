package graph

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// PWOp is one operation of a fused pointwise expression (Pointwise).
type PWOp uint8

const (
	PWInvalid PWOp = iota
	PWInput        // the fused node's input In, broadcast to the iteration shape
	PWConst        // the constant Scalar
	// One argument (A).
	PWNeg
	PWExp
	PWLog
	PWSqrt
	PWRsqrt // 1/√a
	PWAbs
	PWTanh
	PWSigmoid
	PWRelu
	PWGelu     // erf form
	PWGeluTanh // tanh approximation
	PWSign
	PWSilu
	// PWCast rounds a to DType (bfloat16 or float16, to nearest even);
	// float32 leaves it as it is.
	PWCast
	// PWExpand is A (per row) broadcast along the row: a per-element value.
	PWExpand
	// Two arguments (A, B).
	PWAdd
	PWSub
	PWMul
	PWDiv
	PWPow
	PWMax
	PWSiluGrad     // A·silu′(B)
	PWGeluGrad     // A·gelu′(B), erf form
	PWGeluTanhGrad // A·gelu′(B), tanh approximation
	PWReluGrad     // A where B > 0, else 0
	// Reductions over the last axis of the iteration shape: one value per
	// row, Scalar·Σ A (sum; Scalar 1/count gives the mean) or max A. (A
	// sum over the rows, one value per column, is an output's ColSum.)
	PWRowSum
	PWRowMax
	endPWOps
)

var pwNames = [...]string{"invalid", "in", "const", "neg", "exp", "log", "sqrt", "rsqrt", "abs", "tanh",
	"sigmoid", "relu", "gelu", "gelu_tanh", "sign", "silu", "cast", "expand", "add", "sub", "mul", "div", "pow", "max",
	"silu_grad", "gelu_grad", "gelu_tanh_grad", "relu_grad", "row_sum", "row_max"}

func (o PWOp) String() string {
	if o < endPWOps {
		return pwNames[o]
	}
	return fmt.Sprintf("PWOp(%d)", uint8(o))
}

// Args is how many arguments o takes (0, 1 or 2).
func (o PWOp) Args() int {
	switch {
	case o == PWInput || o == PWConst:
		return 0
	case o >= PWNeg && o <= PWExpand, o == PWRowSum, o == PWRowMax:
		return 1
	case o >= PWAdd && o <= PWReluGrad:
		return 2
	}
	return -1
}

// IsReduce reports whether o reduces the rows of its argument.
func (o PWOp) IsReduce() bool { return o == PWRowSum || o == PWRowMax }

// PWNode is one node of a Pointwise expression. A and B name earlier
// nodes of the expression.
type PWNode struct {
	Op     PWOp
	A, B   int
	In     int     // PWInput: the fused node's input index
	Scalar float64 // PWConst's value; PWRowSum's scale
	DType  DType   // PWCast's target
}

// Pointwise is the expression DAG of a fused_pointwise node: nodes in
// topological order over the node's inputs, each broadcast (NumPy rules,
// stride-0 dimensions) to the iteration shape S that all inputs broadcast
// to. Values are computed in float32. A node is per element, or per row
// (one value for each index of S but its last axis): a reduction (row_sum,
// row_max) makes a per-row value of a per-element one, an input whose
// last dimension is 1 (or that has rank 0) is per row, and an op is per
// row when all its arguments are. Outs are the nodes the fused op can give;
// its node gives Outs[Attrs.Axis], with shape S for a per-element value, S
// with its last dimension 1 for a per-row one, and S with every dimension
// but the last 1 for a column sum (PWOut.ColSum). A Pointwise is shared by
// the nodes that give its outputs, and must not change once made.
type Pointwise struct {
	Nodes []PWNode
	Outs  []PWOut
	text  string
}

// PWOut is one output of a Pointwise: its node and the dtype it is stored in.
// A ColSum output is the sum of its per-element node over the rows (every
// axis of S but the last, the batch axis among them), accumulated in
// float32: a weight's or a bias's gradient summed in the kernel that
// computes its terms. Nothing in the expression reads it.
type PWOut struct {
	Node   int
	DType  DType
	ColSum bool
}

// NewPointwise checks nodes and outs and returns their Pointwise.
func NewPointwise(nodes []PWNode, outs []PWOut) (*Pointwise, error) {
	p := &Pointwise{Nodes: slices.Clone(nodes), Outs: slices.Clone(outs)}
	if err := p.check(); err != nil {
		return nil, err
	}
	p.text = p.canonical()
	return p, nil
}

// Text is the expression's canonical text: one line per node and output,
// the same for two equal expressions (kernel caches key on it).
func (p *Pointwise) Text() string {
	if p == nil {
		return ""
	}
	if p.text != "" {
		return p.text
	}
	return p.canonical()
}

func (p *Pointwise) canonical() string {
	var b strings.Builder
	for i, n := range p.Nodes {
		fmt.Fprintf(&b, "v%d=%s", i, n.Op)
		switch n.Op {
		case PWInput:
			fmt.Fprintf(&b, " in%d", n.In)
		case PWConst:
			b.WriteString(" " + strconv.FormatUint(math.Float64bits(n.Scalar), 16))
		case PWCast:
			fmt.Fprintf(&b, " v%d %s", n.A, n.DType)
		case PWRowSum:
			fmt.Fprintf(&b, " v%d %s", n.A, strconv.FormatUint(math.Float64bits(n.Scalar), 16))
		default:
			if n.Op.Args() >= 1 {
				fmt.Fprintf(&b, " v%d", n.A)
			}
			if n.Op.Args() == 2 {
				fmt.Fprintf(&b, " v%d", n.B)
			}
		}
		b.WriteByte(';')
	}
	for _, o := range p.Outs {
		fmt.Fprintf(&b, "out v%d %s", o.Node, o.DType)
		if o.ColSum {
			b.WriteString(" colsum")
		}
		b.WriteByte(';')
	}
	return b.String()
}

// NumInputs is one more than the largest input index the expression reads.
func (p *Pointwise) NumInputs() int {
	n := 0
	for _, nd := range p.Nodes {
		if nd.Op == PWInput {
			n = max(n, nd.In+1)
		}
	}
	return n
}

// HasReduce reports whether the expression reduces rows.
func (p *Pointwise) HasReduce() bool {
	for _, n := range p.Nodes {
		if n.Op.IsReduce() {
			return true
		}
	}
	return false
}

// HasColSum reports whether an output sums its node over the rows.
func (p *Pointwise) HasColSum() bool { return p.ColSums() > 0 }

// ColSums is how many outputs sum their node over the rows.
func (p *Pointwise) ColSums() int {
	n := 0
	for _, o := range p.Outs {
		if o.ColSum {
			n++
		}
	}
	return n
}

// check verifies the nodes are well formed and topological, and the
// outputs name nodes and float dtypes.
func (p *Pointwise) check() error {
	if len(p.Nodes) == 0 || len(p.Outs) == 0 {
		return Errorf(ErrAttr, "fused_pointwise: an expression needs nodes and outputs (%d nodes, %d outputs)", len(p.Nodes), len(p.Outs))
	}
	for i, n := range p.Nodes {
		k := n.Op.Args()
		if k < 0 || n.Op == PWInvalid {
			return Errorf(ErrAttr, "fused_pointwise: node %d has unknown op %s", i, n.Op)
		}
		if (k >= 1 && (n.A < 0 || n.A >= i)) || (k == 2 && (n.B < 0 || n.B >= i)) {
			return Errorf(ErrAttr, "fused_pointwise: node %d (%s) reads v%d, v%d: arguments must be earlier nodes", i, n.Op, n.A, n.B)
		}
		if n.Op == PWInput && n.In < 0 {
			return Errorf(ErrAttr, "fused_pointwise: node %d reads input %d", i, n.In)
		}
		if n.Op == PWCast && !n.DType.IsFloat() {
			return Errorf(ErrAttr, "fused_pointwise: node %d casts to %s, not a floating-point dtype", i, n.DType)
		}
	}
	for i, o := range p.Outs {
		if o.Node < 0 || o.Node >= len(p.Nodes) {
			return Errorf(ErrAttr, "fused_pointwise: output %d names node %d of %d", i, o.Node, len(p.Nodes))
		}
		if !o.DType.IsFloat() {
			return Errorf(ErrAttr, "fused_pointwise: output %d is stored as %s, not a floating-point dtype", i, o.DType)
		}
	}
	return nil
}

// Rows reports, for each node, whether it is per row (one value for each
// row of S) rather than per element, given which inputs are per row
// (rowIn[i]: input i's last dimension is 1 in S's rank, or it has rank 0).
// A reduction of a per-row value is an error, as is any use of rowIn
// beyond its length.
func (p *Pointwise) Rows(rowIn []bool) ([]bool, error) {
	row := make([]bool, len(p.Nodes))
	for i, n := range p.Nodes {
		switch k := n.Op.Args(); {
		case n.Op == PWInput:
			if n.In >= len(rowIn) {
				return nil, Errorf(ErrArity, "fused_pointwise: node %d reads input %d of %d", i, n.In, len(rowIn))
			}
			row[i] = rowIn[n.In]
		case n.Op == PWConst:
			row[i] = true
		case n.Op == PWExpand:
			row[i] = false
		case n.Op.IsReduce():
			if row[n.A] {
				return nil, Errorf(ErrAttr, "fused_pointwise: node %d (%s) reduces v%d, a value that is per row already", i, n.Op, n.A)
			}
			row[i] = true
		case k == 1:
			row[i] = row[n.A]
		default:
			row[i] = row[n.A] && row[n.B]
		}
	}
	return row, nil
}

// RowInputs says which of inputs of shapes in are per row against S: rank
// 0, or a last dimension of 1 where S's is not.
func RowInputs(in [][]int, s []int) []bool {
	r := make([]bool, len(in))
	for i, sh := range in {
		r[i] = len(sh) == 0 || (sh[len(sh)-1] == 1 && len(s) > 0 && s[len(s)-1] != 1)
	}
	return r
}

// noVJPFused: fused nodes are made after autodiff.
const noVJPFused = "a fused op: FusePointwise makes it after autodiff, which never differentiates it"

// fusedOps: the one fused op. Its chunk behaviour is a binary op's: an
// operand without a batch axis must not span it; the rule refuses a
// reduction along the batch axis, so each row lies in one sample. A column
// sum consumes the batch axis: its chunks' partial sums add.
var fusedOps = []OpInfo{
	OpFusedPointwise: {Name: "fused_pointwise", Category: CatFused, MinArity: 1, Arity: Variadic, Attrs: []string{"pointwise", "axis"},
		Rule: fusedPointwiseRule, Chunk: &Chunk{PerSample: noSpan, Consume: fusedConsume}, NoVJP: noVJPFused},
}

// fusedConsume: a column sum's chunk partials add; no other output of a
// fused node drops the batch axis of its inputs.
func fusedConsume(n *Node, _ []Type) (Combine, string) {
	if p := n.Attrs.Pointwise; p != nil && n.Attrs.Axis >= 0 && n.Attrs.Axis < len(p.Outs) && p.Outs[n.Attrs.Axis].ColSum {
		return CombineSum, ""
	}
	return CombineNone, "mixes samples (batch axis consumed by fused_pointwise)"
}

// fusedPointwiseRule types a fused_pointwise node: S is the broadcast of
// every input's shape, the batch axis lines up as a binary op's does, and
// the node gives output Attrs.Axis of Attrs.Pointwise.
func fusedPointwiseRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) {
	p := attrs.Pointwise
	if p == nil {
		return Type{}, Errorf(ErrAttr, "%s needs an expression (Attrs.Pointwise)", op)
	}
	if err := p.check(); err != nil {
		return Type{}, err
	}
	if err := needFloat(op, in...); err != nil {
		return Type{}, err
	}
	if p.NumInputs() > len(in) {
		return Type{}, Errorf(ErrArity, "%s: the expression reads %d inputs, the node has %d", op, p.NumInputs(), len(in))
	}
	if attrs.Axis < 0 || attrs.Axis >= len(p.Outs) {
		return Type{}, Errorf(ErrAttr, "%s gives output %d of an expression with %d", op, attrs.Axis, len(p.Outs))
	}
	var s []int
	shapes := make([][]int, len(in))
	for i, t := range in {
		shapes[i] = t.Shape
		var err error
		if s, err = BroadcastShapes(s, t.Shape); err != nil {
			return Type{}, Errorf(ErrShape, "%s: input %d: %v", op, i, err)
		}
	}
	row, err := p.Rows(RowInputs(shapes, s))
	if err != nil {
		return Type{}, err
	}
	ax, per, err := alignBatch(len(s), in...)
	if err != nil {
		return Type{}, Errorf(ErrShape, "%s: %v", op, err)
	}
	for _, t := range in {
		if t.BatchAxis >= 0 && t.Shape[t.BatchAxis] != s[ax] {
			ax, per = -1, 1
		}
	}
	if p.HasReduce() {
		if len(s) == 0 {
			return Type{}, Errorf(ErrShape, "%s reduces rows of a rank-0 value", op)
		}
		if ax == len(s)-1 {
			return Type{}, Errorf(ErrShape, "%s reduces rows along the batch axis of %v", op, s)
		}
	}
	o := p.Outs[attrs.Axis]
	shape := slices.Clone(s)
	if o.ColSum {
		// The sum over the rows: S with every dimension but the last 1.
		if row[o.Node] {
			return Type{}, Errorf(ErrAttr, "%s: output %d sums v%d over the rows, a value that is per row", op, attrs.Axis, o.Node)
		}
		if len(s) < 2 {
			return Type{}, Errorf(ErrShape, "%s: output %d sums the rows of %v, a value of rank %d", op, attrs.Axis, s, len(s))
		}
		if ax == len(s)-1 {
			return Type{}, Errorf(ErrShape, "%s: output %d sums the rows of %v, whose batch axis is the last", op, attrs.Axis, s)
		}
		for d := range len(shape) - 1 {
			shape[d] = 1
		}
		return Type{Shape: shape, DType: o.DType, BatchAxis: -1, PerSample: 1}, nil
	}
	if row[o.Node] && len(shape) > 0 {
		shape[len(shape)-1] = 1
	}
	if shape == nil {
		shape = []int{}
	}
	t := Type{Shape: shape, DType: o.DType, BatchAxis: ax, PerSample: per}
	if ax >= 0 && shape[ax] != s[ax] {
		t.BatchAxis, t.PerSample = -1, 1
	}
	return t, nil
}
