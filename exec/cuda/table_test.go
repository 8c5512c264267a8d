package cuda

import (
	"bytes"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
	"github.com/batchfit/batchfit/internal/optable"
)

// TestKernelTableComplete: every op but the sources has kernels, in
// exactly one family.
func TestKernelTableComplete(t *testing.T) {
	for _, p := range optable.Problems(func(k opKernel) bool { return k.run != nil }, families...) {
		t.Error(p)
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
