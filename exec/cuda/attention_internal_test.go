package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
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

// The tensor-core forward takes 16-bit values at head dim 64 or 128, with
// no mask and 16-byte aligned arrays; anything else runs on the plain-FMA
// kernels.
func TestAttentionMMAChoice(t *testing.T) {
	mask := &operand{shape: []int{4, 4}, dt: graph.BFloat16}
	for _, c := range []struct {
		dt   graph.DType
		d    int
		mask *operand
		p    alloc.Ptr
		want bool
	}{
		{graph.BFloat16, 64, nil, 256, true},
		{graph.Float16, 128, nil, 4096, true},
		{graph.Float32, 64, nil, 256, false},
		{graph.BFloat16, 32, nil, 256, false},
		{graph.BFloat16, 96, nil, 256, false},
		{graph.BFloat16, 64, mask, 256, false},
		{graph.Float16, 64, nil, 264, false},
	} {
		require.Equal(t, c.want, attnMMA(c.dt, c.d, c.mask, 0, c.p), "%s d=%d mask=%v ptr=%d", c.dt, c.d, c.mask != nil, c.p)
	}
	loaded := map[string]bool{}
	for _, n := range kernelFiles["attention.cu"] {
		loaded[n] = true
	}
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, d := range []int{64, 128} {
			require.True(t, loaded[attnMMAKernel(d, dt)], attnMMAKernel(d, dt))
		}
	}
}
