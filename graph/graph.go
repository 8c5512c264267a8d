package graph

import (
	"slices"

	"gorgonia.org/tensor"
)

// Type is what shape inference knows about a node's value. Shape is the
// full-batch shape. When BatchAxis ≥ 0, Shape[BatchAxis] = Batch·PerSample,
// where Batch is the graph's batch size N: running a chunk of b samples
// gives the same shape with that axis equal to b·PerSample.
type Type struct {
	Shape     []int
	DType     DType
	BatchAxis int // −1 when the value has no batch axis
	PerSample int // size of the batch axis per sample (1 unless a reshape folded axes into it)
}

// Numel is the number of elements at the full batch.
func (t Type) Numel() int { return Numel(t.Shape) }

// Bytes is the size of the value at the full batch.
func (t Type) Bytes() int64 { return int64(t.Numel()) * int64(t.DType.Size()) }

// Batched reports whether the value has a batch axis.
func (t Type) Batched() bool { return t.BatchAxis >= 0 }

// AtBatch returns the shape the value has when b samples run at once.
func (t Type) AtBatch(b int) []int {
	s := append([]int(nil), t.Shape...)
	if t.BatchAxis >= 0 {
		s[t.BatchAxis] = b * t.PerSample
	}
	return s
}

// Numel multiplies out a shape; a scalar ([]) has one element.
func Numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// Node is one operation in the graph.
type Node struct {
	ID     int
	Op     Op
	Inputs []int // ids of earlier nodes
	Attrs  Attrs
	Type   Type          // set by Graph.Append: the op rule's answer (a source's checked data type)
	Name   string        // parameter name for sources; empty otherwise
	Scope  string        // dotted module path active when the node was made ("layers.3")
	Site   string        // caller's file:line
	Value  tensor.Tensor // data of a source node; nil for shape-only graphs
}

// Graph is an append-only list of nodes in topological order.
type Graph struct {
	nodes []Node
	batch int // N, the full batch size; 0 until a batched input is added
	// scopes is the module scope stack, each entry the dotted path down
	// to it, so Append need not join the path for every node.
	scopes []string
	in     []Type // typeOf's scratch: the input types of the node it types
}

// New returns an empty graph.
func New() *Graph { return &Graph{} }

// Clone returns a copy of g whose node list is its own: appending to it or
// setting a node's Value leaves g as it was. Nodes share their Inputs,
// Attrs slices and Values with g's.
func (g *Graph) Clone() *Graph {
	return &Graph{nodes: append([]Node(nil), g.nodes...), batch: g.batch}
}

// Grow makes room for n more nodes, so that the next n Appends do not
// copy the node list.
func (g *Graph) Grow(n int) { g.nodes = slices.Grow(g.nodes, n) }

// Len is the number of nodes.
func (g *Graph) Len() int { return len(g.nodes) }

// Node returns node id. The pointer stays valid until the next Append.
// Callers must not change its Op, Inputs or Type: Append typed them.
func (g *Graph) Node(id int) *Node { return &g.nodes[id] }

// Nodes returns the nodes in id order; callers must not modify them.
func (g *Graph) Nodes() []Node { return g.nodes }

// Batch is the full batch size N (0 when the graph has no batched input).
func (g *Graph) Batch() int { return g.batch }

// SetBatch records N. The first batched input fixes it; later inputs must agree.
func (g *Graph) SetBatch(n int) error {
	if g.batch != 0 && g.batch != n {
		return Errorf(ErrShape, "batch size %d differs from the graph's batch size %d", n, g.batch)
	}
	g.batch = n
	return nil
}

// Append types n and adds it, returning its id. It is the only way a node
// enters a graph, so every stored type is its op's answer: a source
// (input, param, const) is checked and typed from n.Type (an input's batch
// axis fixes the graph's batch size); any other node gets the type its
// op's rule computes from its inputs, with its attributes normalised, and
// a non-zero n.Type that disagrees with the rule is an ErrShape error.
// Inputs must name existing nodes; that is what keeps ids topological.
func (g *Graph) Append(n Node) (int, error) {
	for _, in := range n.Inputs {
		if in < 0 || in >= len(g.nodes) {
			return -1, Errorf(ErrArity, "%s: input id %d does not name a node", n.Op, in)
		}
	}
	// n is typed in place at the end of the list: passed by pointer to its
	// op's rule, a local n would be moved to the heap, an allocation of
	// the whole node for every Append. A rejected node is taken off again.
	id := len(g.nodes)
	g.nodes = append(g.nodes, n)
	nd := &g.nodes[id]
	t, err := g.typeOf(nd)
	if err != nil {
		g.nodes[id] = Node{}
		g.nodes = g.nodes[:id]
		return -1, err
	}
	nd.Type = t
	nd.ID = id
	if nd.Scope == "" {
		nd.Scope = g.Scope()
	}
	return id, nil
}

// typeOf runs n's source check or shape rule and the size check.
func (g *Graph) typeOf(n *Node) (Type, error) {
	if n.Op < numOps && n.Op != OpInvalid && n.Op.Category() == CatSource {
		return g.sourceType(n.Type, n.Op)
	}
	in := g.in[:0]
	for _, id := range n.Inputs {
		in = append(in, g.nodes[id].Type)
	}
	g.in = in
	t, err := n.Op.Rule(&n.Attrs, in, g.batch)
	if err != nil {
		return Type{}, err
	}
	if err := CheckSize(t); err != nil {
		return Type{}, err
	}
	if given := n.Type; (given.Shape != nil || given.DType != InvalidDType) && !sameType(given, t) {
		return Type{}, Errorf(ErrShape, "%s is typed %s%v (batch axis %d) but its rule gives %s%v (batch axis %d)",
			n.Op, given.DType, given.Shape, given.BatchAxis, t.DType, t.Shape, t.BatchAxis)
	}
	return t, nil
}

func sameType(a, b Type) bool {
	return slices.Equal(a.Shape, b.Shape) && a.DType == b.DType && a.BatchAxis == b.BatchAxis
}

// PushScope enters a module scope; nodes appended until PopScope carry it.
func (g *Graph) PushScope(name string) {
	path := name
	if n := len(g.scopes); n > 0 {
		path = g.scopes[n-1] + "." + name
	}
	g.scopes = append(g.scopes, path)
}

// PopScope leaves the innermost module scope.
func (g *Graph) PopScope() {
	if len(g.scopes) > 0 {
		g.scopes = g.scopes[:len(g.scopes)-1]
	}
}

// Scope is the current dotted module path.
func (g *Graph) Scope() string {
	if n := len(g.scopes); n > 0 {
		return g.scopes[n-1]
	}
	return ""
}

// NodeNamed returns the id of the first node named name, or −1.
func (g *Graph) NodeNamed(name string) int {
	for i := range g.nodes {
		if g.nodes[i].Name == name {
			return i
		}
	}
	return -1
}
