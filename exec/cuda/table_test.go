package cuda

import (
	"bytes"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/require"

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
// from the codes in the family files; run go generate ./exec/cuda after
// changing them.
func TestOpcodesGenerated(t *testing.T) {
	got, err := fs.ReadFile(Sources, "kernels/opcodes.cuh")
	require.NoError(t, err)
	if !bytes.Equal(got, OpcodeHeader()) {
		t.Errorf("kernels/opcodes.cuh drifted from the declared op codes: run go generate ./exec/cuda")
	}
}
