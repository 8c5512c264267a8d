package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
)

// A CUDA session on a card budgets its total less the CUDA context and the
// cuBLAS workspace; estimate --gpu plans the same budget with the CUDA
// executor's workspaces.
func TestEstimateOnCard(t *testing.T) {
	const context = 594 << 20 // ≈0.58 GiB, measured on an H100
	cases := []struct {
		gpu      string
		total    int64
		measured bool
	}{
		{"h100-80gb", 81079 << 20, true}, // 79.18 GiB: cuMemGetInfo on the H100 80GB HBM3
		{"a100-40gb", 42298834944, false},
		{"rtx4090", 24207 << 20, false}, // 23.64 GiB
	}
	for _, c := range cases {
		t.Run(c.gpu, func(t *testing.T) {
			budget := c.total - context - 32<<20 - 4<<20 - 8<<20
			require.Equal(t, int64(32<<20), int64(cuda.DefaultWorkspace), "the session's cuBLAS workspace")
			require.Equal(t, int64(4<<20), int64(cuda.DriverReserve), "what a CUDA session leaves free for the driver")
			_, want, err := gpt2PlanWith(t, 8, budget, cuda.Workspace)
			require.NoError(t, err)
			_, onCPU, err := gpt2PlanWith(t, 8, budget, cpu.Workspace)
			require.NoError(t, err)
			require.NotEqual(t, want.PeakAllocated, onCPU.PeakAllocated, "the CUDA executor's workspaces show in the plan")

			args := []string{"estimate", "--model", "gpt2-small", "--batch", "8", "--gpu", c.gpu, "--no-fused-loss"} // gpt2PlanWith's unfused graph
			code, stdout, stderr := runCLI(append(args, "--json")...)
			require.Equal(t, exitOK, code, stderr)
			var r report
			require.NoError(t, json.Unmarshal([]byte(stdout), &r))
			require.NotNil(t, r.Device)
			assert.Equal(t, c.gpu, r.Device.Card)
			assert.Equal(t, c.total, r.Device.Total)
			assert.Equal(t, int64(context), r.Device.Context)
			assert.Equal(t, c.measured, r.Device.ContextMeasured)
			assert.Equal(t, int64(cuda.DefaultWorkspace), r.Device.Workspace)
			assert.Equal(t, int64(cuda.DriverReserve), r.Device.DriverReserve)
			assert.Equal(t, int64(8<<20), r.Device.CuDNN, "the cuDNN handle, measured on the H100")
			assert.Equal(t, budget, r.Device.Budget)
			assert.Equal(t, budget, r.Budget)
			assert.NotEmpty(t, r.Device.TotalSource)
			require.NotNil(t, r.Plan)
			assert.Equal(t, want.PeakReserved, r.Plan.PeakReserved)
			assert.Equal(t, want.PeakAllocated, r.Plan.PeakAllocated)

			code, stdout, stderr = runCLI(args...)
			require.Equal(t, exitOK, code, stderr)
			note := "measured on an H100 80GB"
			if !c.measured {
				note = "estimate: ≈0.58 GiB measured on an H100 80GB; assumed equal on other cards"
			}
			assert.Contains(t, stdout, c.gpu+": "+alloc.FormatBytes(c.total)+" total − 594.00 MiB CUDA context and libraries ("+
				note+") − 32.00 MiB cuBLAS workspace − 4.00 MiB left free for the driver − 8.00 MiB cuDNN handle = "+alloc.FormatBytes(budget)+"; CUDA executor's workspaces")
			assert.Contains(t, stdout, alloc.FormatBytes(budget)+" − headroom 0 B = "+alloc.FormatBytes(budget)+" available")
		})
	}
}

// "Will it fit on a 1 GiB card?" is not "will it fit in 1 GiB": the CUDA
// context, the cuBLAS workspace, the driver reserve and the cuDNN handle
// take 638 MiB of it first.
func TestEstimateGPUMemory(t *testing.T) {
	args := []string{"estimate", "--model", "convnet", "--batch", "1024", "--json"}
	code, stdout, stderr := runCLI(append(args, "--budget", "1GiB")...)
	require.Equal(t, exitOK, code, stderr)
	var whole report
	require.NoError(t, json.Unmarshal([]byte(stdout), &whole))
	require.True(t, whole.Plan.WholeBatch, "1 GiB of budget holds the whole batch")
	require.Nil(t, whole.Device)

	code, stdout, stderr = runCLI(append(args, "--gpu-memory", "1GiB")...)
	require.Equal(t, exitOK, code, stderr)
	var card report
	require.NoError(t, json.Unmarshal([]byte(stdout), &card))
	require.NotNil(t, card.Device)
	assert.Empty(t, card.Device.Card)
	assert.Equal(t, int64(1<<30-638<<20), card.Budget) // less the context, the cuBLAS workspace, the driver reserve and the cuDNN handle
	assert.False(t, card.Plan.WholeBatch, "a 1 GiB card does not: %+v", card.Plan)
	assert.LessOrEqual(t, card.Plan.PeakReserved, card.Budget)
}

func TestUnknownGPUListsCards(t *testing.T) {
	code, _, stderr := runCLI("estimate", "--model", "mlp", "--batch", "8", "--gpu", "h100")
	assert.Equal(t, exitUsage, code)
	first, _, _ := strings.Cut(stderr, "\n")
	for _, name := range []string{"h100-80gb", "a100-40gb", "a100-80gb", "l4", "rtx4090", "--gpu-memory"} {
		assert.Contains(t, first, name)
	}
	code, stdout, _ := runCLI("estimate", "-h")
	assert.Equal(t, exitOK, code)
	assert.Contains(t, stdout, "-gpu card")
	assert.Contains(t, stdout, "measured on an H100 80GB; assumed equal on other cards")
}
