package shapeinfer

import (
	"math/bits"

	"github.com/batchfit/batchfit/graph"
)

// Append infers n's type from its inputs, normalises its attributes and
// appends it to g. It is the one way non-source nodes enter a graph, so a
// node's stored Type is always the rule's answer.
func Append(g *graph.Graph, n graph.Node) (int, error) {
	in := make([]graph.Type, len(n.Inputs))
	for i, id := range n.Inputs {
		if id < 0 || id >= g.Len() {
			return -1, graph.Errorf(graph.ErrArity, "%s: input id %d does not name a node", n.Op, id)
		}
		in[i] = g.Node(id).Type
	}
	t, err := Rule(n.Op, &n.Attrs, in, g.Batch())
	if err != nil {
		return -1, err
	}
	if err := CheckSize(t); err != nil {
		return -1, err
	}
	n.Type = t
	return g.Append(n)
}

// AppendSource appends an input, parameter or constant of type t. For an
// input, t.BatchAxis names the batch axis and fixes the graph's batch size.
func AppendSource(g *graph.Graph, n graph.Node) (int, error) {
	t := n.Type
	if n.Op.Category() != graph.CatSource {
		return -1, graph.Errorf(graph.ErrArity, "%s is not a source", n.Op)
	}
	if !t.DType.IsFloat() && t.DType != graph.Int64 {
		return -1, graph.Errorf(graph.ErrDType, "unsupported dtype %s", t.DType)
	}
	if err := CheckSize(t); err != nil {
		return -1, err
	}
	if n.Op != graph.OpInput {
		t.BatchAxis, t.PerSample = -1, 1
	} else {
		if t.BatchAxis < 0 || t.BatchAxis >= len(t.Shape) {
			return -1, graph.Errorf(graph.ErrAttr, "batch axis %d out of range for shape %v", t.BatchAxis, t.Shape)
		}
		if t.Shape[t.BatchAxis] == 0 {
			return -1, graph.Errorf(graph.ErrShape, "batch axis %d of %v is empty", t.BatchAxis, t.Shape)
		}
		if err := g.SetBatch(t.Shape[t.BatchAxis]); err != nil {
			return -1, err
		}
		t.PerSample = 1
	}
	n.Type = t
	return g.Append(n)
}

// MaxBytes bounds the size of one value. Byte counts are int64; the bound
// leaves room to add up many values (a planner's totals) without overflow,
// and is far beyond any device.
const MaxBytes = 1 << 56

// CheckSize rejects negative dimensions and values larger than MaxBytes,
// computing the size without the silent wrap-around of graph.Numel (a
// reshape of an empty tensor to [2⁴⁰, 1, 2⁴⁰] would otherwise count 0
// elements). Zero dimensions are left out of the product, so reducing them
// away can never produce an oversized value.
func CheckSize(t graph.Type) error {
	n := uint64(max(t.DType.Size(), 1))
	for _, d := range t.Shape {
		if d < 0 {
			return graph.Errorf(graph.ErrShape, "negative dimension in %v", t.Shape)
		}
	}
	for _, d := range t.Shape {
		if d == 0 {
			continue
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > MaxBytes {
			return graph.Errorf(graph.ErrShape, "%s%v is larger than %d bytes", t.DType, t.Shape, uint64(MaxBytes))
		}
		n = lo
	}
	return nil
}
