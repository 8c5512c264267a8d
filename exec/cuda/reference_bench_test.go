package cuda_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// BenchmarkGPUTestReferences times, on the CPU and with no GPU, the
// references the heaviest GPU tests compute before their first launch, one
// after the other on one core (the tests spread them over every core:
// cpuAttnRefs, evalRefs, attnF32Refs): the float64 reference's (ref.Eval)
// for TestCuDNNAttention, TestAttentionQKV and TestAttentionF32Blocked
// (shared with TestAttentionTF32Blocked), the CPU executor's for
// TestAttention16 and TestAttentionMMA. core-s is one iteration's
// seconds; divided by the GPU machine's cores it is about what the test
// waits before its launches. Run with -benchtime 1x.
func BenchmarkGPUTestReferences(b *testing.B) {
	ctx := context.Background()
	float64Ref := func(g *graph.Graph, ids []int) error { _, err := ref.Eval(g, nil, ids...); return err }
	cpuRef := func(g *graph.Graph, ids []int) error { _, err := cpu.New().Run(ctx, g, ids...); return err }
	type work struct {
		g   *graph.Graph
		ids []int
	}
	for _, test := range []struct {
		name  string
		build func(b *testing.B) []work
		run   func(*graph.Graph, []int) error
	}{
		{"CuDNNAttention", func(b *testing.B) []work {
			var w []work
			for _, sc := range sdpaCases() {
				g, ids := attnGraph(b, sc.c, sc.dt, rand.New(rand.NewPCG(uint64(sc.c.T*131+sc.c.D), 17)))
				w = append(w, work{g, ids})
			}
			return w
		}, float64Ref},
		{"AttentionQKV", func(b *testing.B) []work {
			var w []work
			for _, c := range qkvCases() {
				for _, dt := range []graph.DType{graph.BFloat16, graph.Float16, graph.Float32} {
					g, ids := qkvGraph(b, c, dt, rand.New(rand.NewPCG(uint64(c.T*131+c.D), 19)))
					w = append(w, work{g, ids})
				}
			}
			return w
		}, float64Ref},
		{"AttentionF32Blocked", func(b *testing.B) []work {
			var w []work
			for _, c := range attnF32Cases {
				g, ids := attnGraph(b, c, graph.Float32, rand.New(rand.NewPCG(uint64(c.T*131+c.D), 11)))
				w = append(w, work{g, ids})
			}
			return w
		}, float64Ref},
		{"Attention16", func(b *testing.B) []work {
			var w []work
			for _, p := range attention16Problems() {
				g, ids := attnGraph(b, p.c, p.dt, rand.New(rand.NewPCG(uint64(p.c.T*131+p.c.D), 7)))
				w = append(w, work{g, ids})
			}
			return w
		}, cpuRef},
		{"AttentionMMA", func(b *testing.B) []work {
			var w []work
			for _, c := range attnMMACases() {
				for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
					g, ids := attnGraph(b, c, dt, rand.New(rand.NewPCG(uint64(c.T*131+c.D), 7)))
					w = append(w, work{g, ids})
				}
			}
			return w
		}, cpuRef},
	} {
		b.Run(test.name, func(b *testing.B) {
			w := test.build(b)
			start := time.Now()
			for b.Loop() {
				for _, x := range w {
					if err := test.run(x.g, x.ids); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(time.Since(start).Seconds()/float64(b.N), "core-s")
			b.ReportMetric(float64(len(w)), "problems")
		})
	}
}
