// Package ref is an independent float64 interpreter of batchfit graphs, the
// oracle that tests hold executors and autodiff against.
//
// Rules, stated up front:
//   - Clarity over speed. Every op is a plain nested loop over row-major
//     float64 arrays written from the op's definition; nothing is shared with
//     the executors (exec/cpu) so that a bug there cannot hide here.
//   - Eval always runs the full batch: a node's value has node.Type.Shape.
//   - Attributes are read as the op rules normalised them; scale factors of
//     means and losses come from Attrs.Scalar, never from recounting.
//   - Integer tensors (indices, labels) travel as float64 of integral value.
//   - Bad input (missing data, an index out of range, a malformed node) is a
//     *graph.OpError wrapping one of graph's sentinel errors, never a panic.
//
// Every op has one kernel in a table indexed by op (kernels.go), its entry
// in the file of its family (elementwise.go, contraction.go, reduce.go,
// norm.go with batchnorm.go, movement.go, index.go, conv.go, loss.go); a
// test fails when an op has none. The table is laid out by internal/optable,
// as the executors' are; that helper holds no op semantics.
//
// Semantics follow PyTorch: exact GELU uses erf; layer_norm uses the biased
// variance; avg_pool2d divides by kh·kw, padding included; max_pool2d's
// padding never wins and its gradient goes to the first maximum of each
// window (row-major); the reduction max shares its gradient evenly among
// ties; maximum's gradient gives each operand half on ties.
package ref
