// Package autodiff is reverse-mode differentiation as a graph transform.
//
// Backward appends the vector-Jacobian nodes of a scalar loss to the same
// graph, in one reverse sweep over node ids with a side table of gradient
// ids, and returns one gradient node per requested parameter. Every
// gradient node is created through shapeinfer.Append, so it is typed,
// classed and costed exactly like a forward node, and saved activations need
// no special case: a forward value simply lives until its last backward
// consumer.
//
// VJPs use the ops PyTorch's backward saves for: relu's gradient reads relu's
// output, softmax's reads softmax's output, cross-entropy's recomputes the
// softmax from the logits. Broadcast operands get their gradient summed back
// to their own shape. Parameter gradients are sums over samples, which is
// what makes chunked accumulation exact.
//
// It lives beside graph rather than in it because building typed nodes needs
// package shapeinfer, which itself sits on graph.
package autodiff
