package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
)

// The zoo's Llamas: Llama 3 8B has 8,030,261,248 parameters and, trained
// with AdamW in float32 or bf16-mixed, does not fit an H100 80GB; the
// explanation names its persistent bytes (parameters and two AdamW slots,
// 12 bytes a parameter), more than the card by themselves.
func TestEstimateLlama3_8B(t *testing.T) {
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		args := []string{"estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", "--batch", "1", "--seq", "2048", "--precision", prec}
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, exitPlan, code, "%s: %s", prec, stdout)
		assert.Contains(t, stdout, "8,030,261,248", prec)
		persistent := alloc.FormatBytes(3 * 4 * 8_030_261_248)
		assert.Contains(t, stderr, persistent+" persistent (parameters, optimizer state), more than the budget by itself", prec)

		code, stdout, _ = runCLI(append(args, "--json")...)
		require.Equal(t, exitPlan, code)
		var r report
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		assert.Equal(t, int64(8_030_261_248), r.Params)
		require.NotNil(t, r.DoesNotFit)
		assert.Greater(t, r.DoesNotFit.Needed, r.DoesNotFit.Available)
		assert.GreaterOrEqual(t, r.DoesNotFit.Fixed, int64(3*4*8_030_261_248), "parameters and two AdamW slots")
		assert.Greater(t, r.DoesNotFit.Fixed, r.DoesNotFit.Available, "persistent bytes alone exceed the card")
	}
	// Inference in bfloat16 fits: 16 GB of weights.
	code, stdout, stderr := runCLI("estimate", "--model", "llama3-8b", "--gpu", "h100-80gb", "--batch", "1", "--seq", "2048", "--mode", "infer", "--dtype", "bfloat16")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "yes: the whole batch of 1 runs in one chunk")
}

// Llama 3.2 1B at the benchmark's shape (seq 2048, batch 4, bf16-mixed,
// AdamW) plans in one chunk on an H100 80GB, and the list shows every
// Llama with its parameter count.
func TestEstimateLlama32_1B(t *testing.T) {
	code, stdout, stderr := runCLI("estimate", "--model", "llama3.2-1b", "--gpu", "h100-80gb", "--batch", "4", "--seq", "2048", "--precision", "bf16-mixed")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "1,235,814,400")
	assert.Contains(t, stdout, "yes: the whole batch of 4 runs in one chunk")

	code, stdout, stderr = runCLI("models")
	require.Equal(t, exitOK, code, stderr)
	counts := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(stdout), "\n")[1:] {
		f := strings.Fields(l)
		counts[f[0]] = f[1]
	}
	assert.Equal(t, "1,235,814,400", counts["llama3.2-1b"])
	assert.Equal(t, "8,030,261,248", counts["llama3-8b"])
	assert.Contains(t, counts, "llama-tiny")
}

// llama-tiny runs on the CPU: report --run measures a training step and
// the planner predicted its peaks to the byte.
func TestReportRunLlamaTiny(t *testing.T) {
	code, stdout, stderr := runCLI("report", "--model", "llama-tiny", "--batch", "4", "--seq", "32", "--budget", "1GiB", "--run", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r memReport
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	require.NotNil(t, r.Measured)
	assert.Equal(t, r.Measured.PredictedPeakReserved, r.Measured.PeakReserved)
	assert.Equal(t, r.Measured.PredictedPeakAllocated, r.Measured.PeakAllocated)
	require.NotNil(t, r.Measured.Loss)
	assert.InDelta(t, 4.16, float64(*r.Measured.Loss), 0.3, "about log 64 at initialisation")
}

// A LoRA fine-tune of Llama 3 8B (rank 16 on q, k, v and o, seq 2048,
// batch 1, bf16-mixed) plans within 24 GiB with recompute auto: the
// frozen base in bfloat16 (no gradients, no optimizer state), PEFT's
// count of adapter parameters (13,631,488) with their float32 gradients
// and two AdamW slots. Without recompute it does not fit. The --lora
// flags are refused where they do not apply.
func TestEstimateLlama3_8BLoRA(t *testing.T) {
	args := []string{"estimate", "--model", "llama3-8b", "--lora", "16", "--seq", "2048", "--batch", "1",
		"--precision", "bf16-mixed", "--budget", "24GiB", "--json"}
	code, stdout, stderr := runCLI(append(args, "--recompute", "auto")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	require.NotNil(t, r.LoRA)
	require.NotNil(t, r.Plan)
	assert.Equal(t, int64(13_631_488), r.LoRA.AdapterParams)
	assert.Equal(t, 4*r.LoRA.AdapterParams, r.LoRA.AdapterBytes)
	assert.Equal(t, int64(8_030_261_248), r.LoRA.FrozenParams)
	assert.Equal(t, 128, r.LoRA.Adapters)
	assert.Equal(t, 2*r.LoRA.AdapterBytes, r.StateBytes, "AdamW state of the adapters only")
	// Persistent: the base, the adapters, their state, and the constants:
	// the rotary table [2048, 128] (1 MiB), the packed q/k/v update's zero
	// blocks shared by every layer ([4096, 32], [1024, 16], [1024, 32]:
	// 704 KiB) and the loss's 1/count scalar.
	consts := int64(2048*128*4 + (4096*32+1024*16+1024*32)*4 + 4)
	assert.Equal(t, r.LoRA.FrozenBytes+r.LoRA.AdapterBytes+r.StateBytes+consts, r.Plan.Persistent)
	assert.LessOrEqual(t, r.Plan.PeakReserved, int64(24<<30))
	assert.True(t, r.Plan.WholeBatch)
	t.Logf("peak reserved %s, persistent %s", alloc.FormatBytes(r.Plan.PeakReserved), alloc.FormatBytes(r.Plan.Persistent))

	code, _, _ = runCLI(args...)
	assert.Equal(t, exitPlan, code, "without recompute the step does not fit 24 GiB")

	for _, bad := range [][]string{
		{"estimate", "--model", "llama-tiny", "--batch", "1", "--budget", "1GiB", "--lora-targets", "q_proj"},
		{"estimate", "--model", "llama-tiny", "--batch", "1", "--budget", "1GiB", "--lora", "4", "--mode", "infer"},
		{"estimate", "--model", "llama-tiny", "--batch", "1", "--budget", "1GiB", "--lora", "0"},
		{"estimate", "--model", "llama-tiny", "--batch", "1", "--budget", "1GiB", "--lora", "4", "--lora-targets", ","},
	} {
		code, _, _ := runCLI(bad...)
		assert.Equal(t, exitUsage, code, "%v", bad)
	}
	code, _, stderr = runCLI("estimate", "--model", "llama-tiny", "--batch", "1", "--budget", "1GiB", "--lora", "4", "--lora-targets", "c_attn")
	assert.Equal(t, exitPlan, code)
	assert.Contains(t, stderr, `"c_attn" matches no module`)
}
