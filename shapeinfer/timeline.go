package shapeinfer

import "github.com/batchfit/batchfit/graph"

// Timeline returns, for each node in program (id) order, the bytes live
// right after it ran and the values it was the last consumer of were freed,
// with b samples per run. Sources (inputs, parameters, constants) are held
// by their owner and live to the end; values nothing reads are never
// computed and count nothing. This is the allocator-free view of memory: the
// sum of tensor sizes, before rounding and caching.
func (r *Result) Timeline(g *graph.Graph, b int) []int64 {
	n := len(r.LastUse)
	delta := make([]int64, n+1)
	for id := range n {
		last := r.LastUse[id]
		if last < 0 {
			continue
		}
		size := r.Bytes(id, b)
		delta[id] += size
		if last != End && g.Node(id).Op.Category() != graph.CatSource {
			delta[last] -= size
		}
	}
	live := make([]int64, n)
	var cur int64
	for i := range n {
		cur += delta[i]
		live[i] = cur
	}
	return live
}
