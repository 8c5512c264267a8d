package shapeinfer_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// The memory timeline of one training step of a two-layer MLP, worked out
// by hand node by node. Timeline counts a value from the node that makes it
// until its last consumer has run; sources (inputs, parameters) from their
// own id to the end; outputs (the loss and the four gradients) to the end.
// Each row's live bytes after the node are fixed + perSample·b; the comment
// shows the node's size, what dies at it, and the total at b = 4.
func TestTimelineOfMLPTrainingStepByHand(t *testing.T) {
	g := lazy.NewGraph()
	x := g.Placeholder([]int{4, 3}, f32, 0)
	labels := g.Placeholder([]int{4}, i64, 0)
	w1, b1 := lazy.ParamSpec([]int{5, 3}, f32, "l1.weight"), lazy.ParamSpec([]int{5}, f32, "l1.bias")
	w2, b2 := lazy.ParamSpec([]int{2, 5}, f32, "l2.weight"), lazy.ParamSpec([]int{2}, f32, "l2.bias")
	loss := x.Linear(w1, b1).Relu().Linear(w2, b2).CrossEntropy(labels, graph.ReduceMean)
	grads := lazy.Grad(loss, w1, b1, w2, b2)
	res := analyze(t, append([]*lazy.Tensor{loss}, grads...)...)

	type row struct {
		op               graph.Op
		inputs           []int
		fixed, perSample int64 // live bytes after the node: fixed + perSample·b
	}
	want := []row{
		{graph.OpInput, nil, 0, 12},                          // 0: x [b 3] f32 = 12b; a source, lives to the end → 12b = 48
		{graph.OpInput, nil, 0, 20},                          // 1: labels [b] int64 = 8b → 12b + 8b = 20b = 80
		{graph.OpParam, nil, 60, 20},                         // 2: l1.weight [5 3] = 60 B → 60 + 20b = 140
		{graph.OpParam, nil, 80, 20},                         // 3: l1.bias [5] = 20 B → 80 + 20b = 160
		{graph.OpLinear, []int{0, 2, 3}, 80, 40},             // 4: linear [b 5] = 20b; frees nothing (its inputs are sources) → 80 + 40b = 240
		{graph.OpRelu, []int{4}, 80, 40},                     // 5: relu [b 5] = 20b; frees 4 (20b) → 80 + 40b = 240
		{graph.OpParam, nil, 120, 40},                        // 6: l2.weight [2 5] = 40 B → 120 + 40b = 280
		{graph.OpParam, nil, 128, 40},                        // 7: l2.bias [2] = 8 B → 128 + 40b = 288
		{graph.OpLinear, []int{5, 6, 7}, 128, 48},            // 8: logits [b 2] = 8b; frees nothing (5 is read again by 13 and 15) → 128 + 48b = 320
		{graph.OpCrossEntropy, []int{8, 1}, 132, 48},         // 9: loss [] = 4 B, an output; frees nothing (11 reads 8) → 132 + 48b = 324
		{graph.OpFill, nil, 136, 48},                         // 10: d loss/d loss [] = 4 B → 136 + 48b = 328
		{graph.OpCrossEntropyGrad, []int{10, 8, 1}, 132, 48}, // 11: d logits [b 2] = 8b; frees 10 (4 B) and 8 (8b) → 132 + 48b = 324
		{graph.OpMatMul, []int{11, 6}, 132, 68},              // 12: d relu = d logits·l2.weight [b 5] = 20b; frees nothing → 132 + 68b = 404
		{graph.OpMatMul, []int{11, 5}, 172, 68},              // 13: d l2.weight = d logitsᵀ·relu [2 5] = 40 B, an output; 5 is read by 15 → 172 + 68b = 444
		{graph.OpSum, []int{11}, 180, 60},                    // 14: d l2.bias [2] = 8 B, an output; frees 11 (8b) → 180 + 60b = 420
		{graph.OpReluGrad, []int{12, 5}, 180, 40},            // 15: d linear [b 5] = 20b; frees 12 (20b) and 5 (20b) → 180 + 40b = 340
		{graph.OpMatMul, []int{15, 0}, 240, 40},              // 16: d l1.weight = d linearᵀ·x [5 3] = 60 B, an output → 240 + 40b = 400
		{graph.OpSum, []int{15}, 260, 20},                    // 17: d l1.bias [5] = 20 B, an output; frees 15 (20b) → 260 + 20b = 340
	}

	nodes := g.IR().Nodes()
	require.Len(t, nodes, len(want), "the graph autodiff built changed; rework the table")
	for id, w := range want {
		require.Equal(t, w.op, nodes[id].Op, "node %d", id)
		if w.inputs == nil {
			require.Empty(t, nodes[id].Inputs, "node %d", id)
		} else {
			require.Equal(t, w.inputs, nodes[id].Inputs, "node %d (%s)", id, w.op)
		}
	}
	require.Equal(t, []int{13, 14, 16, 17}, []int{grads[2].ID(), grads[3].ID(), grads[0].ID(), grads[1].ID()})

	// b = 4 is the whole batch; b = 2 and b = 1 are chunks, where only the
	// per-sample parts shrink.
	for _, b := range []int{4, 2, 1} {
		wantLive := make([]int64, len(want))
		for id, w := range want {
			wantLive[id] = w.fixed + w.perSample*int64(b)
		}
		require.Equal(t, wantLive, res.Timeline(g.IR(), b), "b = %d", b)
	}
	// Timeline is measured after each node's frees: its maximum, 444 B at
	// node 13, is below the high-water mark while node 15 runs, when its
	// output is allocated before 12 and 5 are freed: 420 + 80 = 500 B.
	require.Equal(t, []int64{48, 80, 140, 160, 240, 240, 280, 288, 320, 324, 328, 324, 404, 444, 420, 340, 400, 340},
		res.Timeline(g.IR(), 4))
}

// Values nothing reads are never computed and count nothing; a source's
// bytes count once however many nodes read it.
func TestTimelineSkipsDeadValues(t *testing.T) {
	g := lazy.NewGraph()
	x := g.Placeholder([]int{2, 3}, f32, 0)
	unused := x.Exp()
	y := x.Relu().Mul(x).Sum()
	require.NoError(t, unused.Err())
	res := analyze(t, y)
	require.Equal(t, -1, res.LastUse[unused.ID()])
	require.Equal(t, []int64{
		24, // 0: x [2 3] = 24 B, a source
		24, // 1: exp, read by nothing: +0
		48, // 2: relu [2 3] = 24 B
		48, // 3: mul [2 3] = 24 B; frees 2 (24 B)
		28, // 4: sum [] = 4 B, the output; frees 3 (24 B)
	}, res.Timeline(g.IR(), 2))
}
