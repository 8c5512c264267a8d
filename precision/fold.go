package precision

import "github.com/batchfit/batchfit/graph"

// foldWideningCasts turns a widening cast of a 16-bit matmul's result
// into the matmul's own float32 output (graph.OpMatMul's Attrs.Target):
// cuBLAS then accumulates in float32 and stores float32, with no 16-bit
// result and no cast kernel. It applies where the cast, to float32, reads
// the matmul directly or through reshapes and slices, and nothing else
// reads the matmul or those movements (each has one reader, and none is
// an output of the step). After autodiff these are every weight gradient
// (cast back to the float32 master weight, Cast's VJP), the gradient of a
// 16-bit copy of a float32 activation (a linear's input gradient for the
// layer norm that fed it), and the tied head's padded weight gradient
// (slice, then cast). The result is more accurate than the cast of a
// rounded product: it is rounded once, to float32, rather than to 16 bits
// and widened. Movements between are appended again in float32.
//
// It rebuilds s's graph when it folds any cast (ids change; every id of s
// is remapped) and leaves it as it was otherwise.
func (s *Step) foldWideningCasts() error {
	g := s.Graph
	users := consumers(g)
	out := make([]bool, g.Len()) // the step's outputs: never folded away
	for _, id := range append([]int{s.Loss, s.Scaled, s.Scale}, s.Grads...) {
		if id >= 0 {
			out[id] = true
		}
	}
	sole := func(id, reader int) bool { return !out[id] && len(users[id]) == 1 && users[id][0] == reader }
	widen := make([]bool, g.Len()) // matmuls that write float32
	drop := make([]bool, g.Len())  // casts they replace
	folded := false
	for i := range g.Len() {
		nd := g.Node(i)
		if nd.Op != graph.OpCast || nd.Type.DType != graph.Float32 {
			continue
		}
		p, reader := nd.Inputs[0], i
		for q := g.Node(p); (q.Op == graph.OpReshape || q.Op == graph.OpSlice) && sole(p, reader); q = g.Node(p) {
			p, reader = q.Inputs[0], p
		}
		if q := g.Node(p); q.Op == graph.OpMatMul && q.Type.DType.IsHalf() && sole(p, reader) {
			widen[p], drop[i], folded = true, true, true
		}
	}
	if !folded {
		return nil
	}
	ng, ids, err := graph.Rebuild(g, "fold cast into ", func(i int, n *graph.Node, ids []int) (int, bool) {
		if drop[i] {
			return ids[g.Node(i).Inputs[0]], false
		}
		if widen[i] {
			n.Attrs.Target = graph.Type{DType: graph.Float32}
		}
		return 0, true
	})
	if err != nil {
		return err
	}
	s.rebind(ng, ids)
	return nil
}

// rebind makes ng s's graph, ids[i] being old node i's id in ng (−1 for
// a node a pass removed), and remaps every id of s.
func (s *Step) rebind(ng *graph.Graph, ids []int) {
	remap := func(v []int) {
		for k, id := range v {
			if id >= 0 { // −1: a forward node the attention fusion removed
				v[k] = ids[id]
			}
		}
	}
	s.Graph = ng
	s.Loss, s.Scaled = ids[s.Loss], ids[s.Scaled]
	if s.Scale >= 0 {
		s.Scale = ids[s.Scale]
	}
	remap(s.Params)
	remap(s.Grads)
	remap(s.IDs)
}

// fuse runs a backward-pass fusion (graph.FuseGeluGrad,
// graph.FuseLayerNormGradAdd, graph.FuseEmbeddingGradAdd) on s's graph, the step's loss, scaled loss
// and gradients kept as outputs.
func (s *Step) fuse(pass func(*graph.Graph, []int) (*graph.Graph, []int, error)) error {
	outs := append([]int{s.Loss, s.Scaled, s.Scale}, s.Grads...)
	ng, ids, err := pass(s.Graph, outs)
	if err != nil {
		return err
	}
	s.rebind(ng, ids)
	return nil
}
