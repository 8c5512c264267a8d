package main

import (
	"io"
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// The README's program runs as a reader would run it: ten steps whose loss
// falls (from about ln 4 to below half of it), then a plan line whose
// predicted peak equals the measured one. The budget splits the batch on
// the CPU (the whole batch needs more than 64 MiB); on CUDA the
// plan's chunks differ, and the same lines hold.
func TestQuickstart(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	stdout := os.Stdout
	os.Stdout = w
	done := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		done <- b
	}()
	main()
	os.Stdout = stdout
	require.NoError(t, w.Close())
	out := string(<-done)

	losses := regexp.MustCompile(`(?m)^step +\d+  loss (\S+)$`).FindAllStringSubmatch(out, -1)
	require.Len(t, losses, 10, out)
	first, err := strconv.ParseFloat(losses[0][1], 64)
	require.NoError(t, err)
	last, err := strconv.ParseFloat(losses[9][1], 64)
	require.NoError(t, err)
	require.InDelta(t, 1.386, first, 0.2, "about ln 4 at initialisation")
	require.Less(t, last, first/2, out)

	plan := regexp.MustCompile(`(?m)^batch 16384 as (.+) chunks, peak (.+) predicted, (.+) measured$`).FindStringSubmatch(out)
	require.Len(t, plan, 4, out)
	require.Equal(t, plan[2], plan[3], "predicted = measured")
	require.NotEqual(t, "1 × 16384", plan[1], "the budget splits the batch")
}
