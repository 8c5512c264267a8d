package planner_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
)

// TestAttentionLSEIsAllocatedWithItsForward: the log-sum-exp that
// attention's backward recomputes (attention_lse) is the forward pass's
// companion: its output is allocated right after the attention output,
// before the attention runs, and its own run step stays where autodiff put
// it. A second attention over other keys gets its own companion.
func TestAttentionLSEIsAllocatedWithItsForward(t *testing.T) {
	x := lazy.Placeholder([]int{4, 2, 8, 16}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{16}, graph.Float32, "w")
	q := x.Mul(w)
	a := q.Attention(x, x, lazy.AttentionOptions{Causal: true})
	b := a.Attention(q, x, lazy.AttentionOptions{})
	p := testutil.StepProgram(t, nil, b.Sum(), []*lazy.Tensor{w}, 2)

	g := p.Graph
	pairs, gradPairs := 0, 0
	for id := range g.Len() {
		m := p.Companion[id]
		if g.Node(id).Op == graph.OpAttentionGradQ && m >= 0 {
			// dq's pass may give dk|dv too (TestAttentionGradKVCompanion).
			assert.Equal(t, graph.OpAttentionGradKV, g.Node(m).Op)
			gradPairs++
			continue
		}
		if g.Node(id).Op != graph.OpAttention {
			assert.Equal(t, -1, m, "node %d (%s) has no companion", id, g.Node(id).Op)
			continue
		}
		require.GreaterOrEqual(t, m, 0, "attention node %d has its attention_lse", id)
		lse := g.Node(m)
		require.Equal(t, graph.OpAttentionLSE, lse.Op)
		assert.Equal(t, g.Node(id).Inputs[:2], lse.Inputs[:2], "same q and k")
		assert.Equal(t, g.Node(id).Attrs.Causal, lse.Attrs.Causal)
		pairs++

		// Steps: alloc attention, alloc attention_lse, …, run attention;
		// later run attention_lse, with no alloc of its own.
		allocs := map[int]int{}
		runAt := map[int]int{}
		for si, st := range p.Steps {
			switch st.Kind {
			case planner.StepAlloc:
				if p.Buffers[st.Buf].Kind == planner.BufOutput {
					allocs[st.Node]++
					if st.Node == m {
						require.Greater(t, si, 0)
						prev := p.Steps[si-1]
						assert.Equal(t, planner.Step{Kind: planner.StepAlloc, Node: id, Buf: p.OutputBuf[id]}, prev,
							"attention_lse's output comes right after the attention's")
					}
				}
			case planner.StepRun:
				runAt[st.Node] = si
			}
		}
		assert.Equal(t, 1, allocs[m], "attention_lse's output is allocated once")
		assert.Less(t, runAt[id], runAt[m], "attention_lse still runs, after its forward")
	}
	assert.Equal(t, 2, pairs)
	assert.Equal(t, 1, gradPairs, "the second attention's k needs its gradient, the first's does not")
}

// TestAttentionGradKVIsAllocatedWithGradQ: attention_grad_kv is
// attention_grad_q's companion (graph.AttentionGradKVProducer): its dk|dv
// output is allocated right after dq's, before dq's pass runs (cuDNN's
// backward pass gives all three at once), and its own run step stays, so
// an executor that does not compute it there runs it as before.
func TestAttentionGradKVIsAllocatedWithGradQ(t *testing.T) {
	x := lazy.Placeholder([]int{4, 2, 8, 16}, graph.BFloat16, 0)
	w := lazy.ParamSpec([]int{16}, graph.BFloat16, "w")
	q := x.Mul(w)
	out := q.Attention(q, q, lazy.AttentionOptions{Causal: true})
	p := testutil.StepProgram(t, nil, out.Sum(), []*lazy.Tensor{w}, 2)

	g := p.Graph
	pairs := 0
	for id := range g.Len() {
		if g.Node(id).Op != graph.OpAttentionGradQ {
			continue
		}
		m := p.Companion[id]
		require.GreaterOrEqual(t, m, 0, "attention_grad_q node %d has its attention_grad_kv", id)
		require.Equal(t, graph.OpAttentionGradKV, g.Node(m).Op)
		assert.Equal(t, g.Node(id).Inputs, g.Node(m).Inputs)
		pairs++
		allocAt, runAt := map[int]int{}, map[int]int{}
		for si, st := range p.Steps {
			switch {
			case st.Kind == planner.StepAlloc && p.Buffers[st.Buf].Kind == planner.BufOutput:
				allocAt[st.Node] = si
			case st.Kind == planner.StepRun:
				runAt[st.Node] = si
			}
		}
		assert.Equal(t, allocAt[id]+1, allocAt[m], "dk|dv is allocated right after dq")
		assert.Less(t, allocAt[m], runAt[id], "before dq's pass runs")
		assert.Less(t, runAt[id], runAt[m], "attention_grad_kv keeps its run step")
	}
	assert.Equal(t, 1, pairs)
}

// companionHooks runs nothing and records, in order, the Companion calls
// and the runs of the nodes that have companions.
type companionHooks struct {
	p   *planner.Program
	log []string
}

func (*companionHooks) Resident(planner.Buffer) *alloc.Block                          { return nil }
func (*companionHooks) Fill(planner.Buffer, *alloc.Block) error                       { return nil }
func (*companionHooks) Freed(planner.Buffer, *alloc.Block)                            {}
func (*companionHooks) ChunkDone(planner.Chunk, []*alloc.Block, []*alloc.Block) error { return nil }
func (*companionHooks) Finish([]*alloc.Block, *alloc.Block) error                     { return nil }
func (*companionHooks) EveryChunk() bool                                              { return true }
func (h *companionHooks) Companion(nd *graph.Node, m int, blk *alloc.Block, _ []*alloc.Block) {
	h.log = append(h.log, fmt.Sprintf("companion %d of %d (%d bytes)", m, nd.ID, blk.Requested()))
}
func (h *companionHooks) Run(nd *graph.Node, _ planner.Chunk, _ *alloc.Block, _ []*alloc.Block, _ *alloc.Block) error {
	if h.p.Companion[nd.ID] >= 0 {
		h.log = append(h.log, fmt.Sprintf("run %d", nd.ID))
	}
	return nil
}

// TestLayerNormGradsAreAllocatedWithGradX: layer norm's backward pass as
// autodiff emits it gives layer_norm_grad_x two companions, its weight's
// gradient and its bias's (the sum of g over the leading axes), in that
// order; both outputs are allocated right after dx's, before its pass
// runs, both keep their own run steps, and a replay hands both blocks to
// CompanionHooks before running layer_norm_grad_x. Without a bias, or with
// the weight not trained, the one that is left pairs alone; with neither
// trained there is no companion.
func TestLayerNormGradsAreAllocatedWithGradX(t *testing.T) {
	build := func(bias, trainW bool) (*planner.Program, *lazy.Tensor, *lazy.Tensor) {
		x := lazy.Placeholder([]int{4, 6, 16}, graph.Float32, 0)
		p := lazy.ParamSpec([]int{16}, graph.Float32, "p") // x·p needs dx
		w := lazy.ParamSpec([]int{16}, graph.Float32, "w")
		var b *lazy.Tensor
		if bias {
			b = lazy.ParamSpec([]int{16}, graph.Float32, "b")
		}
		ln := x.Mul(p).LayerNorm(w, b, 1, 1e-5)
		params := []*lazy.Tensor{p}
		if trainW {
			params = append(params, w)
		}
		if bias {
			params = append(params, b)
		}
		return testutil.StepProgram(t, nil, ln.Mul(ln).Sum(), params, 2), w, b
	}
	for _, c := range []struct {
		name         string
		bias, trainW bool
		want         []graph.Op
	}{
		{"weight and bias", true, true, []graph.Op{graph.OpLayerNormGradW, graph.OpSum}},
		{"weight only", false, true, []graph.Op{graph.OpLayerNormGradW}},
		{"bias only", true, false, []graph.Op{graph.OpSum}},
		{"neither", false, false, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, _, _ := build(c.bias, c.trainW)
			g := p.Graph
			gx := -1
			for id := range g.Len() {
				if g.Node(id).Op == graph.OpLayerNormGradX {
					require.Equal(t, -1, gx, "one layer_norm_grad_x")
					gx = id
				} else {
					assert.Equal(t, 0, len(slices.Collect(p.Companions(id))), "node %d (%s) has no companion", id, g.Node(id).Op)
				}
			}
			require.GreaterOrEqual(t, gx, 0)
			cos := slices.Collect(p.Companions(gx))
			var ops []graph.Op
			for _, m := range cos {
				ops = append(ops, g.Node(m).Op)
				assert.Equal(t, g.Node(gx).Inputs[0], g.Node(m).Inputs[0], "companion %d reads dx's g", m)
				assert.Less(t, gx, m)
			}
			assert.Equal(t, c.want, ops)
			if len(cos) == 0 {
				return
			}
			allocAt, runAt := map[int]int{}, map[int]int{}
			for si, st := range p.Steps {
				switch {
				case st.Kind == planner.StepAlloc && p.Buffers[st.Buf].Kind == planner.BufOutput:
					_, seen := allocAt[st.Node]
					assert.False(t, seen, "node %d's output is allocated once", st.Node)
					allocAt[st.Node] = si
				case st.Kind == planner.StepRun:
					runAt[st.Node] = si
				}
			}
			for i, m := range cos {
				assert.Equal(t, allocAt[gx]+1+i, allocAt[m], "companion %d is allocated right after dx (and the one before it)", m)
				assert.Less(t, runAt[gx], runAt[m], "companion %d keeps its run step, after dx's", m)
			}

			h := &companionHooks{p: p}
			a := alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{})
			_, err := planner.Replay(p, planner.Chunks(4, 2), a, h, false)
			require.NoError(t, err)
			var want []string
			for range 2 { // each chunk
				for _, m := range cos {
					want = append(want, fmt.Sprintf("companion %d of %d (%d bytes)", m, gx, 16*4))
				}
				want = append(want, fmt.Sprintf("run %d", gx))
			}
			assert.Equal(t, want, h.log)
		})
	}
}
