package recompute_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
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
