package main

import (
	"bytes"
	"io"
	"math"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// meanLast is the mean of the last k losses.
func meanLast(losses []float32, k int) float64 {
	s := 0.0
	for _, l := range losses[len(losses)-k:] {
		s += float64(l)
	}
	return s / float64(k)
}

// TestTrainingHalvesLoss trains briefly and asks that the mean loss of the
// last five steps fall below half the first step's. Why that is safe: the
// first loss is ln 32 ≈ 3.47 to within a few hundredths (GPT-2's
// N(0, 0.02²) initialisation keeps the tied head's logits near zero), so
// the threshold is ≈ 1.73, while the chain's entropy, the loss of a model
// that has learnt the transition table, is 1.11. A model at the threshold
// has learnt most tokens' likely successor; a model that learnt nothing
// (a broken gradient, a step that does not update) stays near 3.4.
// Averaging five steps keeps one noisy batch from deciding the test. With
// these options the ratio last/first was at most 0.40 over seeds 1–20.
func TestTrainingHalvesLoss(t *testing.T) {
	o := options{steps: 60, batch: 16, seq: 16, seed: 3, lr: 1e-2}
	var out bytes.Buffer
	losses, err := run(&out, o)
	require.NoError(t, err)
	require.Len(t, losses, o.steps)
	last := meanLast(losses, 5)
	t.Logf("first loss %.4f, mean of last five %.4f", losses[0], last)
	assert.InDelta(t, math.Log(vocab), losses[0], 0.1, "an untrained model guesses nearly uniformly")
	assert.Less(t, last, float64(losses[0])/2)

	text := out.String()
	assert.Regexp(t, `(?m)^device: (cpu|cuda): `, text)
	assert.Regexp(t, `(?m)^training graph: \d+ nodes; sum of tensor sizes \(not a peak\): \d+ B fixed \+ \d+ B per sequence`, text)
	assert.Len(t, regexp.MustCompile(`(?m)^step +\d+  loss \d+\.\d+$`).FindAllString(text, -1), 11, "step 1 and every sixth step:\n%s", text)
}

func TestRunRejectsBadOptions(t *testing.T) {
	good := options{steps: 1, batch: 2, seq: 4, seed: 1, lr: 1e-3}
	for name, edit := range map[string]func(*options){
		"zero batch":     func(o *options) { o.batch = 0 },
		"one token":      func(o *options) { o.seq = 1 },
		"too long":       func(o *options) { o.seq = maxSeq + 1 },
		"negative lr":    func(o *options) { o.lr = -1 },
		"negative steps": func(o *options) { o.steps = -1 },
		"no such policy": func(o *options) { o.precision = "bf17" },
		"no such device": func(o *options) { o.device = "gpu" },
	} {
		o := good
		edit(&o)
		_, err := run(io.Discard, o)
		assert.Error(t, err, name)
	}
	_, err := run(io.Discard, good)
	assert.NoError(t, err)
}

// TestChainEntropy checks the printed floor against the empirical entropy
// of the generator's own transitions: with 200k samples the plug-in
// estimate is within 0.02 nats.
func TestChainEntropy(t *testing.T) {
	c := newChain(5)
	counts := make([][vocab]float64, vocab)
	tok, tgt := c.batch(5, 0, 2000, 100)
	a, b := tok.Data().([]int64), tgt.Data().([]int64)
	for i := range a {
		counts[a[i]][b[i]]++
	}
	h, n := 0.0, float64(len(a))
	for _, row := range counts {
		tot := 0.0
		for _, k := range row {
			tot += k
		}
		for _, k := range row {
			if k > 0 {
				h -= k / n * math.Log(k/tot)
			}
		}
	}
	assert.InDelta(t, c.entropy(), h, 0.02)
}

// TestParseFlags: -precision and -device take only the names the session
// knows; anything else is a usage error (main exits 2) whose message and
// usage go to stderr.
func TestParseFlags(t *testing.T) {
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "fp32", o.precision)
	assert.Equal(t, "auto", o.device)
	assert.Equal(t, 200, o.steps)

	o, err = parseFlags([]string{"-precision", "bf16-mixed", "-device", "cpu", "-steps", "20", "-dump", "d"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, options{steps: 20, batch: 16, seq: maxSeq, seed: 1, lr: 3e-3,
		precision: "bf16-mixed", device: "cpu", dump: "d"}, o)

	for _, args := range [][]string{
		{"-precision", "bf16"},
		{"-device", "gpu"},
		{"-steps", "x"},
		{"extra"},
	} {
		var stderr bytes.Buffer
		_, err := parseFlags(args, &stderr)
		assert.Error(t, err, "%q", args)
		assert.Contains(t, stderr.String(), "Usage of transformer:", "%q", args)
	}
}
