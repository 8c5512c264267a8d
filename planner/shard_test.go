package planner_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// mlpStep compiles an MLP's training step (AdamW's two slots) at batch n.
func mlpStep(t testing.TB, n int, widths []int) *planner.Program {
	model := nn.MLP(nn.Options{ShapeOnly: true}, widths, nn.ReLU{})
	x := lazy.Placeholder([]int{n, widths[0]}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{n}, graph.Int64, 0)
	loss := model.Forward(x).CrossEntropy(y, graph.ReduceMean)
	params := nn.ParamTensors(model)
	outputs := []int{loss.ID()}
	var kept, trained []int
	for i, g := range lazy.Grad(loss, params...) {
		outputs = append(outputs, g.ID())
		kept = append(kept, g.ID())
		trained = append(trained, loss.Graph().NodeOf(params[i]))
	}
	g := loss.Graph().IR()
	info, err := shapeinfer.Analyze(g, outputs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Kept: kept, Trained: trained, StateSlots: 2, Workspace: cpu.Workspace})
	require.NoError(t, err)
	return p
}

// One rank of 8 under ZeRO stage 3: the MLP's 2.9 million parameters
// become shards of ⌈T/8⌉ values, and the rank's plan holds the parameter,
// gradient and two state shards (4 × 1.39 MiB) and the 1 MiB bucket
// persistently, and at most two 4 MiB weights gathered at once (the one
// read and the next, gathered ahead).
func ExampleShard() {
	p := mlpStep(nil, 64, []int{784, 1024, 1024, 1024, 10})
	q, b, err := planner.Shard(p, planner.ShardOptions{Stage: 3, Ranks: 8, BucketBytes: 1 << 20})
	if err != nil {
		fmt.Println(err)
		return
	}
	whole, err := planner.Make(p, planner.Options{Budget: 1 << 30})
	if err != nil {
		fmt.Println(err)
		return
	}
	rank, err := planner.Make(q, planner.Options{Budget: 1 << 30})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("parameters:", b.Total, "shard:", b.ShardLen)
	fmt.Println("persistent:", alloc.FormatBytes(whole.Persistent), "→", alloc.FormatBytes(rank.Persistent))
	fmt.Println("gathered at most:", alloc.FormatBytes(b.Gather))
	// Output:
	// parameters: 2913290 shard: 364162
	// persistent: 33.34 MiB → 6.56 MiB
	// gathered at most: 8.00 MiB
}

// Shard refuses what it cannot shard: a stage outside 1–3, no ranks, a
// program without trained parameters.
func TestShardRefuses(t *testing.T) {
	p := mlpStep(t, 8, []int{4, 8, 3})
	for _, o := range []planner.ShardOptions{{Stage: 0, Ranks: 2}, {Stage: 4, Ranks: 2}, {Stage: 1, Ranks: 0}} {
		_, _, err := planner.Shard(p, o)
		require.ErrorIs(t, err, graph.ErrAttr, "%+v", o)
	}
	x := lazy.Placeholder([]int{8, 4}, graph.Float32, 0)
	out := x.Tanh()
	g := out.Graph().IR()
	info, err := shapeinfer.Analyze(g, out.ID())
	require.NoError(t, err)
	eval, err := planner.Compile(g, info, []int{out.ID()}, planner.CompileOptions{})
	require.NoError(t, err)
	_, _, err = planner.Shard(eval, planner.ShardOptions{Stage: 1, Ranks: 2})
	require.ErrorIs(t, err, graph.ErrAttr)
}
