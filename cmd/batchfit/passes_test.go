package main

import (
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// estimate --passes prints a row per pass of the pipeline, in order, with
// the numbers compile.Train gives for the same step built directly (the
// Session's options: bf16-mixed, channels last by default, a plain step),
// the recompute pass last; --json carries them, and only with --passes.
func TestEstimatePasses(t *testing.T) {
	args := []string{"estimate", "--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--precision", "bf16-mixed"}
	code, stdout, stderr := runCLI(append(args, "--passes")...)
	require.Equal(t, exitOK, code, stderr)
	_, table, ok := strings.Cut(stdout, "graph passes, in order")
	require.True(t, ok, stdout)
	at := 0
	for _, name := range compile.Names() {
		i := strings.Index(table[at:], "\n"+name+" ")
		require.GreaterOrEqual(t, i, 0, "%s, after the passes before it:\n%s", name, table)
		at += i + 1
	}
	assert.Contains(t, table, "skipped: Options.Recompute is off")
	assert.Contains(t, table, "skipped: needs Options.LossScale")
	for _, l := range strings.Split(table, "\n") {
		assert.Equal(t, strings.TrimRight(l, " "), l, "no trailing spaces")
	}

	code, stdout, stderr = runCLI(append(args, "--passes", "--json")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	var names []string
	for _, p := range r.Passes {
		names = append(names, p.Name)
	}
	require.Equal(t, compile.Names(), names)

	m := slices.IndexFunc(zoo(), func(z zooModel) bool { return z.name == "gpt-tiny" })
	require.GreaterOrEqual(t, m, 0)
	b := zoo()[m].build(nn.Options{ShapeOnly: true}, 4, zoo()[m].context, true, nil, nil)
	wrt, err := lazy.ParamIDs(b.loss, nn.ParamTensors(b.module)...)
	require.NoError(t, err)
	st, err := compile.Train(b.loss.Graph().IR(), b.loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed, ChannelsLast: true, Plain: true})
	require.NoError(t, err)
	assert.Equal(t, st.Passes, r.Passes[:len(r.Passes)-1])
	gelu := r.Passes[slices.Index(names, "fuse-gelu-grad")]
	assert.True(t, gelu.Ran)
	assert.Positive(t, gelu.Saved(), "gpt-tiny's MLPs: the products GELU′ multiplies are not stored")

	code, stdout, stderr = runCLI(append(args, "--json")...)
	require.Equal(t, exitOK, code, stderr)
	assert.NotContains(t, stdout, `"passes"`)
}

// --disable-passes leaves passes out of the step (and says so); a name
// that is no pass, or autodiff, is a usage error naming it.
func TestEstimateDisablePasses(t *testing.T) {
	args := []string{"estimate", "--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--precision", "bf16-mixed", "--passes", "--json"}
	code, stdout, stderr := runCLI(append(args, "--disable-passes", "fuse-gelu-grad, recompute")...)
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	for _, p := range r.Passes {
		if p.Name == "fuse-gelu-grad" || p.Name == "recompute" {
			assert.False(t, p.Ran, p.Name)
			assert.Equal(t, "disabled", p.Why, p.Name)
		}
	}
	doc, err := os.ReadFile("../../docs/cli.md")
	require.NoError(t, err)
	_, row, ok := strings.Cut(string(doc), "| `--disable-passes LIST` |")
	require.True(t, ok)
	row, _, _ = strings.Cut(row, "\n")
	for _, p := range compile.Passes() {
		assert.Contains(t, row, "`"+p.Name+"`", "docs/cli.md's --disable-passes row names every pass")
	}
	for _, bad := range []string{"fuse-everything", "autodiff"} {
		code, _, stderr = runCLI(append(args, "--disable-passes", bad)...)
		assert.Equal(t, exitUsage, code)
		assert.Contains(t, usageLines(t, "estimate", stderr), bad)
	}
}
