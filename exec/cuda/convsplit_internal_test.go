package cuda

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// TestConvSlice checks the slices a convolution runs on cuDNN in
// (convsplit.go) at the real limit, for the shapes that failed on the
// H100 (ResNet-50's stem at batch 4096, the ConvNet's first convolution
// at 366,762), and at lowered limits, where the slice must start every
// slice's x and y on a 16-byte boundary.
func TestConvSlice(t *testing.T) {
	key := func(dt graph.DType, x, w, y [4]int64) convKey {
		return convKey{pass: convForward, dt: dt, x: x, w: w, y: y, groups: 1}
	}
	stem := func(n int64) convKey {
		return key(graph.Float32, [4]int64{n, 3, 224, 224}, [4]int64{64, 3, 7, 7}, [4]int64{n, 64, 112, 112})
	}
	// 2³¹ − 1 elements hold 2,674 images of 64·112·112.
	require.Equal(t, int64(2674), convSlice(stem(2674)))
	require.Equal(t, int64(2674), convSlice(stem(2675)))
	require.Equal(t, int64(2674), convSlice(stem(4096)))
	require.Equal(t, int64(1000), convSlice(stem(1000)))
	require.Equal(t, []int64{2674, 1422}, sliceSizes(4096, 2674))
	convnet := key(graph.BFloat16, [4]int64{366762, 3, 32, 32}, [4]int64{32, 3, 3, 3}, [4]int64{366762, 32, 32, 32})
	require.Equal(t, int64(65535), convSlice(convnet)) // ⌊(2³¹ − 1)/32768⌋
	require.Equal(t, []int64{65535, 39087}, sliceSizes(366762, 65535))
	require.Equal(t, []int64{4}, sliceSizes(8, 4))
	require.Equal(t, []int64{3}, sliceSizes(3, 4))

	// Nothing to describe: no image, an image or a weight over the limit.
	require.Zero(t, convSlice(stem(0)))
	require.Zero(t, convSlice(key(graph.Float32, [4]int64{2, 1, 50000, 50000}, [4]int64{1, 1, 1, 1}, [4]int64{2, 1, 50000, 50000})))
	require.Zero(t, convSlice(key(graph.Float32, [4]int64{2, 65536, 1, 1}, [4]int64{65536, 65536, 1, 1}, [4]int64{2, 65536, 1, 1})))

	defer cudnnMaxElems.Store(cudnnMaxElems.Load())
	// x [N, 3, 7, 7] (147 elements), y [N, 4, 7, 7] (196): bfloat16 slices
	// must be multiples of 8 images (294 bytes an image of x), float32
	// ones of 4 (588).
	odd := func(dt graph.DType, n int64) convKey {
		return key(dt, [4]int64{n, 3, 7, 7}, [4]int64{4, 3, 3, 3}, [4]int64{n, 4, 7, 7})
	}
	for _, c := range []struct {
		dt       graph.DType
		lim, n   int64
		want     int64
		wantPlan []int64
	}{
		{graph.BFloat16, 196 * 12, 20, 8, []int64{8, 4}},
		{graph.Float32, 196 * 12, 20, 12, []int64{12, 8}},
		{graph.BFloat16, 196 * 12, 12, 12, []int64{12}}, // whole: no alignment needed
		{graph.BFloat16, 196 * 7, 20, 0, nil},           // 7 images, no multiple of 8
		{graph.Float32, 196 * 7, 20, 4, []int64{4}},
	} {
		cudnnMaxElems.Store(c.lim)
		k := odd(c.dt, c.n)
		s := convSlice(k)
		require.Equal(t, c.want, s, "%s limit %d, %d images", c.dt, c.lim, c.n)
		if s == 0 {
			continue
		}
		size := elemSize(c.dt)
		require.LessOrEqual(t, s*k.y[1]*k.y[2]*k.y[3], c.lim)
		if s < c.n { // slices after the first start s images on
			require.Zero(t, s*k.x[1]*k.x[2]*k.x[3]*size%16)
			require.Zero(t, s*k.y[1]*k.y[2]*k.y[3]*size%16)
		}
		require.Equal(t, c.wantPlan, sliceSizes(c.n, s))
	}
}

// TestNewWindowPlaneLimit: planes beyond the kernels' 32-bit in-plane
// arithmetic are a shape error, not a wrong result.
func TestNewWindowPlaneLimit(t *testing.T) {
	a := graph.Attrs{Stride: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}
	_, err := newWindow("conv2d", []int{1, 1, 1 << 16, 1 << 16}, []int{1, 1, 1 << 16, 1 << 16}, 1, 1, &a, 1)
	require.ErrorIs(t, err, graph.ErrShape)
	side := int(math.Sqrt(math.MaxInt32))
	_, err = newWindow("conv2d", []int{1, 1, side, side}, []int{1, 1, side, side}, 1, 1, &a, 1)
	require.NoError(t, err)
}
