package cuda

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// The workspace Workspace declares for a channels-last convolution holds
// what convThroughNCHW lays out in it, at every chunk size and in every
// dtype: the three NCHW copies, each on a 256-byte boundary, then the
// NCHW path's im2col workspace (which it needs when cuDNN is absent).
// Shapes whose byte counts are no multiple of 256 make the alignment
// count.
func TestChannelsLastCopiesFitWorkspace(t *testing.T) {
	cases := []struct {
		name string
		x, w []int // NCHW, [O, C/g, kh, kw]
		a    graph.Attrs
	}{
		{"depthwise", []int{5, 32, 15, 15}, []int{32, 1, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 32}},
		{"stem_odd", []int{3, 3, 17, 13}, []int{7, 3, 7, 7}, graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{3, 3}, Groups: 1}},
		{"1x1", []int{4, 5, 3, 3}, []int{3, 5, 1, 1}, graph.Attrs{Stride: [2]int{1, 1}, Groups: 1}},
		{"grouped_dilated", []int{2, 16, 15, 13}, []int{24, 4, 3, 3}, graph.Attrs{Stride: [2]int{1, 2}, Padding: [2]int{2, 2}, Dilation: [2]int{2, 2}, Groups: 4}},
	}
	toNHWC := func(s []int) []int { return graph.ToNHWC(graph.Type{Shape: s, BatchAxis: -1}).Shape }
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/%s", dt, c.name), func(t *testing.T) {
				g := graph.New()
				add := func(n graph.Node) int {
					id, err := g.Append(n)
					require.NoError(t, err)
					return id
				}
				a := c.a
				a.ChannelsLast = true
				x := add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: toNHWC(c.x), DType: dt, BatchAxis: 0}})
				w := add(graph.Node{Op: graph.OpParam, Name: "w", Type: graph.Type{Shape: toNHWC(c.w), DType: dt}})
				y := add(graph.Node{Op: graph.OpConv2d, Inputs: []int{x, w}, Attrs: a})
				gy := add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: g.Node(y).Type.Shape, DType: dt, BatchAxis: 0}})
				gi, gw := a, a
				gi.Target = g.Node(x).Type
				gw.Target = graph.Type{Shape: toNHWC(c.w), DType: dt, BatchAxis: -1, PerSample: 1}
				dx := add(graph.Node{Op: graph.OpConv2dGradInput, Inputs: []int{gy, w}, Attrs: gi})
				dw := add(graph.Node{Op: graph.OpConv2dGradWeight, Inputs: []int{gy, x}, Attrs: gw})
				for _, id := range []int{y, dx, dw} {
					nd := g.Node(id)
					for b := 1; b <= c.x[0]; b++ {
						nx, ny := int64(graph.Numel(g.Node(x).Type.AtBatch(b))), int64(graph.Numel(g.Node(y).Type.AtBatch(b)))
						_, _, _, rest := nchwCopyLayout(nx, ny, int64(graph.Numel(c.w)), elemSize(dt))
						need := rest + im2colBytes(g, nd)
						require.GreaterOrEqual(t, Workspace(g, nd, b), need, "%s at %d images", nd.Op, b)
					}
				}
			})
		}
	}
}
