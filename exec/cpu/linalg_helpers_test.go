package cpu_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/lazy"
)

// Tolerances for float32 results against float64 references.
const (
	// GEMM-based ops accumulate up to a few hundred float32 products.
	gemmRTol = 1e-4
	gemmATol = 1e-5
	// Pooling: max is exact; the average sums in float64 and rounds once.
	poolRTol = 1e-6
	poolATol = 1e-6
)

// widen converts to float64 for the references.
func widen(v []float32) []float64 {
	w := make([]float64, len(v))
	for i, x := range v {
		w[i] = float64(x)
	}
	return w
}

func mkDense(data []float32, shape ...int) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(data))
}

// runFor evaluates y on the CPU executor and returns its shape and data.
func runFor(t testing.TB, y *lazy.Tensor) ([]int, []float32) {
	t.Helper()
	require.NoError(t, y.Err())
	res, err := cpu.New().Run(context.Background(), y.Graph().IR(), y.ID())
	require.NoError(t, err)
	require.Len(t, res, 1)
	return []int(res[0].Shape()), res[0].Data().([]float32)
}

// closeTo checks |got − want| ≤ atol + rtol·|want| element by element.
func closeTo(t *testing.T, want []float64, got []float32, rtol, atol float64) {
	t.Helper()
	require.Len(t, got, len(want))
	bad := 0
	for i, w := range want {
		g := float64(got[i])
		if math.IsNaN(w) != math.IsNaN(g) || math.Abs(g-w) > atol+rtol*math.Abs(w) {
			if bad < 5 {
				t.Errorf("element %d: got %v, want %v (rtol %g, atol %g)", i, g, w, rtol, atol)
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d elements out of tolerance", bad, len(want))
	}
}

// unravel writes the multi-index of flat offset i in shape into idx.
func unravel(i int, shape, idx []int) {
	for d := len(shape) - 1; d >= 0; d-- {
		idx[d] = i % shape[d]
		i /= shape[d]
	}
}

// bcastOffset is the row-major offset into shape s of the broadcast
// multi-index idx (right-aligned, size-1 axes pinned to 0).
func bcastOffset(idx, s []int) int {
	off := 0
	shift := len(idx) - len(s)
	for d, n := range s {
		i := idx[d+shift]
		if n == 1 {
			i = 0
		}
		off = off*n + i
	}
	return off
}

// benchRun times full executor runs of y and reports GFLOP/s for flops
// floating-point operations per run.
func benchRun(b *testing.B, y *lazy.Tensor, flops float64) {
	require.NoError(b, y.Err())
	g, e, ctx := y.Graph().IR(), cpu.New(), context.Background()
	b.ResetTimer()
	for b.Loop() {
		if _, err := e.Run(ctx, g, y.ID()); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}
