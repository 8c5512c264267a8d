package cpu_test

import (
	"context"
	"testing"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
)

// The CPU executor computes in float32 with float64 accumulation in
// reductions; against the float64 reference over values in [−1, 2) it holds
// to 1e-4 relative, 1e-5 absolute.
var cpuTolerance = conformance.Tolerance{RTol: 1e-4, ATol: 1e-5}

func TestConformance(t *testing.T) {
	conformance.RunAll(t, runCPU, cpuTolerance)
}

func runCPU(g *graph.Graph, feeds map[int]ref.Value, outputs ...int) ([]ref.Value, error) {
	feed := func(id int) tensor.Tensor {
		v, ok := feeds[id]
		if !ok {
			return nil
		}
		if g.Node(id).Type.DType == graph.Int64 {
			d := make([]int64, len(v.Data))
			for i, x := range v.Data {
				d[i] = int64(x)
			}
			return tensor.New(tensor.WithShape(v.Shape...), tensor.WithBacking(d))
		}
		d := make([]float32, len(v.Data))
		for i, x := range v.Data {
			d[i] = float32(x)
		}
		return tensor.New(tensor.WithShape(v.Shape...), tensor.WithBacking(d))
	}
	out, err := cpu.New().RunBatch(context.Background(), g, g.Batch(), feed, outputs...)
	if err != nil {
		return nil, err
	}
	vals := make([]ref.Value, len(out))
	for i, d := range out {
		if vals[i], err = ref.FromTensor(d); err != nil {
			return nil, err
		}
	}
	return vals, nil
}

// Every case again with its input and parameters in bfloat16 and in
// float16: each op runs on 16-bit values and rounds its result where the
// reference rounds (conformance.BFloat16Tol, Float16Tol).
func TestConformanceBFloat16(t *testing.T) {
	conformance.RunAllAs(t, runCPU, graph.BFloat16, conformance.BFloat16Tol)
}

func TestConformanceFloat16(t *testing.T) {
	conformance.RunAllAs(t, runCPU, graph.Float16, conformance.Float16Tol)
}
