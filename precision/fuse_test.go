package precision_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// withFusion builds st's step with the padded-loss fusion on or off, the
// head and loss as two ops (fuse-linear-cross-entropy disabled: the fusion is of
// them).
func withFusion(t *testing.T, on bool, fwd *graph.Graph, loss int, wrt []int) *precision.Step {
	t.Helper()
	prev := precision.SetFusePaddedLoss(on)
	defer precision.SetFusePaddedLoss(prev)
	st, err := trainStep(fwd, loss, wrt, compile.Options{Policy: precision.BF16Mixed, Disable: []string{compile.FuseLinearCrossEntropy}})
	require.NoError(t, err)
	return st
}

// ran counts, per op, the nodes of st's step that a program computing the
// loss and the gradients runs (dead nodes never run).
func ran(t *testing.T, st *precision.Step) map[graph.Op]int {
	t.Helper()
	outs := append([]int{st.Loss}, st.Grads...)
	info, err := shapeinfer.Analyze(st.Graph, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(st.Graph, info, outs, planner.CompileOptions{})
	require.NoError(t, err)
	n := map[graph.Op]int{}
	for _, s := range p.Steps {
		if s.Kind == planner.StepRun {
			n[st.Graph.Node(s.Node).Op]++
		}
	}
	return n
}

// Under bf16-mixed the GPT head's padded logits go to cross_entropy as
// they are, with End = the vocabulary: the step runs one slice and one
// slice_grad fewer than without the fusion, and its cross_entropy and
// cross_entropy_grad read [B·T, Vp] logits.
func TestFusedLossRewrite(t *testing.T) {
	const vocab = 1030
	m := gptVocab(t, vocab)
	fwd, wrt := m.forward(t)
	fused, plain := withFusion(t, true, fwd, m.loss.ID(), wrt), withFusion(t, false, fwd, m.loss.ID(), wrt)
	f, p := ran(t, fused), ran(t, plain)
	assert.Equal(t, p[graph.OpSlice]-1, f[graph.OpSlice], "the head's slice no longer runs")
	assert.Equal(t, p[graph.OpSliceGrad]-1, f[graph.OpSliceGrad], "nor its gradient")
	vp := (vocab + precision.AlignOutputs - 1) / precision.AlignOutputs * precision.AlignOutputs
	for op, logits := range map[graph.Op]int{graph.OpCrossEntropy: 0, graph.OpCrossEntropyGrad: 1} { // the logits' input
		seen := 0
		for _, nd := range fused.Graph.Nodes() {
			if nd.Op != op {
				continue
			}
			seen++
			x := fused.Graph.Node(nd.Inputs[logits])
			assert.Equal(t, []int{16, vp}, x.Type.Shape, "%s reads the padded logits", op)
			assert.Equal(t, vocab, nd.Attrs.End, "%s scores the vocabulary", op)
		}
		assert.Equal(t, 1, seen, op.String())
	}
	// The forward ids still name values of their original shapes: the
	// logits an Eval may ask for are [2, 8, vocab] (the unread slice).
	logits := fwd.Node(fwd.Node(m.loss.ID()).Inputs[0]).Inputs[0]
	assert.Equal(t, []int{2, 8, vocab}, fused.Graph.Node(fused.IDs[logits]).Type.Shape)
}

// The fused step's loss and gradients on the CPU executor in bf16 equal
// the unfused one's: cross_entropy over the first V of Vp columns is the
// cross_entropy of their slice, and the padded columns' zero gradient is
// the slice_grad's. Tolerance: 1e-6 relative to each output's largest
// magnitude (the same float64 sums either way; only bf16 roundings of
// equal values follow).
func TestFusedLossValues(t *testing.T) {
	m := gptVocab(t, 1030)
	fwd, wrt := m.forward(t)
	run := func(on bool) [][]float32 {
		st := withFusion(t, on, fwd, m.loss.ID(), wrt)
		return stepValues(t, st)
	}
	want, got := run(false), run(true)
	require.Len(t, got, len(want))
	requireCloseToScale(t, want, got)
}

// The fusion leaves a graph as it was when the padded logits or their
// reshape have a reader besides the loss, or no cross_entropy reads them.
func TestFusedLossLeavesOtherGraphs(t *testing.T) {
	const vocab = 1030
	for _, c := range []struct {
		name string
		loss func(logits, tgt *lazy.Tensor) *lazy.Tensor
	}{
		{"logits read twice", func(logits, tgt *lazy.Tensor) *lazy.Tensor {
			return models.Loss(logits, tgt).Add(logits.Mean())
		}},
		{"reshaped logits read twice", func(logits, tgt *lazy.Tensor) *lazy.Tensor {
			flat := logits.Reshape(-1, vocab)
			return flat.CrossEntropy(tgt.Reshape(-1), graph.ReduceMean).Add(flat.Softmax(-1).Max(0, 1))
		}},
		{"no cross_entropy", func(logits, _ *lazy.Tensor) *lazy.Tensor {
			return logits.LogSoftmax(-1).Mean()
		}},
		{"a reshape no cross_entropy reads", func(logits, _ *lazy.Tensor) *lazy.Tensor {
			return logits.Reshape(1, -1, vocab).Mean()
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := models.NewGPT(nn.Seed(5), models.GPTConfig{Vocab: vocab, Context: 8, Layers: 1, Heads: 2, Dim: 16})
			rng := rand.New(rand.NewPCG(vocab, 9))
			tok := lazy.Wrap(testutil.Classes(rng, vocab, 2, 8), 0)
			tgt := tok.Graph().Wrap(testutil.Classes(rng, vocab, 2, 8), 0)
			loss := c.loss(m.Forward(tok), tgt)
			require.NoError(t, loss.Err())
			fwd := loss.Graph().IR()
			apply := func(on bool) *graph.Graph {
				prev := precision.SetFusePaddedLoss(on)
				defer precision.SetFusePaddedLoss(prev)
				g, _, err := precision.Apply(fwd, precision.BF16Mixed)
				require.NoError(t, err)
				return g
			}
			fused, plain := apply(true), apply(false)
			require.Positive(t, countOps(plain, graph.OpSlice), "the head is padded")
			require.Equal(t, plain.Len(), fused.Len())
			for i := range plain.Len() {
				a, b := plain.Node(i), fused.Node(i)
				require.Equal(t, a.Op, b.Op, "node %d", i)
				require.Equal(t, a.Inputs, b.Inputs, "node %d", i)
				require.Equal(t, a.Attrs, b.Attrs, "node %d", i)
				require.Equal(t, a.Type, b.Type, "node %d", i)
			}
		})
	}
}

// The fusion does not raise the predicted peak of GPT-2 small's bf16-mixed
// training step at batch 8, seq 1024 (shape-only, CUDA's workspace rules,
// AdamW's two state slots, one chunk): without the slice the logits'
// [8192, 50257] copy and its gradient's are never allocated.
func TestFusedLossPeakGPT2Small(t *testing.T) {
	model := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	tokens := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), targets)
	wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(model)...)
	require.NoError(t, err)
	peak := func(on bool) int64 {
		st := withFusion(t, on, loss.Graph().IR(), loss.ID(), wrt)
		outs := append([]int{st.Loss}, st.Grads...)
		info, err := shapeinfer.Analyze(st.Graph, outs...)
		require.NoError(t, err)
		p, err := planner.Compile(st.Graph, info, outs, planner.CompileOptions{Kept: st.Grads, Trained: st.Params,
			StateSlots: 2, Workspace: cuda.Workspace})
		require.NoError(t, err)
		pl, err := planner.Make(p, planner.Options{Budget: 1 << 40})
		require.NoError(t, err)
		require.Len(t, pl.Chunks, 1)
		return pl.PeakReserved
	}
	fused, plain := peak(true), peak(false)
	t.Logf("predicted peak: %d MiB fused, %d MiB with the slice", fused>>20, plain>>20)
	assert.LessOrEqual(t, fused, plain)
}

// A 2-D head read by cross_entropy directly (no reshape) is fused too,
// and its loss and gradients on the CPU in bf16 equal the unfused step's
// within 1e-6 of each output's largest magnitude.
func TestFusedLossDirectHead(t *testing.T) {
	const n, d, vocab = 12, 16, 1030
	rng := rand.New(rand.NewPCG(31, 32))
	x := lazy.Wrap(testutil.UniformF32(rng, n, d), 0)
	w := lazy.Param(testutil.UniformF32(rng, vocab, d), "w")
	b := lazy.Param(testutil.UniformF32(rng, vocab), "b")
	loss := x.Linear(w, b).CrossEntropy(x.Graph().Wrap(testutil.Classes(rng, vocab, n), 0), graph.ReduceMean)
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, w, b)
	require.NoError(t, err)
	fwd := loss.Graph().IR()
	run := func(on bool) [][]float32 {
		st := withFusion(t, on, fwd, loss.ID(), wrt)
		ce := st.Graph.Node(st.Loss)
		if on {
			require.Equal(t, vocab, ce.Attrs.End)
			require.Equal(t, graph.OpLinear, st.Graph.Node(ce.Inputs[0]).Op, "cross_entropy reads the padded linear")
		} else {
			require.Equal(t, graph.OpSlice, st.Graph.Node(ce.Inputs[0]).Op)
		}
		return stepValues(t, st)
	}
	want, got := run(false), run(true)
	requireCloseToScale(t, want, got)
}
