package cpu

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// TestKernelTableComplete: every op but the sources has a kernel, in
// exactly one family.
func TestKernelTableComplete(t *testing.T) {
	fams := []family{elementwiseKernels, matmulKernels, reduceKernels, normKernels,
		movementKernels, indexKernels, convKernels, poolKernels, lossKernels}
	in := make([]int, graph.NumOps)
	for _, f := range fams {
		for op, k := range f {
			in[op]++
			assert.NotNil(t, k.run, "%s has a table entry without a kernel", op)
		}
	}
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		if op.Category() == graph.CatSource { // the host side fills their buffers
			assert.Nil(t, kernelTable[op].run, "source op %s has a kernel", op)
			continue
		}
		assert.NotNil(t, kernelTable[op].run, "op %s has no CPU kernel", op)
		assert.Equal(t, 1, in[op], "op %s is in %d families", op, in[op])
	}
}
