package graph

// FuseLayerNormGradAdd is a graph pass over a training graph (after
// autodiff): it rewrites add(r, layer_norm_grad_x(g, x[, w])) (either
// operand order), where nothing else reads the layer_norm_grad_x and it is
// none of outputs, and r has the gradient's type (shape, dtype, batch axis), into one
// layer_norm_grad_x_add(g, x, r[, w]) in the add's place, and likewise
// add(r, rms_norm_grad_x(g, x[, w])) into rms_norm_grad_x_add(g, x, r[,
// w]). A pre-norm transformer's backward pass has one per norm inside the
// residual stream: the stream's gradient meets the gradient through the
// block's norm. An executor then adds r in the norm's backward pass,
// so that gradient is neither stored nor read back. Everything else is
// copied as it is; a graph without the pattern comes back as a copy of
// itself. ids[i] is old node i's id in the new graph, −1 for a fused
// layer_norm_grad_x or rms_norm_grad_x.
func FuseLayerNormGradAdd(g *Graph, outputs []int) (*Graph, []int, error) {
	users := readers(g, outputs)
	// absorbed[i] is the layer_norm_grad_x that add i takes in, −1 for
	// none; residual[i] is the add's other operand.
	absorbed, residual := make([]int, g.Len()), make([]int, g.Len())
	drop := make([]bool, g.Len()) // the layer_norm_grad_x nodes absorbed
	for i := range g.Len() {
		absorbed[i] = -1
		nd := g.Node(i)
		if nd.Op != OpAdd || len(nd.Inputs) != 2 {
			continue
		}
		for k, p := range nd.Inputs {
			ln, r := g.Node(p), nd.Inputs[1-k]
			if ln.Op != OpLayerNormGradX && ln.Op != OpRMSNormGradX || users[p] != 1 || drop[p] || r == p ||
				!sameType(ln.Type, g.Node(r).Type) || !sameType(ln.Type, nd.Type) {
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
			ln, r := g.Node(p), residual[i]
			n.Op = OpLayerNormGradXAdd
			if ln.Op == OpRMSNormGradX {
				n.Op = OpRMSNormGradXAdd
			}
			n.Attrs = Attrs{NormDims: ln.Attrs.NormDims, Eps: ln.Attrs.Eps}
			n.Inputs = []int{ids[ln.Inputs[0]], ids[ln.Inputs[1]], ids[r]}
			if len(ln.Inputs) > 2 {
				n.Inputs = append(n.Inputs, ids[ln.Inputs[2]])
			}
		}
		return 0, true
	})
}
