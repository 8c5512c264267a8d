package cpu_test

import (
	"context"
	"testing"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
)

// The CPU executor computes in float32 with float64 accumulation in
// reductions; against the float64 reference over values in [−1, 2) it holds
// to 1e-4 relative, 1e-5 absolute.
var cpuTolerance = conformance.Tolerance{RTol: 1e-4, ATol: 1e-5}

func TestConformance(t *testing.T) {
	conformance.RunAll(t, runCPU, cpuTolerance)
}

// runCPU runs graphs on a fresh CPU executor.
var runCPU = conformance.RunnerOf(func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
	return cpu.New().RunBatch(ctx, g, b, feed, outputs...)
})

// Every case again with its input and parameters in bfloat16 and in
// float16: each op runs on 16-bit values and rounds its result where the
// reference rounds (conformance.BFloat16Tol, Float16Tol).
func TestConformanceBFloat16(t *testing.T) {
	conformance.RunAllAs(t, runCPU, graph.BFloat16, conformance.BFloat16Tol)
}

func TestConformanceFloat16(t *testing.T) {
	conformance.RunAllAs(t, runCPU, graph.Float16, conformance.Float16Tol)
}

// The fused_pointwise interpreter against the float64 reference on 300
// random expression DAGs × shapes × dtypes (conformance.RunPointwiseFuzz):
// 1e-4 relative, 1e-5 absolute in float32 throughout, 2e-2 and 1e-3 where
// a 16-bit dtype appears.
func TestPointwiseFuzz(t *testing.T) {
	conformance.RunPointwiseFuzz(t, runCPU, 300, 1, cpuTolerance, conformance.Tolerance{RTol: 2e-2, ATol: 1e-3})
}
