package data_test

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// cudaSession is a CUDA session with opts, or a skip without a GPU.
func cudaSession(tb testing.TB, opts batchfit.Options) *batchfit.Session {
	tb.Helper()
	opts.Device = batchfit.DeviceCUDA
	sess := batchfit.NewSession(opts)
	testutil.SkipWithoutGPU(tb, sess.Err(), cuda.ErrNoGPU)
	return sess
}

// tokenFile writes n GPT-2-vocabulary tokens below vocab in llm.c's
// format and maps them: a learnable stream (learnableTokens), so that a
// model trained on it lowers its loss in a few steps.
func tokenFile(tb testing.TB, n, vocab int) *data.TokenFile {
	tb.Helper()
	path := filepath.Join(tb.TempDir(), "train.bin")
	toks := narrow(learnableTokens(11, n, vocab))
	if err := os.WriteFile(path, llmcFile(20240520, 1, int32(len(toks)), toks), 0o644); err != nil {
		tb.Fatal(err)
	}
	f, err := data.OpenTokens(path, data.FormatAuto)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = f.Close() })
	return f
}

// learnableTokens is n tokens below vocab where each follows from the one
// before (t' = (5t + 7) mod vocab, a full cycle for a power-of-two vocab)
// but one in eight, drawn at random: uniform random tokens hold nothing
// to learn, and a loss over them only wanders about ln(vocab).
func learnableTokens(seed uint64, n, vocab int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 1))
	t := make([]uint32, n)
	for i := range t {
		if i == 0 || rng.IntN(8) == 0 {
			t[i] = uint32(rng.IntN(vocab))
		} else {
			t[i] = uint32((5*int(t[i-1]) + 7) % vocab)
		}
	}
	return t
}

// On CUDA, batches in the session's page-locked HostMemory are uploaded
// by DMA straight from it (the device counts them) and give the same
// losses as the same batches from Go memory: Eval of one GPT over both
// loaders' batches agree bit for bit (the same data, parameters and
// kernels); then training steps fed by the pinned loader run and lower
// the loss.
func TestPinnedLoaderFeedsCUDASession(t *testing.T) {
	sess := cudaSession(t, batchfit.Options{})
	defer sess.Close()
	host := sess.HostMemory()
	require.NotNil(t, host)
	dev, ok := host.(*cuda.Device)
	require.True(t, ok)
	cfg := models.GPTConfig{Vocab: 512, Context: 64, Layers: 2, Heads: 2, Dim: 64}
	model := models.NewGPT(nn.Seed(1), cfg)
	ds, err := data.NewWindows(tokenFile(t, 1<<16, cfg.Vocab).Tokens, cfg.Context, data.WindowOptions{Vocab: cfg.Vocab})
	require.NoError(t, err)
	o := data.Options{Batch: 16, Shuffle: true, Seed: 3}
	plain := newLoader(t, ds, o)
	o.Host = host
	pinned, err := data.NewLoader(ds, o)
	require.NoError(t, err)
	defer pinned.Close() // before the session's Close (deferred first)
	ctx := context.Background()
	loss := func(b *data.Batch) *lazy.Tensor {
		x := lazy.Wrap(b.Tensor("inputs"), 0)
		return models.Loss(model.Forward(x), x.Graph().Wrap(b.Tensor("targets"), 0))
	}
	for range 3 {
		bp, err := pinned.Next(ctx)
		require.NoError(t, err)
		bg, err := plain.Next(ctx)
		require.NoError(t, err)
		require.Equal(t, bg.Tensor("inputs").Data(), bp.Tensor("inputs").Data())
		before := dev.PinnedUploads()
		vp, err := sess.Eval(ctx, loss(bp))
		require.NoError(t, err)
		assert.Equal(t, before+2, dev.PinnedUploads(), "inputs and targets by DMA")
		vg, err := sess.Eval(ctx, loss(bg))
		require.NoError(t, err)
		assert.Equal(t, before+2, dev.PinnedUploads(), "Go memory is staged")
		assert.Equal(t, vg[0].Data(), vp[0].Data())
	}
	opt := optim.NewAdam(3e-3)
	var first, last float32
	for step := range 30 {
		b, err := pinned.Next(ctx)
		require.NoError(t, err)
		l, err := sess.Step(ctx, loss(b), nn.ParamTensors(model), opt)
		require.NoError(t, err)
		if step == 0 {
			first = l
		}
		last = l
	}
	t.Logf("loss %.4f → %.4f over 30 steps; %d pinned uploads", first, last, dev.PinnedUploads())
	assert.Less(t, last, first)
}

// BenchmarkGPT2SmallLoaderStep is the acceptance measurement of the
// loader on the GPU: GPT-2 small (bf16-mixed, AdamW, batch 8, sequence
// 1024) trained by one Session, its steps in alternate blocks of ten fed
// from resident synthetic batches (four, cycled: data already in memory),
// from a shuffled Loader over a memory-mapped token file in the session's
// page-locked HostMemory, and from the same Loader in Go memory. Each
// step's time runs from its start to the next one's (graph build, Step,
// and for the loaders Next). It reports each mode's median step (ms) and
// the pinned loader's over the resident batches' (target ≤ 1.01). Run it
// with a fixed count: -benchtime 300x.
func BenchmarkGPT2SmallLoaderStep(b *testing.B) {
	sess := cudaSession(b, batchfit.Options{Precision: "bf16-mixed"})
	defer sess.Close()
	const batch, seq = 8, 1024
	cfg := models.GPT2Small()
	model := models.NewGPT(nn.Seed(1), cfg)
	params := nn.ParamTensors(model)
	opt := optim.NewAdamW(3e-4)
	opt.WeightDecay = 0.01
	ds, err := data.NewWindows(tokenFile(b, 16<<20, cfg.Vocab).Tokens, seq, data.WindowOptions{Vocab: cfg.Vocab})
	must(b, err)
	o := data.Options{Batch: batch, Shuffle: true, Seed: 1}
	paged, err := data.NewLoader(ds, o)
	must(b, err)
	defer paged.Close()
	o.Host = sess.HostMemory()
	pinned, err := data.NewLoader(ds, o)
	must(b, err)
	defer pinned.Close()
	var resident [][2]*tensor.Dense
	for k := range 4 {
		toks := randomTokens(uint64(20+k), batch*(seq+1), cfg.Vocab)
		in, tg := make([]int64, batch*seq), make([]int64, batch*seq)
		for r := range batch {
			for j := range seq {
				in[r*seq+j], tg[r*seq+j] = int64(toks[r*(seq+1)+j]), int64(toks[r*(seq+1)+j+1])
			}
		}
		resident = append(resident, [2]*tensor.Dense{tensor.New(tensor.WithShape(batch, seq), tensor.WithBacking(in)),
			tensor.New(tensor.WithShape(batch, seq), tensor.WithBacking(tg))})
	}
	ctx := context.Background()
	modes := []string{"resident", "loader-pinned", "loader-pageable"}
	feed := func(mode, i int) (in, tg *tensor.Dense) {
		switch mode {
		case 0:
			r := resident[i%len(resident)]
			return r[0], r[1]
		case 1, 2:
			l := pinned
			if mode == 2 {
				l = paged
			}
			bt, err := l.Next(ctx)
			must(b, err)
			return bt.Tensor("inputs"), bt.Tensor("targets")
		}
		return nil, nil
	}
	step := func(mode, i int) {
		in, tg := feed(mode, i)
		x := lazy.Wrap(in, 0)
		loss := models.Loss(model.Forward(x), x.Graph().Wrap(tg, 0))
		if _, err := sess.Step(ctx, loss, params, opt); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 3 * len(modes) { // warm-up: plans, CUDA graphs, the loaders' rings
		step(i%len(modes), i)
	}
	const block = 10
	times := make([][]float64, len(modes))
	b.ResetTimer()
	prev, prevMode := time.Now(), -1
	for i := range b.N {
		mode := (i / block) % len(modes)
		now := time.Now()
		if prevMode >= 0 {
			times[prevMode] = append(times[prevMode], now.Sub(prev).Seconds())
		}
		prev, prevMode = now, mode
		step(mode, i)
	}
	if err := sess.SyncParams(); err != nil { // waits for the last step's tail
		b.Fatal(err)
	}
	times[prevMode] = append(times[prevMode], time.Since(prev).Seconds())
	b.StopTimer()
	med := make([]float64, len(modes))
	for m, ts := range times {
		if len(ts) == 0 {
			return // too few steps for every mode: run with -benchtime 300x
		}
		slices.Sort(ts)
		med[m] = ts[len(ts)/2]
		b.ReportMetric(1e3*med[m], modes[m]+"-ms")
	}
	b.ReportMetric(med[1]/med[0], "pinned/resident")
	b.ReportMetric(med[2]/med[0], "pageable/resident")
}
