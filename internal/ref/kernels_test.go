package ref

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// TestKernelTableComplete: every op but the sources has a kernel, in
// exactly one family.
func TestKernelTableComplete(t *testing.T) {
	fams := []family{elementwiseKernels, contractionKernels, reduceKernels, normKernels,
		movementKernels, indexKernels, convKernels, lossKernels}
	in := make([]int, graph.NumOps)
	for _, f := range fams {
		for op, k := range f {
			in[op]++
			assert.NotNil(t, k, "%s has a nil kernel", op)
		}
	}
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		if op.Category() == graph.CatSource { // Eval reads their data
			assert.Nil(t, kernelTable[op], "source op %s has a kernel", op)
			continue
		}
		assert.NotNil(t, kernelTable[op], "op %s has no reference kernel", op)
		assert.Equal(t, 1, in[op], "op %s is in %d families", op, in[op])
	}
}
