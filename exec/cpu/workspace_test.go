package cpu_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// TestWorkspace checks the declared im2col scratch against sizes worked out
// by hand: a 3×3 convolution of 5 channels over 8×8 with padding 1 unfolds
// [5·3·3, 8·8] elements; a plain 1×1 convolution needs none.
func TestWorkspace(t *testing.T) {
	for _, dt := range []graph.DType{graph.Float32, graph.Float16} {
		x := lazy.Placeholder([]int{2, 5, 8, 8}, dt, 0)
		w := lazy.ParamSpec([]int{4, 5, 3, 3}, dt, "w")
		y := x.Conv2d(w, nil, lazy.ConvOptions{Padding: [2]int{1, 1}})
		w1 := lazy.ParamSpec([]int{4, 5, 1, 1}, dt, "w1")
		y1 := x.Conv2d(w1, nil, lazy.ConvOptions{})
		require.NoError(t, y.Err())
		require.NoError(t, y1.Err())
		g := x.Graph().IR()
		want := int64(5*3*3) * 8 * 8 * int64(dt.Size())
		assert.Equal(t, want, cpu.Workspace(g, g.Node(y.ID()), 2), dt.String())
		assert.Equal(t, int64(0), cpu.Workspace(g, g.Node(y1.ID()), 2), dt.String())
	}
}
