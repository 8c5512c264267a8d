package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/recompute"
)

// chosenLever is the one setting of levers marked Chosen.
func chosenLever(t *testing.T, levers []batchfit.LeverChoice) batchfit.LeverChoice {
	t.Helper()
	var got []batchfit.LeverChoice
	for _, c := range levers {
		if c.Chosen {
			got = append(got, c)
		}
	}
	require.Len(t, got, 1, "one setting is chosen")
	return got[0]
}

// The fused loss's token chunk is the one whose plan the cost model
// predicts fastest among those that fit: without a budget the largest,
// the next planned and the rest not (they only add launches); within a budget
// that chunks the batch at the largest token chunk, the step the session
// runs is the chosen setting's plan, predicted = measured.
func TestLossChunkIsTheFastestSettingThatFits(t *testing.T) {
	ctx := context.Background()
	// A vocabulary large enough that a logits chunk's size moves the
	// reserved peak by whole segments.
	const vocab = 8200
	gpt := models.NewGPT(nn.Seed(2), models.GPTConfig{Vocab: vocab, Context: 32, Layers: 2, Heads: 2, Dim: 64})
	loss := func(rng *rand.Rand) *lazy.Tensor {
		tokens := lazy.Wrap(testutil.Classes(rng, vocab, 32, 32), 0)
		return models.Loss(gpt.Forward(tokens), tokens.Graph().Wrap(testutil.Classes(rng, vocab, 32, 32), 0))
	}
	probe := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	sp, err := probe.Plan(loss(rand.New(rand.NewPCG(1, 2))), nn.ParamTensors(gpt), optim.NewAdamW(1e-3))
	require.NoError(t, err)
	require.NoError(t, probe.Close())
	require.Len(t, sp.Levers, 3, "1,024 token rows: chunks of 1,024, 512 and 256")
	first := chosenLever(t, sp.Levers)
	require.Equal(t, 1024, first.LossChunk)
	require.Equal(t, sp.Plan.LossChunk, first.LossChunk)
	require.Equal(t, 1, first.Plan.Split.Len())
	require.Positive(t, first.Seconds)
	// 512 is planned (the largest chunk runs whole, but a smaller one may
	// hold less at about its speed) and does not win: on a step this small
	// its extra launches cost more than LossChunkSlack, or it holds no
	// less. 256 is not planned.
	half := sp.Levers[1]
	require.NotNil(t, half.Plan, "loss chunk 512 is planned")
	assert.True(t, half.Seconds > first.Seconds*(1+batchfit.LossChunkSlack) || half.Plan.PeakReserved >= first.Plan.PeakReserved,
		"512: %.3g s, %d B against %.3g s, %d B", half.Seconds, half.Plan.PeakReserved, first.Seconds, first.Plan.PeakReserved)
	assert.True(t, sp.Levers[2].Skipped, "loss chunk 256")
	assert.True(t, sp.Levers[2].Plan == nil, "loss chunk 256 has a plan")

	// A budget between the largest token chunk's whole-batch peak and the
	// smallest's: the largest chunk must split the batch, a smaller one may not.
	small := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, LossChunk: 256})
	sps, err := small.Plan(loss(rand.New(rand.NewPCG(1, 2))), nn.ParamTensors(gpt), optim.NewAdamW(1e-3))
	require.NoError(t, err)
	require.NoError(t, small.Close())
	require.Less(t, sps.Plan.PeakReserved, sp.Plan.PeakReserved)
	budget := (sps.Plan.PeakReserved + sp.Plan.PeakReserved) / 2

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget})
	defer sess.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	bp, err := sess.Plan(loss(rng), nn.ParamTensors(gpt), optim.NewAdamW(1e-3))
	require.NoError(t, err)
	best := chosenLever(t, bp.Levers)
	for _, c := range bp.Levers {
		if c.Plan != nil {
			require.LessOrEqual(t, c.Plan.PeakReserved, budget-c.Plan.Headroom, "loss chunk %d", c.LossChunk)
			require.GreaterOrEqual(t, c.Seconds, best.Seconds, "loss chunk %d is predicted faster than the chosen %d", c.LossChunk, best.LossChunk)
		}
	}
	require.NotNil(t, bp.Levers[0].Plan, "%v", bp.Levers[0].Err)
	require.Greater(t, bp.Levers[0].Plan.Split.Len(), 1, "the largest token chunk runs the batch in chunks")
	var whole bool
	for _, c := range bp.Levers {
		whole = whole || c.Plan != nil && c.Plan.Split.Len() == 1
	}
	require.True(t, whole, "a smaller token chunk runs the batch whole")
	require.Equal(t, best.LossChunk, bp.Plan.LossChunk)
	require.Equal(t, best.Plan.PeakReserved, bp.Plan.PeakReserved)

	_, err = sess.Step(ctx, loss(rand.New(rand.NewPCG(1, 2))), nn.ParamTensors(gpt), optim.NewAdamW(1e-3))
	require.NoError(t, err)
	pl := sess.LastPlan()
	require.Equal(t, best.LossChunk, pl.LossChunk, "the step runs the chosen setting")
	require.Equal(t, best.Plan.Split, pl.Split)
	require.Equal(t, best.Plan.PeakReserved, pl.PeakReserved)
	require.Equal(t, pl.PeakReserved, sess.LastUsage().PeakReserved, "predicted = measured")
	require.Equal(t, pl.PeakAllocated, sess.LastUsage().PeakAllocated)
}

// Options.Offload OffloadAuto plans the first step both ways and keeps
// the faster that fits: within a budget only the offloaded optimizer
// fits, it offloads, and the step is that plan, device and host bytes
// predicted = measured; with room for everything it keeps the optimizer
// on the device (the host's trip only adds time); under fp32 it offloads
// nothing, without an error.
func TestOffloadAutoKeepsTheFasterThatFits(t *testing.T) {
	ctx := context.Background()
	// Large enough that 12 bytes a parameter of optimizer state and
	// float32 weights are many segments.
	cfg := wideLlamaTiny()
	m := models.NewLlama(nn.Seed(3), cfg)
	tok := llamaCorpus(rand.New(rand.NewPCG(5, 5)), cfg.Vocab, 2, 16)
	plan := func(o batchfit.Options) *batchfit.StepPlan {
		t.Helper()
		o.Device, o.Precision = batchfit.DeviceCPU, "bf16-mixed"
		s := batchfit.NewSession(o)
		defer s.Close()
		sp, err := s.Plan(llamaLoss(m, tok), nn.ParamTensors(m), offloadAdamW(m))
		require.NoError(t, err)
		return sp
	}
	off := plan(batchfit.Options{Offload: batchfit.OffloadOptimizer})
	dev1 := plan(batchfit.Options{MaxChunk: 1}) // the device's least peak: one sample a chunk
	require.Less(t, off.Plan.PeakReserved, dev1.Plan.PeakReserved)

	t.Run("only offload fits", func(t *testing.T) {
		budget := (off.Plan.PeakReserved + dev1.Plan.PeakReserved) / 2
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: batchfit.OffloadAuto, Budget: budget})
		defer sess.Close()
		require.Equal(t, batchfit.OffloadAuto, sess.Offload(), "undecided before a step")
		opt := offloadAdamW(m)
		sp, err := sess.Plan(llamaLoss(m, tok), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		require.Equal(t, batchfit.OffloadOptimizer, sess.Offload())
		c := chosenLever(t, sp.Levers)
		require.Equal(t, batchfit.OffloadOptimizer, c.Offload)
		require.Positive(t, c.OffloadSeconds)
		var device int
		for _, l := range sp.Levers {
			if l.Offload == batchfit.OffloadNone {
				device++
				require.True(t, l.Plan == nil, "loss chunk %d on the device fits %d B", l.LossChunk, budget)
				require.Error(t, l.Err)
			}
		}
		require.Positive(t, device, "the device's settings were weighed")
		require.Equal(t, c.Plan.PeakReserved, sp.Plan.PeakReserved)
		require.Equal(t, c.Plan.HostPinned, sp.Plan.HostPinned)

		_, err = sess.Step(ctx, llamaLoss(m, tok), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		pl := sess.LastPlan()
		require.Equal(t, c.Plan.PeakReserved, pl.PeakReserved, "the step runs the chosen plan")
		require.Equal(t, c.Plan.Split, pl.Split)
		require.Equal(t, pl.PeakReserved, sess.LastUsage().PeakReserved, "predicted = measured device bytes")
		require.Equal(t, pl.PeakAllocated, sess.LastUsage().PeakAllocated)
		require.Positive(t, pl.HostPinned)
		require.Equal(t, pl.HostPinned, sess.HostPinned(), "predicted = measured host bytes")
	})

	t.Run("everything fits", func(t *testing.T) {
		budget := 4 * dev1.Plan.PeakReserved
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: batchfit.OffloadAuto, Budget: budget})
		defer sess.Close()
		opt := offloadAdamW(m)
		first, err := sess.Plan(llamaLoss(m, tok), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		weighed := map[batchfit.Offload]float64{}
		for _, l := range first.Levers {
			if l.Plan != nil {
				weighed[l.Offload] = l.Seconds
			}
		}
		require.Len(t, weighed, 2, "both placements planned")
		require.Less(t, weighed[batchfit.OffloadNone], weighed[batchfit.OffloadOptimizer], "the host's trip adds time")
		require.Equal(t, batchfit.OffloadNone, chosenLever(t, first.Levers).Offload)
		_, err = sess.Step(ctx, llamaLoss(m, tok), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		require.Equal(t, batchfit.OffloadNone, sess.Offload())
		require.Equal(t, first.Plan.PeakReserved, sess.LastPlan().PeakReserved)
		require.Zero(t, sess.LastPlan().HostPinned)
		require.Zero(t, sess.HostPinned())
		require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved)
		sp, err := sess.Plan(llamaLoss(m, tok), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		for _, l := range sp.Levers {
			require.Equal(t, batchfit.OffloadNone, l.Offload, "the choice is made once: later plans weigh the device only")
		}
	})

	t.Run("fp32", func(t *testing.T) {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Offload: batchfit.OffloadAuto, Budget: 4 * dev1.Plan.PeakReserved})
		defer sess.Close()
		require.NoError(t, sess.Err())
		_, err := sess.Step(ctx, llamaLoss(m, tok), nn.ParamTensors(m), optim.NewAdamW(1e-3))
		require.NoError(t, err)
		require.Equal(t, batchfit.OffloadNone, sess.Offload())
	})
}

// MaxBatch under OffloadAuto, before any step: both places' largest
// batches are searched, and the session keeps the one predicted to train
// more samples a second, then answers as a session of that place does.
// Within a budget where the device's optimizer leaves no room for one
// sample, that is the host; with room for many samples on the device,
// the device (the host's trip costs more than the larger batch gains).
func TestMaxBatchOffloadAuto(t *testing.T) {
	cfg := wideLlamaTiny()
	mod := models.NewLlama(nn.Options{ShapeOnly: true}, cfg)
	params := nn.ParamTensors(mod)
	build := func(n int) (*lazy.Tensor, []*lazy.Tensor) {
		tokens := lazy.Placeholder([]int{n, 16}, graph.Int64, 0)
		labels := tokens.Graph().Placeholder([]int{n, 16}, graph.Int64, 0)
		return models.CausalLMLoss(mod.Forward(tokens), labels), params
	}
	fitWith := func(o batchfit.Offload, budget int64) (*batchfit.BatchFit, batchfit.Offload) {
		t.Helper()
		sess := batchfit.NewSession(batchfit.Options{Precision: "bf16-mixed", Offload: o, Budget: budget, DryRun: &batchfit.DryRun{}})
		defer sess.Close()
		fit, err := sess.MaxBatch(build, optim.NewAdamW(1e-3), batchfit.MaxBatchOptions{Limit: 4096})
		require.NoError(t, err)
		return fit, sess.Offload()
	}
	one, _ := fitWith(batchfit.OffloadNone, 1<<40)
	onePlan := one.Plan.Plan
	for _, c := range []struct {
		name   string
		budget int64
		want   batchfit.Offload
	}{
		{"the device holds no sample", onePlan.Persistent + (onePlan.Persistent / 8), batchfit.OffloadOptimizer},
		{"room on the device", 64 << 20, batchfit.OffloadNone},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, place := fitWith(batchfit.OffloadAuto, c.budget)
			require.Equal(t, c.want, place)
			same, _ := fitWith(c.want, c.budget)
			require.Equal(t, same.Batch, got.Batch, "the answer of a session of the chosen place")
			require.Positive(t, got.Batch)
			require.Equal(t, same.Plan.Plan.PeakReserved, got.Plan.Plan.PeakReserved)
			require.Greater(t, got.Plans, same.Plans, "the probes' plans are counted")
		})
	}
}

// Half the fastest token chunk runs instead when it is predicted within
// LossChunkSlack and holds less: the Llama-3.2-1B step (batch 4, seq
// 2048, bf16-mixed, the H100 cost profile, a dry run) holds 2.0 GiB less
// with 4,096 tokens a chunk than with 8,192 at a step time the cost
// model cannot tell apart; nothing smaller is planned.
func TestLossChunkSmallerPeakWithinSlack(t *testing.T) {
	m := models.NewLlama(nn.Options{ShapeOnly: true}, models.Llama32_1B())
	x := lazy.Placeholder([]int{4, 2048}, graph.Int64, 0)
	loss := models.CausalLMLoss(m.Forward(x), x.Graph().Placeholder([]int{4, 2048}, graph.Int64, 0))
	sess := batchfit.NewSession(batchfit.Options{DryRun: &batchfit.DryRun{Workspace: cpu.Workspace},
		Precision: "bf16-mixed", Profile: recompute.H100Profile()})
	defer sess.Close()
	sp, err := sess.Plan(loss, nn.ParamTensors(m), optim.NewAdamW(3e-4))
	require.NoError(t, err)
	byChunk := map[int]batchfit.LeverChoice{}
	for _, c := range sp.Levers {
		byChunk[c.LossChunk] = c
	}
	whole, half := byChunk[8192], byChunk[4096]
	require.NotNil(t, whole.Plan)
	require.NotNil(t, half.Plan)
	chosen := chosenLever(t, sp.Levers)
	require.Equal(t, 4096, chosen.LossChunk)
	require.Equal(t, 4096, sp.Plan.LossChunk)
	assert.Less(t, half.Plan.PeakReserved, whole.Plan.PeakReserved)
	assert.LessOrEqual(t, half.Seconds, whole.Seconds*(1+batchfit.LossChunkSlack))
	assert.Equal(t, sp.Plan.PeakReserved, half.Plan.PeakReserved, "the plan is the chosen setting's")
	for _, c := range sp.Levers {
		if c.LossChunk < 4096 {
			assert.True(t, c.Skipped, "loss chunk %d", c.LossChunk)
		}
	}
}
