package graph

// Rebuild copies g into a new graph node by node, in order, for the passes
// that rewrite a graph (FuseGeluGrad, package precision's cast fold, …).
// Each node is cloned (attributes copied, a source's type kept, inputs
// mapped to their ids in the new graph) and handed to edit with the ids
// so far; edit may change the copy, or return keep = false and the id
// that stands for the node instead (−1 for none). ids[i] is node i's id in
// the new graph. An append that fails is an OpError whose op is what
// followed by the copy's op.
func Rebuild(g *Graph, what string, edit func(i int, n *Node, ids []int) (alias int, keep bool)) (*Graph, []int, error) {
	return RebuildEmit(g, what, func(i int, n *Node, ids []int, _ Emit) (int, bool) { return edit(i, n, ids) })
}

// Emit appends a node to the graph RebuildEmit builds, before the copy
// being edited, and returns its id (−1 once an append has failed; the
// rebuild then returns that error).
type Emit func(n Node) int

// RebuildEmit is Rebuild whose edit may also append nodes of its own
// (emit) ahead of the copy it edits, as FuseAttentionQKV appends the
// packed weights and the rotation its attention_qkv reads.
func RebuildEmit(g *Graph, what string, edit func(i int, n *Node, ids []int, emit Emit) (alias int, keep bool)) (*Graph, []int, error) {
	out := New()
	if g.Batch() != 0 {
		if err := out.SetBatch(g.Batch()); err != nil {
			return nil, nil, err
		}
	}
	var failed error
	emit := func(n Node) int {
		if failed != nil {
			return -1
		}
		id, err := out.Append(n)
		if err != nil {
			failed = &OpError{Op: what + n.Op.String(), Site: n.Site, Err: err}
			return -1
		}
		return id
	}
	ids := make([]int, g.Len())
	for i := range g.Len() {
		nd := g.Node(i)
		n := Node{Op: nd.Op, Attrs: nd.Attrs.Clone(), Name: nd.Name, Scope: nd.Scope, Site: nd.Site, Value: nd.Value,
			Inputs: make([]int, len(nd.Inputs))}
		if nd.Op.Category() == CatSource {
			n.Type = nd.Type
		}
		for k, in := range nd.Inputs {
			n.Inputs[k] = ids[in]
		}
		alias, keep := edit(i, &n, ids, emit)
		if failed != nil {
			return nil, nil, failed
		}
		if !keep {
			ids[i] = alias
			continue
		}
		id, err := out.Append(n)
		if err != nil {
			return nil, nil, &OpError{Op: what + n.Op.String(), Site: nd.Site, Err: err}
		}
		ids[i] = id
	}
	return out, ids, nil
}
