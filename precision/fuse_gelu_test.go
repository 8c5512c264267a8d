package precision_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/precision"
)

// withGelu builds a step under p with the gelu_grad fusion on or off.
func withGelu(t *testing.T, on bool, p precision.Policy, fwd *graph.Graph, loss int, wrt []int) *precision.Step {
	t.Helper()
	return withPass(t, setFuseGelu, on, p, fwd, loss, wrt)
}

// Under both mixed policies a small GPT's MLP backward pass runs as one
// matmul_gelu_grad per block, one node fewer than with the fusion off; the
// step's loss and gradients on the CPU equal the float64 reference's
// evaluation of the same graph within 1e-3 of each output's largest
// magnitude, and the unfused step's within 2⁻⁶ of it (the fused node does
// not round the product to 16 bits before multiplying by GELU′, one
// rounding fewer, whose difference passes through the rest of the backward
// pass). Float32 policies are left as they were.
func TestFuseGeluGradValues(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(p), func(t *testing.T) {
			m := gptVocab(t, 64)
			fwd, wrt := m.forward(t)
			fused, plain := withGelu(t, true, p, fwd, m.loss.ID(), wrt), withGelu(t, false, p, fwd, m.loss.ID(), wrt)
			require.Equal(t, 1, countOps(fused.Graph, graph.OpMatMulGeluGrad), "one block")
			require.Zero(t, countOps(fused.Graph, graph.OpGeluGrad))
			require.Equal(t, plain.Graph.Len()-1, fused.Graph.Len())
			requireRewriteAgrees(t, fused, plain)
		})
	}
	m := gptVocab(t, 64)
	wrt, err := lazy.ParamIDs(m.loss, m.params...)
	require.NoError(t, err)
	for _, p := range []precision.Policy{precision.FP32, precision.TF32} {
		a := withGelu(t, true, p, m.loss.Graph().IR(), m.loss.ID(), wrt)
		assert.Zero(t, countOps(a.Graph, graph.OpMatMulGeluGrad), string(p))
	}
}
