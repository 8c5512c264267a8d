package ref

import (
	"testing"

	"github.com/batchfit/batchfit/internal/optable"
)

// TestKernelTableComplete: every op but the sources has a kernel, in
// exactly one family.
func TestKernelTableComplete(t *testing.T) {
	for _, p := range optable.Problems(func(k kernel) bool { return k != nil }, families...) {
		t.Error(p)
	}
}
