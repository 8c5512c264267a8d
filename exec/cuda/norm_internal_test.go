package cuda

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
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
