package batchfit

import (
	"context"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// hostOnlyExecutor is an executor that computes nothing: an Execute that
// finds a persistent buffer not resident (the first; one with a constant
// made that step) replays the program through its allocator so that the
// parameters, optimizer state and constants stay resident, as on a device
// after a real step, and every Execute returns a loss of 0.5 (and zeros for
// the step's other host outputs). Session.Step then does exactly the host
// work it does on a device (the step graph, the program and plan caches,
// the residents' matching), so a benchmark of it times what a training
// loop pays on the host before the first launch.
type hostOnlyExecutor struct {
	a        *alloc.Allocator
	res      exec.Residents[struct{}]
	replayed bool
	// keptOf is exec.KeptOutputs of the program whose Outputs it was
	// computed for (outputsOf), so Execute costs next to nothing.
	keptOf    []int
	outputsOf *int
}

func newHostOnlyExecutor() *hostOnlyExecutor {
	return &hostOnlyExecutor{a: alloc.New(alloc.NewSimBackend(cpu.Unlimited), alloc.Options{})}
}

func (e *hostOnlyExecutor) Run(context.Context, *graph.Graph, ...int) ([]*tensor.Dense, error) {
	return nil, graph.Errorf(graph.ErrAttr, "hostOnlyExecutor runs no graphs")
}

func (e *hostOnlyExecutor) Execute(_ context.Context, p *planner.Program, chunks []planner.Chunk, o exec.Options) (*exec.Result, error) {
	// A real executor's replay makes every persistent buffer it does not
	// hold resident (a constant made every step), as this one's does.
	if !e.replayed || !exec.HoldsExactly(p, e.res.Held()) {
		call, err := exec.NewCall(p, o, &e.res)
		if err != nil {
			return nil, err
		}
		if _, err := planner.Replay(p, chunks, e.a, &hostOnlyHooks{call}, false); err != nil {
			return nil, err
		}
		e.replayed = true
	}
	if len(p.Outputs) == 0 {
		return nil, graph.Errorf(graph.ErrArity, "hostOnlyExecutor: a program without outputs")
	}
	if e.outputsOf != &p.Outputs[0] {
		keptOf, err := exec.KeptOutputs(p)
		if err != nil {
			return nil, err
		}
		e.keptOf, e.outputsOf = keptOf, &p.Outputs[0]
	}
	keptOf := e.keptOf
	outs := make([]*tensor.Dense, len(p.Outputs))
	outs[0] = tensor.New(tensor.WithShape(), tensor.WithBacking([]float32{0.5}))
	for i, o := range p.Outputs[1:] {
		if keptOf[i+1] < 0 {
			outs[i+1] = exec.NewHostBuf(graph.Float32, p.Graph.Node(o).Type.Shape).Dense()
		}
	}
	return &exec.Result{Outputs: outs}, nil
}

func (e *hostOnlyExecutor) Workspace() planner.WorkspaceFunc { return cpu.Workspace }
func (e *hostOnlyExecutor) Allocator() *alloc.Allocator      { return e.a }
func (e *hostOnlyExecutor) Overhead() int64                  { return 0 }
func (e *hostOnlyExecutor) Reserve() int64                   { return 0 }
func (e *hostOnlyExecutor) SyncParams() error                { return nil }
func (e *hostOnlyExecutor) SyncState() error                 { return nil }
func (e *hostOnlyExecutor) Held() []exec.Held                { return e.res.Held() }
func (e *hostOnlyExecutor) ReleaseUnread(p *planner.Program) (bool, error) {
	return e.res.ReleaseUnread(e.a, p, nil, nil)
}
func (e *hostOnlyExecutor) Close() error   { return e.res.Release(e.a) }
func (e *hostOnlyExecutor) Yield() error   { return e.res.Yield(e.a, nil) }
func (e *hostOnlyExecutor) Restore() error { return e.res.Restore(e.a, nil) }
func (e *hostOnlyExecutor) Yielded() bool  { return e.res.Yielded() }

// hostOnlyHooks keeps a replay's persistent buffers resident and computes
// nothing.
type hostOnlyHooks struct{ *exec.Call[struct{}] }

func (h *hostOnlyHooks) Resident(b planner.Buffer) *alloc.Block {
	if rb := h.Call.Resident(b); rb != nil {
		return rb.Blk
	}
	return nil
}
func (h *hostOnlyHooks) Fill(pb planner.Buffer, blk *alloc.Block) error {
	h.Keep(pb, blk, struct{}{})
	return nil
}
func (*hostOnlyHooks) Run(*graph.Node, planner.Chunk, *alloc.Block, []*alloc.Block, *alloc.Block) error {
	return nil
}
func (*hostOnlyHooks) Freed(planner.Buffer, *alloc.Block)                            {}
func (*hostOnlyHooks) ChunkDone(planner.Chunk, []*alloc.Block, []*alloc.Block) error { return nil }
func (*hostOnlyHooks) Finish([]*alloc.Block, *alloc.Block) error                     { return nil }
func (*hostOnlyHooks) EveryChunk() bool                                              { return false }

// hostModel is a model of gobench's session mode: its module, its
// optimizer, and a build of its loss over feed i, as a training loop
// builds it every step.
type hostModel struct {
	name  string
	mod   nn.Module
	opt   optim.Optimizer
	build func(i int) *lazy.Tensor
}

// llama8x1024 is gobench's "llama" (written: "llama-written", RMSNorm,
// rotary and SwiGLU as plain ops) at -llama-config llama-8x1024, seq 1024,
// batch 8, AdamW.
func llama8x1024(written bool) func() hostModel {
	cfg := models.LlamaConfig{Vocab: 32000, Hidden: 1024, Intermediate: 2816, Layers: 8, Heads: 16, KVHeads: 16, HeadDim: 64,
		MaxPositions: 4096, RMSNormEps: 1e-5, TieEmbeddings: true, Rope: models.RopeConfig{Theta: 10000}, WrittenOut: written}
	name := "llama-8x1024"
	if written {
		name = "llama-8x1024-written"
	}
	return llamaHost(name, cfg, 8, 1024)
}

// llamaHost is a Llama of cfg over batch × seq tokens, trained with AdamW
// on the shifted causal LM loss.
func llamaHost(name string, cfg models.LlamaConfig, batch, seq int) func() hostModel {
	return func() hostModel {
		m := models.NewLlama(nn.Seed(1), cfg)
		rng := rand.New(rand.NewPCG(2, 3))
		var feeds [2][2]*tensor.Dense
		for i := range feeds {
			tok := testutil.Classes(rng, cfg.Vocab, batch, seq)
			labels, _, err := models.ShiftLabels(tok)
			if err != nil {
				panic(err)
			}
			feeds[i] = [2]*tensor.Dense{tok, labels}
		}
		opt := optim.NewAdamW(3e-4)
		opt.WeightDecay = 0.01
		return hostModel{name: name, mod: m, opt: opt, build: func(i int) *lazy.Tensor {
			tok := lazy.Wrap(feeds[i%2][0], 0)
			labels := tok.Graph().Wrap(feeds[i%2][1], 0)
			return models.ShiftedCausalLMLoss(m.Forward(tok), labels, batch*(seq-1))
		}}
	}
}

// hostModels are gobench's "gpt" (GPT-2 small, fused attention, batch 8
// × seq 1024, AdamW), "resnet50" (batch 64 of 3×224×224, Adam), "llama"
// and "llama-written" at llama-8x1024 (llama8x1024), "llama" at
// Llama-3.2-1B (batch 4 × seq 2048, AdamW) and "mlp" (784→4096→4096→10,
// batch 1024, Adam), with parameters and two feeds of data.
func hostModels() []func() hostModel {
	return []func() hostModel{
		func() hostModel {
			m := models.NewGPT(nn.Seed(1), models.GPT2Small())
			rng := rand.New(rand.NewPCG(2, 3))
			var feeds [2][2]*tensor.Dense
			for i := range feeds {
				feeds[i] = [2]*tensor.Dense{testutil.Classes(rng, 50257, 8, 1024), testutil.Classes(rng, 50257, 8, 1024)}
			}
			opt := optim.NewAdamW(3e-4)
			opt.WeightDecay = 0.01
			return hostModel{name: "gpt2-small", mod: m, opt: opt, build: func(i int) *lazy.Tensor {
				tok := lazy.Wrap(feeds[i%2][0], 0)
				tgt := tok.Graph().Wrap(feeds[i%2][1], 0)
				return models.Loss(m.Forward(tok), tgt)
			}}
		},
		func() hostModel {
			m := models.NewResNet(nn.Seed(1), models.ResNet50(1000))
			rng := rand.New(rand.NewPCG(2, 3))
			var feeds [2][2]*tensor.Dense
			for i := range feeds {
				feeds[i] = [2]*tensor.Dense{testutil.UniformF32(rng, 64, 3, 224, 224), testutil.Classes(rng, 1000, 64)}
			}
			return hostModel{name: "resnet50", mod: m, opt: optim.NewAdam(1e-3), build: func(i int) *lazy.Tensor {
				x := lazy.Wrap(feeds[i%2][0], 0)
				y := x.Graph().Wrap(feeds[i%2][1], 0)
				return m.Forward(x).CrossEntropy(y, graph.ReduceMean)
			}}
		},
		llama8x1024(false),
		llama8x1024(true),
		llamaHost("llama3.2-1b", models.Llama32_1B(), 4, 2048),
		func() hostModel {
			m := nn.MLP(nn.Seed(1), []int{784, 4096, 4096, 10}, nn.ReLU{})
			rng := rand.New(rand.NewPCG(2, 3))
			var feeds [2][2]*tensor.Dense
			for i := range feeds {
				feeds[i] = [2]*tensor.Dense{testutil.UniformF32(rng, 1024, 784), testutil.Classes(rng, 10, 1024)}
			}
			return hostModel{name: "mlp", mod: m, opt: optim.NewAdam(1e-3), build: func(i int) *lazy.Tensor {
				x := lazy.Wrap(feeds[i%2][0], 0)
				y := x.Graph().Wrap(feeds[i%2][1], 0)
				return m.Forward(x).CrossEntropy(y, graph.ReduceMean)
			}}
		},
	}
}

// BenchmarkStepHostWork times, on the CPU, the host work of gobench's
// session mode under bf16-mixed for GPT-2 small (seq 1024, batch 8),
// ResNet-50 (batch 64), the Llama of llama-8x1024 hand-fused and
// written out (seq 1024, batch 8), the Llama-3.2-1B shape (seq 2048,
// batch 4) and the MLP (batch 1024): "build" is the caller's graph build (the model's
// forward and loss over a step's data), "step" is Session.Step on an
// executor that computes nothing (hostOnlyExecutor) in a steady loop, so
// its ns/op and allocs/op are Step's host work before the first launch
// plus a negligible Execute; host-µs/step is Session.StepHostTime.
//
//	go test -run '^$' -bench StepHostWork -benchmem -count 6 .
func BenchmarkStepHostWork(b *testing.B) {
	for _, mk := range hostModels() {
		var hm hostModel
		made := false
		model := func() hostModel {
			if !made {
				hm, made = mk(), true
			}
			return hm
		}
		b.Run("model="+model().name+"/part=build", func(b *testing.B) {
			m := model()
			i := 0
			for b.Loop() {
				if err := m.build(i).Err(); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
		b.Run("model="+model().name+"/part=step", func(b *testing.B) {
			m := model()
			ctx := context.Background()
			sess := NewSession(Options{Device: DeviceCPU, Precision: "bf16-mixed"})
			defer sess.Close()
			sess.be = newHostOnlyExecutor()
			params := nn.ParamTensors(m.mod)
			for i := range 3 { // the first step differentiates, compiles and plans
				if _, err := sess.Step(ctx, m.build(i), params, m.opt); err != nil {
					b.Fatal(err)
				}
			}
			runtime.GC()
			var host time.Duration
			i := 0
			for b.Loop() {
				b.StopTimer()
				loss := m.build(i)
				b.StartTimer()
				if _, err := sess.Step(ctx, loss, params, m.opt); err != nil {
					b.Fatal(err)
				}
				host += sess.StepHostTime()
				i++
			}
			b.ReportMetric(float64(host.Nanoseconds())/1e3/float64(b.N), "host-µs/step")
		})
	}
}
