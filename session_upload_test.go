package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// A CPU session holds a frozen bfloat16 weight as a rounded copy, as the
// device does: after its host tensor is written (a checkpoint loaded),
// UploadParams makes the next Eval read it, round after round, and gives
// what a new session evaluates. Float32 parameters are their host
// tensors and need no upload.
//
// Tolerance: exact (the same kernels on the same rounded values).
func TestUploadParamsRoundsFrozen16BitOnCPU(t *testing.T) {
	ctx := context.Background()
	const in, hidden, n = 32, 16, 8
	m := newTwoLayer(51, in, hidden)
	require.NoError(t, nn.FreezeAs(graph.BFloat16, m.Params()[0]))
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	rng := rand.New(rand.NewPCG(51, 52))
	opt := optim.NewAdamW(1e-2)
	for step := range 2 {
		_, err := sess.Step(ctx, mlpStep(m, rng, n, in), nn.ParamTensors(m), opt)
		require.NoError(t, err, "step %d", step)
	}
	x := testutil.UniformF32(rng, n, in)
	eval := func(s *batchfit.Session) []float32 {
		out, err := s.Eval(ctx, m.Forward(lazy.Wrap(x, 0)))
		require.NoError(t, err)
		return testutil.Float32s(t, out[0])
	}
	for round := range 3 {
		before := eval(sess)
		f := m.Params()[0].Value().Data().([]float32)
		for i := range f {
			f[i] = float32(rng.NormFloat64()) / 4
		}
		require.NoError(t, sess.UploadParams())
		fresh := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		want := eval(fresh)
		require.NoError(t, fresh.Close())
		got := eval(sess)
		require.NotEqual(t, before, want, "round %d: the write changes the outputs", round)
		require.Equal(t, want, got, "round %d", round)
	}
}
