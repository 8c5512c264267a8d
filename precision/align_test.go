package precision_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// gptVocab is a small GPT whose vocabulary (its tied head's outputs) is
// vocab, with data: its loss over random tokens and its parameters.
func gptVocab(t *testing.T, vocab int) model {
	m := models.NewGPT(nn.Seed(5), models.GPTConfig{Vocab: vocab, Context: 8, Layers: 1, Heads: 2, Dim: 16})
	rng := rand.New(rand.NewPCG(uint64(vocab), 9))
	tok := lazy.Wrap(testutil.Classes(rng, vocab, 2, 8), 0)
	tgt := tok.Graph().Wrap(testutil.Classes(rng, vocab, 2, 8), 0)
	loss := models.Loss(m.Forward(tok), tgt)
	require.NoError(t, loss.Err())
	return model{loss, nn.ParamTensors(m)}
}

// forward is m's forward graph and its parameters' ids there.
func (m model) forward(t *testing.T) (*graph.Graph, []int) {
	t.Helper()
	wrt, err := lazy.ParamIDs(m.loss, m.params...)
	require.NoError(t, err)
	return m.loss.Graph().IR(), wrt
}

// countOps counts g's nodes of op.
func countOps(g *graph.Graph, op graph.Op) int {
	n := 0
	for i := range g.Len() {
		if g.Node(i).Op == op {
			n++
		}
	}
	return n
}

// A 16-bit linear layer with at least 1024 outputs, not a multiple of 8,
// runs with its weight padded to a multiple of AlignOutputs rows (a concat
// with a zero fill) and its output sliced back; narrower layers, aligned
// ones and float32 policies are left as they are.
func TestAlignedLinearRewrite(t *testing.T) {
	for _, c := range []struct {
		vocab   int
		policy  precision.Policy
		aligned bool
	}{
		{1030, precision.BF16Mixed, true},
		{1030, precision.FP16Mixed, true},
		{1030, precision.FP32, false},
		{1032, precision.BF16Mixed, false}, // a multiple of 8 already
		{1000, precision.BF16Mixed, false}, // below alignMinOutputs
	} {
		m := gptVocab(t, c.vocab)
		fwd, wrt := m.forward(t)
		g, _, err := precision.Apply(fwd, c.policy)
		require.NoError(t, err)
		added := countOps(g, graph.OpConcat) - countOps(fwd, graph.OpConcat)
		if !c.aligned {
			assert.Zero(t, added, "vocab %d under %s", c.vocab, c.policy)
			continue
		}
		assert.Equal(t, 1, added, "vocab %d under %s: one padded weight", c.vocab, c.policy)
		vp := (c.vocab + precision.AlignOutputs - 1) / precision.AlignOutputs * precision.AlignOutputs
		heads := 0
		for i := range g.Len() {
			if nd := g.Node(i); nd.Op == graph.OpLinear && nd.Type.Shape[len(nd.Type.Shape)-1] == vp {
				heads++
			}
		}
		assert.Equal(t, 1, heads, "the head's outputs are padded to %d", vp)
		_, err = trainStep(fwd, m.loss.ID(), wrt, compile.Options{Policy: c.policy})
		require.NoError(t, err, "autodiff goes through the padding")
	}
}

// The padded head computes the same loss and gradients as the plain one,
// run on the CPU executor in bf16: the real outputs are the same dot
// products, and every added term of the backward products is 0·0.
// Tolerance: 1e-6 relative to each gradient's largest magnitude.
func TestAlignedLinearValues(t *testing.T) {
	m := gptVocab(t, 1030)
	fwd, wrt := m.forward(t)
	run := func(align bool) [][]float32 {
		prev := precision.SetAlignLinears(align)
		defer precision.SetAlignLinears(prev)
		st, err := trainStep(fwd, m.loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed})
		require.NoError(t, err)
		return stepValues(t, st)
	}
	want, got := run(false), run(true)
	require.Len(t, got, len(want))
	requireCloseToScale(t, want, got)
}

// stepValues runs a training step's graph on the CPU: the loss, then the
// gradients.
func stepValues(t *testing.T, st *precision.Step) [][]float32 {
	t.Helper()
	outs, err := cpu.New().Run(context.Background(), st.Graph, append([]int{st.Loss}, st.Grads...)...)
	require.NoError(t, err)
	vals := make([][]float32, len(outs))
	for i, o := range outs {
		vals[i] = o.Float32s()
	}
	return vals
}

// requireCloseToScale holds every output of got to want's within 1e-6 of
// that output's largest magnitude, which must not be 0.
func requireCloseToScale(t *testing.T, want, got [][]float32) {
	t.Helper()
	for i := range want {
		scale := float32(0)
		for _, v := range want[i] {
			scale = max(scale, abs32(v))
		}
		require.Positive(t, scale, "output %d is not all zero", i)
		for j := range want[i] {
			require.InDelta(t, want[i][j], got[i][j], 1e-6*float64(scale), "output %d [%d]", i, j)
		}
	}
}

func abs32(v float32) float32 {
	if v < 0 {
		return -v
	}
	return v
}
