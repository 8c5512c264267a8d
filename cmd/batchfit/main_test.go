package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// runCLI runs the command with args and returns its exit code and output.
func runCLI(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = run(args, &o, &e)
	return code, o.String(), e.String()
}

// usageLines checks what a usage mistake of subcommand sub ("" for the
// command line itself) writes to stderr: the mistake in one line, then one
// line saying where the flags are, and not the flag list. It returns the
// first line.
func usageLines(t *testing.T, sub, stderr string) string {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
	require.Len(t, lines, 2, "the mistake and where the flags are, nothing else:\n%s", stderr)
	if sub == "" {
		assert.Equal(t, "Run 'batchfit help' for the subcommands (docs/cli.md describes them all).", lines[1])
	} else {
		assert.Equal(t, "Run 'batchfit "+sub+" -h' for its flags (docs/cli.md describes them all).", lines[1])
	}
	assert.NotContains(t, stderr, "Usage:")
	return lines[0]
}

func TestUsageErrors(t *testing.T) {
	base := []string{"--model", "gpt2-small", "--batch", "8", "--budget", "24GiB"}
	with := func(extra ...string) []string { return append(append([]string(nil), base...), extra...) }
	cases := []struct {
		name string
		args []string
		kind error
	}{
		{"missing model", []string{"--batch", "8", "--budget", "1GiB"}, errMissing},
		{"unknown model", []string{"--model", "gpt5", "--batch", "8", "--budget", "1GiB"}, errUnknown},
		{"missing batch", []string{"--model", "mlp", "--budget", "1GiB"}, errMissing},
		{"zero batch", []string{"--model", "mlp", "--batch", "0", "--budget", "1GiB"}, errRange},
		{"negative batch", []string{"--model", "mlp", "--batch", "-3", "--budget", "1GiB"}, errRange},
		{"negative micro-batch", []string{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "--micro-batch", "-1"}, errRange},
		{"batch not a number", []string{"--model", "mlp", "--batch", "x", "--budget", "1GiB"}, errFlag},
		{"unknown flag", with("--foo"), errFlag},
		{"flag without value", with("--top"), errFlag},
		{"positional argument", with("extra"), errFlag},
		{"seq on an mlp", []string{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "--seq", "16"}, errNotApplicable},
		{"seq zero", with("--seq", "0"), errRange},
		{"seq beyond context", with("--seq", "1025"), errRange},
		{"missing budget", []string{"--model", "mlp", "--batch", "8"}, errMissing},
		{"empty budget", []string{"--model", "mlp", "--batch", "8", "--budget", ""}, alloc.ErrSize},
		{"budget unit", []string{"--model", "mlp", "--batch", "8", "--budget", "24XB"}, alloc.ErrSize},
		{"negative budget", []string{"--model", "mlp", "--batch", "8", "--budget", "-1GiB"}, alloc.ErrSize},
		{"budget overflow", []string{"--model", "mlp", "--batch", "8", "--budget", "9999999TiB"}, alloc.ErrSize},
		{"zero budget", []string{"--model", "mlp", "--batch", "8", "--budget", "0"}, errRange},
		{"bad headroom", with("--headroom", "lots"), alloc.ErrSize},
		{"headroom eats budget", with("--headroom", "24GiB"), errRange},
		{"unknown optimizer", with("--optimizer", "lion"), errUnknown},
		{"unknown mode", with("--mode", "eval"), errUnknown},
		{"optimizer in inference", with("--mode", "infer", "--optimizer", "sgd"), errNotApplicable},
		{"dtype int64", with("--dtype", "int64"), errUnknown},
		{"dtype float64", with("--dtype", "float64"), errUnknown},
		{"unknown batchnorm", with("--batchnorm", "chunked"), errUnknown},
		{"negative top", with("--top", "-1"), errRange},
		{"unknown gpu", []string{"--model", "mlp", "--batch", "8", "--gpu", "h100"}, errUnknown},
		{"gpu and gpu-memory", []string{"--model", "mlp", "--batch", "8", "--gpu", "l4", "--gpu-memory", "24GiB"}, errConflict},
		{"gpu and budget", with("--gpu", "l4"), errConflict},
		{"gpu-memory and budget", with("--gpu-memory", "24GiB"), errConflict},
		{"gpu-memory unit", []string{"--model", "mlp", "--batch", "8", "--gpu-memory", "24XB"}, alloc.ErrSize},
		{"gpu-memory below the context", []string{"--model", "mlp", "--batch", "8", "--gpu-memory", "512MiB"}, errRange},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseEstimate(c.args)
			require.Error(t, err)
			assert.ErrorIs(t, err, errUsage)
			assert.ErrorIs(t, err, c.kind)
			var ue *usageError
			require.ErrorAs(t, err, &ue)

			code, stdout, stderr := runCLI(append([]string{"estimate"}, c.args...)...)
			assert.Equal(t, exitUsage, code)
			assert.Empty(t, stdout)
			assert.Equal(t, "batchfit estimate: "+err.Error(), usageLines(t, "estimate", stderr), "one line naming the mistake")
		})
	}
}

// A size typed with an unquoted space, "--budget 24 GB", reads as the
// size "24 GB" in every SIZE flag and flag form.
func TestSizeWithASpace(t *testing.T) {
	for _, c := range []struct{ spaced, joined []string }{
		{[]string{"--budget", "24", "GB"}, []string{"--budget", "24GB"}},
		{[]string{"-budget", "1.5", "GiB", "--headroom", "2", "MiB"}, []string{"--budget", "1.5GiB", "--headroom", "2MiB"}},
		{[]string{"--budget=512", "MiB"}, []string{"--budget", "512MiB"}},
		{[]string{"--gpu-memory", "24", "GiB"}, []string{"--gpu-memory", "24GiB"}},
	} {
		base := []string{"estimate", "--model", "mlp", "--batch", "8"}
		code, want, stderr := runCLI(append(base, c.joined...)...)
		require.Equal(t, exitOK, code, "%q: %s", c.joined, stderr)
		code, got, stderr := runCLI(append(base, c.spaced...)...)
		require.Equal(t, exitOK, code, "%q: %s", c.spaced, stderr)
		untimed := func(s string) string { // the planning line's times vary
			return regexp.MustCompile(`(?m)^planning .*$`).ReplaceAllString(s, "")
		}
		assert.Equal(t, untimed(want), untimed(got), "%q", c.spaced)
	}
	// Not a unit: still the mistake it was.
	code, _, stderr := runCLI("estimate", "--model", "mlp", "--batch", "8", "--budget", "24", "XB")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, stderr, `unexpected argument "XB"`)
	// A number after a size is no unit either.
	code, _, _ = runCLI("estimate", "--model", "mlp", "--budget", "24GiB", "--batch", "8", "16")
	assert.Equal(t, exitUsage, code)
}

func TestSubcommandErrors(t *testing.T) {
	for _, args := range [][]string{nil, {"plan"}, {"models", "extra"}, {"models", "--foo"}} {
		code, stdout, stderr := runCLI(args...)
		assert.Equal(t, exitUsage, code, "%q", args)
		assert.Empty(t, stdout, "%q", args)
		sub := ""
		if len(args) > 1 {
			sub = args[0]
		}
		usageLines(t, sub, stderr)
	}
	for _, args := range [][]string{{"help"}, {"-h"}, {"estimate", "-h"}, {"estimate", "--help"}, {"models", "-h"}} {
		code, stdout, stderr := runCLI(args...)
		assert.Equal(t, exitOK, code, "%q", args)
		assert.Contains(t, stdout, "Usage:", "%q", args)
		assert.Empty(t, stderr, "%q", args)
	}
}

// gpt2Plan builds GPT-2 small's training step at batch b, seq 1024, the
// way the library's users would, and plans it within budget with AdamW's
// state: the independent route to the numbers the CLI prints with
// --no-fused-loss (a Session's step: the tied embedding's gradient onto
// the head's, graph.FuseEmbeddingGradAdd).
func gpt2Plan(t *testing.T, b int, budget int64) (*planner.Program, *planner.Plan, error) {
	t.Helper()
	return gpt2PlanWith(t, b, budget, cpu.Workspace)
}

// gpt2PlanWith is gpt2Plan with the workspaces of another executor.
func gpt2PlanWith(t *testing.T, b int, budget int64, ws planner.WorkspaceFunc) (*planner.Program, *planner.Plan, error) {
	t.Helper()
	model := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	tokens := lazy.Placeholder([]int{b, 1024}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{b, 1024}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), targets)
	params := nn.ParamTensors(model)
	outs := []int{loss.ID()}
	var trained []int
	for i, gr := range lazy.Grad(loss, params...) {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
		trained = append(trained, loss.Graph().NodeOf(params[i]))
	}
	g, ids, err := graph.FuseEmbeddingGradAdd(loss.Graph().IR(), outs)
	require.NoError(t, err)
	for i := range outs {
		outs[i] = ids[outs[i]]
	}
	for i := range trained {
		trained[i] = ids[trained[i]]
	}
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, planner.CompileOptions{Kept: outs[1:], Trained: trained,
		StateSlots: optim.NewAdamW(1e-3).StateSlots(), Workspace: ws})
	require.NoError(t, err)
	pl, err := planner.Make(p, planner.Options{Budget: budget, NoHeadroom: true})
	return p, pl, err
}

func TestEstimateGPT2SmallFits(t *testing.T) {
	_, want, err := gpt2Plan(t, 8, 24<<30)
	require.NoError(t, err)
	require.Len(t, want.Chunks, 1, "GPT-2 small at batch 8 fits 24 GiB in one chunk")

	// gpt2Plan's graph is the unfused head and loss.
	args := []string{"estimate", "--model", "gpt2-small", "--batch", "8", "--seq", "1024", "--budget", "24GiB", "--optimizer", "adamw", "--no-fused-loss"}
	code, stdout, stderr := runCLI(args...)
	require.Equal(t, exitOK, code, stderr)
	assert.Empty(t, stderr)
	// 124,439,808 parameters: GPT-2 small with its head tied to wte.
	for _, s := range []string{"124,439,808", alloc.FormatBytes(124439808 * 4), alloc.FormatBytes(2 * 124439808 * 4),
		"yes: the whole batch of 8 runs in one chunk", exact(want.PeakReserved), exact(want.PeakAllocated),
		alloc.FormatBytes(want.Fixed) + " + " + alloc.FormatBytes(want.PerSample) + " × chunk",
		alloc.FormatBytes(want.Persistent), alloc.FormatBytes(24 << 30)} {
		assert.Contains(t, stdout, s)
	}

	code, stdout, stderr = runCLI(append(args, "--json")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, int64(124439808), r.Params)
	assert.Equal(t, int64(124439808*4), r.ParamBytes)
	assert.Equal(t, int64(2*124439808*4), r.StateBytes)
	require.NotNil(t, r.Plan)
	assert.Equal(t, planReport{WholeBatch: true, Chunk: 8, NumChunks: 1, Chunks: []chunkRun{{Count: 1, Size: 8}}, PeakReserved: want.PeakReserved,
		PeakAllocated: want.PeakAllocated, Fixed: want.Fixed, PerSample: want.PerSample, Persistent: want.Persistent,
		WholePeakReserved: want.PeakReserved, Replays: want.Replays, PlanningSeconds: r.Plan.PlanningSeconds}, *r.Plan)
	assert.Equal(t, int64(2*124439808*4+124439808*4), r.Plan.Persistent, "parameters and two AdamW slots")
}

// TestEstimateGPT2SmallBatch32 is the README's question: batch 32 does not
// fit a 24 GiB card at once, but runs in balanced chunks that do.
func TestEstimateGPT2SmallBatch32(t *testing.T) {
	_, want, err := gpt2Plan(t, 32, 24<<30)
	require.NoError(t, err)
	code, stdout, stderr := runCLI("estimate", "--model", "gpt2-small", "--batch", "32", "--budget", "24GiB", "--json", "--no-fused-loss")
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	require.NotNil(t, r.Plan)
	var runs []chunkRun
	for _, run := range want.Split.Runs() {
		runs = append(runs, chunkRun(run))
	}
	assert.Equal(t, runs, r.Plan.Chunks)
	assert.Equal(t, len(want.Chunks), r.Plan.NumChunks)
	assert.False(t, r.Plan.WholeBatch)
	assert.Equal(t, want.PeakReserved, r.Plan.PeakReserved)
	assert.LessOrEqual(t, r.Plan.PeakReserved, int64(24<<30))
	assert.Greater(t, r.Plan.WholePeakReserved, int64(24<<30))
	assert.Equal(t, int64(124439808*4), r.Plan.Accumulators, "one float32 gradient sum per parameter")
}

// estimate fuses a language model's head and loss by default, reports the
// session's token chunk (or the one --loss-chunk forces), and plans less
// than with --no-fused-loss; a negative --loss-chunk is a usage mistake.
func TestEstimateFusedLoss(t *testing.T) {
	plan := func(extra ...string) *planReport {
		t.Helper()
		args := append([]string{"estimate", "--model", "gpt2-small", "--batch", "8", "--seq", "1024", "--budget", "24GiB",
			"--precision", "bf16-mixed", "--json"}, extra...)
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, exitOK, code, stderr)
		var r report
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		require.NotNil(t, r.Plan)
		return r.Plan
	}
	fused, forced, unfused := plan(), plan("--loss-chunk", "512"), plan("--no-fused-loss")
	// Unbounded by the budget: the largest chunk is fastest, and half of
	// it, as fast by the cost model, holds less (batchfit.LossChunkSlack).
	assert.Equal(t, 4096, fused.LossChunk, "half the fastest chunk")
	assert.Equal(t, 512, forced.LossChunk)
	assert.Zero(t, unfused.LossChunk)
	assert.Less(t, fused.PeakReserved, unfused.PeakReserved)
	assert.Less(t, forced.PeakReserved, unfused.PeakReserved)
	code, _, stderr := runCLI("estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "24GiB", "--loss-chunk", "-1")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, stderr, "--loss-chunk")
	_, stdout, _ := runCLI("estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "24GiB")
	assert.Contains(t, stdout, "loss chunk       4096 tokens per logits chunk")
}

func TestEstimateDoesNotFit(t *testing.T) {
	_, _, err := gpt2Plan(t, 8, 2<<30)
	var want *planner.DoesNotFitError
	require.ErrorAs(t, err, &want)

	args := []string{"estimate", "--model", "gpt2-small", "--batch", "8", "--budget", "2GiB", "--no-fused-loss"}
	code, stdout, stderr := runCLI(args...)
	assert.Equal(t, exitPlan, code)
	assert.Equal(t, "batchfit estimate: "+want.Error()+"\n", stderr, "the planner's message, naming the largest buffers")
	assert.Contains(t, stdout, "124,439,808", "the model summary still prints")

	code, stdout, _ = runCLI(append(args, "--json")...)
	assert.Equal(t, exitPlan, code)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Nil(t, r.Plan)
	require.NotNil(t, r.DoesNotFit)
	assert.Equal(t, want.Needed, r.DoesNotFit.Needed)
	assert.Equal(t, want.Whole, r.DoesNotFit.Whole)
	assert.Equal(t, int64(2<<30), r.DoesNotFit.Available)
	assert.Greater(t, r.DoesNotFit.Needed, r.DoesNotFit.Available)
	assert.Len(t, r.DoesNotFit.Largest, len(want.Largest))
}

// A batch of one sample that does not fit says so, and what the sample
// needs beyond the persistent bytes; models without batch norm hear nothing
// about batch statistics.
func TestEstimateOneSampleDoesNotFit(t *testing.T) {
	for _, args := range [][]string{
		{"--model", "mlp", "--batch", "1", "--budget", "1MiB"},
		{"--model", "gpt2-small", "--batch", "1", "--budget", "1GiB"},
	} {
		code, _, stderr := runCLI(append([]string{"estimate"}, args...)...)
		assert.Equal(t, exitPlan, code, "%q", args)
		assert.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %s", stderr)
		assert.Contains(t, stderr, "does not fit the memory budget", "%q", args)
		assert.Contains(t, stderr, "persistent (parameters, optimizer state)", "%q", args)
		assert.Contains(t, stderr, "for the step's work at 1 sample a chunk", "%q", args)
		assert.NotContains(t, stderr, "batch statistics", "%q", args)
		assert.NotContains(t, stderr, "not chunkable", "%q", args)
	}
}

func TestJSONRoundTrip(t *testing.T) {
	code, stdout, stderr := runCLI("estimate", "--model", "convnet", "--batch", "64", "--budget", "64MiB",
		"--optimizer", "sgd-momentum", "--json", "--table", "--top", "5")
	require.Equal(t, exitOK, code, stderr)
	dec := json.NewDecoder(strings.NewReader(stdout))
	dec.DisallowUnknownFields()
	var r report
	require.NoError(t, dec.Decode(&r))
	var again bytes.Buffer
	require.NoError(t, writeJSON(&again, &r))
	assert.JSONEq(t, stdout, again.String())

	assert.Equal(t, "sgd-momentum", r.Optimizer)
	assert.Equal(t, 1, r.StateSlots)
	assert.Equal(t, r.ParamBytes, r.StateBytes, "one momentum buffer per parameter")
	assert.Equal(t, "float32[64 3 32 32]", r.Input)
	assert.Equal(t, "int64[64]", r.Labels)
	require.Len(t, r.Largest, 5)
	for i := 1; i < len(r.Largest); i++ {
		assert.GreaterOrEqual(t, r.Largest[i-1].Bytes, r.Largest[i].Bytes)
	}
	require.NotEmpty(t, r.Timeline)
	for _, row := range r.Timeline {
		assert.LessOrEqual(t, row.Reserved, r.Plan.PeakReserved)
		assert.LessOrEqual(t, row.Allocated, row.Reserved)
	}
}

func TestTablePrintsRows(t *testing.T) {
	c, err := parseEstimate([]string{"--model", "convnet", "--batch", "16", "--budget", "1GiB", "--table"})
	require.NoError(t, err)
	st, err := buildStep(c)
	require.NoError(t, err)
	runs := 0
	for _, s := range st.program.Steps {
		if s.Kind == planner.StepRun {
			runs++
		}
	}
	code, stdout, stderr := runCLI("estimate", "--model", "convnet", "--batch", "16", "--budget", "1GiB", "--table")
	require.Equal(t, exitOK, code, stderr)
	_, table, ok := strings.Cut(stdout, "memory timeline of chunk 0")
	require.True(t, ok, stdout)
	lines := strings.Split(strings.TrimSpace(table), "\n")
	require.Len(t, lines, 2+runs, "title, header, one row per node run")
	assert.True(t, strings.HasPrefix(lines[1], "STEP"))
	conv := 0
	for _, l := range lines[2:] {
		if f := strings.Fields(l); f[2] == "conv2d" {
			conv++
			assert.NotContains(t, l, " - ", "a 3×3 convolution declares a workspace: %s", l)
		}
	}
	assert.Equal(t, 3, conv, "three conv stages")
}

func TestInferenceHoldsNoOptimizerState(t *testing.T) {
	code, stdout, stderr := runCLI("estimate", "--model", "mlp", "--batch", "128", "--budget", "1GiB", "--mode", "infer", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, "infer", r.Mode)
	assert.Empty(t, r.Optimizer)
	assert.Zero(t, r.StateBytes)
	assert.Empty(t, r.Labels)
	require.NotNil(t, r.Plan)
	// 784·512 + 512 + 512·512 + 512 + 512·10 + 10 parameters.
	assert.Equal(t, int64(669706), r.Params)
	assert.Equal(t, int64(669706*4), r.Plan.Persistent, "parameters only")
}

func TestHalfPrecisionHalvesParameters(t *testing.T) {
	for _, dt := range []string{"float16", "bfloat16"} {
		code, stdout, stderr := runCLI("estimate", "--model", "gpt2-small", "--batch", "2", "--seq", "128",
			"--budget", "24GiB", "--dtype", dt, "--json")
		require.Equal(t, exitOK, code, stderr)
		var r report
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		assert.Equal(t, dt, r.DType)
		assert.Equal(t, int64(124439808*2), r.ParamBytes, dt)
		assert.Equal(t, int64(2*124439808*2), r.StateBytes, dt)
		assert.Equal(t, "int64[2 128]", r.Input, "tokens stay int64")
	}
	code, _, stderr := runCLI("estimate", "--model", "convnet", "--batch", "4", "--budget", "1GiB", "--dtype", "float16")
	assert.Equal(t, exitOK, code, stderr)
}

func TestModelsList(t *testing.T) {
	code, stdout, stderr := runCLI("models")
	require.Equal(t, exitOK, code, stderr)
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	require.Len(t, lines, 1+len(zoo()))
	want := map[string]string{
		"mlp":        "669,706",    // 784·512+512 + 512·512+512 + 512·10+10
		"mlp-large":  "20,037,642", // 784·4096+4096 + 4096·4096+4096 + 4096·10+10
		"gpt2-small": "124,439,808",
		// torchvision's resnet18 and resnet50 at 1000 classes; ResNet-18
		// with a CIFAR stem at 10 classes.
		"resnet18":       "11,689,512",
		"resnet50":       "25,557,032",
		"resnet18-cifar": "11,173,962",
	}
	seen := 0
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if n, ok := want[f[0]]; ok {
			assert.Equal(t, n, f[1], f[0])
			seen++
		}
	}
	assert.Equal(t, len(want), seen, "every model checked is listed:\n%s", stdout)
	assert.Contains(t, stdout, "images [3 224 224]")
}

func TestChunkSummary(t *testing.T) {
	assert.Equal(t, "4 × 8", planner.DescribeSizes([]int{8, 8, 8, 8}))
	assert.Equal(t, "1 × 4 + 2 × 3", planner.DescribeSizes([]int{4, 3, 3}))
	assert.Equal(t, "1 × 32", planner.DescribeSizes([]int{32}))
}

func TestThousands(t *testing.T) {
	for in, want := range map[int64]string{0: "0", 999: "999", 1000: "1,000", 124439808: "124,439,808", -1234: "-1,234"} {
		assert.Equal(t, want, thousands(in))
	}
}

func TestErrorsAreTyped(t *testing.T) {
	// A planning error is not a usage error.
	c, err := parseEstimate([]string{"--model", "gpt2-small", "--batch", "8", "--budget", "1GiB"})
	require.NoError(t, err)
	_, err = estimate(c)
	assert.ErrorIs(t, err, planner.ErrDoesNotFit)
	assert.False(t, errors.Is(err, errUsage))
}

// --precision: estimate plans exactly what a Session with that precision
// runs (report --run measures the Session's step on the CPU executor), the
// report says which policy, and bad values are usage errors.
func TestPrecisionFlag(t *testing.T) {
	for _, args := range [][]string{
		{"--model", "mlp", "--batch", "2048", "--budget", "26MiB"}, // chunked
		{"--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--optimizer", "adam"},
		{"--model", "convnet", "--batch", "8", "--budget", "256MiB"},
		{"--model", "convnet", "--batch", "2", "--budget", "64MiB", "--mode", "infer"},
	} {
		for _, p := range []string{"bf16-mixed", "fp16-mixed"} {
			t.Run(args[1]+"/"+p, func(t *testing.T) {
				code, stdout, stderr := runCLI(append(append([]string{"estimate"}, args...), "--precision", p, "--json")...)
				require.Equal(t, exitOK, code, stderr)
				var r report
				require.NoError(t, json.Unmarshal([]byte(stdout), &r))
				assert.Equal(t, p, r.Precision)
				require.NotNil(t, r.Plan)
				code, stdout, stderr = runCLI(append(append([]string{"report"}, args...), "--precision", p, "--run", "--json")...)
				require.Equal(t, exitOK, code, stderr)
				var m memReport
				require.NoError(t, json.Unmarshal([]byte(stdout), &m))
				require.NotNil(t, m.Measured)
				assert.Contains(t, m.Step, p)
				assert.Equal(t, r.Plan.PeakReserved, m.Measured.PeakReserved, "estimate's prediction is the Session's measured peak")
				assert.Equal(t, r.Plan.PeakAllocated, m.Measured.PeakAllocated)
			})
		}
	}
	// fp32 is the default, and tf32 changes no byte.
	var plans []int64
	for _, p := range []string{"", "fp32", "tf32"} {
		args := []string{"estimate", "--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--json"}
		if p != "" {
			args = append(args, "--precision", p)
		}
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, exitOK, code, stderr)
		var r report
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		require.NotNil(t, r.Plan)
		plans = append(plans, r.Plan.PeakReserved)
	}
	assert.Equal(t, plans[0], plans[1])
	assert.Equal(t, plans[0], plans[2])

	base := []string{"--model", "mlp", "--batch", "8", "--budget", "1GiB"}
	for _, c := range []struct {
		args []string
		kind error
	}{
		{[]string{"--precision", "bf16"}, errUnknown},
		{[]string{"--precision", ""}, errUnknown},
		{[]string{"--precision", "bf16-mixed", "--dtype", "bfloat16"}, errNotApplicable},
	} {
		for _, sub := range []string{"estimate", "snapshot", "report"} {
			code, stdout, stderr := runCLI(append(append([]string{sub}, base...), c.args...)...)
			assert.Equal(t, exitUsage, code, "%s %q: %s", sub, c.args, stderr)
			assert.Empty(t, stdout)
			assert.Contains(t, stderr, "--precision")
		}
		_, err := parseEstimate(append(append([]string(nil), base...), c.args...))
		assert.ErrorIs(t, err, c.kind, "%q", c.args)
	}
	// The CUDA executor runs the mixed policies: a card's budget plans them.
	c, err := parseEstimate([]string{"--model", "mlp", "--batch", "8", "--gpu", "h100-80gb", "--precision", "bf16-mixed"})
	require.NoError(t, err)
	assert.Equal(t, precision.BF16Mixed, c.policy)
}

// --context gives a GPT model more positions, so --seq may go past the
// zoo's context: GPT-2 small with attention written out at seq 8192 fits
// a 24 GiB budget only with recomputation (its [12, T, T] scores), and
// the position embedding grows by 7,168 × 768 parameters. Other models
// refuse the flag, and a context must be positive.
func TestEstimateContext(t *testing.T) {
	code, _, stderr := runCLI("estimate", "--model", "gpt2-small", "--batch", "1", "--seq", "8192", "--budget", "24GiB")
	require.Equal(t, exitUsage, code)
	assert.Contains(t, stderr, "--seq must lie in 1…1024")

	args := []string{"estimate", "--model", "gpt2-small-written", "--batch", "1", "--seq", "8192", "--context", "8192",
		"--budget", "24GiB", "--json"}
	code, _, stderr = runCLI(args...)
	require.Equal(t, exitPlan, code, "without recompute the sample does not fit: %s", stderr)
	code, stdout, stderr := runCLI(append(args, "--recompute", "auto")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, int64(124439808+7168*768), r.Params)
	require.NotNil(t, r.Plan)
	assert.LessOrEqual(t, r.Plan.PeakReserved, int64(24<<30))
	require.NotNil(t, r.Recompute)
	assert.NotEqual(t, "none", r.Recompute.Chosen, "recomputation makes it fit")

	for _, bad := range [][]string{
		{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "--context", "64"},
		{"--model", "gpt-tiny", "--batch", "8", "--budget", "1GiB", "--context", "0"},
	} {
		code, _, _ := runCLI(append([]string{"estimate"}, bad...)...)
		assert.Equal(t, exitUsage, code, "%v", bad)
	}
}

// --micro-batch caps the chunk (planner.Options.MaxChunk): 1000 samples
// that fit whole in 1 GiB run as 4 micro-batches of 250 under a cap of
// 300, the report says the batch would fit whole, and the JSON carries
// the cap; without the flag the batch runs whole.
func TestEstimateMicroBatch(t *testing.T) {
	args := []string{"estimate", "--model", "mlp", "--batch", "1000", "--budget", "1GiB"}
	code, stdout, stderr := runCLI(append(args, "--micro-batch", "300", "--json")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, 300, r.MicroBatch)
	require.NotNil(t, r.Plan)
	assert.Equal(t, 250, r.Plan.Chunk)
	assert.Equal(t, 4, r.Plan.NumChunks)
	assert.False(t, r.Plan.WholeBatch)

	code, stdout, stderr = runCLI(append(args, "--micro-batch", "300")...)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "in micro-batches of at most 300 (--micro-batch): 4 × 250")

	code, stdout, stderr = runCLI(append(args, "--json")...)
	require.Equal(t, exitOK, code, stderr)
	r = report{}
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Zero(t, r.MicroBatch)
	assert.True(t, r.Plan.WholeBatch)
}
