package shapeinfer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// chain builds nodes nodes through the lazy API: a [32, 64] batched input,
// then Linear, Add and Relu in turn, sharing one weight and one bias.
func chain(nodes int, w, bias *lazy.Tensor) *lazy.Tensor {
	h := lazy.Placeholder([]int{32, 64}, graph.Float32, 0)
	ir := h.Graph().IR()
	for k := 0; ir.Len() < nodes; k++ {
		switch k % 3 {
		case 0:
			h = h.Linear(w, nil)
		case 1:
			h = h.Add(bias)
		default:
			h = h.Relu()
		}
	}
	return h
}

// BenchmarkInferChain times shape inference over a chain: building it
// (every node goes through its shape rule) and one Analyze sweep.
func BenchmarkInferChain(b *testing.B) {
	w := lazy.ParamSpec([]int{64, 64}, graph.Float32, "w")
	bias := lazy.ParamSpec([]int{64}, graph.Float32, "b")
	for _, nodes := range []int{1000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("nodes=%d", nodes), func(b *testing.B) {
			var build, analyze time.Duration
			runs := 0
			for b.Loop() {
				t0 := time.Now()
				out := chain(nodes, w, bias)
				t1 := time.Now()
				res, err := shapeinfer.Analyze(out.Graph().IR(), out.ID())
				analyze += time.Since(t1)
				build += t1.Sub(t0)
				if err != nil || out.Err() != nil || !res.Chunkable() {
					b.Fatalf("chain: %v %v %v", err, out.Err(), res.NotChunkable)
				}
				runs++
			}
			per := float64(runs * nodes)
			b.ReportMetric(float64(build+analyze)/per, "ns/node")
			b.ReportMetric(float64(build)/per, "build-ns/node")
			b.ReportMetric(float64(analyze)/per, "analyze-ns/node")
		})
	}
}
