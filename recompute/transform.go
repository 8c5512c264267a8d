package recompute

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/batchfit/batchfit/graph"
)

// Apply returns a copy of g in which each forward node i (i < boundary)
// with set[i] is recomputed for backward: backward nodes (id ≥ boundary)
// read a copy of it, appended right before the first backward node that
// needs it (its inputs in the set are copied first, recursively; inputs
// outside the set are read as they are: the checkpoints). remap[old] is
// the new id of node old; forward nodes keep their ids. Sources, and nodes
// Eligible rejects, are never copied whatever set says.
func Apply(g *graph.Graph, boundary int, set []bool) (ng *graph.Graph, remap []int, copies int, err error) {
	nodes := g.Nodes()
	if boundary < 0 || boundary > len(nodes) {
		return nil, nil, 0, graph.Errorf(graph.ErrArity, "recompute: boundary %d outside the graph's %d nodes", boundary, len(nodes))
	}
	ng = graph.New()
	if g.Batch() > 0 {
		if err := ng.SetBatch(g.Batch()); err != nil {
			return nil, nil, 0, err
		}
	}
	remap = make([]int, len(nodes))
	copyOf := make([]int, boundary)
	for i := range copyOf {
		copyOf[i] = -1
	}
	add := func(nd graph.Node, ins []int) (int, error) {
		nd.Inputs = ins
		id, err := ng.Append(nd)
		if err != nil {
			return -1, fmt.Errorf("recompute: node %d (%s): %w", nd.ID, nd.Op, err)
		}
		return id, nil
	}
	recomputed := func(i int) bool { return i < boundary && i < len(set) && set[i] && Eligible(&nodes[i]) }
	var ensure func(i int) (int, error)
	ensure = func(i int) (int, error) {
		if copyOf[i] >= 0 {
			return copyOf[i], nil
		}
		nd := nodes[i]
		ins := make([]int, len(nd.Inputs))
		for k, in := range nd.Inputs {
			if recomputed(in) {
				c, err := ensure(in)
				if err != nil {
					return -1, err
				}
				ins[k] = c
			} else {
				ins[k] = remap[in]
			}
		}
		nd.Type = graph.Type{} // retyped by its rule
		id, err := add(nd, ins)
		if err != nil {
			return -1, err
		}
		copyOf[i] = id
		copies++
		return id, nil
	}
	for i := range nodes {
		nd := nodes[i]
		ins := make([]int, len(nd.Inputs))
		for k, in := range nd.Inputs {
			if i >= boundary && recomputed(in) {
				c, err := ensure(in)
				if err != nil {
					return nil, nil, 0, err
				}
				ins[k] = c
			} else {
				ins[k] = remap[in]
			}
		}
		if nd.Op.Category() != graph.CatSource {
			nd.Type = graph.Type{}
		}
		id, err := add(nd, ins)
		if err != nil {
			return nil, nil, 0, err
		}
		remap[i] = id
	}
	return ng, remap, copies, nil
}

// Copied lists the nodes of set that Apply copies (those backward reads,
// and the set nodes their copies read, transitively), in id order.
func Copied(g *graph.Graph, boundary int, set []bool) []int {
	nodes := g.Nodes()
	in := func(i int) bool { return i < boundary && i < len(set) && set[i] && Eligible(&nodes[i]) }
	copied := make([]bool, boundary)
	var stack []int
	for i := boundary; i < len(nodes); i++ {
		for _, j := range nodes[i].Inputs {
			if in(j) && !copied[j] {
				copied[j] = true
				stack = append(stack, j)
			}
		}
	}
	for len(stack) > 0 {
		j := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for _, k := range nodes[j].Inputs {
			if in(k) && !copied[k] {
				copied[k] = true
				stack = append(stack, k)
			}
		}
	}
	var ids []int
	for i, c := range copied {
		if c {
			ids = append(ids, i)
		}
	}
	return ids
}

// Eligible reports whether a node may be recomputed at all: not a source
// or a fill (nothing to recompute), not batch norm (training mode reads
// batch statistics and updates running ones), and a per-sample value
// (it has a batch axis: cross-batch values are sums the chunks build).
func Eligible(nd *graph.Node) bool {
	switch {
	case nd.Op.Category().Leaf(), nd.Op == graph.OpBatchNorm:
		return false
	}
	return nd.Type.Batched()
}

// Cheap reports whether recomputing the node costs little next to what it
// saves: elementwise ops, normalisations and activations (selective
// recompute, as Megatron recomputes attention's elementwise part). Matrix
// products, convolutions, reductions and movement are not cheap.
func Cheap(nd *graph.Node) bool {
	switch nd.Op.Category() {
	case graph.CatUnary, graph.CatScalar, graph.CatBinary:
		return true
	case graph.CatNormalize:
		return nd.Op != graph.OpBatchNorm
	}
	return false
}

// Block is a module scope whose forward nodes can be checkpointed as one:
// a repeated layer such as a transformer block "h.3" or a Sequential's
// child "2".
type Block struct {
	Scope string
	Nodes []int // forward nodes inside it that may be recomputed
}

// BlockOf is the block a scope belongs to: its shortest dotted prefix that
// ends in a number ("h.3.attn.q" → "h.3"), or "" when there is none.
func BlockOf(scope string) string {
	end := 0
	for end < len(scope) {
		next := strings.IndexByte(scope[end:], '.')
		stop := len(scope)
		if next >= 0 {
			stop = end + next
		}
		if _, err := strconv.Atoi(scope[end:stop]); err == nil && stop > end {
			return scope[:stop]
		}
		if next < 0 {
			break
		}
		end = stop + 1
	}
	return ""
}

// Blocks lists the checkpointable blocks of the forward nodes (ids below
// boundary) in the order they first appear. A block's nodes are the
// eligible ones inside it that no forward node outside it reads: a block's
// outputs stay (they are the next block's checkpoint), everything inside
// is recomputed from them.
func Blocks(g *graph.Graph, boundary int) []Block {
	nodes := g.Nodes()
	scope := make([]string, boundary)
	index := map[string]int{}
	var blocks []Block
	for i := range boundary {
		scope[i] = BlockOf(nodes[i].Scope)
		if s := scope[i]; s != "" {
			if _, ok := index[s]; !ok {
				index[s] = len(blocks)
				blocks = append(blocks, Block{Scope: s})
			}
		}
	}
	escapes := make([]bool, boundary)
	for i := range boundary {
		for _, in := range nodes[i].Inputs {
			if scope[in] != scope[i] {
				escapes[in] = true
			}
		}
	}
	for i := range boundary {
		if s := scope[i]; s != "" && !escapes[i] && Eligible(&nodes[i]) {
			b := &blocks[index[s]]
			b.Nodes = append(b.Nodes, i)
		}
	}
	out := blocks[:0]
	for _, b := range blocks {
		if len(b.Nodes) > 0 {
			out = append(out, b)
		}
	}
	return out
}

// Selective lists the eligible cheap forward nodes (Cheap) that backward
// reads and whose inputs backward keeps anyway (it reads them itself, or
// they are sources): their copies then extend no other value's life, and
// no copy waits on another copy. Nodes marked in skip, and nodes with an
// input marked in skip, are left out (skip is the block set they join;
// nil for none).
func Selective(g *graph.Graph, boundary int, skip []bool) []int {
	nodes := g.Nodes()
	read := make([]bool, boundary)
	for i := boundary; i < len(nodes); i++ {
		for _, in := range nodes[i].Inputs {
			if in < boundary {
				read[in] = true
			}
		}
	}
	skipped := func(i int) bool { return i < len(skip) && skip[i] }
	var ids []int
	for i := range boundary {
		nd := &nodes[i]
		if !read[i] || skipped(i) || !Cheap(nd) || !Eligible(nd) {
			continue
		}
		ok := true
		for _, in := range nd.Inputs {
			if skipped(in) || !(read[in] || nodes[in].Op.Category().Leaf()) {
				ok = false
				break
			}
		}
		if ok {
			ids = append(ids, i)
		}
	}
	return ids
}
