// Package lazy is batchfit's user API: tensors whose ops build a graph
// instead of computing, and know their shape, dtype and batch axis at once.
//
//	x := lazy.Wrap(images, 0)          // axis 0 of images is the batch
//	y := x.Linear(w, b).Relu()         // w, b from lazy.Param
//	loss := y.CrossEntropy(x.Graph().Wrap(labels, 0), lazy.Mean)
//	if err := loss.Err(); err != nil { … }
//
// Rules:
//   - No user mistake panics. The first error sticks to the tensor it made
//     and to every tensor derived from it; Err returns it as a
//     *graph.OpError naming the op, the input shapes and the caller's
//     file:line, wrapping a sentinel (graph.ErrShape, graph.ErrDType, …).
//   - Inputs made by Wrap or Placeholder belong to one graph. Params and
//     Consts belong to none: each graph that uses one adopts it once, so the
//     same parameters serve a graph rebuilt every training step. Combining
//     tensors of two graphs is an error (graph.ErrMixedGraphs).
//   - Means over the batch carry 1/N with the full batch N, so chunked runs
//     add up exactly (see package shapeinfer).
package lazy
