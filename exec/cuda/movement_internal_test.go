package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
)

// Movement kernels go by element size: bfloat16 and float16 share _b16,
// and every name moving gives is loaded with movement.cu.
func TestMovingKernelNames(t *testing.T) {
	for dt, want := range map[graph.DType]string{graph.Float32: "copy2d_f32", graph.BFloat16: "copy2d_b16",
		graph.Float16: "copy2d_b16", graph.Int64: "copy2d_i64"} {
		got, err := moving(kCopy2d, dt)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err := moving(kCopy, graph.InvalidDType)
	require.ErrorIs(t, err, graph.ErrDType)

	loaded := map[string]bool{}
	for _, n := range kernelFiles["movement.cu"] {
		loaded[n] = true
	}
	for _, n := range []string{kCopy, kGather, kGatherRows, kTranspose, kSlice, kCopy2d} {
		for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16, graph.Int64} {
			name, err := moving(n, dt)
			require.NoError(t, err)
			require.True(t, loaded[name], name)
		}
	}
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		name, err := moving(kSliceGrad, dt)
		require.NoError(t, err)
		require.True(t, loaded[name], name)
	}
}

// 16-bit gradients that sum in float32 take their sums from the
// workspace: embedding_grad after its flag, conv2d_grad_weight after its
// patches and regrouped gradient (each 256-byte aligned); float32 ones sum
// into the output.
func TestHalfSumsWorkspace(t *testing.T) {
	require.Equal(t, int64(flagBytes), embeddingGradWorkspace(graph.Float32, 60))
	require.Equal(t, int64(sumsOffset+4*60), embeddingGradWorkspace(graph.BFloat16, 60))

	// dW [8, 3, 3, 3] from g [4, 8, 5, 5]: per image 27·25 patch and 8·25
	// gradient elements; all 4 images fit one tile.
	w, y := []int{8, 3, 3, 3}, []int{4, 8, 5, 5}
	f32 := newGradWeightLayout(w, y, 4, 1, graph.Float32)
	require.Equal(t, gradWeightLayout{tile: 4, gradAt: align256(4 * 27 * 25 * 4), sumsAt: align256(align256(4*27*25*4) + 4*8*25*4)}, gradWeightLayout{tile: f32.tile, gradAt: f32.gradAt, sumsAt: f32.sumsAt})
	require.Equal(t, f32.sumsAt, f32.bytes, "float32 sums into the output")
	bf := newGradWeightLayout(w, y, 4, 1, graph.BFloat16)
	require.Equal(t, align256(4*27*25*2), bf.gradAt, "16-bit patches take half the bytes")
	require.Equal(t, bf.sumsAt+4*8*27, bf.bytes, "then the float32 sums of the 216 weights")
	// Two groups: each GEMM covers one group's 4 output channels.
	g2 := newGradWeightLayout([]int{8, 3, 3, 3}, y, 4, 2, graph.Float32)
	require.Equal(t, align256(f32.gradAt+4*4*25*4), g2.sumsAt)
	// A tile is bounded by 64 MiB of both matrices.
	big := newGradWeightLayout([]int{64, 64, 3, 3}, []int{4096, 64, 32, 32}, 4096, 1, graph.Float32)
	require.Equal(t, int64(convColCap/(4*(576+64)*1024)), big.tile)

	// conv2d's patches are copies of values: 16-bit ones take half the bytes.
	a := &graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}}
	require.Equal(t, 4*int64(3*9*25), convColBytes(w, y, 4, a, 4)/4)
	require.Equal(t, convColBytes(w, y, 4, a, 4), 2*convColBytes(w, y, 4, a, 2))
}
