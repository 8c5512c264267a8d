package recompute_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

func TestCandidatesGPT2(t *testing.T) {
	st := gptStep(t, models.GPT2Small(), 2, 1024)
	blocks := recompute.Blocks(st.Graph, st.Boundary)
	require.Len(t, blocks, 12)
	assert.Equal(t, "h.0", blocks[0].Scope)
	for _, c := range []string{"none", "selective", "blocks 3/12", "blocks 6/12", "blocks 9/12", "blocks 12/12", "blocks 12/12+selective"} {
		_ = c
	}
	res, err := recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: 8 * gib}, PlanAll: true})
	require.NoError(t, err)
	for _, c := range res.All {
		t.Logf("%-24s copies %4d chunks %v peak %v time %.3f ms err %v", c.Name, c.Copies, splitOf(c), peakOf(c), c.Time*1e3, c.Err)
	}
}

func splitOf(c *recompute.Choice) string {
	if c.Plan == nil {
		return "-"
	}
	return c.Plan.Split.String()
}

func peakOf(c *recompute.Choice) string {
	if c.Plan == nil {
		return "-"
	}
	return fmt.Sprint(c.Plan.PeakReserved >> 20)
}
