package planner_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

const gib = 1 << 30

var gpt2 struct {
	sync.Mutex
	progs map[int]*planner.Program
}

// gpt2Program compiles one shape-only GPT-2 small training step over
// tokens [batch, 1024]: forward, mean next-token loss, backward over every
// parameter, gradients kept on the device and AdamW's two state tensors
// per parameter. No executor workspace is declared: this is the step as a
// GPU would run it. Programs are built once per batch size and shared.
func gpt2Program(b testing.TB, batch int) *planner.Program {
	gpt2.Lock()
	defer gpt2.Unlock()
	if p := gpt2.progs[batch]; p != nil {
		return p
	}
	model := models.NewGPT(nn.Options{ShapeOnly: true}, gpt2Written())
	tokens := lazy.Placeholder([]int{batch, 1024}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{batch, 1024}, graph.Int64, 0)
	p := testutil.StepProgram(b, nil, models.Loss(model.Forward(tokens), targets), nn.ParamTensors(model), 2)
	if gpt2.progs == nil {
		gpt2.progs = map[int]*planner.Program{}
	}
	gpt2.progs[batch] = p
	return p
}

// reportPlan adds the plan's answer to a benchmark's output.
func reportPlan(b *testing.B, pl *planner.Plan) {
	b.ReportMetric(float64(pl.Replays), "replays")
	b.ReportMetric(float64(pl.Chunk), "chunk")
	b.ReportMetric(float64(len(pl.Chunks)), "chunks")
	b.ReportMetric(float64(pl.PeakReserved)/(1<<20), "peak-MiB")
}

// BenchmarkPlanGPT2Small times planner.Make on the GPT-2 small training
// step (compiled once, outside the timer). At batch 8 it fits 24 GiB in
// one chunk; 8 GiB forces a search for chunks; at batch 64 the largest
// chunk that fits 24 GiB is GPT-2 small's largest trainable batch there.
func BenchmarkPlanGPT2Small(b *testing.B) {
	for _, c := range []struct {
		batch  int
		budget int64
	}{{8, 24 * gib}, {8, 8 * gib}, {64, 24 * gib}} {
		b.Run(fmt.Sprintf("batch=%d/budget=%dGiB", c.batch, c.budget/gib), func(b *testing.B) {
			p := gpt2Program(b, c.batch)
			var pl *planner.Plan
			for b.Loop() {
				var err error
				if pl, err = planner.Make(p, planner.Options{Budget: c.budget}); err != nil {
					b.Fatal(err)
				}
			}
			reportPlan(b, pl)
		})
	}
}

// chainProgram compiles a shape-only forward chain of about nodes nodes
// over x [8192, 512] (16 MiB per value at the whole batch): Linear, Add and
// Relu in turn, sharing one weight and one bias, as BenchmarkInferChain in
// package shapeinfer builds it.
func chainProgram(b *testing.B, nodes int) *planner.Program {
	w := lazy.ParamSpec([]int{512, 512}, graph.Float32, "w")
	bias := lazy.ParamSpec([]int{512}, graph.Float32, "b")
	h := testutil.Chain(lazy.Placeholder([]int{8192, 512}, graph.Float32, 0), nodes, w, bias)
	ir := h.Graph().IR()
	if err := h.Err(); err != nil {
		b.Fatal(err)
	}
	info, err := shapeinfer.Analyze(ir, h.ID())
	if err != nil {
		b.Fatal(err)
	}
	p, err := planner.Compile(ir, info, []int{h.ID()}, planner.CompileOptions{})
	if err != nil {
		b.Fatal(err)
	}
	return p
}

// BenchmarkPlanChain times planner.Make over long chains with a 24 MiB
// budget: the whole batch does not fit, so the planner searches for the
// chunk size with replays, each linear in the program's length.
func BenchmarkPlanChain(b *testing.B) {
	for _, nodes := range []int{1000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("nodes=%dk", nodes/1000), func(b *testing.B) {
			p := chainProgram(b, nodes)
			var pl *planner.Plan
			for b.Loop() {
				var err error
				if pl, err = planner.Make(p, planner.Options{Budget: 24 << 20}); err != nil {
					b.Fatal(err)
				}
			}
			if len(pl.Chunks) < 2 {
				b.Fatalf("the budget did not force chunks: %d", len(pl.Chunks))
			}
			reportPlan(b, pl)
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(p.Graph.Len()), "ns/node")
		})
	}
}

// BenchmarkReplay times one replay of the GPT-2 small training step at
// batch 8 in one chunk on a fresh simulated device, and reports the time
// per program step.
func BenchmarkReplay(b *testing.B) {
	p := gpt2Program(b, 8)
	chunks := planner.Chunks(8, 1)
	for b.Loop() {
		a := alloc.New(alloc.NewSimBackend(24*gib), alloc.Options{})
		if _, err := planner.Replay(p, chunks, a, nil, false); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(p.Steps)), "steps")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(p.Steps)), "ns/step")
}

// gpt2Written is GPT-2 small with attention written out: the program whose
// figures the README's performance table quotes (1,849 steps).
func gpt2Written() models.GPTConfig {
	cfg := models.GPT2Small()
	cfg.WrittenOutAttention = true
	return cfg
}
