package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/safetensors"
)

// cudaSession is a CUDA session, or the test skipped with the reason
// there is none.
func cudaSession(t *testing.T) *batchfit.Session {
	t.Helper()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA})
	if err := sess.Err(); err != nil {
		if os.Getenv(testutil.RequireGPUEnv) != "" {
			t.Fatalf("%s is set: %v", testutil.RequireGPUEnv, err)
		}
		t.Skipf("no GPU: %v", err)
	}
	return sess
}

// On the GPU, in float32 and bf16-mixed: the loss drops, the saved
// checkpoint (synced from the device) reloads with the trained weights
// bit for bit, and greedy generation on the device from transformers'
// GPT-2 prompt gives transformers' float32 continuation.
func TestFinetuneCUDA(t *testing.T) {
	probe := cudaSession(t)
	probe.Close()
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		t.Run(prec, func(t *testing.T) {
			base := tinyCheckpoint(t, hf.Llama, "llama3-style.json")
			out := filepath.Join(t.TempDir(), "tuned")
			var log strings.Builder
			o := options{model: base, data: corpus(t), out: out, steps: 40, batch: 4, seq: 32, lr: 3e-3, warmup: 4,
				minRatio: 0.1, clip: 1, wd: 0.01, logEvery: 10, generate: 8, seed: 1, precision: prec, device: batchfit.DeviceCUDA,
				prompt: "the quick brown"}
			res, err := run(context.Background(), &log, o)
			require.NoError(t, err, log.String())
			t.Log(log.String())
			assert.Contains(t, log.String(), "device: cuda: ")
			assert.Equal(t, res.Predicted, res.Measured, "the last step's peak reserved bytes, predicted and measured")
			first, last := mean(res.Losses[:5]), mean(res.Losses[35:])
			assert.Less(t, last, first-3, "the loss drops: first five steps %.3f, last five %.3f", first, last)
			_, reloaded, err := load(out)
			require.NoError(t, err)
			want, got := res.Model.Params(), reloaded.Params()
			for i := range want {
				assert.Equal(t, want[i].Value().Data(), got[i].Value().Data(), want[i].Name())
			}
			require.NotEmpty(t, res.Generated)
		})
	}

	sess := cudaSession(t)
	defer sess.Close()
	cfg, model, err := load(filepath.Join(hfTestdata, "gpt2-tiny"))
	require.NoError(t, err)
	f, err := safetensors.Open(filepath.Join(hfTestdata, "gpt2-tiny", "reference.safetensors"))
	require.NoError(t, err)
	defer f.Close()
	prompt64, _ := readInt64(t, f, "generate_prompt")
	want64, _ := readInt64(t, f, "generate_ids")
	prompt, want := ints(prompt64), ints(want64)
	_, positions := dims(cfg)
	got, err := generate(context.Background(), sess, model, prompt, len(want)-len(prompt), positions, cfg.EOS)
	require.NoError(t, err)
	assert.Equal(t, want[len(prompt):], got)
}
