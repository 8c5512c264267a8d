package main

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/progress"
	"github.com/batchfit/batchfit/recompute"
)

// Without --recompute, estimate prints today's report: no recompute
// section, nothing in the JSON.
func TestEstimateRecomputeOffUnchanged(t *testing.T) {
	code, out, _ := runCLI("estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "8GiB")
	require.Equal(t, exitOK, code)
	assert.NotContains(t, out, "recompute")
	code, out, _ = runCLI("estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "8GiB", "--json")
	require.Equal(t, exitOK, code)
	assert.NotContains(t, out, `"recompute"`)
}

// --recompute auto at a budget where chunks alone cannot run one sample,
// whatever the fused loss's token chunk: estimate succeeds with a recompute plan and lists the alternatives
// (chunks only, full checkpointing) with predicted times and peaks, in
// text and in JSON.
func TestEstimateRecomputeAuto(t *testing.T) {
	const budget = 29 << 30 / 10
	args := []string{"estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "2.9GiB", "--recompute", "auto"}
	code, out, errOut := runCLI(args...)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "recompute (--recompute auto")
	assert.Contains(t, out, "none (chunks only)")
	assert.Contains(t, out, "(full checkpointing)")
	assert.Contains(t, out, "does not fit")
	code, out, errOut = runCLI(append(args, "--json")...)
	require.Equal(t, exitOK, code, errOut)
	var r report
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	require.NotNil(t, r.Recompute)
	require.NotNil(t, r.Plan)
	assert.LessOrEqual(t, r.Plan.PeakReserved, int64(budget))
	var chosen *candidateRow
	for i, c := range r.Recompute.Candidates {
		if c.Chosen {
			chosen = &r.Recompute.Candidates[i]
		}
	}
	require.NotNil(t, chosen)
	assert.Equal(t, r.Recompute.Chosen, chosen.Name)
	assert.NotEqual(t, "none", chosen.Name)
	assert.Equal(t, r.Plan.PeakReserved, chosen.PeakReserved, "the plan reported is the chosen candidate's")
	assert.Positive(t, chosen.StepSeconds)
	assert.Positive(t, chosen.ExtraFLOPs)
	assert.False(t, r.Recompute.Candidates[0].Fits, "chunks only does not fit 2.9 GiB")
}

// TestEstimateRecomputeMixed: under a precision policy the recompute search
// sees the whole forward pass of the rewritten graph, all 12 blocks of
// GPT-2 small (the casts shift node ids, so the loss's id before the
// rewrite would cut the forward pass short).
func TestEstimateRecomputeMixed(t *testing.T) {
	code, out, errOut := runCLI("estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "3GiB",
		"--recompute", "auto", "--precision", "bf16-mixed")
	require.Contains(t, []int{exitOK, exitPlan}, code, errOut)
	assert.Contains(t, out, "blocks 12/12 (full checkpointing)")
}

func TestEstimatePlot(t *testing.T) {
	path := filepath.Join(t.TempDir(), "plot.svg")
	code, _, errOut := runCLI("estimate", "--model", "gpt-tiny", "--batch", "64", "--budget", "16MiB", "--plot", path)
	require.Equal(t, exitOK, code, errOut)
	assert.Equal(t, plotPoints, strings.Count(errOut, "batchfit estimate --plot: "), "a progress line per budget off a terminal:\n%s", errOut)
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc struct {
		XMLName   xml.Name
		Polylines []struct {
			Points string `xml:"points,attr"`
		} `xml:"polyline"`
	}
	require.NoError(t, xml.Unmarshal(data, &doc))
	assert.Equal(t, "svg", doc.XMLName.Local)
	assert.Len(t, doc.Polylines, 5)
	assert.NotEmpty(t, doc.Polylines[0].Points)
}

func TestRecomputeFlagErrors(t *testing.T) {
	base := []string{"estimate", "--model", "mlp", "--batch", "8", "--budget", "1GiB"}
	code, _, errOut := runCLI(append(base, "--recompute", "always")...)
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "--recompute")
	code, _, errOut = runCLI(append(base, "--profile", filepath.Join(t.TempDir(), "none.json"))...)
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "--profile")
	code, _, _ = runCLI(append(base, "--recompute", "auto", "--mode", "infer")...)
	assert.Equal(t, exitUsage, code)
}

// Without a GPU, calibrate says so (ErrNoGPU) and exits 1.
func TestCalibrateWithoutGPU(t *testing.T) {
	if s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA}); s.Err() == nil {
		s.Close()
		t.Skip("a GPU is present: calibrate would run")
	} else if !errors.Is(s.Err(), cuda.ErrNoGPU) {
		t.Skipf("CUDA is present but unusable: %v", s.Err())
	}
	code, _, errOut := runCLI("calibrate")
	assert.Equal(t, exitPlan, code)
	assert.Contains(t, errOut, ErrNoGPU.Error())
}

// The calibration's arithmetic, on the CPU executor at small sizes: every
// figure comes out positive and the profile validates.
func TestMeasureProfileOnCPU(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	hsess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
	sz := calibrateSizes{n: 64, elems: 1 << 14, chain: 3, repeat: 1, attnT: 16, convBatch: 2, convSize: 8, hostParams: 1 << 16}
	var lines strings.Builder
	p, err := measureProfile(context.Background(), sess, nil, hsess, sz, progress.Lines(&lines, "calibrate", calibrateItems(false, true, sz)))
	require.NoError(t, err)
	assert.Equal(t, calibrateItems(false, true, sz), strings.Count(lines.String(), "\n"), "one progress line per rate timed:\n%s", lines.String())
	assert.Contains(t, lines.String(), "calibrate: 10/10 bf16 attention")
	for name, v := range map[string]float64{"matmul": p.MatMulFLOPS, "bandwidth": p.Bandwidth, "launch": p.Launch,
		"host bandwidth": p.HostBandwidth, "attention": p.AttentionFLOPS, "half": p.HalfFLOPS,
		"half unaligned": p.HalfUnalignedFLOPS, "half conv": p.HalfConvFLOPS, "half attention": p.HalfAttentionFLOPS,
		"host update rate": p.HostUpdateRate} {
		assert.Positive(t, v, name)
	}
	assert.True(t, strings.HasPrefix(p.Sources["matmul_flops"], "measured"))
	var buf strings.Builder
	require.NoError(t, recompute.WriteProfile(&buf, p))
}

// --gpu names the cost model when --profile does not: the H100's and the
// H200's built-in profiles, the nominal mid-range one for other cards.
func TestEstimateProfileFollowsGPU(t *testing.T) {
	for _, c := range []struct{ gpu, want string }{
		{"h100-80gb", recompute.H100Profile().Name},
		{"h200", recompute.H200Profile().Name},
		{"l4", recompute.DefaultProfile().Name},
	} {
		code, out, errOut := runCLI("estimate", "--model", "mlp", "--batch", "8", "--gpu", c.gpu, "--recompute", "auto", "--json")
		require.Equal(t, exitOK, code, "%s: %s", c.gpu, errOut)
		var r report
		require.NoError(t, json.Unmarshal([]byte(out), &r), c.gpu)
		require.NotNil(t, r.Recompute, c.gpu)
		assert.Equal(t, c.want, r.Recompute.Profile.Name, c.gpu)
	}
}
