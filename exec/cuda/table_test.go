package cuda

import (
	"bytes"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
	"github.com/batchfit/batchfit/graph"
)

// TestKernelTableComplete: every op but the sources has kernels, in exactly
// one family.
func TestKernelTableComplete(t *testing.T) {
	fams := []family{elementwiseKernels, matmulKernels, reduceKernels, normKernels,
		movementKernels, convKernels, lossKernels}
	in := make([]int, graph.NumOps)
	for _, f := range fams {
		for op, k := range f {
			in[op]++
			assert.NotNil(t, k.run, "%s has a table entry without a launch", op)
		}
	}
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		if op.Category() == graph.CatSource { // the host side fills their blocks
			assert.Nil(t, kernelTable[op].run, "source op %s has kernels", op)
			continue
		}
		assert.NotNil(t, kernelTable[op].run, "op %s has no CUDA kernel", op)
		assert.Equal(t, 1, in[op], "op %s is in %d families", op, in[op])
	}
}

// TestOpcodesGenerated: kernels/opcodes.cuh is what go generate writes
// from internal/opcode; run go generate ./exec/cuda after changing codes.
func TestOpcodesGenerated(t *testing.T) {
	got, err := fs.ReadFile(Sources, "kernels/opcodes.cuh")
	require.NoError(t, err)
	if !bytes.Equal(got, opcode.Header()) {
		t.Errorf("kernels/opcodes.cuh drifted from internal/opcode: run go generate ./exec/cuda")
	}
}
