package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
)

// Kernels instantiated per float storage type are named by typed, as
// kernels/common.cuh's FOR_FLOATS and MIXED_FLOATS name them.
func TestTypedKernelNames(t *testing.T) {
	require.Equal(t, "unary_f32", typed(kUnary, graph.Float32))
	require.Equal(t, "unary_bf16", typed(kUnary, graph.BFloat16))
	require.Equal(t, "unary_f16", typed(kUnary, graph.Float16))
	require.Equal(t, "binary_f32_bf16", typed(kBinary, graph.Float32, graph.BFloat16))
	require.Equal(t, []string{"relu_grad_f32", "relu_grad_bf16", "relu_grad_f16"}, allTyped(kReluGrad))
	require.Equal(t, "cast_bf16_f32", castKernel(graph.BFloat16, graph.Float32))
	require.Len(t, castKernels(), 9)
	require.Equal(t, int64(4), perPack(graph.Float32))
	require.Equal(t, int64(8), perPack(graph.BFloat16))
	require.Equal(t, int64(4), perPack(graph.BFloat16, graph.Float32))
}

// Operands of two float dtypes into float32 (graph.Promote) run on the
// promoting binary kernels; anything else is an error naming the dtypes.
func TestMixedDTypesTyped(t *testing.T) {
	f32 := operand{shape: []int{2, 3}, dt: graph.Float32}
	bf := operand{shape: []int{2, 3}, dt: graph.BFloat16}
	f16 := operand{shape: []int{2, 3}, dt: graph.Float16}
	i64 := operand{shape: []int{2, 3}, dt: graph.Int64}

	dt, err := floatsOf(bf, bf)
	require.NoError(t, err)
	require.Equal(t, graph.BFloat16, dt)
	for _, ops := range [][]operand{{f32, bf}, {bf, f16}, {i64, i64}} {
		_, err := floatsOf(ops...)
		require.ErrorIs(t, err, graph.ErrDType)
	}

	name, bcast, err := binaryKernels(f32, bf, f32)
	require.NoError(t, err)
	require.Equal(t, "binary_f32_bf16", name)
	require.Equal(t, "binary_bcast_f32_bf16", bcast)
	name, _, err = binaryKernels(bf, f16, f32)
	require.NoError(t, err)
	require.Equal(t, "binary_bf16_f16", name)
	for _, c := range [][3]operand{{f32, bf, bf}, {bf, f16, bf}, {bf, bf, f32}, {i64, f32, f32}} {
		_, _, err := binaryKernels(c[0], c[1], c[2])
		require.ErrorIs(t, err, graph.ErrDType, "%s %s → %s", c[0].dt, c[1].dt, c[2].dt)
		require.ErrorContains(t, err, c[0].dt.String())
	}
	// Every name those helpers give is loaded with elementwise.cu.
	loaded := map[string]bool{}
	for _, n := range kernelFiles["elementwise.cu"] {
		loaded[n] = true
	}
	for _, n := range append(mixedBinaryKernels(), castKernels()...) {
		require.True(t, loaded[n], n)
	}
}

// The 16-bit uploads and downloads encode and decode as package half does.
func TestHalfHostCodec(t *testing.T) {
	src := []float32{1, -2.5, 3.14159, 65504, 1e-8, 70000}
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		bits := encodeHalf(dt, src)
		got := make([]float32, len(src))
		decodeHalf(dt, got, bits)
		for i, f := range src {
			want := half.RoundF16(f)
			if dt == graph.BFloat16 {
				want = half.RoundBF16(f)
			}
			require.Equal(t, want, got[i], "%s %g", dt, f)
		}
	}
}
