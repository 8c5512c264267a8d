package graph

// FuseEmbeddingGradAdd is a graph pass over a training graph (after
// autodiff): it rewrites add(r, embedding_grad(g, idx)) (either operand
// order), where nothing else reads the embedding_grad and it is none of
// outputs, and r has the gradient's type (shape, dtype, no batch axis),
// into embedding_grad(g, idx, r) in the add's place: the rows scatter-added
// onto r. A tied embedding's gradient is the head's (a linear's or
// linear_cross_entropy's dW) plus the embedding's; without the pass the
// step's end holds three [V, D] values at once (the two and their sum),
// with it two. Everything else is copied as it is; a graph without the
// pattern comes back as a copy of itself. ids[i] is old node i's id in the
// new graph, −1 for a fused embedding_grad.
func FuseEmbeddingGradAdd(g *Graph, outputs []int) (*Graph, []int, error) {
	users := readers(g, outputs)
	absorbed, residual := make([]int, g.Len()), make([]int, g.Len())
	drop := make([]bool, g.Len())
	for i := range g.Len() {
		absorbed[i] = -1
		nd := g.Node(i)
		if nd.Op != OpAdd || len(nd.Inputs) != 2 {
			continue
		}
		for k, p := range nd.Inputs {
			eg, r := g.Node(p), nd.Inputs[1-k]
			rt := g.Node(r).Type
			if eg.Op != OpEmbeddingGrad || len(eg.Inputs) != 2 || users[p] != 1 || drop[p] || r == p ||
				rt.Batched() || !sameType(eg.Type, rt) || !sameType(eg.Type, nd.Type) {
				continue
			}
			absorbed[i], residual[i], drop[p] = p, r, true
			break
		}
	}
	return Rebuild(g, "fuse ", func(i int, n *Node, ids []int) (int, bool) {
		if drop[i] {
			return -1, false
		}
		if p := absorbed[i]; p >= 0 {
			eg := g.Node(p)
			n.Op, n.Attrs = OpEmbeddingGrad, eg.Attrs.Clone()
			n.Inputs = []int{ids[eg.Inputs[0]], ids[eg.Inputs[1]], ids[residual[i]]}
		}
		return 0, true
	})
}
