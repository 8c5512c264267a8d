package autodiff_test

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// What batch_norm's backward reads decides which activations stay alive.
// Training mode saves x: its statistics come from it. Evaluation mode's dx
// is g scaled per channel by weight·rstd from the [C] inputs, so when only
// x's gradient is asked for, no backward node reads x, and x can be freed
// after the forward pass.
func TestBatchNormBackwardReadsX(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for _, training := range []bool{true, false} {
		g := lazy.NewGraph()
		x := g.Wrap(f32(rng, 4, 3, 2, 2), 0)
		w, b := lazy.Const(f32(rng, 3)), lazy.Const(f32(rng, 3))
		mean := lazy.Const(f32(rng, 3))
		variance := lazy.Const(tensor.New(tensor.WithShape(3), tensor.WithBacking([]float32{0.5, 1, 1.5})))
		y := x.BatchNorm2d(w, b, mean, variance, training, 1e-5)
		loss := y.Mul(lazy.Const(f32(rng, 4, 3, 2, 2))).Sum()
		require.NoError(t, loss.Err())
		ir := g.IR()
		grads, err := autodiff.Backward(ir, loss.ID(), []int{x.ID()})
		require.NoError(t, err)
		readers := 0
		for _, nd := range ir.Nodes()[loss.ID()+1:] {
			if slices.Contains(nd.Inputs, x.ID()) {
				readers++
			}
		}
		if training {
			assert.Equal(t, 1, readers, "batch_norm_grad_x reads x")
			assert.Equal(t, graph.OpBatchNormGradX, ir.Node(grads[0]).Op)
		} else {
			assert.Zero(t, readers, "evaluation-mode dx does not read x")
			assert.Equal(t, graph.OpMul, ir.Node(grads[0]).Op)
		}
	}
}
