package planner_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
