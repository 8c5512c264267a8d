package shapeinfer

import "github.com/batchfit/batchfit/graph"

// Append appends the non-source node n to g, typed by its op's rule. It is
// graph.Graph.Append restricted to non-sources, kept for its callers.
func Append(g *graph.Graph, n graph.Node) (int, error) {
	if n.Op.Category() == graph.CatSource {
		_, err := n.Op.Rule(&n.Attrs, nil, g.Batch()) // a source has no rule: its error says so
		return -1, err
	}
	return g.Append(n)
}

// AppendSource appends an input, parameter or constant of type n.Type. It
// is graph.Graph.Append restricted to sources, kept for its callers.
func AppendSource(g *graph.Graph, n graph.Node) (int, error) {
	if n.Op.Category() != graph.CatSource {
		return -1, graph.Errorf(graph.ErrArity, "%s is not a source", n.Op)
	}
	return g.Append(n)
}

// MaxBytes bounds the size of one value; it is graph.MaxBytes.
const MaxBytes = graph.MaxBytes

// CheckSize rejects negative dimensions and values larger than MaxBytes. It
// is graph.CheckSize.
func CheckSize(t graph.Type) error { return graph.CheckSize(t) }
