// Package autodiff is reverse-mode differentiation as a graph transform.
//
// Backward appends the vector-Jacobian nodes of a scalar loss to the same
// graph, in one reverse sweep over node ids with a side table of gradient
// ids, and returns one gradient node per requested parameter. Each op's VJP
// is part of its spec in package graph (OpInfo.VJP, in graph/op_*.go),
// written against graph.VJPBuilder; this package is the driver that
// implements it: ordering, accumulation of contributions, summing broadcast
// gradients back (SumTo) and joining the gradients of slices that tile an
// axis. Every gradient node goes through graph.Graph.Append, so it is typed,
// classed and costed exactly like a forward node, and saved activations
// need no special case: a forward value simply lives until its last
// backward consumer.
//
// VJPs use the ops PyTorch's backward saves for (OpInfo.Saves lists them):
// relu's gradient reads relu's output, softmax's reads softmax's output,
// cross-entropy's recomputes the softmax from the logits. Parameter
// gradients are sums over samples, which is what makes chunked
// accumulation exact.
//
// A gradient has its value's dtype, as PyTorch's autograd keeps it: a
// contribution of another float dtype (from an op that promoted a
// bfloat16 operand to float32) is cast first, so gradient ops always see
// their forward node's dtype. Mixed-precision graphs (package precision)
// need nothing else from this package.
package autodiff
