package precision_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// In a GPT's training step under every policy, as compile.Train builds it,
// each layer norm's backward pass pairs up as the fused CUDA pass needs:
// layer_norm_grad_x (layer_norm_grad_x_add inside the residual stream)
// has two companions, its weight's gradient and its
// bias's (a sum of the same g over the leading axes, in g's dtype:
// float32 under the mixed policies too, since layer_norm's gradient takes
// a float32 g), and CUDA's workspace rule gives it the partials' scratch;
// under the mixed policies the gradient's 16-bit cast for the next GEMMs
// is a third.
func TestLayerNormCompanionsInTrainingStep(t *testing.T) {
	cfg := models.GPTConfig{Vocab: 64, Context: 16, Layers: 2, Heads: 2, Dim: 32}
	for _, pol := range []precision.Policy{precision.FP32, precision.BF16Mixed, precision.FP16Mixed} {
		t.Run(string(pol), func(t *testing.T) {
			model := models.NewGPT(nn.Options{ShapeOnly: true}, cfg)
			tokens := lazy.Placeholder([]int{4, cfg.Context}, graph.Int64, 0)
			targets := tokens.Graph().Placeholder([]int{4, cfg.Context}, graph.Int64, 0)
			loss := models.Loss(model.Forward(tokens), targets)
			p := trainProgram(t, loss, nn.ParamTensors(model), pol, compile.Options{})
			g := p.Graph
			ws := map[int]bool{}
			for _, b := range p.Buffers {
				if b.Kind == planner.BufWorkspace {
					ws[b.Node] = true
				}
			}
			lns, added, narrowed := 0, 0, 0
			for id := range g.Len() {
				nd := g.Node(id)
				if nd.Op != graph.OpLayerNormGradX && nd.Op != graph.OpLayerNormGradXAdd {
					continue
				}
				lns++
				if nd.Op == graph.OpLayerNormGradXAdd {
					added++
				}
				var ops []graph.Op
				for m := range p.Companions(id) {
					if c := g.Node(m); c.Op == graph.OpCast { // the 16-bit copy for the GEMMs
						assert.True(t, pol.Mixed(), "node %d's cast", id)
						assert.Equal(t, pol.Half(), c.Type.DType)
						narrowed++
						continue
					}
					ops = append(ops, g.Node(m).Op)
					assert.Equal(t, nd.Type.DType, g.Node(m).Type.DType)
				}
				assert.Equal(t, []graph.Op{graph.OpLayerNormGradW, graph.OpSum}, ops, "node %d", id)
				assert.Equal(t, graph.Float32, g.Node(nd.Inputs[0]).Type.DType, "g of node %d", id)
				assert.True(t, ws[id], "node %d has a workspace", id)
			}
			assert.Equal(t, 2*cfg.Layers+1, lns)
			assert.Equal(t, 2*cfg.Layers, added, "every in-stream layer norm's gradient meets the stream's (layer_norm_grad_x_add)")
			if pol.Mixed() { // all but the first block's ln_1, whose gradient goes to the embeddings
				assert.Equal(t, 2*cfg.Layers, narrowed)
			}
			assert.True(t, slices.ContainsFunc(p.NextCompanion, func(m int) bool { return m >= 0 }))
			// Every forward layer norm reads an add (the embeddings, then
			// the residual stream) and is that add's only companion (its
			// 16-bit cast is not one: graph.LayerNormGradCastProducer says
			// why).
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

// In a ResNet's training step under every policy, NCHW and channels last
// (package layout, bf16-mixed), each batch_norm_grad_x gives exactly two
// companions: its weight's gradient and its bias's (the sum of the same g
// over every axis but the channels, in g's dtype). Every bias gradient of
// a batch norm pairs so, a block's shortcut and branch each with its own
// batch_norm_grad_x of their shared g, and no other sum becomes a
// companion (the classifier's bias gradient stays a plain sum).
func TestBatchNormCompanionsInTrainingStep(t *testing.T) {
	for _, c := range []struct {
		pol  precision.Policy
		last bool
	}{{precision.FP32, false}, {precision.BF16Mixed, false}, {precision.FP16Mixed, false}, {precision.BF16Mixed, true}} {
		t.Run(fmt.Sprintf("%s/channels_last=%t", c.pol, c.last), func(t *testing.T) {
			m := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNetConfig{Blocks: []int{1, 1, 1, 1}, Bottleneck: true,
				Width: 8, CIFARStem: true, ImageSize: 8, Classes: 5})
			x := lazy.Placeholder([]int{4, 3, 8, 8}, graph.Float32, 0)
			y := x.Graph().Placeholder([]int{4}, graph.Int64, 0)
			loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
			require.NoError(t, loss.Err())
			p := trainProgram(t, loss, nn.ParamTensors(m), c.pol, compile.Options{ChannelsLast: c.last})
			g := p.Graph
			gxs, norms, lastLayout := 0, 0, 0
			companion := map[int]bool{}
			for id := range g.Len() {
				nd := g.Node(id)
				switch nd.Op {
				case graph.OpBatchNorm:
					norms++
				case graph.OpBatchNormGradX:
					gxs++
					if nd.Attrs.ChannelsLast {
						lastLayout++
					}
					var ops []graph.Op
					for m := range p.Companions(id) {
						mn := g.Node(m)
						ops = append(ops, mn.Op)
						companion[m] = true
						assert.Equal(t, nd.Inputs[0], mn.Inputs[0], "node %d's companion %d reads its g", id, m)
						assert.Equal(t, g.Node(nd.Inputs[0]).Type.DType, mn.Type.DType, "node %d's companion %d", id, m)
					}
					assert.Equal(t, []graph.Op{graph.OpBatchNormGradW, graph.OpSum}, ops, "node %d", id)
				}
			}
			assert.Equal(t, norms, gxs)
			if c.last {
				assert.Equal(t, gxs, lastLayout, "every batch norm channels last")
			}
			sums := 0
			for id := range g.Len() {
				if nd := g.Node(id); nd.Op == graph.OpSum {
					sums++
					if !companion[id] {
						assert.Equal(t, -1, graph.BatchNormBiasGradProducer(g, id), "sum %d", id)
					}
				}
			}
			assert.Equal(t, norms+1, sums, "one bias sum per batch norm, and the classifier's")
		})
	}
}

// trainProgram compiles loss's training step under pol and o
// (compile.Train) with CUDA's workspace rule, the gradients kept and
// Adam's two state slots, as a Session on CUDA plans it.
func trainProgram(t *testing.T, loss *lazy.Tensor, params []*lazy.Tensor, pol precision.Policy, o compile.Options) *planner.Program {
	t.Helper()
	wrt, err := lazy.ParamIDs(loss, params...)
	require.NoError(t, err)
	o.Policy = pol
	st, err := trainStep(loss.Graph().IR(), loss.ID(), wrt, o)
	require.NoError(t, err)
	outs := append([]int{st.Loss}, st.Grads...)
	info, err := shapeinfer.Analyze(st.Graph, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(st.Graph, info, outs, planner.CompileOptions{Kept: st.Grads, Trained: st.Params,
		StateSlots: 2, Workspace: cuda.Workspace})
	require.NoError(t, err)
	return p
}
