package optable

import (
	"fmt"

	"github.com/batchfit/batchfit/graph"
)

// Build lays fams out by op. An op in two families keeps the later entry;
// Problems reports it.
func Build[F ~map[graph.Op]K, K any](fams ...F) *[graph.NumOps]K {
	var t [graph.NumOps]K
	for _, f := range fams {
		for op, k := range f {
			t[op] = k
		}
	}
	return &t
}

// Problems lists what is wrong with fams as a table: an op (other than a
// source op) in no family or in several, a source op with an entry, and an
// entry that has no kernel (has reports false). Source ops have none: the
// host side fills their values.
func Problems[F ~map[graph.Op]K, K any](has func(K) bool, fams ...F) []string {
	count := make([]int, graph.NumOps)
	var out []string
	for _, f := range fams {
		for op, k := range f {
			if int(op) >= graph.NumOps {
				out = append(out, fmt.Sprintf("entry for undeclared op %d", op))
				continue
			}
			count[op]++
			if !has(k) {
				out = append(out, fmt.Sprintf("%s has an entry without a kernel", op))
			}
		}
	}
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		n := count[op]
		switch {
		case op.Category() == graph.CatSource && n > 0:
			out = append(out, fmt.Sprintf("source op %s has a kernel", op))
		case op.Category() == graph.CatSource:
		case n == 0:
			out = append(out, fmt.Sprintf("op %s has no kernel", op))
		case n > 1:
			out = append(out, fmt.Sprintf("op %s is in %d families", op, n))
		}
	}
	return out
}
