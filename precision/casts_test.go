package precision_test

import (
	"fmt"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// castCount is the casts a step runs, grouped by what produces their input
// and what reads their output.
type castCount struct {
	nodes    int
	elements int64
	groups   map[string][2]int64 // "producer -> consumers": nodes, elements
}

// countCasts counts the cast nodes of st's graph that the loss or a
// gradient depends on.
func countCasts(st *precision.Step) castCount {
	g := st.Graph
	live := make([]bool, g.Len())
	for _, o := range append([]int{st.Loss}, st.Grads...) {
		live[o] = true
	}
	for i := g.Len() - 1; i >= 0; i-- {
		if live[i] {
			for _, in := range g.Node(i).Inputs {
				live[in] = true
			}
		}
	}
	users := make([][]int, g.Len())
	for i := range g.Len() {
		if live[i] {
			for _, in := range g.Node(i).Inputs {
				users[in] = append(users[in], i)
			}
		}
	}
	c := castCount{groups: map[string][2]int64{}}
	for i := range g.Len() {
		nd := g.Node(i)
		if !live[i] || nd.Op != graph.OpCast {
			continue
		}
		in := g.Node(nd.Inputs[0])
		var cons []string
		for _, u := range users[i] {
			cons = append(cons, g.Node(u).Op.String())
		}
		sort.Strings(cons)
		k := fmt.Sprintf("%s %s -> %s -> %v", in.Op, in.Type.DType, nd.Type.DType, cons)
		n := int64(nd.Type.Numel())
		v := c.groups[k]
		c.groups[k] = [2]int64{v[0] + 1, v[1] + n}
		c.nodes++
		c.elements += n
	}
	return c
}

// gpt2SmallStep is GPT-2 small's bf16-mixed training step at batch 8, seq
// 1024, shape-only, its head and loss as two ops.
func gpt2SmallStep(t *testing.T) *precision.Step {
	t.Helper()
	return gpt2SmallStepWith(t, compile.Options{Disable: []string{compile.FuseLinearCrossEntropy}})
}

// gpt2SmallStepWith is gpt2SmallStep built with options o.
func gpt2SmallStepWith(t *testing.T, o compile.Options) *precision.Step {
	t.Helper()
	model := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	tokens := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), targets)
	wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(model)...)
	require.NoError(t, err)
	o.Policy = precision.BF16Mixed
	st, err := trainStep(loss.Graph().IR(), loss.ID(), wrt, o)
	require.NoError(t, err)
	return st
}

// GPT-2 small's bf16-mixed step (batch 8, seq 1024) runs 194 casts of
// 432 M elements, down from 268 casts of 713 M without the folding of
// widening casts into matmuls (foldWideningCasts): the 48 weight
// gradients, the 25 linear input gradients that layer norms' backward
// reads and the tied head's padded weight gradient are written in float32
// by their GEMMs. With the 16-bit layer norms (halfNorm, off by default)
// the 25 layer norms that feed linears write bfloat16 themselves: 169
// casts of 275 M. With the fused head and loss (the default) the step
// runs 196 casts of 477 M: linear_cross_entropy writes dh and the padded
// head's dW in bfloat16, and each widens by a cast of its own where the
// head's GEMMs wrote float32. The groups are logged, so a regression
// shows which casts came back.
func TestCastCountGPT2Small(t *testing.T) {
	prevCasts, prevNorms := setFoldCasts(false), precision.SetFoldNorms(false)
	plain := countCasts(gpt2SmallStep(t))
	setFoldCasts(prevCasts)
	precision.SetFoldNorms(prevNorms)
	require.Equal(t, 268, plain.nodes, "casts without folding")
	require.Equal(t, int64(712797696), plain.elements)
	c := countCasts(gpt2SmallStep(t))
	keys := make([]string, 0, len(c.groups))
	for k := range c.groups {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		t.Logf("%4d casts %11d elements  %s", c.groups[k][0], c.groups[k][1], k)
	}
	t.Logf("total %d casts, %d elements", c.nodes, c.elements)
	require.Equal(t, 194, c.nodes, "casts")
	require.Equal(t, int64(431979264), c.elements, "elements cast")
	prevNorms = precision.SetFoldNorms(true)
	norms := countCasts(gpt2SmallStep(t))
	precision.SetFoldNorms(prevNorms)
	require.Equal(t, 169, norms.nodes, "casts with 16-bit layer norms")
	require.Equal(t, int64(274692864), norms.elements)
	fused := countCasts(gpt2SmallStepWith(t, compile.Options{}))
	require.Equal(t, 196, fused.nodes, "casts with the fused loss")
	require.Equal(t, int64(476868096), fused.elements)
}
