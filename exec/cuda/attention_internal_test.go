package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// The attention kernels are loaded in all three storage types, and the
// mask's dtype travels as its position in floatDTypes.
func TestAttentionTyped(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelFiles["attention.cu"] {
		loaded[n] = true
	}
	for _, dt := range floatDTypes {
		for _, k := range []string{kAttentionFwd, kAttentionGradQ, kAttentionGradKV} {
			require.True(t, loaded[typed(k, dt)], typed(k, dt))
		}
	}
	for i, dt := range floatDTypes {
		code, err := attnMaskCode(graph.OpAttention, &operand{shape: []int{2, 3}, dt: dt})
		require.NoError(t, err)
		require.Equal(t, int64(i), code)
	}
	code, err := attnMaskCode(graph.OpAttention, nil)
	require.NoError(t, err)
	require.Zero(t, code)
	_, err = attnMaskCode(graph.OpAttention, &operand{shape: []int{2, 3}, dt: graph.Int64})
	require.ErrorIs(t, err, graph.ErrDType)
}
