package precision_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/precision"
)

// Under every policy a one-block GPT's backward pass runs its two
// in-stream layer norms (ln_1, ln_2) as layer_norm_grad_x_add, two nodes
// fewer than with the fusion off (ln_f's gradient meets no other
// gradient). The fused step's loss and gradients on the CPU equal the
// unfused step's bit for bit (the fused node rounds the layer norm's
// gradient, then adds, as the add did), and the float64 reference's
// evaluation of the fused graph within requireRewriteAgrees's tolerances.
// Under the mixed policies the 16-bit casts of ln_f's and ln_2's input
// gradients, which feed 16-bit GEMMs, are their companions
// (graph.LayerNormGradCastProducer); ln_1's flows on to the float32
// embeddings uncast.
func TestFuseLayerNormGradValues(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed, precision.FP32} {
		t.Run(string(p), func(t *testing.T) {
			m := gptVocab(t, 64)
			fwd, wrt := m.forward(t)
			fused := withPass(t, setFuseLayerNormGrad, true, p, fwd, m.loss.ID(), wrt)
			plain := withPass(t, setFuseLayerNormGrad, false, p, fwd, m.loss.ID(), wrt)
			require.Equal(t, 2, countOps(fused.Graph, graph.OpLayerNormGradXAdd))
			require.Equal(t, 1, countOps(fused.Graph, graph.OpLayerNormGradX), "ln_f's")
			require.Equal(t, plain.Graph.Len()-2, fused.Graph.Len())
			require.Equal(t, stepValues(t, plain), stepValues(t, fused), "bit for bit on the CPU")
			requireRewriteAgrees(t, fused, plain)
			casts := 0
			for id := range fused.Graph.Len() {
				if pr := graph.LayerNormGradCastProducer(fused.Graph, id); pr >= 0 {
					require.Contains(t, []graph.Op{graph.OpLayerNormGradX, graph.OpLayerNormGradXAdd}, fused.Graph.Node(pr).Op, "cast %d", id)
					casts++
				}
			}
			if p.Mixed() {
				require.Equal(t, 2, casts, "the layer norms' gradients' 16-bit casts")
			} else {
				require.Zero(t, casts)
			}
		})
	}
}
