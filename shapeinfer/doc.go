// Package shapeinfer gives every node of a graph its type and every value
// its memory facts, in linear time.
//
// Two entry points:
//   - Rule (called through Append when a node is created) computes a node's
//     shape, dtype and batch axis from its inputs' types and normalises its
//     attributes. Its switch over ops has an error default.
//   - Analyze sweeps a finished graph once, filling side tables indexed by
//     node id: node class (constant / per-sample / cross-batch), how a
//     cross-batch value combines across chunks (sum or max), bytes as an
//     affine function of the batch size (Fixed + PerSample·B), and liveness
//     (the id of each value's last consumer).
//
// Chunking rule (DESIGN.md): a cross-batch value must be a sum (or max) over
// samples. Means and mean-reduced losses carry 1/count computed with the
// full batch N, so chunk partials simply add. A graph where a cross-batch
// value flows back into per-sample work, passes through a non-linear op, or
// where an op mixes samples (training-mode batch_norm, which normalises with
// the batch's statistics), is not chunkable; Result.NotChunkable names the
// first such node and why.
package shapeinfer
