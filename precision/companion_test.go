package precision_test

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// In a GPT's training step under every policy, as TrainWith builds it,
// each layer norm's backward pass pairs up as the fused CUDA pass needs:
// layer_norm_grad_x has two companions, its weight's gradient and its
// bias's (a sum of the same g over the leading axes, in g's dtype:
// float32 under the mixed policies too, since layer_norm's gradient takes
// a float32 g), and CUDA's workspace rule gives it the partials' scratch.
func TestLayerNormCompanionsInTrainingStep(t *testing.T) {
	cfg := models.GPTConfig{Vocab: 64, Context: 16, Layers: 2, Heads: 2, Dim: 32}
	for _, pol := range []precision.Policy{precision.FP32, precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(pol), func(t *testing.T) {
			model := models.NewGPT(nn.Options{ShapeOnly: true}, cfg)
			tokens := lazy.Placeholder([]int{4, cfg.Context}, graph.Int64, 0)
			targets := tokens.Graph().Placeholder([]int{4, cfg.Context}, graph.Int64, 0)
			loss := models.Loss(model.Forward(tokens), targets)
			wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(model)...)
			require.NoError(t, err)
			st, err := precision.TrainWith(loss.Graph().IR(), pol, loss.ID(), wrt, precision.TrainOptions{})
			require.NoError(t, err)
			outs := append([]int{st.Loss}, st.Grads...)
			info, err := shapeinfer.Analyze(st.Graph, outs...)
			require.NoError(t, err)
			p, err := planner.Compile(st.Graph, info, outs, planner.CompileOptions{Kept: st.Grads, Trained: st.Params,
				StateSlots: 2, Workspace: cuda.Workspace})
			require.NoError(t, err)
			g := p.Graph
			ws := map[int]bool{}
			for _, b := range p.Buffers {
				if b.Kind == planner.BufWorkspace {
					ws[b.Node] = true
				}
			}
			lns := 0
			for id := range g.Len() {
				nd := g.Node(id)
				if nd.Op != graph.OpLayerNormGradX {
					continue
				}
				lns++
				var ops []graph.Op
				for m := range p.Companions(id) {
					ops = append(ops, g.Node(m).Op)
					assert.Equal(t, nd.Type.DType, g.Node(m).Type.DType)
				}
				assert.Equal(t, []graph.Op{graph.OpLayerNormGradW, graph.OpSum}, ops, "node %d", id)
				assert.Equal(t, graph.Float32, g.Node(nd.Inputs[0]).Type.DType, "g of node %d", id)
				assert.True(t, ws[id], "node %d has a workspace", id)
			}
			assert.Equal(t, 2*cfg.Layers+1, lns)
			assert.True(t, slices.ContainsFunc(p.NextCompanion, func(m int) bool { return m >= 0 }))
			// Every forward layer norm reads an add (the embeddings, then
			// the residual stream) and is that add's companion.
			norms := 0
			for id := range g.Len() {
				if nd := g.Node(id); nd.Op == graph.OpLayerNorm {
					norms++
					add := nd.Inputs[0]
					assert.Equal(t, graph.OpAdd, g.Node(add).Op, "layer norm %d", id)
					assert.Equal(t, []int{id}, slices.Collect(p.Companions(add)), "layer norm %d", id)
				}
			}
			assert.Equal(t, 2*cfg.Layers+1, norms)
		})
	}
}
