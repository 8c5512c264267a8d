package recompute_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// TestInputUploadIsPriced: each chunk uploads its rows of every input at
// HostBandwidth (here 1 GB/s: x is [n, 256] float32, 1 KiB a row), and a
// profile without a host bandwidth leaves the upload out.
func TestInputUploadIsPriced(t *testing.T) {
	x := lazy.Placeholder([]int{64, 256}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{256}, graph.Float32, "w")
	st := stepOf(t, x.Mul(w).Sum(), []*lazy.Tensor{w}, 0, nil)
	c, err := recompute.Build(st, "none", nil)
	require.NoError(t, err)
	p := recompute.H100Profile()
	p.HostBandwidth = 0
	without := recompute.NewCost(c.Program, p, false)
	p.HostBandwidth = 1e9
	with := recompute.NewCost(c.Program, p, false)
	assert.InDelta(t, 32*1024/1e9, with.Chunk(32)-without.Chunk(32), 1e-12, "32 rows of 1 KiB at 1 GB/s")
}

// TestUpdateLaunchesArePriced: the optimizer's update pays one launch per
// UpdateTensors parameters (the device kernels' lists), not one per
// parameter: with a free memory system and 1 s launches, a one-chunk step
// costs its chunk plus ⌈trained/64⌉ seconds.
func TestUpdateLaunchesArePriced(t *testing.T) {
	for _, c := range []struct{ trained, launches int }{{1, 1}, {64, 1}, {65, 2}, {150, 3}} {
		x := lazy.Placeholder([]int{8, 4}, graph.Float32, 0)
		var loss *lazy.Tensor
		var params []*lazy.Tensor
		for i := range c.trained {
			w := lazy.ParamSpec([]int{4}, graph.Float32, fmt.Sprintf("w%d", i))
			params = append(params, w)
			if term := x.Mul(w).Sum(); loss == nil {
				loss = term
			} else {
				loss = loss.Add(term)
			}
		}
		st := stepOf(t, loss, params, 2, nil)
		b, err := recompute.Build(st, "none", nil)
		require.NoError(t, err)
		require.Len(t, b.Program.Trained, c.trained)
		p := recompute.H100Profile()
		p.Bandwidth, p.HostBandwidth, p.Launch = math.Inf(1), 0, 1
		cost := recompute.NewCost(b.Program, p, false)
		assert.Equal(t, c.launches, recompute.UpdateLaunches(c.trained))
		assert.InDelta(t, float64(c.launches), cost.Step(planner.Split{N: 8, K: 1})-cost.Chunk(8), 1e-9, "%d parameters", c.trained)
	}
}
