package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
)

// With --offload optimizer a full AdamW fine-tune of Llama 3 8B under
// bf16-mixed at seq 2048, batch 1, plans within 80 GB: 2 bytes a
// parameter of bfloat16 weights persist on the device, and the host holds
// 14 (float32 master, m and v, a bfloat16 staging buffer). The Llama 3.2
// 3B shape fits a 24 GiB budget so.
func TestEstimateOffload(t *testing.T) {
	for _, c := range []struct {
		model, budget string
		params        int64
	}{{"llama3-8b", "80GB", 8_030_261_248}, {"llama3.2-3b", "24GiB", 3_212_749_824}} {
		args := []string{"estimate", "--model", c.model, "--budget", c.budget, "--batch", "1", "--seq", "2048",
			"--precision", "bf16-mixed", "--offload", "optimizer"}
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, exitOK, code, "%s: %s%s", c.model, stdout, stderr)
		assert.Contains(t, stdout, "yes: the whole batch of 1 runs in one chunk", c.model)
		assert.Contains(t, stdout, "host pinned", c.model)
		assert.Contains(t, stdout, alloc.FormatBytes(14*c.params), c.model)

		code, stdout, stderr = runCLI(append(args, "--json")...)
		require.Equal(t, exitOK, code, stderr)
		var r report
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		require.NotNil(t, r.Plan)
		assert.Equal(t, "optimizer", r.Offload)
		assert.Equal(t, 14*c.params, r.Plan.HostPinned, "%s: masters, m, v, staging", c.model)
		assert.GreaterOrEqual(t, r.Plan.Persistent, 2*c.params, c.model)
		assert.Less(t, r.Plan.Persistent, 2*c.params+(64<<20), "%s: bfloat16 parameters and constants only", c.model)
		assert.LessOrEqual(t, r.Plan.PeakReserved, r.Available, c.model)
	}
	// Without offload the host holds nothing.
	code, stdout, stderr := runCLI("estimate", "--model", "llama-tiny", "--budget", "1GiB", "--batch", "1", "--precision", "bf16-mixed", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Zero(t, r.Plan.HostPinned)
	assert.Empty(t, r.Offload)
}

// --offload optimizer needs training, bf16-mixed and Adam; an unknown
// mode is a usage error.
func TestEstimateOffloadUsage(t *testing.T) {
	base := []string{"estimate", "--model", "llama-tiny", "--budget", "1GiB", "--batch", "1"}
	for _, extra := range [][]string{
		{"--offload", "disk", "--precision", "bf16-mixed"},
		{"--offload", "optimizer"},
		{"--offload", "optimizer", "--precision", "bf16-mixed", "--optimizer", "sgd"},
		{"--offload", "optimizer", "--precision", "bf16-mixed", "--mode", "infer"},
		{"--offload", "optimizer", "--precision", "bf16-mixed", "--lora", "4"},
		{"--offload", "optimizer", "--precision", "bf16-mixed", "--ranks", "2", "--zero", "1"},
		{"--offload", "auto"},
		{"--offload", "auto", "--precision", "bf16-mixed", "--lora", "4"},
	} {
		code, _, stderr := runCLI(append(base, extra...)...)
		assert.Equal(t, exitUsage, code, "%v: %s", extra, stderr)
		assert.Contains(t, stderr, "--offload", "%v", extra)
	}
}

// --offload auto plans the step both ways: the Llama 3.2 3B shape's full
// fine-tune does not fit 24 GiB with its optimizer on the device, so it
// offloads; at 80 GB the device's plan fits and is predicted faster, so
// it stays. --levers lists every setting weighed, one chosen, and --json
// carries them.
func TestEstimateOffloadAuto(t *testing.T) {
	for _, c := range []struct {
		budget  string
		offload string
	}{{"24GiB", "optimizer"}, {"80GB", ""}} {
		args := []string{"estimate", "--model", "llama3.2-3b", "--budget", c.budget, "--batch", "1", "--seq", "2048",
			"--precision", "bf16-mixed", "--offload", "auto", "--levers"}
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, exitOK, code, "%s: %s%s", c.budget, stdout, stderr)
		assert.Contains(t, stdout, "--offload auto chose it", c.budget)
		assert.Contains(t, stdout, "levers: ", c.budget)

		code, stdout, stderr = runCLI(append(args, "--json")...)
		require.Equal(t, exitOK, code, stderr)
		var r report
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		require.NotNil(t, r.Plan)
		assert.Equal(t, c.offload, r.Offload, c.budget)
		assert.Equal(t, "auto", r.OffloadAsked)
		var chosen []leverRow
		places := map[string]bool{}
		for _, l := range r.Levers {
			places[l.Offload] = true
			if l.Chosen {
				chosen = append(chosen, l)
			}
		}
		assert.Len(t, places, 2, "%s: both placements weighed", c.budget)
		require.Len(t, chosen, 1, c.budget)
		assert.Equal(t, c.offload, chosen[0].Offload, c.budget)
		assert.Equal(t, r.Plan.PeakReserved, chosen[0].PeakReserved, "%s: the plan is the chosen setting's", c.budget)
		assert.Equal(t, r.Plan.LossChunk, chosen[0].LossChunk, c.budget)
		if c.offload == "" {
			assert.Zero(t, r.Plan.HostPinned)
		} else {
			assert.Positive(t, r.Plan.HostPinned)
			assert.Positive(t, chosen[0].OffloadSeconds)
		}
	}
}
