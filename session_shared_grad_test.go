package batchfit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// When two parameters receive the very same gradient node (in
// Σ(Σ_batch x + p1 + p2), p1 and p2 have the upstream gradient's shape, so
// both get that node itself), the step must free it once and update both.
func TestStepWithParametersSharingAGradientNode(t *testing.T) {
	for _, budget := range []int64{0, 8 << 20} { // one chunk, and the session's chunked path
		p1 := lazy.Param(tensor.New(tensor.WithShape(2), tensor.WithBacking([]float32{1, 2})), "p1")
		p2 := lazy.Param(tensor.New(tensor.WithShape(2), tensor.WithBacking([]float32{3, 4})), "p2")
		x := lazy.Wrap(tensor.New(tensor.WithShape(3, 2), tensor.WithBacking([]float32{1, 2, 3, 4, 5, 6})), 0)
		loss := x.Sum(0).Add(p1).Add(p2).Sum()
		require.NoError(t, loss.Err())
		grads := lazy.Grad(loss, p1, p2)
		require.Equal(t, grads[0].ID(), grads[1].ID(), "the case under test: one gradient node for both")
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget})
		_, err := sess.Step(context.Background(), loss, []*lazy.Tensor{p1, p2}, optim.NewSGD(0.5, 0))
		require.NoError(t, err)
		// d loss/d p = 1 per element: p ← p − 0.5.
		require.Equal(t, []float32{0.5, 1.5}, p1.Value().Data())
		require.Equal(t, []float32{2.5, 3.5}, p2.Value().Data())
		// Only the two parameters stay allocated (SGD without momentum keeps
		// no state): 8 B each, rounded to 512 B blocks.
		require.Equal(t, int64(2*512), sess.Allocator().Stats().AllocatedBytes[alloc.All].Current)
	}
}
