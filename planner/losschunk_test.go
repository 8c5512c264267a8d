package planner_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/planner"
)

// The candidates are the powers of two from 8192 down to 256, none larger
// than the first that holds every row.
func TestLossChunkCandidates(t *testing.T) {
	assert.Equal(t, []int{8192, 4096, 2048, 1024, 512, 256}, planner.LossChunkCandidates(1<<20))
	assert.Equal(t, []int{8192, 4096, 2048, 1024, 512, 256}, planner.LossChunkCandidates(8192))
	assert.Equal(t, []int{1024, 512, 256}, planner.LossChunkCandidates(1024))
	assert.Equal(t, []int{1024, 512, 256}, planner.LossChunkCandidates(1000))
	assert.Equal(t, []int{256}, planner.LossChunkCandidates(100))
}

// ChooseLossChunk: unbounded, the largest candidate; within a budget, the
// largest that fits in as few batch chunks as the smallest does; the
// smallest with its error when even it does not fit; any other error of a
// plan ends the search.
func TestChooseLossChunk(t *testing.T) {
	// plans: the batch chunks at each token chunk, 0 for does not fit.
	type c struct {
		unbounded bool
		plans     map[int]int
		want      int
		tried     []int
		fails     bool
	}
	for _, tc := range []c{
		{true, map[int]int{4096: 1}, 4096, []int{4096}, false},
		{false, map[int]int{4096: 1, 2048: 1, 1024: 1, 512: 1, 256: 1}, 4096, []int{256, 4096}, false},
		{false, map[int]int{4096: 0, 2048: 2, 1024: 1, 512: 1, 256: 1}, 1024, []int{256, 4096, 2048, 1024}, false},
		{false, map[int]int{4096: 2, 2048: 2, 1024: 2, 512: 2, 256: 2}, 4096, []int{256, 4096}, false},
		{false, map[int]int{256: 0}, 256, []int{256}, true},
		{false, map[int]int{256: 1}, 256, []int{256, 4096, 2048, 1024, 512}, false},
	} {
		var tried []int
		got, pl, err := planner.ChooseLossChunk(4096, tc.unbounded, func(t int) (*planner.Plan, error) {
			tried = append(tried, t)
			k := tc.plans[t]
			if k == 0 {
				return nil, &planner.DoesNotFitError{Chunk: 1}
			}
			return &planner.Plan{Split: planner.Split{N: 8, K: k}}, nil
		})
		assert.Equal(t, tc.want, got, "%v", tc.plans)
		assert.Equal(t, tc.tried, tried, "%v", tc.plans)
		if tc.fails {
			require.ErrorIs(t, err, planner.ErrDoesNotFit)
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, tc.plans[got], pl.Split.K)
	}
	boom := errors.New("boom")
	_, _, err := planner.ChooseLossChunk(4096, false, func(t int) (*planner.Plan, error) {
		if t == 256 {
			return &planner.Plan{Split: planner.Split{N: 8, K: 1}}, nil
		}
		return nil, boom
	})
	require.ErrorIs(t, err, boom)
}
