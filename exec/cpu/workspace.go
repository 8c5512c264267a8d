package cpu

import "github.com/batchfit/batchfit/graph"

// Workspace declares the scratch memory of the CPU kernels when b samples
// run at once, so the planner allocates it like any buffer: the unfolded
// patches of a convolution or of its gradients, [C/groups·kh·kw, Ho·Wo]
// elements, made once per call and reused across samples and groups (a 1×1
// convolution with unit stride and no padding reads its input directly).
// Elements take the node's dtype size, so shape-only half-precision graphs
// plan with the same declaration; the kernels themselves run float32.
func Workspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	var w, y []int // weight [O, C/g, kh, kw] and forward output [N, O, Ho, Wo]
	switch nd.Op {
	case graph.OpConv2d:
		w, y = g.Node(nd.Inputs[1]).Type.Shape, nd.Type.Shape
		a := nd.Attrs
		if w[2] == 1 && w[3] == 1 && a.Stride == [2]int{1, 1} && a.Padding == [2]int{} {
			return 0
		}
	case graph.OpConv2dGradInput:
		w, y = g.Node(nd.Inputs[1]).Type.Shape, g.Node(nd.Inputs[0]).Type.Shape
	case graph.OpConv2dGradWeight:
		w, y = nd.Type.Shape, g.Node(nd.Inputs[0]).Type.Shape
	default:
		return 0
	}
	return int64(w[1]*w[2]*w[3]) * int64(y[2]*y[3]) * int64(nd.Type.DType.Size())
}
