package cuda

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// The fused layer norm pass's launch geometry keeps the kernel's
// preconditions (bx a multiple of 32, d ≤ LN_FUSED_VPT·bx, bx·by ≤ 256,
// its launch bound), and the groups a chunk runs in on any device fit the
// workspace planned from the full batch.
func TestLayerNormFusedGeometry(t *testing.T) {
	for _, d := range []int64{1, 5, 32, 96, 129, 256, 257, 768, 769, 1024, 1600, 2048} {
		is := assert.New(t)
		b := lnFusedBlock(d)
		bx, by := int64(b[0]), int64(b[1])
		is.Zero(bx%32, "d %d", d)
		is.LessOrEqual(d, lnFusedVPT*bx, "d %d", d)
		is.LessOrEqual(bx*by, int64(256), "d %d", d)
		is.True(lnFusedFits(d))
		for _, full := range []int64{1, 7, 100, 8192, 1 << 20} {
			ws := lnFusedBytes(lnFusedGroupsBound(full, d), d)
			for _, rows := range []int64{1, full / 3, full} {
				for _, resident := range []int64{1, 132 * 6, 132 * 32, math.MaxInt64} {
					grid, groups := lnFusedGroups(max(rows, 1), d, resident)
					what := fmt.Sprintf("d %d, rows %d of %d, resident %d", d, rows, full, resident)
					is.GreaterOrEqual(grid, int64(1), what)
					is.LessOrEqual(grid, max(resident, 1), what)
					is.Equal(grid*by, groups, what)
					is.LessOrEqual(lnFusedBytes(groups, d), ws, what)
				}
			}
		}
	}
	assert.False(t, lnFusedFits(0))
	assert.False(t, lnFusedFits(lnFusedMaxD+1))
}

// lnFusedGroupsBound is the groups lnFusedWorkspace plans for.
func lnFusedGroupsBound(rows, d int64) int64 {
	_, groups := lnFusedGroups(rows, d, math.MaxInt64)
	return groups
}

// The channels-last batch norm's vector path: its geometry keeps the
// kernels' preconditions (a block of bnVecBlock threads, bx a power of two
// ≤ 32 covering the groups or a tile of 32, every group in a tile), and
// the row chunks of every chunk size fit the workspace's bound, which is
// affine in the images and never below the scalar path's n rows.
func TestBatchNormVecGeometry(t *testing.T) {
	_, ok := bnVecGeometry(graph.BFloat16, 5)
	assert.False(t, ok, "c not a multiple of 8")
	_, ok = bnVecGeometry(graph.Float32, 6)
	assert.False(t, ok, "c not a multiple of 4")
	_, ok = bnVecGeometry(graph.Int64, 64)
	assert.False(t, ok, "not a float")
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		for _, c := range []int64{4, 8, 12, 24, 64, 256, 520, 1024, 2048, 4096} {
			q, ok := bnVecGeometry(dt, c)
			if c%(16/int64(dt.Size())) != 0 {
				assert.False(t, ok, "%s c %d", dt, c)
				continue
			}
			require.True(t, ok, "%s c %d", dt, c)
			what := fmt.Sprintf("%s c %d", dt, c)
			assert.Equal(t, c, q.v*q.groups, what)
			assert.Equal(t, int64(bnVecBlock), q.bx*q.by, what)
			assert.Zero(t, q.bx&(q.bx-1), what)
			assert.LessOrEqual(t, q.bx, int64(32), what)
			assert.GreaterOrEqual(t, q.bx*q.tiles, q.groups, what)
			assert.Less(t, q.bx*(q.tiles-1), q.groups, what)
			for _, hw := range []int64{1, 7, 49, 196, 784, 3136, 12544} {
				b0, b1 := q.rowsBound(0, hw), q.rowsBound(1, hw)
				for _, n := range []int64{0, 1, 2, 3, 8, 17, 64, 256} {
					p := n * hw
					w := fmt.Sprintf("%s, hw %d, n %d", what, hw, n)
					ppt := q.ppt(p)
					assert.GreaterOrEqual(t, ppt, int64(1), w)
					assert.LessOrEqual(t, ppt, int64(bnVecPPT), w)
					assert.LessOrEqual(t, q.rows(p), q.rowsBound(n, hw), w)
					assert.Equal(t, b0+n*(b1-b0), q.rowsBound(n, hw), w+": affine")
					assert.GreaterOrEqual(t, q.rowsBound(n, hw), n, w+": the scalar path's rows")
					assert.GreaterOrEqual(t, q.rows(p)*q.by*ppt, p, w+": the chunks cover every position")
				}
			}
		}
	}
	// Enough blocks to fill the device where there are positions for them:
	// [64, 56, 56, 64] and [64, 7, 7, 2048] in bfloat16.
	q, _ := bnVecGeometry(graph.BFloat16, 64)
	assert.GreaterOrEqual(t, q.rows(64*3136)*q.tiles, int64(132))
	q, _ = bnVecGeometry(graph.BFloat16, 2048)
	assert.GreaterOrEqual(t, q.rows(64*49)*q.tiles, int64(132))
}
