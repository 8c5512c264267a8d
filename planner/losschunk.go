package planner

import "github.com/batchfit/batchfit/graph"

// LossChunkCandidates are the token chunks a Session tries for a
// fused loss (graph.OpLinearCrossEntropy) over rows tokens, largest
// first: the powers of two from graph.MaxLossChunk down to
// graph.MinLossChunk, none larger than the first power of two that holds
// every row (a larger chunk would run the same single chunk). Large
// chunks make the logits GEMMs efficient; small ones hold less.
func LossChunkCandidates(rows int) []int {
	var c []int
	for t := graph.MaxLossChunk; t >= graph.MinLossChunk; t /= 2 {
		if t/2 >= rows && t > graph.MinLossChunk {
			continue
		}
		c = append(c, t)
	}
	return c
}
