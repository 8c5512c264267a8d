package batchfit_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// A TraceEntries out of range is the session's error, wrapping
// alloc.ErrInvalid, returned by Err and every run; it used to panic in
// NewSession making a trace buffer of that capacity.
func TestNewSessionTraceEntriesOutOfRange(t *testing.T) {
	for _, n := range []int{math.MaxInt, alloc.MaxTraceEntries + 1, -1} {
		var s *batchfit.Session
		require.NotPanics(t, func() { s = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, TraceEntries: n}) }, n)
		assert.ErrorIs(t, s.Err(), alloc.ErrInvalid, n)
		_, err := s.Eval(context.Background(), lazy.Placeholder([]int{2, 3}, graph.Float32, 0).Sum())
		assert.ErrorIs(t, err, alloc.ErrInvalid, n)
		assert.NoError(t, s.Close())
	}
	s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, TraceEntries: alloc.MaxTraceEntries})
	assert.NoError(t, s.Err())
}
