// Package graph is batchfit's intermediate representation.
//
// Rules, stated up front:
//   - A Graph is append-only. Node ids are dense ints in creation order, and
//     since a node's inputs must already exist when it is appended, creation
//     order is a topological order. Every pass is one forward (or backward)
//     sweep over ids with slice side tables indexed by id: no maps, no
//     recursion.
//   - Every op is declared once, in the op table (ops.go): name, arity,
//     category and the attributes it reads. Adding an op means adding a row
//     there, a rule in package shapeinfer (whose switch has an error default)
//     and a kernel per executor.
//   - A node stores its type (shape, dtype, batch axis) as computed by
//     shapeinfer when it was appended, so graph builders know shapes at once.
//     Shapes are those of the full batch; executors rescale the batch axis per
//     chunk (see Type.AtBatch).
//   - Errors from user input are values of *OpError wrapping one of the
//     sentinel errors below; callers test them with errors.Is / errors.As.
package graph
