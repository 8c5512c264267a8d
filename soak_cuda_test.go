package batchfit_test

import (
	"testing"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
)

// Issue 17 item 10, the full version: 1,000 steps on CUDA within a budget
// that holds the cuBLAS workspace and makes the full batches run in
// chunks.
func TestSoakCUDA(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 steps on the GPU: not in -short")
	}
	sess := cudaSession(t, batchfit.Options{Device: batchfit.DeviceCUDA, Budget: 40 << 20})
	soak(t, sess, 1000, 512)
}

// Issue 17 item 5 on the device that has an overhead: a session given a
// budget never reserves more, the cuBLAS workspace included.
func TestBudgetIncludesOverheadCUDA(t *testing.T) {
	const budget = 51_600_000
	sess := cudaSession(t, batchfit.Options{Device: batchfit.DeviceCUDA, Budget: budget})
	soak(t, sess, 8, 512)
	if peak := sess.Allocator().Stats().ReservedBytes[alloc.All].Peak; peak > budget {
		t.Fatalf("peak reserved %d bytes over a budget of %d (overhead %d)", peak, budget, sess.Overhead())
	}
}
