package optable

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

type fam map[graph.Op]int

func TestProblems(t *testing.T) {
	all := fam{}
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		if op.Category() != graph.CatSource {
			all[op] = 1
		}
	}
	ok := func(k int) bool { return k != 0 }
	assert.Empty(t, Problems(ok, all))
	assert.Equal(t, 1, Build(all)[graph.OpAdd])

	delete(all, graph.OpAdd)
	assert.Equal(t, []string{"op add has no kernel"}, Problems(ok, all))
	all[graph.OpAdd] = 1
	assert.Equal(t, []string{"op relu is in 2 families"}, Problems(ok, all, fam{graph.OpRelu: 2}))
	assert.Equal(t, []string{"source op input has a kernel"}, Problems(ok, all, fam{graph.OpInput: 1}))
	assert.Equal(t, []string{"exp has an entry without a kernel", "op exp is in 2 families"}, Problems(ok, all, fam{graph.OpExp: 0}))
}
