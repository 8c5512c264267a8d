package shapeinfer

import "github.com/batchfit/batchfit/graph"

// The shape rules live with their ops in package graph (graph/op_*.go), so
// that graph.Graph.Append types every node. The functions below forward to
// them for callers that still reach them here.

// Rule computes the type of op applied to inputs of types in, normalising
// attrs in place. It is graph.Op.Rule.
func Rule(op graph.Op, attrs *graph.Attrs, in []graph.Type, batch int) (graph.Type, error) {
	return op.Rule(attrs, in, batch)
}

// BroadcastShapes applies NumPy broadcasting to two shapes. It is
// graph.BroadcastShapes.
func BroadcastShapes(a, b []int) ([]int, error) { return graph.BroadcastShapes(a, b) }

// ConvOut is the output extent of a convolution or pooling window along one
// axis. It is graph.ConvOut.
func ConvOut(in, kernel, stride, pad, dil int) int {
	return graph.ConvOut(in, kernel, stride, pad, dil)
}
