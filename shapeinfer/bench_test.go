package shapeinfer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// chain builds nodes nodes through the lazy API: a [32, 64] batched input,
// then Linear, Add and Relu in turn (testutil.Chain).
func chain(nodes int, w, bias *lazy.Tensor) *lazy.Tensor {
	return testutil.Chain(lazy.Placeholder([]int{32, 64}, graph.Float32, 0), nodes, w, bias)
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
