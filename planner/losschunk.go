package planner

import (
	"errors"

	"github.com/batchfit/batchfit/graph"
)

// LossChunkCandidates are the token chunks ChooseLossChunk tries for a
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

// ChooseLossChunk picks the token chunk of a step's fused loss over rows
// tokens: plan(t) plans the step with chunk t. With unbounded set (no
// budget) it is the largest candidate, planned once. Otherwise the
// smallest candidate is planned first: when it does not fit, it is the
// answer, with its error; else the largest candidate whose plan fits in
// as few batch chunks as the smallest's is (it holds no more), the next
// smaller one tried while it does not. The plan returned is the chosen
// chunk's.
func ChooseLossChunk(rows int, unbounded bool, plan func(t int) (*Plan, error)) (int, *Plan, error) {
	c := LossChunkCandidates(rows)
	if unbounded || len(c) == 1 {
		pl, err := plan(c[0])
		return c[0], pl, err
	}
	least := c[len(c)-1]
	base, err := plan(least)
	if err != nil {
		return least, base, err
	}
	for _, t := range c[:len(c)-1] {
		pl, err := plan(t)
		var dnf *DoesNotFitError
		switch {
		case errors.As(err, &dnf):
			continue
		case err != nil:
			return t, nil, err
		case pl.Split.Len() <= base.Split.Len():
			return t, pl, nil
		}
	}
	return least, base, nil
}
