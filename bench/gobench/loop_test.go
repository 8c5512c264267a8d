package main

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeLoop is a stepLoop whose steps sleep d and log their loop's name
// and step index.
func fakeLoop(name string, d time.Duration, log *[]string, failAt int) *stepLoop {
	l := &stepLoop{r: &Record{Kind: name}, close: func() {}}
	l.step = func(i int) error {
		if i == failAt {
			return errors.New("step failed")
		}
		*log = append(*log, name+string(rune('0'+i)))
		time.Sleep(d)
		return nil
	}
	l.end = func() error { l.r.setRates(1); return nil }
	return l
}

// runInterleaved warms both loops up, then alternates their timed steps
// in blocks, times every step once, and gives the slower loop's record
// its paired ratio above 1.
func TestRunInterleavedAlternatesBlocks(t *testing.T) {
	var log []string
	a, b := fakeLoop("a", time.Millisecond, &log, -1), fakeLoop("b", 4*time.Millisecond, &log, -1)
	c := config{warmup: 2, steps: 5}
	require.NoError(t, runInterleaved(a, b, c, 2))
	assert.Equal(t, []string{"a0", "a1", "b0", "b1", "a2", "a3", "b2", "b3", "a4", "a5", "b4", "b5", "a6", "b6"}, log)
	assert.Len(t, a.r.StepSeconds, 5)
	assert.Len(t, b.r.StepSeconds, 5)
	assert.Equal(t, 2, b.r.Interleave)
	assert.Greater(t, b.r.OverPaired, 1.0, "b's steps sleep four times as long")
	assert.Zero(t, a.r.OverPaired)
	assert.Positive(t, a.r.MedianStepSeconds)

	// A failing step stops the loops with its error.
	log = nil
	a, b = fakeLoop("a", 0, &log, -1), fakeLoop("b", 0, &log, 4)
	assert.Error(t, runInterleaved(a, b, c, 2))
	assert.Equal(t, []string{"a0", "a1", "b0", "b1", "a2", "a3", "b2", "b3", "a4", "a5"}, log)
}

// runLoop runs the warm-up untimed and times each timed step.
func TestRunLoopTimesTimedSteps(t *testing.T) {
	var log []string
	l := fakeLoop("a", 0, &log, -1)
	require.NoError(t, runLoop(l, config{warmup: 3, steps: 4}))
	assert.Len(t, log, 7)
	assert.Len(t, l.r.StepSeconds, 4)
}
