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

// TestOffloadSecondsArePriced: an offloaded optimizer's step copies 2
// bytes a parameter down, then updates on the host while copying 2 bytes
// a parameter back, the slower of the two counting; a profile without
// host figures prices it at the nominal ones.
func TestOffloadSecondsArePriced(t *testing.T) {
	p := recompute.Profile{HostBandwidth: 1e9, HostUpdateRate: 1e8}
	assert.InDelta(t, 2e6/1e9+1e6/1e8, p.OffloadSeconds(1e6), 1e-12, "update bound")
	p.HostUpdateRate = 1e10
	assert.InDelta(t, 2e6/1e9+2e6/1e9, p.OffloadSeconds(1e6), 1e-12, "upload bound")
	nominal := recompute.Profile{}
	assert.InDelta(t, 2e6/recompute.NominalHostBandwidth+max(1e6/recompute.NominalHostUpdateRate, 2e6/recompute.NominalHostBandwidth),
		nominal.OffloadSeconds(1e6), 1e-12)
	require.Error(t, recompute.Profile{Name: "x", MatMulFLOPS: 1e12, VectorFLOPS: 1e12, Bandwidth: 1e11, HostUpdateRate: 1e-3}.Validate(),
		"a host update rate outside the plausible bounds")
}

// TestLossChunkLaunchesArePriced: a fused loss over 1,024 token rows in
// chunks of t launches its kernels ⌈1024/t⌉ times, the first with the
// node's own launch: with 1 s launches and a free memory system, halving
// the chunk from 1,024 to 512 adds one chunk's launches (3 without the
// gradients in its pass: a loss evaluated alone).
func TestLossChunkLaunchesArePriced(t *testing.T) {
	chunk := func(t0 int) float64 {
		h := lazy.Placeholder([]int{1024, 16}, graph.Float32, 0)
		w := lazy.ParamSpec([]int{40, 16}, graph.Float32, "w")
		labels := h.Graph().Placeholder([]int{1024}, graph.Int64, 0)
		loss := h.LinearCrossEntropyWith(w, labels, graph.ReduceMean, lazy.LinearCrossEntropyOptions{Chunk: t0})
		st := stepOf(t, loss, nil, 0, nil)
		c, err := recompute.Build(st, "none", nil)
		require.NoError(t, err)
		p := recompute.H100Profile()
		p.Bandwidth, p.HostBandwidth, p.Launch = math.Inf(1), 0, 1
		p.MatMulFLOPS, p.VectorFLOPS = math.Inf(1), math.Inf(1)
		return recompute.NewCost(c.Program, p, false).Chunk(1024)
	}
	whole, halves, quarters := chunk(1024), chunk(512), chunk(256)
	assert.InDelta(t, float64(recompute.LossChunkLaunches), halves-whole, 1e-9)
	assert.InDelta(t, 3*float64(recompute.LossChunkLaunches), quarters-whole, 1e-9)
}

// The H200's built-in profile is valid, named apart from the H100's, and
// faster where the H200 was measured: 16-bit GEMMs, attention and memory.
func TestH200Profile(t *testing.T) {
	p, err := recompute.LoadProfile("h200")
	require.NoError(t, err)
	require.NoError(t, p.Validate())
	h := recompute.H100Profile()
	assert.NotEqual(t, h.Name, p.Name)
	assert.Greater(t, p.HalfFLOPS, h.HalfFLOPS)
	assert.Greater(t, p.HalfAttentionFLOPS, h.HalfAttentionFLOPS)
	assert.Greater(t, p.Bandwidth, h.Bandwidth)
	for k := range h.Sources {
		assert.NotEmpty(t, p.Sources[k], "source of %s", k)
	}
}
