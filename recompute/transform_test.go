package recompute_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/recompute"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Apply keeps forward ids, appends each copy in the run of copies right
// before the first backward node that reads it (directly or through other
// copies), and the originals in the set are no longer read by backward:
// their last use is a forward node.
func TestApplyPlacesCopiesLate(t *testing.T) {
	st := gptStep(t, models.GPTConfig{Vocab: 64, Context: 32, Layers: 3, Heads: 2, Dim: 32}, 4, 32)
	full := recompute.Candidates(st.Graph, st.Boundary)
	c := full[len(full)-1]
	mark := make([]bool, st.Boundary)
	for _, id := range c.Set {
		mark[id] = true
	}
	ng, remap, copies, err := recompute.Apply(st.Graph, st.Boundary, mark)
	require.NoError(t, err)
	require.Equal(t, st.Graph.Len()+copies, ng.Len())
	assert.Equal(t, len(recompute.Copied(st.Graph, st.Boundary, mark)), copies)
	isCopy := make([]bool, ng.Len())
	for i := range st.Boundary {
		require.Equal(t, i, remap[i], "forward ids are kept")
	}
	orig := map[int]bool{}
	for _, id := range remap {
		orig[id] = true
	}
	for id := st.Boundary; id < ng.Len(); id++ {
		isCopy[id] = !orig[id]
	}
	nodes := ng.Nodes()
	for id := range nodes {
		if !isCopy[id] {
			continue
		}
		// The run of copies ends at a backward node; something from id up
		// to it reads id.
		end := id
		for end < len(nodes) && isCopy[end] {
			end++
		}
		require.Less(t, end, len(nodes))
		read := false
		for k := id + 1; k <= end; k++ {
			for _, in := range nodes[k].Inputs {
				read = read || in == id
			}
		}
		assert.True(t, read, "copy %d (%s) is read by the run it belongs to", id, nodes[id].Op)
	}
	outs := make([]int, len(st.Outputs))
	for i, o := range st.Outputs {
		outs[i] = remap[o]
	}
	info, err := shapeinfer.Analyze(ng, outs...)
	require.NoError(t, err)
	for _, id := range recompute.Copied(st.Graph, st.Boundary, mark) {
		if nodes[id].Op == graph.OpReshape {
			continue // a view: it shares its input's buffer
		}
		assert.Less(t, info.LastUse[id], st.Boundary, "original %d (%s) dies in the forward pass", id, nodes[id].Op)
	}
}

func TestBlockOf(t *testing.T) {
	for in, want := range map[string]string{"h.3.attn.q": "h.3", "h.11": "h.11", "2": "2", "0.fc": "0", "ln_f": "", "": "", "layers.x.1": "layers.x.1"} {
		assert.Equal(t, want, recompute.BlockOf(in), in)
	}
}
