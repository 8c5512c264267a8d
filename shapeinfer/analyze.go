package shapeinfer

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// Class says how a node's value relates to the batch (docs/ARCHITECTURE.md,
// "Batch axis and chunking").
type Class uint8

const (
	Constant   Class = iota // no batched ancestor
	PerSample               // has a batch axis
	CrossBatch              // batched ancestor, no batch axis
)

func (c Class) String() string {
	return [...]string{"constant", "per-sample", "cross-batch"}[c]
}

// Combine says how chunk partials of a cross-batch value merge; the op
// specs in package graph declare it.
type Combine = graph.Combine

const (
	CombineNone = graph.CombineNone // not cross-batch
	CombineSum  = graph.CombineSum  // partials add (sums; means scaled by 1/N with the full N)
	CombineMax  = graph.CombineMax  // partials combine by max
	// CombineMoments: per-channel mean and unbiased variance merged
	// exactly (batch_norm_stats).
	CombineMoments = graph.CombineMoments
)

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
	// MinChunk is the fewest samples a chunk may hold: 1, or more where an
	// op's per-chunk semantics need it (graph.Chunk.MinChunk: per-chunk
	// batch statistics of x [N, C] need 2). The planner splits no batch
	// into smaller chunks.
	MinChunk int
	// WholeStats and ChunkStats list the needed nodes that normalise with
	// statistics of the samples they run on (graph.Chunk.Stats): the whole
	// batch's (training-mode batch_norm; the graph is not chunkable) and
	// each chunk's own (per-chunk batch_norm: chunkable, with gradient
	// accumulation's semantics). Plans say which are in force.
	WholeStats, ChunkStats []int

	needed []bool       // nodes the outputs depend on
	in     []graph.Type // scratch: the input types of the node being classed
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
		MinChunk:  1,
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
		if r.needed[id] {
			r.chunkFacts(nodes, nd)
		}
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
	r.in = nil
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
		r.Combine[id] = r.propagate(nodes, nd, allCrossSum, allCrossMax)
	} else {
		r.Combine[id] = r.consume(nodes, nd)
	}
}

// chunkFacts records what needed node nd's spec says about chunks beyond
// chunkability: the fewest samples per chunk, and its statistics.
func (r *Result) chunkFacts(nodes []graph.Node, nd *graph.Node) {
	c := nd.Op.Chunk()
	if c == nil {
		return
	}
	if c.MinChunk != nil {
		r.MinChunk = max(r.MinChunk, c.MinChunk(nd, r.inputTypes(nodes, nd)))
	}
	if c.Stats != nil {
		switch c.Stats(nd) {
		case graph.WholeStats:
			r.WholeStats = append(r.WholeStats, nd.ID)
		case graph.ChunkStats:
			r.ChunkStats = append(r.ChunkStats, nd.ID)
		}
	}
}

// inputTypes is the types of nd's inputs, which a spec's chunk functions
// read, in a buffer reused from node to node.
func (r *Result) inputTypes(nodes []graph.Node, nd *graph.Node) []graph.Type {
	r.in = r.in[:0]
	for _, id := range nd.Inputs {
		r.in = append(r.in, nodes[id].Type)
	}
	return r.in
}

// checkPerSample rejects ops that keep a batch axis but mix samples, as
// their spec's chunk behaviour says.
func (r *Result) checkPerSample(nodes []graph.Node, nd *graph.Node) {
	c := nd.Op.Chunk()
	if c == nil {
		return
	}
	if c.PerSample != nil {
		if reason := c.PerSample(nd, r.inputTypes(nodes, nd)); reason != "" {
			r.fail(nd, "%s", reason)
		}
	}
	if c.Weights {
		// Weights are shared by every sample; a batched one mixes them.
		for _, in := range nd.Inputs[1:] {
			if r.Class[in] == PerSample {
				r.fail(nd, "weight %v has a batch axis", nodes[in].Type.Shape)
			}
		}
	}
}

// consume decides how a cross-batch value computed directly from per-sample
// values combines across chunks.
func (r *Result) consume(nodes []graph.Node, nd *graph.Node) Combine {
	if c := nd.Op.Chunk(); c != nil && c.Consume != nil {
		comb, reason := c.Consume(nd, r.inputTypes(nodes, nd))
		if reason != "" {
			r.fail(nd, "%s", reason)
		}
		return comb
	}
	r.fail(nd, "mixes samples (batch axis consumed by %s)", nd.Op)
	return CombineNone
}

// propagate decides how a cross-batch value computed from other cross-batch
// values combines, from the linearity its spec declares.
func (r *Result) propagate(nodes []graph.Node, nd *graph.Node, allSum, allMax bool) Combine {
	constOthers := true // every operand that is not cross-batch is constant
	crossCount := 0
	for _, in := range nd.Inputs {
		switch r.Class[in] {
		case PerSample:
			constOthers = false
		case CrossBatch:
			crossCount++
		}
	}
	allCross := crossCount == len(nd.Inputs)
	lin := graph.NonLinear
	if c := nd.Op.Chunk(); c != nil {
		lin = c.Linear
	}
	switch lin {
	case graph.Moves:
		if allSum {
			return CombineSum
		}
		if allMax {
			return CombineMax
		}
		// Moved moments (a slice of batch_norm_stats' [2, C]) are no
		// longer the mean-and-variance pair their combine needs.
	case graph.Scales:
		if allSum {
			return CombineSum
		}
	case graph.KeepsMax:
		if allMax {
			return CombineMax
		}
	case graph.Adds:
		if allSum && allCross {
			return CombineSum
		}
		if allSum {
			r.fail(nd, "adds a batch-independent value to a cross-batch sum")
			return CombineNone
		}
	case graph.Multiplies:
		// An optional trailing input (a bias) would be added once per chunk.
		if allSum && crossCount == 1 && constOthers && len(nd.Inputs) <= nd.Op.Info().Arity {
			return CombineSum
		}
	case graph.Divides:
		if allSum && r.Class[nd.Inputs[0]] == CrossBatch && r.Class[nd.Inputs[1]] == Constant {
			return CombineSum
		}
	case graph.Accumulates:
		if allSum && r.consume(nodes, nd) == CombineSum {
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
