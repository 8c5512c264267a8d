package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// Training a small GPT with the fused attention op, packed (attention_qkv,
// the default) or on q, k, v sliced out (UnpackedAttention), gives the
// losses of the written-out form (q·kᵀ, scale, causal_mask, softmax, ·v):
// 30 Adam steps from the same initialisation on the same batch (which the
// model learns).
// Both run float32; they differ in summation order only, and 30 steps of
// Adam at lr 1e-2 keep the losses within 1e-5 relative of each other
// (measured: 8e-8).
// (Chunked fused steps equal whole ones: TestChunkedStepMatchesWholeBatch
// and TestPlannedPeaksAreMeasured run testutil.GPTModel, fused.)
func TestFusedAttentionTrainsLikeWrittenOut(t *testing.T) {
	const steps, n, seq, vocab = 30, 12, 16, 64
	ctx := context.Background()
	cfg := models.GPTConfig{Vocab: vocab, Context: seq, Layers: 2, Heads: 2, Dim: 16}
	run := func(writtenOut, unpacked bool) []float32 {
		c := cfg
		c.WrittenOutAttention, c.UnpackedAttention = writtenOut, unpacked
		m := models.NewGPT(nn.Seed(22), c)
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		opt := optim.NewAdam(1e-2)
		var losses []float32
		for step := range steps {
			rng := rand.New(rand.NewPCG(5, 6))
			tokens := lazy.Wrap(testutil.Classes(rng, vocab, n, seq), 0)
			targets := tokens.Graph().Wrap(testutil.Classes(rng, vocab, n, seq), 0)
			loss, err := sess.Step(ctx, models.Loss(m.Forward(tokens), targets), nn.ParamTensors(m), opt)
			require.NoError(t, err, "step %d", step)
			losses = append(losses, loss)
		}
		return losses
	}
	want := run(true, false)
	for _, unpacked := range []bool{false, true} {
		fused := run(false, unpacked)
		var worst float64
		for i := range want {
			rel := math.Abs(float64(fused[i]-want[i])) / math.Abs(float64(want[i]))
			worst = max(worst, rel)
			require.InEpsilon(t, want[i], fused[i], 1e-5, "step %d (unpacked %v)", i, unpacked)
		}
		t.Logf("losses %.5f → %.5f; fused (unpacked %v) vs written out: worst relative difference %.2g", want[0], want[steps-1], unpacked, worst)
	}
	require.Less(t, float64(want[steps-1]), 0.9*float64(want[0]), "the model learns")
}

// The fused GPT-2 small step keeps nothing [T, T]-sized: no node of the
// training graph (forward and backward) has two trailing axes of the
// sequence length, where the written-out form has one per score, mask,
// softmax and their gradients.
func TestFusedAttentionHasNoTxTValue(t *testing.T) {
	count := func(writtenOut bool) (tt, fused int) {
		cfg := models.GPT2Small()
		cfg.WrittenOutAttention = writtenOut
		m := models.NewGPT(nn.Options{ShapeOnly: true}, cfg)
		tokens := lazy.Placeholder([]int{2, 1024}, graph.Int64, 0)
		targets := tokens.Graph().Placeholder([]int{2, 1024}, graph.Int64, 0)
		loss := models.Loss(m.Forward(tokens), targets)
		for _, g := range lazy.Grad(loss, nn.ParamTensors(m)...) {
			require.NoError(t, g.Err())
		}
		for _, nd := range tokens.Graph().IR().Nodes() {
			s := nd.Type.Shape
			if len(s) >= 2 && s[len(s)-1] == 1024 && s[len(s)-2] == 1024 {
				tt++
			}
			if nd.Op == graph.OpAttention || nd.Op == graph.OpAttentionQKV {
				fused++
			}
			if !writtenOut {
				// attention_qkv reads the projection in place: no permute
				// or concat, forward or backward (the one slice left is
				// the position embedding's).
				require.NotContains(t, []graph.Op{graph.OpPermute, graph.OpConcat}, nd.Op)
			}
		}
		return tt, fused
	}
	tt, fused := count(false)
	require.Zero(t, tt, "[T, T] values with the fused op")
	require.Equal(t, 12, fused, "one fused attention per layer")
	tt, fused = count(true)
	require.Greater(t, tt, 12*4, "the written-out form has [T, T] values")
	require.Zero(t, fused)
}
