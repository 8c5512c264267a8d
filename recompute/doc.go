// Package recompute trades compute for memory: activation recomputation
// (checkpointing) as a graph transform, a roofline cost model, and a search
// over chunk sizes and recompute sets that maximises predicted samples/s
// with the replayed peak inside the budget.
//
// The transform (Apply) rebuilds a training step's graph: the forward nodes
// in a recompute set keep their forward consumers, and each gets a copy,
// appended right before the first backward node that reads it, which feeds
// backward instead. The original activation dies after its last forward
// use. Copies are ordinary nodes: node ids stay topological, Compile's
// program follows id order, so the copies run late, and the planner's
// replay and both executors treat them like any other node. Dropout
// copies draw the original's mask: the mask is keyed by the node's attrs
// (seed, counter) and the global row, which the copy shares.
//
// The cost model (Profile, Cost) prices a node at chunk size b as
// max(flops/rate, bytes/bandwidth) + launch, the rate by the node's op and
// dtype (Profile), plus each chunk's input upload, summed over the
// program's nodes and chunks; Search replays every candidate through the planner, so
// the chosen plan's peak is exact, not estimated. The same model prices a
// fused loss's token chunks (launches per logits chunk) and an offloaded
// optimizer's host trip (Profile.OffloadSeconds), with which a Session
// chooses those levers too (batchfit.LeverChoice).
package recompute
