package batchfit_test

import (
	"testing"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cuda"
)

// TestChunkErrorNamesGlobalRowCUDA is TestChunkErrorNamesGlobalRow on
// CUDA: the kernels flag the first bad position (atomicMin), and the
// executor names the caller's row.
func TestChunkErrorNamesGlobalRowCUDA(t *testing.T) {
	checkRowError(t, cuda.Workspace, func(t *testing.T, planBudget int64) *batchfit.Session {
		return cudaSession(t, batchfit.Options{Budget: withOverhead(planBudget)})
	})
}
