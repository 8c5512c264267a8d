package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// Llama 3 8B, bf16-mixed, AdamW, sequence 4096, one sample per rank:
// replicated it needs far more than an 80 GB card (90 GiB of parameters
// and state before the step's work), and one rank of 8 under ZeRO stage 3
// plans within 80 GB (the per-rank peak is logged), with every rank's
// shards as the layout gives them.
func TestEstimateZeRO3Llama8BFits80GB(t *testing.T) {
	args := []string{"estimate", "--model", "llama3-8b", "--precision", "bf16-mixed", "--optimizer", "adamw", "--seq", "4096",
		"--batch", "1", "--gpu-memory", "80GB", "--ranks", "8", "--json"}
	code, _, _ := runCLI(append(args, "--zero", "0")...)
	require.Equal(t, exitPlan, code, "replicated, it does not fit")

	code, out, errs := runCLI(append(args, "--zero", "3")...)
	require.Equal(t, exitOK, code, errs)
	var r report
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	z := r.ZeRO
	require.NotNil(t, z)
	const params = 8_030_261_248
	require.Equal(t, int64(params), r.Params)
	shard := int64((params + 7) / 8)
	require.Equal(t, shard, z.ShardLen)
	require.Equal(t, 4*shard, z.Params, "the rank's float32 parameter shard")
	require.Equal(t, 4*shard, z.Grads)
	require.Equal(t, 2*4*shard, z.State, "AdamW's two moments, sharded")
	require.Equal(t, z.Persistent, r.Plan.Persistent, "the plan's persistent bytes are the shards and the bucket")
	require.Positive(t, z.Gather)
	require.LessOrEqual(t, z.RankPeak, int64(80e9))
	t.Logf("one rank of 8, ZeRO-3: peak reserved %d B (%.2f GB), persistent %d B, gathered at most %d B", z.RankPeak, float64(z.RankPeak)/1e9, z.Persistent, z.Gather)
}

// The data-parallel flags' mistakes are usage errors.
func TestEstimateZeROFlags(t *testing.T) {
	base := []string{"estimate", "--model", "mlp", "--batch", "4", "--budget", "1GiB"}
	for _, bad := range [][]string{
		{"--ranks", "0"},
		{"--zero", "4"},
		{"--zero", "1", "--mode", "infer"},
		{"--zero", "1", "--recompute", "auto"},
		{"--zero", "2", "--bucket", "0"},
		{"--zero", "2", "--comm-overhead", "lots"},
	} {
		code, _, errs := runCLI(append(base, bad...)...)
		require.Equal(t, exitUsage, code, "%v: %s", bad, errs)
		usageLines(t, "estimate", errs)
	}
	// The communicator's overhead comes out of the rank's budget.
	code, out, errs := runCLI(append(base, "--ranks", "2", "--zero", "1", "--comm-overhead", "1MiB", "--json")...)
	require.Equal(t, exitOK, code, errs)
	var r report
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	require.Equal(t, int64(1<<20), r.ZeRO.Overhead)
	require.Equal(t, r.Plan.PeakReserved+1<<20, r.ZeRO.RankPeak)
	code, out, errs = runCLI(append(base, "--ranks", "2", "--zero", "3")...)
	require.Equal(t, exitOK, code, errs)
	require.Contains(t, out, "gathered parameters")
}

// A rank's batch in chunks: stage 1 keeps the chunk accumulators of the
// whole gradients, stages 2 and 3 none (the gradient shard accumulates),
// and the whole batch's peak in one chunk is replayed for the report.
func TestEstimateZeROChunked(t *testing.T) {
	for _, stage := range []string{"1", "2", "3"} {
		code, out, errs := runCLI("estimate", "--model", "gpt-tiny", "--batch", "8", "--budget", "1GiB", "--micro-batch", "2",
			"--ranks", "4", "--zero", stage, "--json")
		require.Equal(t, exitOK, code, errs)
		var r report
		require.NoError(t, json.Unmarshal([]byte(out), &r))
		require.Equal(t, 4, r.Plan.NumChunks, "stage %s", stage)
		if stage == "1" {
			require.Positive(t, r.Plan.Accumulators)
		} else {
			require.Zero(t, r.Plan.Accumulators, "stage %s", stage)
		}
		require.GreaterOrEqual(t, r.Plan.WholePeakReserved, r.Plan.PeakReserved, "stage %s", stage)
	}
}
