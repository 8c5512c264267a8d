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

// TestTrainingHalvesLoss trains briefly on 16×16 stripes and asks that the
// mean loss of the last five steps fall below half the first step's. Why
// that is safe: the first loss is close to ln 4 ≈ 1.39 (PyTorch's default
// initialisation gives small logits here), so the threshold is ≈ 0.69,
// which a net reaches once it tells most orientations apart; a net that
// learnt nothing stays near 1.39. With these options the ratio last/first
// was at most 0.10 over seeds 1–20. Averaging five steps keeps one noisy
// batch from deciding the test.
func TestTrainingHalvesLoss(t *testing.T) {
	o := options{steps: 40, batch: 16, size: 16, seed: 3, lr: 1e-2}
	var out bytes.Buffer
	losses, err := run(&out, o)
	require.NoError(t, err)
	require.Len(t, losses, o.steps)
	var last float64
	for _, l := range losses[len(losses)-5:] {
		last += float64(l) / 5
	}
	t.Logf("first loss %.4f, mean of last five %.4f", losses[0], last)
	assert.InDelta(t, math.Log(classes), losses[0], 0.15, "an untrained net guesses nearly uniformly")
	assert.Less(t, last, float64(losses[0])/2)

	text := out.String()
	assert.Regexp(t, `(?m)^device: (cpu|cuda): `, text)
	assert.Regexp(t, `(?m)^training graph: \d+ nodes; sum of tensor sizes \(not a peak\): \d+ B fixed \+ \d+ B per image`, text)
	assert.Len(t, regexp.MustCompile(`(?m)^step +\d+  loss \d+\.\d+$`).FindAllString(text, -1), 11, "step 1 and every fourth step:\n%s", text)
}

func TestRunRejectsBadOptions(t *testing.T) {
	good := options{steps: 1, batch: 2, size: 8, seed: 1, lr: 1e-3}
	for name, edit := range map[string]func(*options){
		"zero batch":          func(o *options) { o.batch = 0 },
		"size not a multiple": func(o *options) { o.size = 10 },
		"zero size":           func(o *options) { o.size = 0 },
		"zero lr":             func(o *options) { o.lr = 0 },
		"negative steps":      func(o *options) { o.steps = -1 },
	} {
		o := good
		edit(&o)
		_, err := run(io.Discard, o)
		assert.Error(t, err, name)
	}
	_, err := run(io.Discard, good)
	assert.NoError(t, err)
}

// TestStripes checks the generator: shapes, all four classes present, and
// pixel statistics (mean near 0; variance near colour²/2 + noise², which
// lies in [0.125, 0.5] + 0.25, so the empirical value must fall in
// [0.35, 0.8] with room for sampling error over 16·3·256 pixels).
func TestStripes(t *testing.T) {
	images, labels := stripes(1, 0, 16, 16)
	assert.Equal(t, []int{16, channels, 16, 16}, []int(images.Shape()))
	seen := map[int64]bool{}
	for _, c := range labels.Data().([]int64) {
		require.True(t, c >= 0 && c < classes)
		seen[c] = true
	}
	assert.Len(t, seen, classes)
	var sum, sq float64
	px := images.Data().([]float32)
	for _, v := range px {
		sum += float64(v)
		sq += float64(v) * float64(v)
	}
	mean := sum / float64(len(px))
	assert.InDelta(t, 0, mean, 0.05)
	assert.InDelta(t, 0.575, sq/float64(len(px))-mean*mean, 0.225)
	again, _ := stripes(1, 0, 16, 16)
	assert.Equal(t, px, again.Data().([]float32), "the same seed and step draw the same images")
}
