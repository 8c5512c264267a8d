package exec

import (
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// LossChunkWorkspace is the workspace of a linear_cross_entropy node or
// one of its gradients at a chunk of b samples, the same on every
// executor so that a plan is the CUDA executor's: graph.LossChunkWorkspace
// (one logits chunk in h's dtype) at the chunk's rows, bounded by the
// node's chunk of tokens (at planner.WorkspaceBound), and none for a
// gradient that its producer computes in its own pass
// (graph.LinearCrossEntropyGradProducer).
func LossChunkWorkspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	if graph.LinearCrossEntropyGradProducer(g, nd.ID) >= 0 {
		return 0
	}
	k := 0
	if nd.Op != graph.OpLinearCrossEntropy {
		k = 1
	}
	if len(nd.Inputs) < k+2 {
		return 0
	}
	h, w := g.Node(nd.Inputs[k]).Type, g.Node(nd.Inputs[k+1]).Type
	rows := graph.LossChunkRows(&nd.Attrs, graph.MaxBytes) // one whole chunk, at planner.WorkspaceBound
	if b != planner.WorkspaceBound {
		rows = h.AtBatch(b)[0]
	}
	return graph.LossChunkWorkspace(&nd.Attrs, rows, w.Shape[0])
}
