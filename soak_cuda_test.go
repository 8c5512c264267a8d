package batchfit_test

import (
	"math/rand/v2"
	"testing"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/nn"
)

// soakBudgetCUDA is a budget at which the soak's full training batch of n
// runs on CUDA in the fewest chunks but one, the cuBLAS workspace
// (cuda.DefaultWorkspace, the session's Overhead) included.
func soakBudgetCUDA(t *testing.T, n int) int64 {
	t.Helper()
	m := newSoakModel()
	p := testutil.StepProgram(t, cuda.Workspace, m.loss(rand.New(rand.NewPCG(95, 96)), n), nn.ParamTensors(m.m), 2)
	budgets := testutil.TightBudgets(t, p)
	cs := testutil.Counts(budgets)
	if len(cs) < 2 {
		t.Fatalf("the step never runs in chunks: budgets %v", budgets)
	}
	return budgets[cs[1]] + cuda.DefaultWorkspace
}

// The long soak: 1,000 steps on CUDA within a budget
// that holds the cuBLAS workspace and makes the full batches run in
// chunks.
func TestSoakCUDA(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 steps on the GPU: not in -short")
	}
	const n = 512
	sess := cudaSession(t, batchfit.Options{Device: batchfit.DeviceCUDA, Budget: soakBudgetCUDA(t, n)})
	soak(t, sess, 1000, n)
}

// The budget on the device that has an overhead: a session given a
// budget never reserves more, the cuBLAS workspace included.
func TestBudgetIncludesOverheadCUDA(t *testing.T) {
	const n = 512
	budget := soakBudgetCUDA(t, n)
	sess := cudaSession(t, batchfit.Options{Device: batchfit.DeviceCUDA, Budget: budget})
	soak(t, sess, 8, n)
	if peak := sess.Allocator().Stats().ReservedBytes[alloc.All].Peak; peak > budget {
		t.Fatalf("peak reserved %d bytes over a budget of %d (overhead %d)", peak, budget, sess.Overhead())
	}
}
