package main

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/recompute"
)

func TestCapFlags(t *testing.T) {
	c := defaultConfig(t)
	require.Zero(t, c.cap, "off by default")
	require.Zero(t, c.capBatch)
	require.Equal(t, "h100", c.costProfile)
	require.True(t, c.throughput)
	require.NoError(t, c.checkCap())

	c = defaultConfig(t, "-cap", "24GiB", "-cap-batch", "32", "-throughput=false", "-budget", "8GiB")
	require.Equal(t, int64(24<<30), c.cap)
	require.Equal(t, int64(8<<30), c.budget, "-budget is the tightness records', apart")
	require.False(t, c.throughput)
	require.NoError(t, c.checkCap())
	ms, err := benchModels(c)
	require.NoError(t, err)
	for _, m := range ms {
		require.Equal(t, 32, capBatchOf(c, m), m.name)
	}
	c.capBatch = 0
	require.Equal(t, c.gptBatch, capBatchOf(c, ms[1]), "0: the model's timed batch")

	c = defaultConfig(t, "-cap", "1GiB", "-cost-profile", "no-such-profile.json")
	require.ErrorIs(t, c.checkCap(), recompute.ErrProfile)
	require.NoError(t, defaultConfig(t, "-cost-profile", "no-such-profile.json").checkCap(), "checked only with -cap")
	require.Error(t, defaultConfig(t, "-cap", "1GiB", "-cap-batch", "-1").checkCap())

	require.Equal(t, []string{"auto", "off"}, []string{capModeName(capModes[0]), capModeName(capModes[1])})
}

// A cap record's fields read back equal, within_budget false included.
func TestCapRecordRoundTrip(t *testing.T) {
	no := false
	in := Record{Kind: "cap", Model: "gpt", Batch: 32, Seq: 1024, Precision: "bf16-mixed", Budget: 24 << 30,
		Overhead: 32 << 20, RecomputeMode: "auto", Recompute: "blocks 6/12", RecomputedNodes: 120, RecomputeCopies: 130,
		Chunks: 2, ChunkSizes: []int{16, 16}, CostProfile: "NVIDIA H100 80GB HBM3", PredictedStepSeconds: 0.2,
		PredictedSamplesPerSecond: 160, FirstStepSeconds: 3, MedianStepSeconds: 0.21, SamplesPerSecond: 152,
		PredictedPeakReserved: 23 << 30, MeasuredPeakReserved: 23<<30 + 32<<20, WithinBudget: &no}
	var buf bytes.Buffer
	require.NoError(t, writeRecord(&buf, in))
	var out Record
	require.NoError(t, json.Unmarshal(buf.Bytes(), &out))
	require.Equal(t, in, out)
	var fields map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &fields))
	require.Equal(t, false, fields["within_budget"])
	require.Equal(t, "auto", fields["recompute_mode"])
	require.Equal(t, "blocks 6/12", fields["recompute"])

	buf.Reset()
	require.NoError(t, writeRecord(&buf, Record{Kind: "throughput", Model: "conv", Batch: 256}))
	clear(fields)
	require.NoError(t, json.Unmarshal(buf.Bytes(), &fields))
	for _, k := range []string{"within_budget", "recompute_mode", "recompute", "predicted_step_seconds"} {
		require.NotContains(t, fields, k)
	}
}

// smallGPT is a four-layer GPT over 128 tokens with attention written out
// (recompute's own tests' deepGPT), as a gobench model named "gpt" (so
// rebuild makes its graph): its attention scores dominate the per-sample
// memory, so whole-block checkpoints pay.
func smallGPT() benchModel {
	const seq, vocab = 128, 64
	cfg := models.GPTConfig{Vocab: vocab, Context: seq, Layers: 4, Heads: 4, Dim: 32, WrittenOutAttention: true}
	return benchModel{name: "gpt", seq: seq, batch: 8, optName: "adamw(lr=3e-4)",
		optimizer: func() *optim.Adam { return optim.NewAdamW(3e-4) },
		module:    func(opt nn.Options) nn.Module { return models.NewGPT(opt, cfg) },
		build: func(mod nn.Module, n int, data *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
			tok := source(nil, data, []int{n, seq}, graph.Int64, vocab)
			tgt := source(tok.Graph(), data, []int{n, seq}, graph.Int64, vocab)
			return models.Loss(mod.(*models.GPT).Forward(tok), tgt), []*lazy.Tensor{tok, tgt}
		}}
}

// capThroughput on the CPU executor (a simulated device of the cap): a
// small GPT at a cap of 30% of its whole batch's peak runs in chunks in
// both modes, within the cap, the plan's peaks measured to the byte, with
// the same first loss as the whole batch's; the planner's choice
// recomputes whole blocks in fewer chunks than chunks only needs, and is
// predicted faster (the H100 profile). A cap below the parameters fails.
func TestCapThroughputCPU(t *testing.T) {
	c := defaultConfig(t, "-warmup", "1", "-steps", "2")
	m := smallGPT()
	require.Equal(t, m.batch, capBatchOf(c, m))

	c.cap = 1 << 40
	whole, err := capThroughput(c, m, recompute.Off, batchfit.DeviceCPU, nil)
	require.NoError(t, err)
	require.Equal(t, 1, whole.Chunks)
	c.cap = whole.PredictedPeakReserved * 3 / 10
	t.Logf("whole batch of %d: peak %s; cap %s", m.batch, alloc.FormatBytes(whole.PredictedPeakReserved), alloc.FormatBytes(c.cap))

	recs := map[string]Record{}
	for _, mode := range capModes {
		r, err := capThroughput(c, m, mode, batchfit.DeviceCPU, nil)
		require.NoError(t, err, capModeName(mode))
		t.Logf("%s: %s in %v, predicted %.3g s/step, peak %s", r.RecomputeMode, r.Recompute, r.ChunkSizes,
			r.PredictedStepSeconds, alloc.FormatBytes(r.MeasuredPeakReserved))
		require.Equal(t, "cap", r.Kind)
		require.Equal(t, capModeName(mode), r.RecomputeMode)
		require.Equal(t, m.batch, r.Batch)
		require.Equal(t, c.cap, r.Budget)
		require.Len(t, r.StepSeconds, 2)
		require.Positive(t, r.SamplesPerSecond)
		require.Positive(t, r.FirstStepSeconds)
		require.Positive(t, r.PredictedStepSeconds)
		require.InDelta(t, float64(m.batch)/r.PredictedStepSeconds, r.PredictedSamplesPerSecond, 1e-6)
		require.Equal(t, recompute.H100Profile().Name, r.CostProfile)
		require.Len(t, r.ChunkSizes, r.Chunks)
		require.Greater(t, r.Chunks, 1)
		require.NotNil(t, r.WithinBudget)
		require.True(t, *r.WithinBudget)
		require.LessOrEqual(t, r.MeasuredPeakReserved, c.cap)
		require.Equal(t, r.PredictedPeakReserved+r.Overhead, r.MeasuredPeakReserved)
		require.False(t, r.PlanChanged)
		require.InDelta(t, whole.FirstLoss, r.FirstLoss, 1e-5*whole.FirstLoss, "chunks sum the same loss")
		recs[r.RecomputeMode] = r
	}
	auto, off := recs["auto"], recs["off"]
	require.Equal(t, "none", off.Recompute)
	require.Contains(t, auto.Recompute, "blocks")
	require.Positive(t, auto.RecomputedNodes)
	require.Positive(t, auto.RecomputeCopies)
	require.Less(t, auto.Chunks, off.Chunks)
	require.Less(t, auto.PredictedStepSeconds, off.PredictedStepSeconds)

	c.cap = 1 << 10
	r, err := capThroughput(c, m, recompute.Off, batchfit.DeviceCPU, nil)
	require.Error(t, err, "the parameters alone are more than 1KiB")
	require.Equal(t, "cap", r.Kind)
}
