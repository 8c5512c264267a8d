package main

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/hf"
)

const hfTestdata = "../../hf/testdata"

// estimate --hf-config plans every real-shaped config in
// hf/testdata/configs, in both spellings of the rope settings, and
// reports transformers' parameter count for it (params.json, counted on
// the meta device) and its architecture.
func TestEstimateHFConfigsCountTransformersParameters(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(hfTestdata, "configs", "params.json"))
	require.NoError(t, err)
	var want map[string]struct {
		Parameters int64 `json:"parameters"`
	}
	require.NoError(t, json.Unmarshal(b, &want))
	require.Len(t, want, 7)
	arch := map[string]string{"llama3-8b": "LlamaForCausalLM", "llama3.2-1b": "LlamaForCausalLM", "llama3.2-3b": "LlamaForCausalLM",
		"mistral-7b": "MistralForCausalLM", "qwen2-7b": "Qwen2ForCausalLM", "qwen2-0.5b": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}
	for name, w := range want {
		for _, file := range []string{name + ".json", name + ".legacy.json"} {
			path := filepath.Join(hfTestdata, "configs", file)
			code, stdout, stderr := runCLI("estimate", "--hf-config", path, "--batch", "2", "--seq", "64", "--budget", "1000GiB", "--json")
			require.Equal(t, exitOK, code, "%s: %s", file, stderr)
			var r report
			require.NoError(t, json.Unmarshal([]byte(stdout), &r), file)
			assert.Equal(t, w.Parameters, r.Params, file)
			assert.Equal(t, arch[name], r.Model, file)
			assert.Contains(t, r.About, path, file)
			assert.Equal(t, 64, r.Seq, file)
			require.NotNil(t, r.Plan, file)
			assert.True(t, r.Plan.WholeBatch, file)
			assert.GreaterOrEqual(t, r.Plan.Persistent, 3*4*w.Parameters, "%s: float32 parameters and two AdamW slots", file)
		}
	}
}

// The acceptance case: Llama 3 8B's config.json on an H100 80GB reports
// 8,030,261,248 parameters and, trained with AdamW, does not fit, the
// explanation naming the persistent bytes; its --seq defaults to its
// max_position_embeddings, 8192. The same config as a directory reads the
// same; in bfloat16 inference it fits.
func TestEstimateHFConfigLlama3_8B(t *testing.T) {
	path := filepath.Join(hfTestdata, "configs", "llama3-8b.json")
	code, stdout, stderr := runCLI("estimate", "--hf-config", path, "--gpu", "h100-80gb", "--batch", "1")
	require.Equal(t, exitPlan, code, "%s\n%s", stdout, stderr)
	assert.Contains(t, stdout, "LlamaForCausalLM")
	assert.Contains(t, stdout, "8,030,261,248")
	assert.Contains(t, stdout, "int64[1 8192]", "--seq defaults to max_position_embeddings")
	persistent := alloc.FormatBytes(3 * 4 * 8_030_261_248)
	assert.Contains(t, stderr, persistent+" persistent (parameters, optimizer state), more than the budget by itself")

	dir := t.TempDir()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644))
	code, stdout, stderr = runCLI("estimate", "--hf-config", dir, "--gpu", "h100-80gb", "--batch", "1", "--seq", "2048", "--mode", "infer", "--dtype", "bfloat16")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "8,030,261,248")
	assert.Contains(t, stdout, "yes: the whole batch of 1 runs in one chunk")
}

// A config of more positions than maxHFSeqDefault (Llama 3.2's 131,072)
// defaults to that many tokens, and --seq may go up to its
// max_position_embeddings but not past it; a GPT-2 config defaults to
// its n_positions. Mistral's sliding window is named.
func TestEstimateHFConfigSeq(t *testing.T) {
	cfg := func(name string) string { return filepath.Join(hfTestdata, "configs", name) }
	code, stdout, stderr := runCLI("estimate", "--hf-config", cfg("llama3.2-1b.json"), "--batch", "1", "--budget", "1000GiB", "--mode", "infer", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r report
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, maxHFSeqDefault, r.Seq)

	code, _, stderr = runCLI("estimate", "--hf-config", cfg("llama3.2-1b.json"), "--batch", "1", "--budget", "1000GiB", "--seq", "131073")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, usageLines(t, "estimate", stderr), "131072")

	code, stdout, stderr = runCLI("estimate", "--hf-config", cfg("gpt2.json"), "--batch", "1", "--budget", "100GiB", "--json")
	require.Equal(t, exitOK, code, stderr)
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Equal(t, 1024, r.Seq)
	assert.Equal(t, int64(124_439_808), r.Params)

	code, stdout, stderr = runCLI("estimate", "--hf-config", cfg("mistral-7b.json"), "--batch", "1", "--seq", "128", "--budget", "1000GiB")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "MistralForCausalLM")
	assert.Contains(t, stdout, "sliding window 4096")
}

// The tiny checkpoints' configs run: report --run measures a training
// step of each on the CPU, and the planner predicted its peaks to the
// byte; snapshot writes one.
func TestReportRunHFConfigTiny(t *testing.T) {
	for _, dir := range []string{"llama-gqa-tied-llama3", "qwen2-tiny", "gpt2-tiny"} {
		code, stdout, stderr := runCLI("report", "--hf-config", filepath.Join(hfTestdata, dir), "--batch", "2", "--seq", "12", "--budget", "1GiB", "--run", "--json")
		require.Equal(t, exitOK, code, "%s: %s", dir, stderr)
		var r memReport
		require.NoError(t, json.Unmarshal([]byte(stdout), &r), dir)
		require.NotNil(t, r.Measured, dir)
		assert.Equal(t, r.Measured.PredictedPeakReserved, r.Measured.PeakReserved, dir)
		assert.Equal(t, r.Measured.PredictedPeakAllocated, r.Measured.PeakAllocated, dir)
	}
	out := filepath.Join(t.TempDir(), "step.folded")
	code, _, stderr := runCLI("snapshot", "--hf-config", filepath.Join(hfTestdata, "qwen2-tiny", "config.json"), "--batch", "2", "--budget", "1GiB", "-o", out)
	require.Equal(t, exitOK, code, stderr)
	b, err := os.ReadFile(out)
	require.NoError(t, err)
	assert.Contains(t, string(b), "model;layers;0;self_attn;q_proj;bias;param 512")
}

// An architecture batchfit has no model for is refused with an
// *hf.UnsupportedArchitectureError that lists the supported ones: exit 1,
// one line naming them all. So are files that are not configs.
func TestEstimateHFConfigRefused(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
		return p
	}
	bert := write("bert.json", `{"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 768}`)
	_, err := hfModel(bert)
	var ua *hf.UnsupportedArchitectureError
	require.True(t, errors.As(err, &ua), "%v", err)
	assert.Equal(t, "BertForMaskedLM", ua.Architecture)
	assert.Equal(t, hf.Architectures(), ua.Supported)
	var mf *modelFileError
	require.True(t, errors.As(err, &mf))

	code, stdout, stderr := runCLI("estimate", "--hf-config", bert, "--batch", "1", "--budget", "1GiB")
	assert.Equal(t, exitPlan, code)
	assert.Empty(t, stdout)
	assert.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
	for _, a := range hf.Architectures() {
		assert.Contains(t, stderr, string(a))
	}
	assert.Contains(t, stderr, "BertForMaskedLM")

	deep := write("deep.json", `{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 5000, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}`)
	cases := []struct {
		name, path string
		want       error
	}{
		{"not JSON", write("junk.json", "\x00\x01 not json"), hf.ErrConfig},
		{"wrong type", write("type.json", `{"architectures": ["LlamaForCausalLM"], "hidden_size": "big"}`), hf.ErrConfig},
		{"yarn rope", write("yarn.json", `{"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4}}`), hf.ErrUnsupported},
		{"too large", write("big.json", `{"pad": "`+strings.Repeat("x", 2<<20)+`"}`), hf.ErrTooLarge},
		{"no config in the directory", dir, os.ErrNotExist},
		{"missing", filepath.Join(dir, "absent.json"), os.ErrNotExist},
		{"too deep", deep, hf.ErrUnsupported},
	}
	for _, c := range cases {
		_, err := hfModel(c.path)
		assert.True(t, errors.Is(err, c.want), "%s: %v", c.name, err)
		for _, sub := range []string{"estimate", "snapshot", "report"} {
			args := []string{sub, "--hf-config", c.path, "--batch", "1", "--budget", "1GiB"}
			if sub == "snapshot" {
				args = append(args, "-o", filepath.Join(dir, "out.pickle"))
			}
			code, stdout, stderr := runCLI(args...)
			assert.Equal(t, exitPlan, code, "%s %s: %s", sub, c.name, stderr)
			assert.Empty(t, stdout, c.name)
			assert.Equal(t, 1, strings.Count(stderr, "\n"), "%s %s: one line: %s", sub, c.name, stderr)
			assert.True(t, strings.HasPrefix(stderr, "batchfit "+sub+": --hf-config: "), "%s %s: %s", sub, c.name, stderr)
		}
	}

	// Usage mistakes: exit 2.
	code, _, stderr = runCLI("estimate", "--hf-config", bert, "--model", "gpt-tiny", "--batch", "1", "--budget", "1GiB")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, usageLines(t, "estimate", stderr), "exclude each other")
	code, _, stderr = runCLI("estimate", "--hf-config", "", "--batch", "1", "--budget", "1GiB")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, usageLines(t, "estimate", stderr), "--hf-config")
	code, _, stderr = runCLI("report", "--hf-config", bert, "some.pickle")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, usageLines(t, "report", stderr), "--hf-config")
	// A head_dim whose rotary table cannot be made on the host.
	wide := write("wide.json", `{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 16777216, "num_attention_heads": 1, "intermediate_size": 8, "vocab_size": 8}`)
	code, _, stderr = runCLI("estimate", "--hf-config", wide, "--batch", "1", "--budget", "1GiB")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, usageLines(t, "estimate", stderr), "rotary table")
	// A model that does not build is exit 1 whether estimate or report
	// --run finds it.
	odd := write("odd.json", `{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 30, "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 10}`)
	for _, args := range [][]string{{"estimate"}, {"report", "--run"}} {
		sub := args[0]
		code, _, stderr = runCLI(append(args, "--hf-config", odd, "--batch", "2", "--budget", "1GiB")...)
		assert.Equal(t, exitPlan, code, sub)
		assert.Equal(t, 1, strings.Count(stderr, "\n"), "%s: one line: %s", sub, stderr)
		assert.True(t, strings.HasPrefix(stderr, "batchfit "+sub+": building LlamaForCausalLM: "), "%s: %s", sub, stderr)
		assert.Contains(t, stderr, "head_dim 15 is odd", sub)
	}
	// --context keeps the bound.
	long := filepath.Join(hfTestdata, "configs", "llama3-8b.json")
	code, _, stderr = runCLI("estimate", "--hf-config", long, "--context", "100000000", "--seq", "100000000", "--batch", "1", "--budget", "1GiB")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, usageLines(t, "estimate", stderr), "rotary table")
}
