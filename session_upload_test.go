package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// The upload tests' model: two layers, 32 → 16 → 4, over batches of 8.
const uploadIn, uploadHidden, uploadBatch = 32, 16, 8

// trainedTwoLayer is newTwoLayer(seed) (its first weight frozen in
// bfloat16 when frozen) after two AdamW steps on sess, with the rng its
// batches came from, for the tests to draw their data and new values.
func trainedTwoLayer(t *testing.T, sess *batchfit.Session, seed uint64, frozen bool) (*nn.Sequential, *rand.Rand) {
	t.Helper()
	m := newTwoLayer(seed, uploadIn, uploadHidden)
	if frozen {
		require.NoError(t, nn.FreezeAs(graph.BFloat16, m.Params()[0]))
	}
	rng := rand.New(rand.NewPCG(seed, seed+1))
	opt := optim.NewAdamW(1e-2)
	for step := range 2 {
		_, err := sess.Step(context.Background(), mlpStep(m, rng, uploadBatch, uploadIn), nn.ParamTensors(m), opt)
		require.NoError(t, err, "step %d", step)
	}
	return m, rng
}

// evalTwoLayer is m's output for x on s.
func evalTwoLayer(t *testing.T, s *batchfit.Session, m *nn.Sequential, x *tensor.Dense) []float32 {
	t.Helper()
	out, err := s.Eval(context.Background(), m.Forward(lazy.Wrap(x, 0)))
	require.NoError(t, err)
	return testutil.Float32s(t, out[0])
}

// writeParams draws new values from rng into the host tensors of ps, as
// a checkpoint's load writes them.
func writeParams(rng *rand.Rand, ps ...*nn.Param) {
	for _, p := range ps {
		f := p.Value().Data().([]float32)
		for i := range f {
			f[i] = float32(rng.NormFloat64()) / 4
		}
	}
}

// A CPU session holds a frozen bfloat16 weight as a rounded copy, as the
// device does: after its host tensor is written (a checkpoint loaded),
// UploadParams makes the next Eval read it, round after round, and gives
// what a new session evaluates. Float32 parameters are their host
// tensors and need no upload.
//
// Tolerance: exact (the same kernels on the same rounded values).
func TestUploadParamsRoundsFrozen16BitOnCPU(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	m, rng := trainedTwoLayer(t, sess, 51, true)
	x := testutil.UniformF32(rng, uploadBatch, uploadIn)
	for round := range 3 {
		before := evalTwoLayer(t, sess, m, x)
		writeParams(rng, m.Params()[0])
		require.NoError(t, sess.UploadParams())
		fresh := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		want := evalTwoLayer(t, fresh, m, x)
		require.NoError(t, fresh.Close())
		got := evalTwoLayer(t, sess, m, x)
		require.NotEqual(t, before, want, "round %d: the write changes the outputs", round)
		require.Equal(t, want, got, "round %d", round)
	}
}
