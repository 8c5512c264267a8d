package shapeinfer

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// Class says how a node's value relates to the batch (see DESIGN.md).
type Class uint8

const (
	Constant   Class = iota // no batched ancestor
	PerSample               // has a batch axis
	CrossBatch              // batched ancestor, no batch axis
)

func (c Class) String() string {
	return [...]string{"constant", "per-sample", "cross-batch"}[c]
}

// Combine says how chunk partials of a cross-batch value merge.
type Combine uint8

const (
	CombineNone Combine = iota // not cross-batch
	CombineSum                 // partials add (sums; means scaled by 1/N with the full N)
	CombineMax                 // partials combine by max
)

func (c Combine) String() string { return [...]string{"none", "sum", "max"}[c] }

// End is the LastUse of a graph output: it lives past the last node.
const End = int(^uint(0) >> 1)

// Result holds what the analysis knows per node, in side tables indexed by
// node id.
type Result struct {
	Batch     int // full batch size N
	Class     []Class
	Combine   []Combine
	Fixed     []int64 // bytes(B) = Fixed + PerSample·B
	PerSample []int64
	LastUse   []int // id of the last needed consumer, End for outputs, −1 if unused
	Outputs   []int

	// NotChunkable is nil when the graph can run in batch chunks with
	// results identical to the whole batch; otherwise it names the first node
	// that prevents it.
	NotChunkable *ChunkError

	needed []bool // nodes the outputs depend on
}

// ChunkError explains why a graph cannot be split along its batch.
type ChunkError struct {
	Node   int
	Op     string
	Scope  string
	Reason string
}

func (e *ChunkError) Error() string {
	where := ""
	if e.Scope != "" {
		where = " in " + e.Scope
	}
	return fmt.Sprintf("%v: node %d (%s%s): %s", graph.ErrNotChunkable, e.Node, e.Op, where, e.Reason)
}

func (e *ChunkError) Unwrap() error { return graph.ErrNotChunkable }

// Chunkable reports whether the graph may be split along its batch.
func (r *Result) Chunkable() bool { return r.NotChunkable == nil }

// Bytes is node id's size when b samples run at once.
func (r *Result) Bytes(id, b int) int64 { return r.Fixed[id] + r.PerSample[id]*int64(b) }

// Analyze makes one forward sweep over g filling every side table. outputs
// are the values the caller reads after the run; they live to the end.
func Analyze(g *graph.Graph, outputs ...int) (*Result, error) {
	n := g.Len()
	r := &Result{
		Batch:     g.Batch(),
		Class:     make([]Class, n),
		Combine:   make([]Combine, n),
		Fixed:     make([]int64, n),
		PerSample: make([]int64, n),
		LastUse:   make([]int, n),
		Outputs:   slices.Clone(outputs),
	}
	for i := range r.LastUse {
		r.LastUse[i] = -1
	}
	for _, o := range outputs {
		if o < 0 || o >= n {
			return nil, graph.Errorf(graph.ErrArity, "output id %d does not name a node", o)
		}
	}
	nodes := g.Nodes()
	// A backward sweep marks the nodes the outputs need; a node whose
	// value nothing needed reads is never run, so it neither keeps its
	// inputs alive nor blocks chunking. With no outputs named, every node
	// counts as needed.
	r.needed = make([]bool, n)
	for _, o := range outputs {
		r.needed[o] = true
	}
	for id := n - 1; id >= 0; id-- {
		if r.needed[id] || len(outputs) == 0 {
			r.needed[id] = true
			for _, in := range nodes[id].Inputs {
				r.needed[in] = true
			}
		}
	}
	for id := range nodes {
		nd := &nodes[id]
		if r.needed[id] {
			for _, in := range nd.Inputs {
				r.LastUse[in] = id
			}
		}
		r.classify(nodes, nd)
		t := nd.Type
		if t.BatchAxis >= 0 && r.Batch > 0 {
			r.PerSample[id] = t.Bytes() / int64(r.Batch)
		} else {
			r.Fixed[id] = t.Bytes()
		}
	}
	for _, o := range outputs {
		r.LastUse[o] = End
	}
	return r, nil
}

func (r *Result) fail(nd *graph.Node, reason string, args ...any) {
	if r.NotChunkable == nil && r.needed[nd.ID] {
		r.NotChunkable = &ChunkError{Node: nd.ID, Op: nd.Op.String(), Scope: nd.Scope, Reason: fmt.Sprintf(reason, args...)}
	}
}

// classify sets Class and Combine of nd and records the first reason the
// graph cannot be chunked.
func (r *Result) classify(nodes []graph.Node, nd *graph.Node) {
	id, t := nd.ID, nd.Type
	if nd.Op.Category().Leaf() {
		if t.BatchAxis >= 0 {
			r.Class[id] = PerSample
		}
		return
	}
	anyBatched, anyCross, allCrossSum, allCrossMax := false, false, true, true
	for _, in := range nd.Inputs {
		switch r.Class[in] {
		case PerSample:
			anyBatched = true
		case CrossBatch:
			anyBatched, anyCross = true, true
			allCrossSum = allCrossSum && r.Combine[in] == CombineSum
			allCrossMax = allCrossMax && r.Combine[in] == CombineMax
		}
	}
	switch {
	case t.BatchAxis >= 0: // includes gradients expanded from a constant seed
		r.Class[id] = PerSample
		if anyCross {
			r.fail(nd, "a cross-batch value flows back into per-sample work")
		}
		r.checkPerSample(nodes, nd)
		return
	case !anyBatched:
		r.Class[id] = Constant
		return
	}
	r.Class[id] = CrossBatch
	if anyCross {
		r.Combine[id] = r.propagate(nd, allCrossSum, allCrossMax)
	} else {
		r.Combine[id] = r.consume(nodes, nd)
	}
}

// checkPerSample rejects ops that keep a batch axis but mix samples.
func (r *Result) checkPerSample(nodes []graph.Node, nd *graph.Node) {
	g := nd.Type.BatchAxis
	a := nd.Attrs
	rank := len(nd.Type.Shape)
	switch nd.Op {
	case graph.OpAdd, graph.OpSub, graph.OpMul, graph.OpDiv, graph.OpPow, graph.OpMaximum, graph.OpConcat:
		for _, in := range nd.Inputs {
			if t := nodes[in].Type; spans(t, rank, g) {
				r.fail(nd, "operand %v without a batch axis spans the batch axis", t.Shape)
			}
		}
	case graph.OpMatMul:
		x, y := nodes[nd.Inputs[0]].Type, nodes[nd.Inputs[1]].Type
		if a.TransA {
			x = transposeLast2(x)
		}
		if a.TransB {
			y = transposeLast2(y)
		}
		if x.BatchAxis == len(x.Shape)-1 || y.BatchAxis == len(y.Shape)-2 {
			r.fail(nd, "contracts one operand's batch axis while the output keeps the other's")
		}
		for _, t := range []graph.Type{x, y} {
			if g < rank-2 && spans(t, rank, g) {
				r.fail(nd, "operand %v without a batch axis spans the batch axis", t.Shape)
			}
		}
	case graph.OpSoftmax, graph.OpLogSoftmax:
		if a.Axis == g {
			r.fail(nd, "normalises along the batch axis")
		}
	case graph.OpLayerNorm:
		if g >= len(nd.Type.Shape)-a.NormDims {
			r.fail(nd, "normalises over the batch axis")
		}
	case graph.OpConv2d, graph.OpMaxPool2d, graph.OpAvgPool2d:
		if g != 0 {
			r.fail(nd, "batch axis %d is not the N axis of NCHW", g)
		}
	case graph.OpBatchNorm, graph.OpBatchNormGradX, graph.OpBatchNormGradW:
		switch {
		case a.Training:
			// Every output element depends on the whole batch's mean and
			// variance: a chunk would normalise with its own.
			r.fail(nd, "normalises with batch statistics (%s in training mode)", nd.Op)
		case g == 1 || nd.Op == graph.OpBatchNormGradW:
			r.fail(nd, "batch axis is the channel axis: each chunk would need its slice of the per-channel values")
		}
	}
	switch nd.Op {
	case graph.OpLinear, graph.OpConv2d, graph.OpLayerNorm, graph.OpEmbedding, graph.OpBatchNorm:
		// Weights are shared by every sample; a batched one mixes them.
		for _, in := range nd.Inputs[1:] {
			if r.Class[in] == PerSample {
				r.fail(nd, "weight %v has a batch axis", nodes[in].Type.Shape)
			}
		}
	}
}

// spans reports an operand without a batch axis whose extent along output
// axis g (of an output of the given rank) is not 1: each chunk would need a
// slice of it, which executors do not take.
func spans(t graph.Type, rank, g int) bool {
	return t.BatchAxis < 0 && dimFromRight(t.Shape, rank-1-g) != 1
}

// consume decides how a cross-batch value computed directly from per-sample
// values combines across chunks.
func (r *Result) consume(nodes []graph.Node, nd *graph.Node) Combine {
	switch nd.Op {
	case graph.OpSum, graph.OpMean:
		return CombineSum
	case graph.OpMax:
		return CombineMax
	case graph.OpCrossEntropy:
		// Per-sample losses summed, times 1/count fixed at the full batch,
		// when every row of logits and labels is one sample's.
		logits, labels := nodes[nd.Inputs[0]].Type, nodes[nd.Inputs[1]].Type
		if logits.BatchAxis == 0 && labels.BatchAxis == 0 {
			return CombineSum
		}
		r.fail(nd, "logits (batch axis %d) and labels (batch axis %d) must both carry the batch on axis 0", logits.BatchAxis, labels.BatchAxis)
	case graph.OpMSE:
		pred, target := nodes[nd.Inputs[0]].Type, nodes[nd.Inputs[1]].Type
		if pred.BatchAxis == target.BatchAxis {
			return CombineSum
		}
		r.fail(nd, "an operand without a batch axis spans the batch axis")
	case graph.OpLayerNormGradW, graph.OpEmbeddingGrad, graph.OpConv2dGradWeight:
		// Parameter gradients: sums over samples.
		return CombineSum
	case graph.OpBatchNormGradW:
		if !nd.Attrs.Training { // x̂ from running statistics: a sum over samples
			return CombineSum
		}
		r.fail(nd, "normalises with batch statistics (%s in training mode)", nd.Op)
	case graph.OpMatMul:
		if r.bothBatchedOnContraction(nd) {
			return CombineSum
		}
		r.fail(nd, "contracts the batch axis with an unbatched operand")
	case graph.OpLinear:
		r.fail(nd, "contracts the batch axis with an unbatched weight")
	case graph.OpReshape:
		r.fail(nd, "folds the batch axis under a leading axis")
	case graph.OpSlice:
		r.fail(nd, "selects along the batch axis")
	case graph.OpConcat:
		r.fail(nd, "concatenates along the batch axis")
	default:
		r.fail(nd, "mixes samples (batch axis consumed by %s)", nd.Op)
	}
	return CombineNone
}

func (r *Result) bothBatchedOnContraction(nd *graph.Node) bool {
	// Reached only when the output has no batch axis, so any batched operand
	// carried it on the contracted axis.
	return r.Class[nd.Inputs[0]] == PerSample && r.Class[nd.Inputs[1]] == PerSample
}

// propagate decides how a cross-batch value computed from other cross-batch
// values combines: ops linear in their cross-batch operand keep a sum a sum.
func (r *Result) propagate(nd *graph.Node, allSum, allMax bool) Combine {
	constOthers := true // every operand that is not cross-batch is constant
	for _, in := range nd.Inputs {
		if r.Class[in] == PerSample {
			constOthers = false
		}
	}
	crossCount := 0
	for _, in := range nd.Inputs {
		if r.Class[in] == CrossBatch {
			crossCount++
		}
	}
	allCross := crossCount == len(nd.Inputs)
	switch nd.Op {
	case graph.OpReshape, graph.OpPermute, graph.OpSlice:
		if allSum {
			return CombineSum
		}
		return CombineMax
	case graph.OpNeg, graph.OpMulScalar, graph.OpDivScalar, graph.OpSum, graph.OpMean, graph.OpExpand, graph.OpSliceGrad:
		if allSum {
			return CombineSum
		}
	case graph.OpMax:
		if allMax {
			return CombineMax
		}
	case graph.OpAdd, graph.OpSub, graph.OpConcat:
		if allSum && allCross {
			return CombineSum
		}
		if allSum {
			r.fail(nd, "adds a batch-independent value to a cross-batch sum")
			return CombineNone
		}
	case graph.OpMul, graph.OpMatMul, graph.OpLinear:
		// Linear in its one cross-batch operand, unless linear adds a
		// bias: each chunk would add it once.
		if allSum && crossCount == 1 && constOthers && (nd.Op != graph.OpLinear || len(nd.Inputs) == 2) {
			return CombineSum
		}
	case graph.OpDiv:
		if allSum && r.Class[nd.Inputs[0]] == CrossBatch && r.Class[nd.Inputs[1]] == Constant {
			return CombineSum
		}
	}
	r.fail(nd, "non-linear op %s on a cross-batch value", nd.Op)
	return CombineNone
}

// Totals sums every node's bytes as fixed + perSample·B: the size of all
// tensors of the graph, not a peak (liveness frees most of them early).
func (r *Result) Totals() (fixed, perSample int64) {
	for id := range r.Fixed {
		fixed += r.Fixed[id]
		perSample += r.PerSample[id]
	}
	return fixed, perSample
}
