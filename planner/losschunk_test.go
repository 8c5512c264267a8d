package planner_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

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
