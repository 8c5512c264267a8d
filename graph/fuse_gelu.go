package graph

// FuseGeluGrad is a graph pass over a training graph (after autodiff): it
// rewrites gelu_grad(matmul(a, b), x), where nothing else reads the
// matmul and the matmul is none of outputs, into one
// matmul_gelu_grad(a, b, x) with the matmul's transposes and the
// gelu_grad's Approx. An MLP's backward pass has one per GELU: the
// gradient reaching the GELU's output is a product with the next layer's
// weight. An executor runs it as one GEMM whose epilogue multiplies by
// GELU′(x) (cuBLASLt's DGELU), so the product is neither stored nor read
// back. A matmul with a float32 Target (a folded cast) or of another dtype
// than x is left alone. Everything else is copied as it is; a graph
// without the pattern comes back as a copy of itself. ids[i] is old node
// i's id in the new graph, −1 for a fused matmul.
func FuseGeluGrad(g *Graph, outputs []int) (*Graph, []int, error) {
	users := readers(g, outputs)
	fused := make([]bool, g.Len()) // gelu_grads that absorb their matmul
	drop := make([]bool, g.Len())  // the matmuls they absorb
	for i := range g.Len() {
		nd := g.Node(i)
		if nd.Op != OpGeluGrad || len(nd.Inputs) != 2 {
			continue
		}
		p := nd.Inputs[0]
		mm := g.Node(p)
		if mm.Op != OpMatMul || users[p] != 1 || mm.Attrs.Target.DType != InvalidDType ||
			mm.Type.DType != g.Node(nd.Inputs[1]).Type.DType {
			continue
		}
		fused[i], drop[p] = true, true
	}
	return Rebuild(g, "fuse ", func(i int, n *Node, ids []int) (int, bool) {
		if drop[i] {
			return -1, false
		}
		if fused[i] {
			gg := g.Node(i)
			mm := g.Node(gg.Inputs[0])
			n.Op = OpMatMulGeluGrad
			n.Attrs = Attrs{TransA: mm.Attrs.TransA, TransB: mm.Attrs.TransB, Approx: gg.Attrs.Approx}
			n.Inputs = []int{ids[mm.Inputs[0]], ids[mm.Inputs[1]], ids[gg.Inputs[1]]}
		}
		return 0, true
	})
}

// readers counts each node's readers in g: the nodes that take it as an
// input (once per input slot), and the caller for each of outputs.
func readers(g *Graph, outputs []int) []int {
	users := make([]int, g.Len())
	for i := range g.Len() {
		for _, in := range g.Node(i).Inputs {
			users[in]++
		}
	}
	for _, id := range outputs {
		if id >= 0 && id < g.Len() {
			users[id]++
		}
	}
	return users
}
