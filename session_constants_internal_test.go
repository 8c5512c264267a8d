package batchfit

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/recompute"
)

// A Llama loop, whose loss scale is a constant made every step, makes
// its loss-chunk and recompute choices once: the residents the choices
// are keyed by name that constant by its value (exec.HeldKey), which the
// next step's new constant shares, not by its tensor. Keyed by the
// tensor, every step missed both caches and planned every candidate
// again.
func TestConstantPerStepKeepsChoicesCached(t *testing.T) {
	cfg := models.LlamaTiny()
	cfg.Vocab, cfg.Hidden, cfg.Intermediate = 2048, 128, 256
	m := models.NewLlama(nn.Seed(1), cfg)
	rng := rand.New(rand.NewPCG(2, 3))
	var feeds [2][2]*tensor.Dense
	for i := range feeds {
		tok := testutil.Classes(rng, cfg.Vocab, 4, 64)
		labels, _, err := models.ShiftLabels(tok)
		require.NoError(t, err)
		feeds[i] = [2]*tensor.Dense{tok, labels}
	}
	build := func(i int) *lazy.Tensor {
		tok := lazy.Wrap(feeds[i%2][0], 0)
		return models.ShiftedCausalLMLoss(m.Forward(tok), tok.Graph().Wrap(feeds[i%2][1], 0), 4*63)
	}
	sess := NewSession(Options{Device: DeviceCPU, Precision: "bf16-mixed", Budget: 1 << 30, Recompute: recompute.Auto})
	defer sess.Close()
	opt := optim.NewAdamW(1e-3)
	for i := range 6 {
		_, err := sess.Step(context.Background(), build(i), nn.ParamTensors(m), opt)
		require.NoError(t, err, "step %d", i)
	}
	sess.mu.Lock()
	defer sess.mu.Unlock()
	// The first step plans on a device holding nothing, the second on one
	// holding the first's residents; from then on the key stays.
	require.LessOrEqual(t, sess.lossChunks.Len(), 2, "loss-chunk choices made")
	require.LessOrEqual(t, sess.chosen.Len(), 2, "recompute choices made")
}
