package shapeinfer

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// A batch of one broadcast against a longer axis: the output axis has size 2
// at the full batch, so it cannot claim Shape[axis] = Batch·PerSample = 1.
func TestBinaryBatchOfOneBroadcast(t *testing.T) {
	x := graph.Type{Shape: []int{1, 3, 1}, DType: graph.Float32, BatchAxis: 0, PerSample: 1}
	y := graph.Type{Shape: []int{2, 1, 4}, DType: graph.Float32, BatchAxis: -1, PerSample: 1}
	got, err := Rule(graph.OpAdd, &graph.Attrs{}, []graph.Type{x, y}, 1)
	require.NoError(t, err)
	require.Equal(t, []int{2, 3, 4}, got.Shape)
	require.Equal(t, -1, got.BatchAxis)

	// The batch axis survives where the other operand broadcasts instead.
	y.Shape = []int{1, 1, 4}
	got, err = Rule(graph.OpAdd, &graph.Attrs{}, []graph.Type{x, y}, 1)
	require.NoError(t, err)
	require.Equal(t, 0, got.BatchAxis)
}
