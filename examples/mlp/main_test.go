package main

import (
	"bytes"
	"io"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/nn"
)

// TestRun runs the example end to end on the CPU executor. With random
// initial weights the logits are small (std ≈ 0.15 for this data), so the
// mean cross-entropy over ten classes is close to ln 10; the tolerance 0.5
// leaves room for any seed while catching a loss that is not a mean, not
// log-softmax based, or not finite.
func TestRun(t *testing.T) {
	for _, batch := range []int{1, 64} {
		var out bytes.Buffer
		require.NoError(t, run(&out, options{batch: batch, seed: 3, rows: 2, steps: 0}))
		text := out.String()

		assert.Regexp(t, `(?m)^id\s+op\s+name\s+module\s+shape\s+batch axis\s+class\s+bytes\s+last use`, text)
		assert.Contains(t, text, "0.weight")
		assert.Contains(t, text, "cross_entropy")

		m := regexp.MustCompile(`(?m)^loss: (\S+)$`).FindStringSubmatch(text)
		require.Len(t, m, 2, "a loss line in:\n%s", text)
		loss, err := strconv.ParseFloat(m[1], 64)
		require.NoError(t, err)
		require.False(t, math.IsNaN(loss) || math.IsInf(loss, 0), "loss %v", loss)
		assert.InDelta(t, math.Log(10), loss, 0.5, "batch %d", batch)

		i := strings.Index(text, "logits, first ")
		require.GreaterOrEqual(t, i, 0)
		rows := strings.Split(strings.TrimSpace(text[i:]), "\n")[1:]
		assert.Len(t, rows, min(2, batch))
		for _, row := range rows {
			assert.Len(t, strings.Fields(row), 10)
		}
	}
}

func TestRunRejectsEmptyBatch(t *testing.T) {
	assert.Error(t, run(&bytes.Buffer{}, options{batch: 0, seed: 1}))
}

// TestRunRejectsNegativeSteps: -steps -1 is a usage mistake, reported
// before any work, not a panic in the training loop.
func TestRunRejectsNegativeSteps(t *testing.T) {
	var out bytes.Buffer
	assert.Error(t, run(&out, options{batch: 1, seed: 1, steps: -1, lr: 1e-3}))
	assert.Empty(t, out.String())
}

// TestTrainingHalvesLoss trains briefly on the blobs: the mean loss of the
// last five steps must fall below half the first step's loss (≈ ln 10).
// Averaging five steps keeps one noisy batch from deciding the test.
func TestTrainingHalvesLoss(t *testing.T) {
	o := options{batch: 32, seed: 5, steps: 60, lr: 1e-3}
	model := nn.MLP(nn.Seed(o.seed), []int{features, 512, 512, classes}, nn.ReLU{})
	losses, err := train(io.Discard, o, model)
	require.NoError(t, err)
	require.Len(t, losses, o.steps)
	var last float32
	for _, l := range losses[len(losses)-5:] {
		last += l / 5
	}
	t.Logf("first loss %.4f, mean of last five %.4f", losses[0], last)
	assert.Less(t, last, losses[0]/2)
}

// TestChunkedTrainingUnderBudget runs the example the way the README shows
// chunking: a batch whose step needs 66 MiB under a 48 MiB budget runs in
// two chunks, and the executor measures exactly the predicted peak. The
// numbers are the CPU executor's (CUDA's kernel workspaces differ).
func TestChunkedTrainingUnderBudget(t *testing.T) {
	var out bytes.Buffer
	o := options{batch: 4096, seed: 2, steps: 1, lr: 1e-3, budget: 48 << 20, device: "cpu"}
	model := nn.MLP(nn.Seed(o.seed), []int{features, 512, 512, classes}, nn.ReLU{})
	_, err := train(&out, o, model)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "batch 4096 runs as 2 chunks of at most 2048; peak reserved predicted 46.00 MiB, measured 46.00 MiB")
}
