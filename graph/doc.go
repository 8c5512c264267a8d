// Package graph is batchfit's intermediate representation.
//
// Rules, stated up front:
//   - A Graph is append-only. Node ids are dense ints in creation order, and
//     since a node's inputs must already exist when it is appended, creation
//     order is a topological order. Every pass is one forward (or backward)
//     sweep over ids with slice side tables indexed by id: no maps, no
//     recursion.
//   - Every op is one spec, one row of the op table (OpInfo) in the
//     op_*.go file of its family: name, arity, category and attributes;
//     its shape/dtype/batch-axis rule; its chunk behaviour (Chunk: how
//     package shapeinfer classes the node and combines its partials); its
//     VJP, written against VJPBuilder so that package autodiff only drives
//     it, and what that VJP saves from the forward pass. The op's constant
//     is declared in ops.go. TestOpTableComplete fails for an op missing any
//     of these; executors keep their own kernel tables indexed by op.
//   - Graph.Append is the only way in, and it types every node: a source is
//     checked and typed from its data's type, any other node by its op's
//     rule, and the size check (CheckSize) applies to both. A node's stored
//     type is therefore always its rule's answer, so graph builders know
//     shapes at once. Shapes are those of the full batch; executors rescale
//     the batch axis per chunk (see Type.AtBatch).
//   - Dtypes: float32, int64, float16 and bfloat16 (2 bytes an element; every
//     byte count comes from DType.Size). Elementwise binary ops of two float
//     dtypes promote as PyTorch's do (Promote: bfloat16 ⊕ float32 →
//     float32); every other op that takes several float inputs wants one
//     dtype, and anything else is an ErrDType error naming op and dtypes.
//     OpCast converts between float dtypes.
//   - Layout: shapes are logical (NCHW for conv nets), but conv2d,
//     pooling, batch_norm and their gradients with Attrs.ChannelsLast take
//     their 4-D operands channels last (layout.go; package layout makes
//     such graphs, with explicit permutes).
//   - Errors from user input are values of *OpError wrapping one of the
//     sentinel errors below; callers test them with errors.Is / errors.As.
package graph
