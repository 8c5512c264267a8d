// Package shapeinfer gives every value of a graph its memory facts, in
// linear time.
//
// Typing lives with the ops: each op's shape, dtype and batch-axis rule is
// part of its spec in package graph (graph/op_*.go), and graph.Graph.Append
// runs it for every node. Rule, Append, AppendSource, CheckSize, MaxBytes,
// BroadcastShapes and ConvOut here forward to graph for existing callers.
//
// Analyze sweeps a finished graph once, filling side tables indexed by node
// id: node class (constant / per-sample / cross-batch), how a cross-batch
// value combines across chunks (sum or max), bytes as an affine function of
// the batch size (Fixed + PerSample·B), and liveness (the id of each
// value's last consumer). The per-op facts it needs — which checks a
// per-sample node must pass, which inputs are shared weights, how a
// consumed batch axis combines, how the op treats cross-batch operands —
// come from each op's graph.Chunk; this package holds the rules that use
// them and switches on no op.
//
// Chunking rule (docs/ARCHITECTURE.md): a cross-batch value must be a sum (or max) over
// samples. Means and mean-reduced losses carry 1/count computed with the
// full batch N, so chunk partials simply add. A graph where a cross-batch
// value flows back into per-sample work, passes through a non-linear op, or
// where an op mixes samples (training-mode batch_norm, which normalises with
// the batch's statistics), is not chunkable; Result.NotChunkable names the
// first such node and why. A batch_norm that opts in to per-chunk
// statistics (graph.Attrs.PerChunk) normalises each chunk with its own, as
// gradient accumulation does, and keeps the graph chunkable:
// Result.WholeStats and ChunkStats list the nodes of each kind, and
// Result.MinChunk is the fewest samples a chunk may hold (two for x [N, C],
// so that every chunk has more than one value per channel).
// batch_norm_stats (the mean and unbiased variance running statistics are
// updated with) combines its chunk partials exactly (CombineMoments).
package shapeinfer
