package main

import (
	"bytes"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRun runs the example end to end on the CPU executor. With random
// initial weights the logits are small (std ≈ 0.15 for this data), so the
// mean cross-entropy over ten classes is close to ln 10; the tolerance 0.5
// leaves room for any seed while catching a loss that is not a mean, not
// log-softmax based, or not finite.
func TestRun(t *testing.T) {
	for _, batch := range []int{1, 64} {
		var out bytes.Buffer
		require.NoError(t, run(&out, options{batch: batch, seed: 3, rows: 2}))
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
