package checkpoint

import (
	"context"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// cudaRun is newRun on CUDA, or a skip without a GPU.
func cudaRun(t *testing.T, cfg config, seed uint64) *run {
	t.Helper()
	cfg.device = batchfit.DeviceCUDA
	r, err := newRun(cfg, seed)
	testutil.SkipWithoutGPU(t, err, cuda.ErrNoGPU)
	require.NoError(t, err)
	t.Cleanup(r.close)
	return r
}

// On CUDA a run resumed from a checkpoint is the uninterrupted run bit for
// bit: bf16-mixed (whole and in chunks of 4) and fp16-mixed with its
// scaler, AdamW under cosine warmup with clipping and a no-decay group,
// dropout, a late-joining parameter and the shuffling loader, as on the
// CPU. Saved at step 6 from a session whose parameters and state live on
// the device (Save syncs them), the checkpoint is loaded (1) by a new
// session before its first step, and (2) into the saving run's own
// session after it went on to step 9 and yielded its memory (Load's
// UploadParams then writes the host copies that Restore uploads); both
// train on to the end.
// The model has no embedding (whose backward pass sums with atomic adds),
// so two uninterrupted runs agree bit for bit too, which the test checks
// first.
func TestCUDAResumeBitIdentical(t *testing.T) {
	ctx := context.Background()
	for _, cfg := range []config{{precision: "bf16-mixed"}, {precision: "bf16-mixed", maxChunk: 4}, {precision: "fp16-mixed"}} {
		t.Run(cfg.String(), func(t *testing.T) {
			straight := cudaRun(t, cfg, 1)
			require.NoError(t, straight.start())
			require.NoError(t, straight.train(ctx, "", 0, totalSteps, 0, nil))
			again := cudaRun(t, cfg, 1)
			require.NoError(t, again.start())
			require.NoError(t, again.train(ctx, "", 0, totalSteps, 0, nil))
			require.Equal(t, straight.digest(), again.digest(), "two uninterrupted CUDA runs agree: the kernels are deterministic")

			dir := t.TempDir()
			first := cudaRun(t, cfg, 1)
			require.NoError(t, first.start())
			require.NoError(t, first.train(ctx, dir, 0, 9, 3, nil))
			for s := range 9 {
				require.Equal(t, math.Float32bits(straight.losses[s]), math.Float32bits(first.losses[s]), "step %d", s)
			}
			ck6 := filepath.Join(dir, checkpointName(6, 0))

			fresh := cudaRun(t, cfg, 99)
			require.NoError(t, fresh.ck.Load(ck6))
			require.NoError(t, fresh.start())
			require.NoError(t, fresh.train(ctx, "", 6, totalSteps, 0, nil))
			for s := 6; s < totalSteps; s++ {
				require.Equal(t, math.Float32bits(straight.losses[s]), math.Float32bits(fresh.losses[s]), "loaded before the first step: step %d", s)
			}
			require.Equal(t, straight.digest(), fresh.digest(), "loaded before the first step: final parameters")
			require.Equal(t, straight.sess.LossScale(), fresh.sess.LossScale())

			require.NoError(t, first.sess.Yield())
			require.NoError(t, first.ck.Load(ck6))
			// Saved again at once, before a step: what was loaded, not the
			// device's older state (SyncState ignores it).
			again6, err := first.ck.Save(t.TempDir())
			require.NoError(t, err)
			want, err := Verify(ck6)
			require.NoError(t, err)
			got, err := Verify(again6)
			require.NoError(t, err)
			require.Equal(t, want.Files, got.Files, "the same tensors, bit for bit")
			first.loader.Close()
			require.NoError(t, first.start())
			require.NoError(t, first.train(ctx, "", 6, totalSteps, 0, nil))
			for s := 6; s < totalSteps; s++ {
				require.Equal(t, math.Float32bits(straight.losses[s]), math.Float32bits(first.losses[s]), "loaded into a stepped, yielded session: step %d", s)
			}
			require.Equal(t, straight.digest(), first.digest(), "loaded into a stepped session: final parameters")
		})
	}
}

// A GPT's embedding gradient sums rows with atomic adds, so on CUDA its
// uninterrupted runs differ in the last bits from each other. A resumed
// run must differ from the uninterrupted one no more than a second
// uninterrupted run does (and then within 2 % of each loss: bf16-mixed,
// 16 steps, a 2-layer GPT of width 64 on 64 tokens). Loading into the
// stepped session exercises UploadParams on a model with tied weights.
func TestCUDAGPTResumeWithinRounding(t *testing.T) {
	ctx := context.Background()
	const steps, cut, seq, vocab = 16, 8, 32, 64
	rng := rand.New(rand.NewPCG(3, 4))
	toks := make([]uint16, 1<<14)
	for i := range toks {
		toks[i] = uint16(rng.IntN(vocab))
	}
	ds, err := data.NewWindows(data.Tokens16(toks), seq, data.WindowOptions{Vocab: vocab})
	require.NoError(t, err)
	type gptRun struct {
		sess   *batchfit.Session
		model  *models.GPT
		opt    *optim.Adam
		ck     *Training
		losses []float32
	}
	newGPT := func(seed uint64) *gptRun {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA, Precision: "bf16-mixed"})
		testutil.SkipWithoutGPU(t, sess.Err(), cuda.ErrNoGPU)
		t.Cleanup(func() { sess.Close() })
		m := models.NewGPT(nn.Seed(seed), models.GPTConfig{Vocab: vocab, Context: seq, Layers: 2, Heads: 2, Dim: 64})
		opt := optim.NewAdamW(3e-3)
		opt.Schedule = optim.Cosine{Warmup: 4, Total: steps, MinRatio: 0.1}
		opt.Clip.MaxNorm = 1
		_, noDecay := optim.SplitDecay(m.Params())
		opt.AddGroup("no_decay", optim.Keys(noDecay)...).WeightDecay = 0
		return &gptRun{sess: sess, model: m, opt: opt, ck: &Training{Model: m, Optimizer: opt, Session: sess}, losses: make([]float32, steps)}
	}
	train := func(r *gptRun, from, to int, save string) {
		l, err := data.NewLoader(ds, data.Options{Batch: 8, Shuffle: true, Seed: 5, Start: r.ck.Data})
		require.NoError(t, err)
		defer l.Close()
		for s := from; s < to; s++ {
			b, err := l.Next(ctx)
			require.NoError(t, err)
			x := lazy.Wrap(b.Tensor("inputs"), 0)
			loss := models.Loss(r.model.Forward(x), x.Graph().Wrap(b.Tensor("targets"), 0))
			r.losses[s], err = r.sess.Step(ctx, loss, nn.ParamTensors(r.model), r.opt)
			require.NoError(t, err)
			if s+1 == cut && save != "" {
				r.ck.Step, r.ck.Data = s+1, l.Position()
				_, err := r.ck.Save(save)
				require.NoError(t, err)
			}
		}
	}
	maxRel := func(a, b []float32, from int) float64 {
		w := 0.0
		for i := from; i < len(a); i++ {
			w = max(w, math.Abs(float64(a[i]-b[i]))/math.Abs(float64(a[i])))
		}
		return w
	}
	straight, again := newGPT(1), newGPT(1)
	train(straight, 0, steps, "")
	train(again, 0, steps, "")
	dir := t.TempDir()
	first := newGPT(1)
	train(first, 0, steps, dir) // on past the checkpoint, then back to it
	require.NoError(t, first.ck.Load(dir))
	require.Equal(t, cut, first.ck.Step)
	train(first, cut, steps, "")
	noise := maxRel(straight.losses, again.losses, 0)
	resumed := maxRel(straight.losses, first.losses, cut)
	t.Logf("largest relative loss difference: two uninterrupted runs %.3g, resumed against uninterrupted %.3g", noise, resumed)
	assert.Less(t, resumed, 0.02)
	assert.Less(t, resumed, max(10*noise, 1e-6), "no further than run-to-run noise")
}
