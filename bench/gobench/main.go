// Command gobench times batchfit's CUDA executor on three training steps
// (an MLP with Adam, a GPT-2-small-shaped transformer with AdamW, a
// CIFAR-10-shaped ConvNet with Adam) and asks the planner for the largest
// whole batch that fits the card's free memory, then runs a step at that
// batch. With -budget it also plans each model at a batch too large for
// the budget, runs a step in the planned chunks and shows that the next
// larger chunk size would not fit. With -cap it trains each model at
// -cap-batch through batchfit.Session within the cap, the planner's choice
// of chunks and recomputation against chunks only. It writes JSON lines (Record) to stdout
// and, when $OUT is set, to $OUT/gobench.json; bench/run-gpu compares them
// with bench/torch_bench.py. See bench/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

type config struct {
	models        string
	warmup, steps int
	maxBatch      bool
	verify        bool
	gptLayers     int
	gptSeq        int
	gptBatch      int
	llamaConfig   string // the llama model's shape: a zoo name (models.Llama32_1B, ...)
	llamaLayers   int    // its layers (0: the config's)
	llamaSeq      int
	llamaBatch    int
	llamaUpper    int    // the largest-batch search's upper bound
	llamaLoRA     int    // the llama model's LoRA rank (0: a full fine-tune)
	llamaTargets  string // the modules -llama-lora adapts
	tightLlama    int
	mlpBatch      int
	session       bool // also time the steps through batchfit.Session, graph rebuilt each step
	sessionFirst  bool // time each model's Session before its executor
	sessionTrace  bool // each Session step's plan and allocator counts, to stderr
	convBatch     int
	resnetBatch   int
	resnetSize    int
	budget        int64 // tightness records within this many bytes; 0: none
	tightGPT      int
	tightMLP      int
	tightConv     int
	tf32          bool          // GEMMs on TF32 tensor cores (-precision tf32)
	cudnn         bool          // convolutions on cuDNN when it loads (-cudnn)
	cudnnFind     bool          // cuDNN's algorithms by the timed search (-cudnn-find)
	cudnnFindAll  bool          // the timed search for 16-bit and TF32 convolutions too (-cudnn-find-all)
	cudnnBN       bool          // batch norm on cuDNN (-cudnn-bn)
	cudnnAttn     bool          // fused attention on cuDNN (-cudnn-attn)
	cudaGraphs    bool          // replay captured CUDA graphs (-cuda-graphs)
	precision     string        // the precision policy (package precision); -tf32 is -precision tf32
	profile       int           // steps profiled per node after the timed ones
	cpuProfile    string        // Go CPU profile of the timed steps
	dist          bool          // one rank of a data-parallel job: time Trainer steps only
	bucket        int64         // -dist: gradient bytes per all-reduce bucket (0: dist's default)
	throughput    bool          // time each model's step on the executor (the throughput records)
	cap           int64         // cap records within this many bytes; 0: none
	capBatch      int           // the cap records' batch; 0: each model's timed batch
	costProfile   string        // the recompute cost model's profile for the cap records
	channelsLast  bool          // conv nets' bfloat16 activations channels last (-channels-last, the default)
	noPointwise   bool          // no graph.FusePointwise in the steps (-no-pointwise-fusion)
	hostWork      time.Duration // the executor's loop spins this long after each step (-host-work)
	interleave    int           // the executor's and the Session's timed steps in alternate blocks of this many (-interleave)
	noFusedLoss   bool          // the head and loss as two ops (-no-fused-loss: Options.NoFusedLoss)
	lossChunk     int           // the fused loss's tokens per logits chunk (-loss-chunk: Options.LossChunk; 0: the planner's)
}

// registerFlags defines gobench's flags on fs, setting c.
func registerFlags(fs *flag.FlagSet, c *config) {
	fs.StringVar(&c.models, "models", "mlp,gpt,conv", "comma-separated `list` of mlp, gpt (fused attention), gpt-written (attention written out), gpt-unpacked (plain ops into the attention op: q, k, v sliced and permuted), conv, resnet50, llama (models.Llama, -llama-config), llama-written (the same written out with plain ops: models.LlamaConfig.WrittenOut)")
	fs.IntVar(&c.warmup, "warmup", 3, "untimed warm-up steps")
	fs.IntVar(&c.steps, "steps", 20, "timed steps")
	fs.BoolVar(&c.maxBatch, "maxbatch", true, "ask the planner for the largest batch that fits the card's free memory")
	fs.BoolVar(&c.verify, "verify", true, "run one training step at the planner's largest batch")
	fs.IntVar(&c.gptLayers, "gpt-layers", 12, "transformer layers (GPT-2 small has 12)")
	fs.BoolVar(&c.noFusedLoss, "no-fused-loss", false, "keep language models' head and cross-entropy as two ops, storing the logits (Options.NoFusedLoss, TrainOptions.NoFusedLoss), to compare")
	fs.IntVar(&c.lossChunk, "loss-chunk", 0, "the fused loss's tokens per logits chunk, `N` (Options.LossChunk; 0: the Session's planner's choice, and for the executor's programs the largest candidate, planner.LossChunkCandidates)")
	fs.IntVar(&c.gptSeq, "gpt-seq", 256, "transformer sequence length")
	fs.IntVar(&c.gptBatch, "gpt-batch", 8, "transformer batch for the timed run")
	fs.IntVar(&c.mlpBatch, "mlp-batch", 1024, "MLP batch for the timed run")
	fs.StringVar(&c.llamaConfig, "llama-config", "llama3.2-1b", "the llama model's shape: llama3.2-1b, llama3-8b or llama-tiny (models.Llama32_1B, Llama3_8B, LlamaTiny), or llama-0.8b (16 × 2048, 16/4 heads of 128, SwiGLU 5632, vocab 32000) or llama-8x1024 (8 × 1024, 16 heads of 64, SwiGLU 2816, vocab 32000)")
	fs.IntVar(&c.llamaLayers, "llama-layers", 0, "the llama model's decoder layers (0: the config's, 16 for Llama 3.2 1B)")
	fs.IntVar(&c.llamaSeq, "llama-seq", 2048, "the llama model's sequence length")
	fs.IntVar(&c.llamaBatch, "llama-batch", 4, "the llama model's batch for the timed run")
	fs.IntVar(&c.llamaUpper, "llama-upper", 96, "the llama model's largest-batch search starts from a shape-only program of this many samples")
	fs.IntVar(&c.tightLlama, "tight-batch-llama", 32, "the llama model's batch for -budget")
	fs.IntVar(&c.llamaLoRA, "llama-lora", 0, "fine-tune the llama model with LoRA adapters of this `rank` (nn.LoRA, alpha 2·rank) on -llama-lora-targets, its base frozen in bfloat16, as peft with a bf16 base trains (0: every parameter)")
	fs.StringVar(&c.llamaTargets, "llama-lora-targets", "q_proj,k_proj,v_proj,o_proj", "comma-separated `modules` -llama-lora adapts")
	fs.BoolVar(&c.session, "session", true, "also time the training loop through batchfit.Session.Step, the graph built again every step")
	fs.BoolVar(&c.sessionTrace, "session-trace", false, "print each Session step's plan (address, budget, predicted peak) and the allocator's device allocations and frees to stderr")
	fs.BoolVar(&c.sessionFirst, "session-first", false, "time each model's Session steps before its executor's (the order's effect on the comparison)")
	fs.IntVar(&c.convBatch, "conv-batch", 256, "ConvNet batch (3×32×32 images) for the timed run")
	fs.IntVar(&c.resnetBatch, "resnet-batch", 64, "ResNet-50 batch for the timed run")
	fs.IntVar(&c.resnetSize, "resnet-size", 224, "ResNet-50 image height and width (3 channels, 1000 classes)")
	fs.Var(bytesFlag{&c.budget}, "budget", "plan each model at its -tight-batch-* within this `size` (8GiB, 512MiB, 8GB or bytes), run two steps in the planned chunks, and simulate the next larger chunk size; 0: off")
	fs.IntVar(&c.tightGPT, "tight-batch-gpt", 64, "transformer batch for -budget (4 chunks of 16 within 8GiB at 12 layers, seq 256)")
	fs.IntVar(&c.tightMLP, "tight-batch-mlp", 1<<18, "MLP batch for -budget (3 chunks within 8GiB)")
	fs.IntVar(&c.tightConv, "tight-batch-conv", 49152, "ConvNet batch for -budget (4 chunks within 8GiB)")
	fs.BoolVar(&c.cudnn, "cudnn", true, "run the executor's convolutions on cuDNN when it loads (false: im2col + cuBLAS, to compare)")
	fs.BoolVar(&c.cudnnFind, "cudnn-find", true, "choose the executor's plain float32 cuDNN convolution algorithms by the timed search (cuDNN's algorithms and the im2col path), cached on disk, each node declaring the chosen algorithm's workspace (false: ExecutorOptions.ConvHeuristics, cuDNN's heuristics within the static workspace formula, to compare; BATCHFIT_CUDNN_FIND=0, 1 or all overrides it and -cudnn-find-all, the Session's steps included)")
	fs.BoolVar(&c.cudnnFindAll, "cudnn-find-all", false, "extend the timed search to 16-bit and TF32 convolutions (ExecutorOptions.ConvSearchAll; BATCHFIT_CUDNN_FIND=all); by default they keep the heuristics")
	fs.BoolVar(&c.cudnnBN, "cudnn-bn", true, "run the executor's batch norms on cuDNN where it takes them (false: ExecutorOptions.NoCuDNNBatchNorm, batchfit's kernels, to compare)")
	fs.BoolVar(&c.cudnnAttn, "cudnn-attn", true, "run the executor's 16-bit fused attention on cuDNN's SDPA where it takes it (false: ExecutorOptions.NoCuDNNAttention, batchfit's kernels, to compare)")
	fs.BoolVar(&c.cudaGraphs, "cuda-graphs", true, "capture the executor's launches between host steps as CUDA graphs and replay them (false: ExecutorOptions.NoCUDAGraphs and Options.NoCUDAGraphs, every kernel launched eagerly, to compare; BATCHFIT_CUDA_GRAPHS=0 or 1 overrides both ways)")
	fs.BoolVar(&c.tf32, "tf32", false, "run float32 GEMMs on TF32 tensor cores (the same as -precision tf32; PyTorch's allow_tf32)")
	fs.StringVar(&c.precision, "precision", "fp32", "precision `policy`: "+precision.Names()+" (as Options.Precision)")
	fs.IntVar(&c.profile, "profile", 0, "after the timed steps, profile `n` more (device time per node, from CUDA events) and print the time per op to stderr")
	fs.BoolVar(&c.dist, "dist", false, "run as one rank of a data-parallel job started by `batchfit launch -n N` or torchrun: time the models' training loops through package dist (NCCL) at a global batch of -gpt-batch, -mlp-batch or -conv-batch, and nothing else; rank 0 writes the records")
	fs.Var(bytesFlag{&c.bucket}, "bucket", "with -dist: gradient `size` summed per NCCL group (dist.Options.BucketBytes; 0: 25 MiB)")
	fs.BoolVar(&c.throughput, "throughput", true, "time each model's training step on the executor (the throughput records; -session's records come with them or alone)")
	fs.Var(bytesFlag{&c.cap}, "cap", "train each model at -cap-batch through batchfit.Session within this `size` (Options.Budget: 24GiB, 512MiB, 24GB or bytes), once with the planner's choice (recompute auto) and once in chunks only, and time both (the cap records); 0: off")
	fs.IntVar(&c.capBatch, "cap-batch", 0, "the batch of -cap's steps (0: each model's timed batch, -gpt-batch, -mlp-batch, ...)")
	fs.StringVar(&c.costProfile, "cost-profile", "h100", "the recompute cost model's `profile` for -cap (Options.Profile): default, h100, h200 or a JSON file as batchfit calibrate writes it")
	fs.BoolVar(&c.noPointwise, "no-pointwise-fusion", false, "run each elementwise op's own kernel (Options.NoPointwiseFusion) instead of fusing their chains into generated kernels (graph.FusePointwise), as a Session does by default")
	fs.BoolVar(&c.channelsLast, "channels-last", true, "store conv nets' 4-D activations channels last (NHWC; package layout) from their bfloat16 convolutions on (layout.ConvTakes), as a Session does by default under bf16-mixed; false keeps them NCHW (Options.NoChannelsLast)")
	fs.IntVar(&c.interleave, "interleave", 0, "run each model's executor and Session loops in one go, their timed steps in alternate blocks of `n` (the session record's over_paired: the median over block pairs of its median step over the executor's); 0: one loop after the other")
	fs.DurationVar(&c.hostWork, "host-work", 0, "the executor's loop spins this `long` on the host after each step, standing in for a training loop's own host work, to measure how much of it the device's queued work hides")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write a Go CPU profile of the timed steps to `file` (one per model: the model name is inserted before the extension)")
}

func main() {
	var c config
	registerFlags(flag.CommandLine, &c)
	flag.Parse()
	if err := c.resolvePrecision(); err != nil {
		fmt.Fprintln(os.Stderr, "gobench:", err)
		os.Exit(2)
	}
	if err := c.checkCap(); err != nil {
		fmt.Fprintln(os.Stderr, "gobench:", err)
		os.Exit(2)
	}

	var sinks []io.Writer = []io.Writer{os.Stdout}
	if c.dist && os.Getenv("RANK") != "0" {
		sinks = []io.Writer{io.Discard} // rank 0 speaks for the job
	} else if dir := os.Getenv("OUT"); dir != "" {
		f, err := os.Create(filepath.Join(dir, "gobench.json"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "gobench:", err)
			os.Exit(1)
		}
		defer f.Close()
		sinks = append(sinks, f)
	}
	w := io.MultiWriter(sinks...)
	if err := run(c, w); err != nil {
		_ = writeRecord(w, Record{Kind: "error", Error: err.Error()})
		fmt.Fprintln(os.Stderr, "gobench:", err)
		os.Exit(1)
	}
}

// benchModel is one model of the benchmark. build makes its training
// graph over batch samples: with data nil over placeholders (a dry run),
// otherwise over inputs drawn from data. It returns the mean loss, the
// trained parameters and the input nodes (features or tokens, then labels).
type benchModel struct {
	name, about string
	seq         int
	batch       int // of the timed run
	tight       int // of the tightness record
	upper       int // batch of the shape-only program the largest-batch search starts from
	optimizer   func() *optim.Adam
	optName     string
	module      func(opt nn.Options) nn.Module
	build       func(m nn.Module, batch int, data *rand.Rand) (loss *lazy.Tensor, inputs []*lazy.Tensor)
}

func floats(r *rand.Rand, shape ...int) *tensor.Dense {
	d := make([]float32, graph.Numel(shape))
	for i := range d {
		d[i] = float32(r.NormFloat64())
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

func ints(r *rand.Rand, k int, shape ...int) *tensor.Dense {
	d := make([]int64, graph.Numel(shape))
	for i := range d {
		d[i] = int64(r.IntN(k))
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

// source is an input: a placeholder when data is nil.
func source(g *lazy.Graph, data *rand.Rand, shape []int, dt graph.DType, k int) *lazy.Tensor {
	var t *tensor.Dense
	switch {
	case data == nil && g == nil:
		return lazy.Placeholder(shape, dt, 0)
	case data == nil:
		return g.Placeholder(shape, dt, 0)
	case dt == graph.Int64:
		t = ints(data, k, shape...)
	default:
		t = floats(data, shape...)
	}
	if g == nil {
		return lazy.Wrap(t, 0)
	}
	return g.Wrap(t, 0)
}

func benchModels(c config) ([]benchModel, error) {
	mlp := benchModel{name: "mlp", about: "MLP 784→4096→4096→10, ReLU, mean cross-entropy", batch: c.mlpBatch,
		tight: c.tightMLP, upper: 1 << 22, optName: "adam(lr=1e-3)", optimizer: func() *optim.Adam { return optim.NewAdam(1e-3) },
		module: func(opt nn.Options) nn.Module { return nn.MLP(opt, []int{784, 4096, 4096, 10}, nn.ReLU{}) },
		build: func(m nn.Module, n int, data *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
			x := source(nil, data, []int{n, 784}, graph.Float32, 0)
			y := source(x.Graph(), data, []int{n}, graph.Int64, 10)
			return m.Forward(x).CrossEntropy(y, graph.ReduceMean), []*lazy.Tensor{x, y}
		}}
	gptOf := func(name string, written, unpacked bool) benchModel {
		cfg := models.GPT2Small()
		cfg.Layers = c.gptLayers
		cfg.WrittenOutAttention = written
		cfg.UnpackedAttention = unpacked
		attn := "fused attention"
		switch {
		case written:
			attn = "attention written out"
		case unpacked:
			attn = "q, k, v sliced and permuted into the attention op, as PyTorch code writes it"
		}
		return benchModel{name: name, seq: c.gptSeq, batch: c.gptBatch, tight: c.tightGPT, upper: 4096,
			about: fmt.Sprintf("GPT-2 small shape (%d layers, width 768, 12 heads, vocab 50257, tied head, %s), seq %d",
				cfg.Layers, attn, c.gptSeq),
			optName: "adamw(lr=3e-4, wd=0.01)", optimizer: func() *optim.Adam { o := optim.NewAdamW(3e-4); o.WeightDecay = 0.01; return o },
			module: func(opt nn.Options) nn.Module { return models.NewGPT(opt, cfg) },
			build: func(m nn.Module, n int, data *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
				tok := source(nil, data, []int{n, c.gptSeq}, graph.Int64, cfg.Vocab)
				tgt := source(tok.Graph(), data, []int{n, c.gptSeq}, graph.Int64, cfg.Vocab)
				return models.Loss(m.(*models.GPT).Forward(tok), tgt), []*lazy.Tensor{tok, tgt}
			}}
	}
	convCfg := models.CIFAR10()
	conv := benchModel{name: "conv", batch: c.convBatch, tight: c.tightConv, upper: 1 << 20,
		about: fmt.Sprintf("ConvNet %d×%d×%d, conv 3×3 %v → ReLU → max-pool 2×2 per stage, linear %d, mean cross-entropy",
			convCfg.Channels, convCfg.Size, convCfg.Size, convCfg.Widths, convCfg.Classes),
		optName: "adam(lr=1e-3)", optimizer: func() *optim.Adam { return optim.NewAdam(1e-3) },
		module: func(opt nn.Options) nn.Module { return models.NewConvNet(opt, convCfg) },
		build: func(m nn.Module, n int, data *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
			x := source(nil, data, []int{n, convCfg.Channels, convCfg.Size, convCfg.Size}, graph.Float32, 0)
			y := source(x.Graph(), data, []int{n}, graph.Int64, convCfg.Classes)
			return m.Forward(x).CrossEntropy(y, graph.ReduceMean), []*lazy.Tensor{x, y}
		}}
	rcfg := models.ResNet50(1000)
	rcfg.ImageSize = c.resnetSize
	resnet := benchModel{name: "resnet50", batch: c.resnetBatch, tight: c.resnetBatch, upper: 4096,
		about: fmt.Sprintf("ResNet-50 (torchvision layout, batch norm in training mode) over 3×%d×%d images, 1000 classes, mean cross-entropy",
			c.resnetSize, c.resnetSize),
		optName: "adam(lr=1e-3)", optimizer: func() *optim.Adam { return optim.NewAdam(1e-3) },
		module: func(opt nn.Options) nn.Module { return models.NewResNet(opt, rcfg) },
		build: func(m nn.Module, n int, data *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
			x := source(nil, data, []int{n, 3, c.resnetSize, c.resnetSize}, graph.Float32, 0)
			y := source(x.Graph(), data, []int{n}, graph.Int64, 1000)
			return m.Forward(x).CrossEntropy(y, graph.ReduceMean), []*lazy.Tensor{x, y}
		}}
	var llamaCfg models.LlamaConfig
	if names := strings.Split(strings.ReplaceAll(c.models, " ", ""), ","); slices.Contains(names, "llama") || slices.Contains(names, "llama-written") {
		var err error
		if llamaCfg, err = llamaConfig(c); err != nil {
			return nil, err
		}
	}
	llamaOf := func(name string, written bool) benchModel {
		cfg := llamaCfg
		cfg.WrittenOut = written
		how := "models.Llama"
		if written {
			how = "models.Llama written out (RMSNorm, rotary and SwiGLU as plain ops, attention op)"
		}
		return benchModel{name: name, seq: c.llamaSeq, batch: c.llamaBatch, tight: c.tightLlama, upper: c.llamaUpper,
			about: fmt.Sprintf("%s, %s shape (%d layers, width %d, %d/%d heads of %d, SwiGLU %d, vocab %d, tied %v, rope %s), seq %d, causal LM loss%s",
				how, c.llamaConfig, llamaCfg.Layers, llamaCfg.Hidden, llamaCfg.Heads, llamaCfg.KVHeadsOrDefault(), llamaCfg.HeadDimOrDefault(),
				llamaCfg.Intermediate, llamaCfg.Vocab, llamaCfg.TieEmbeddings, llamaCfg.Rope.Type, c.llamaSeq, loraAbout(c)),
			optName: "adamw(lr=3e-4, wd=0.01)", optimizer: func() *optim.Adam { o := optim.NewAdamW(3e-4); o.WeightDecay = 0.01; return o },
			module: func(opt nn.Options) nn.Module {
				m := models.NewLlama(opt, cfg)
				if c.llamaLoRA > 0 {
					l := nn.LoRA{Rank: c.llamaLoRA, Alpha: float64(2 * c.llamaLoRA), Targets: strings.Split(c.llamaTargets, ",")}
					if _, err := l.Apply(opt, m); err != nil {
						return &failedModule{err}
					}
				}
				return m
			},
			build: func(m nn.Module, n int, data *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
				if f, ok := m.(*failedModule); ok {
					return lazy.ErrorTensor("llama lora", f.err), nil
				}
				// Hugging Face's labels=input_ids: the labels are the tokens,
				// shifted here (as the loss would) so that a program compiled
				// once is fed them; nothing is ignored, so the mean's count
				// is n·(seq − 1) every step.
				tok := source(nil, data, []int{n, c.llamaSeq}, graph.Int64, cfg.Vocab)
				var labels *lazy.Tensor
				if data == nil {
					labels = tok.Graph().Placeholder([]int{n, c.llamaSeq}, graph.Int64, 0)
				} else {
					shifted, _, err := models.ShiftLabels(tok.Value())
					if err != nil {
						return lazy.ErrorTensor("llama labels", err), nil
					}
					labels = tok.Graph().Wrap(shifted, 0)
				}
				logits := m.(*models.Llama).Forward(tok)
				return models.ShiftedCausalLMLoss(logits, labels, n*(c.llamaSeq-1)), []*lazy.Tensor{tok, labels}
			}}
	}
	var out []benchModel
	for _, name := range strings.Split(c.models, ",") {
		switch strings.TrimSpace(name) {
		case "mlp":
			out = append(out, mlp)
		case "gpt":
			out = append(out, gptOf("gpt", false, false))
		case "gpt-written":
			out = append(out, gptOf("gpt-written", true, false))
		case "gpt-unpacked":
			out = append(out, gptOf("gpt-unpacked", false, true))
		case "conv":
			out = append(out, conv)
		case "resnet50":
			out = append(out, resnet)
		case "llama":
			out = append(out, llamaOf("llama", false))
		case "llama-written":
			out = append(out, llamaOf("llama-written", true))
		default:
			return nil, graph.Errorf(graph.ErrAttr, "gobench: unknown model %q (mlp, gpt, gpt-written, gpt-unpacked, conv, resnet50, llama, llama-written)", name)
		}
	}
	return out, nil
}

// failedModule is a model that could not be made (a bad -llama-lora):
// its Forward and Err report why.
type failedModule struct{ err error }

func (f *failedModule) Forward(*lazy.Tensor) *lazy.Tensor { return lazy.ErrorTensor("gobench", f.err) }
func (f *failedModule) Params() []*nn.Param               { return nil }
func (f *failedModule) Err() error                        { return f.err }

// llamaConfig is the llama model's config: -llama-config's shape with
// -llama-layers' layers.
func llamaConfig(c config) (models.LlamaConfig, error) {
	var cfg models.LlamaConfig
	switch c.llamaConfig {
	case "llama3.2-1b":
		cfg = models.Llama32_1B()
	case "llama3-8b":
		cfg = models.Llama3_8B()
	case "llama-tiny":
		cfg = models.LlamaTiny()
	case "llama-0.8b", "llama-8x1024":
		cfg = models.LlamaConfig{Vocab: 32000, Hidden: 2048, Intermediate: 5632, Layers: 16, Heads: 16, KVHeads: 4, HeadDim: 128,
			MaxPositions: 4096, RMSNormEps: 1e-5, TieEmbeddings: true, Rope: models.RopeConfig{Theta: 10000}}
		if c.llamaConfig == "llama-8x1024" {
			cfg.Hidden, cfg.Intermediate, cfg.Layers, cfg.KVHeads, cfg.HeadDim = 1024, 2816, 8, 16, 64
		}
	default:
		return cfg, graph.Errorf(graph.ErrAttr, "gobench: -llama-config %q (llama3.2-1b, llama3-8b, llama-tiny, llama-0.8b, llama-8x1024)", c.llamaConfig)
	}
	if c.llamaLayers < 0 || c.llamaSeq < 2 || c.llamaBatch < 1 {
		return cfg, graph.Errorf(graph.ErrAttr, "gobench: -llama-layers %d, -llama-seq %d, -llama-batch %d (want ≥ 0, ≥ 2, ≥ 1)", c.llamaLayers, c.llamaSeq, c.llamaBatch)
	}
	if c.llamaLayers > 0 {
		cfg.Layers = c.llamaLayers
	}
	return cfg, cfg.Check()
}

// resolvePrecision checks -precision and folds -tf32 into it.
func (c *config) resolvePrecision() error {
	pol, err := precision.Parse(c.precision)
	if err != nil {
		return fmt.Errorf("-precision: %w", err)
	}
	if c.tf32 {
		if pol != precision.FP32 && pol != precision.TF32 {
			return fmt.Errorf("-tf32 with -precision %s: pick one", pol)
		}
		pol = precision.TF32
	}
	c.precision, c.tf32 = string(pol), pol.TF32()
	return nil
}

func (c config) policy() precision.Policy { return precision.Policy(c.precision) }

// nhwc reports whether the conv nets' activations are stored channels
// last: -channels-last under bf16-mixed (no other policy has a bfloat16
// convolution).
func (c config) nhwc() bool { return c.channelsLast && c.policy() == precision.BF16Mixed }

// train is how compileStep builds the step's graph besides the policy.
func (c config) train() compile.Options {
	o := compile.Options{ChannelsLast: c.nhwc(), LossChunk: c.lossChunk}
	if c.noPointwise {
		o.Disable = append(o.Disable, compile.FusePointwise)
	}
	if c.noFusedLoss {
		o.Disable = append(o.Disable, compile.FuseLinearCrossEntropy)
	}
	return o
}

// compileStep compiles a training step as batchfit.Session.Step does, with
// workspace rule ws (the executor's, cuda.Executor.Workspace, to run it
// there): the precision policy's graph pass and o's
// (compile.Train: the layout pass with -channels-last), then the
// loss and the gradients of params kept on the device. inputs are source
// nodes of loss's graph; their ids in the compiled graph come back in the
// same order, for feeding.
func compileStep(ws planner.WorkspaceFunc, pol precision.Policy, o compile.Options, loss *lazy.Tensor, params []*lazy.Tensor, slots int, inputs ...*lazy.Tensor) (*planner.Program, []int, error) {
	if err := loss.Err(); err != nil {
		return nil, nil, err
	}
	wrt, err := lazy.ParamIDs(loss, params...)
	if err != nil {
		return nil, nil, err
	}
	o.Policy = pol
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, o)
	if err != nil {
		return nil, nil, err
	}
	ng := st.Graph
	if _, rows, _, _, ok := graph.LossChunkOf(ng); ok && o.LossChunk <= 0 {
		// A fused loss's token chunk: o's (-loss-chunk), else the largest
		// candidate, a Session's choice where memory is ample.
		if ng, err = graph.WithLossChunk(ng, planner.LossChunkCandidates(rows)[0]); err != nil {
			return nil, nil, err
		}
	}
	outs := append([]int{st.Loss}, st.Grads...)
	info, err := shapeinfer.Analyze(ng, outs...)
	if err != nil {
		return nil, nil, err
	}
	p, err := planner.Compile(ng, info, outs, planner.CompileOptions{Kept: outs[1:], Trained: st.Params,
		StateSlots: slots, Workspace: ws, OptimizerScalars: true}) // the device optimizer's scalars
	if err != nil {
		return nil, nil, err
	}
	in := make([]int, len(inputs))
	for i, x := range inputs {
		in[i] = st.IDs[x.ID()]
	}
	return p, in, nil
}

func used(d *cuda.Device) (int64, int64, error) {
	free, total, err := d.Backend().MemInfo()
	return total - free, free, err
}

func run(c config, w io.Writer) error {
	ms, err := benchModels(c)
	if err != nil {
		return err
	}
	if c.dist {
		var errs []error
		for _, m := range ms {
			r, err := distThroughput(c, m)
			if err != nil {
				r.Error = err.Error()
				errs = append(errs, err)
			}
			if err := writeRecord(w, r); err != nil {
				return err
			}
		}
		return errors.Join(errs...)
	}
	d, err := cuda.Open(cuda.Options{})
	if err != nil {
		return err
	}
	defer d.Close()
	_, free, err := used(d)
	if err != nil {
		return err
	}
	if err := writeRecord(w, Record{Kind: "device", Device: d.Describe(), DeviceTotal: d.TotalMem(), DeviceFree: free}); err != nil {
		return err
	}
	for _, m := range ms {
		executor := func() error {
			if !c.throughput {
				return nil
			}
			r, err := throughput(d, c, m)
			if err != nil {
				r.Error = err.Error()
			}
			return writeRecord(w, r)
		}
		session := func() error {
			if !c.session {
				return nil
			}
			r, err := sessionThroughput(c, m)
			if err != nil {
				r.Error = err.Error()
			}
			return writeRecord(w, r)
		}
		if c.interleave > 0 && c.throughput && c.session {
			if err := interleaved(w, d, c, m); err != nil {
				return err
			}
			continue
		}
		first, second := executor, session
		if c.sessionFirst {
			first, second = session, executor
		}
		if err := first(); err != nil {
			return err
		}
		if err := second(); err != nil {
			return err
		}
	}
	if c.cap > 0 {
		deviceUsed := func() (int64, error) {
			u, _, err := used(d)
			return u, err
		}
		for _, m := range ms {
			for _, mode := range capModes {
				r, err := capThroughput(c, m, mode, batchfit.DeviceCUDA, deviceUsed)
				if err != nil {
					r.Error = err.Error()
				}
				if err := writeRecord(w, r); err != nil {
					return err
				}
			}
		}
	}
	if c.maxBatch {
		for _, m := range ms {
			r, err := maxBatch(d, c, m)
			if err != nil {
				r.Error = err.Error()
			}
			if err := writeRecord(w, r); err != nil {
				return err
			}
		}
	}
	if c.budget > 0 {
		for _, m := range ms {
			r, err := tightness(d, c, m)
			if err != nil {
				r.Error = err.Error()
			}
			if err := writeRecord(w, r); err != nil {
				return err
			}
		}
	}
	return nil
}

func scalar(t *tensor.Dense) float64 {
	switch v := t.Data().(type) {
	case float32:
		return float64(v)
	case []float32:
		if len(v) > 0 {
			return float64(v[0])
		}
	}
	return 0
}

// throughput plans the model's step at its batch, then runs c.warmup
// untimed and c.steps timed resident steps with the optimizer on the
// device, a fresh batch of host data fed (and uploaded) every step.
func throughput(d *cuda.Device, c config, m benchModel) (Record, error) {
	l, err := newExecutorLoop(d, c, m)
	if err != nil {
		return *l.r, err
	}
	defer l.close()
	return *l.r, runLoop(l, c)
}

// newExecutorLoop sets up throughput's loop.
func newExecutorLoop(d *cuda.Device, c config, m benchModel) (*stepLoop, error) {
	r := &Record{Kind: "throughput", Model: m.name, About: m.about, Batch: m.batch, Seq: m.seq, Optimizer: m.optName,
		Warmup: c.warmup, Steps: c.steps, TF32: c.tf32, Precision: c.precision, ChannelsLast: c.nhwc(), HostWorkSeconds: c.hostWork.Seconds()}
	l := &stepLoop{r: r, close: func() {}}
	start := time.Now()
	mod := m.module(nn.Seed(1))
	if err := nn.Check(mod); err != nil {
		return l, err
	}
	r.Params = int64(nn.NumParams(mod))
	r.BuildModelSeconds = time.Since(start).Seconds()

	// Four batches of host data, cycled: the first builds the graph, the
	// others are fed in its place.
	rng := rand.New(rand.NewPCG(2, 3))
	_, inputs := m.build(mod, m.batch, rng)
	feeds := make([][]tensor.Tensor, 4)
	feeds[0] = []tensor.Tensor{inputs[0].Value(), inputs[1].Value()}
	for i := 1; i < len(feeds); i++ {
		_, in := m.build(mod, m.batch, rng)
		feeds[i] = []tensor.Tensor{in[0].Value(), in[1].Value()}
	}

	before, free, err := used(d)
	if err != nil {
		return l, err
	}
	r.DeviceUsedBefore = before
	start = time.Now()
	e, err := cuda.NewExecutor(d, c.executorOptions())
	if err != nil {
		return l, err
	}
	r.ExecutorSeconds = time.Since(start).Seconds()
	stopProfile := func() {}
	l.close = func() {
		stopProfile()
		_ = e.Close() // the records are written; a close error changes none of them
	}
	r.Overhead = e.Overhead()
	r.Convolutions = e.Convolutions()

	// Planning: the graph was built above with the data; time a fresh
	// build of the same step, as a training loop makes one every step.
	start = time.Now()
	loss, inputs := m.build(mod, m.batch, nil)
	p, ids, err := compileStep(e.Workspace(), c.policy(), c.train(), loss, nn.Trainable(mod), 2, inputs...)
	if err != nil {
		return l, err
	}
	pl, err := planner.Make(p, planner.Options{Budget: free - e.Overhead()})
	if err != nil {
		return l, err
	}
	r.PlanSeconds = time.Since(start).Seconds()
	r.Chunks = len(pl.Chunks)
	r.PredictedPeakReserved, r.PredictedPeakAllocated = pl.PeakReserved, pl.PeakAllocated

	opt := m.optimizer()
	ctx := context.Background()
	var st0 alloc.Stats
	l.step = func(i int) error {
		if i == c.warmup {
			st0 = e.Allocator().Stats()
		}
		batch := feeds[i%len(feeds)]
		feed := func(id int) tensor.Tensor {
			if k := slices.Index(ids, id); k >= 0 {
				return batch[k]
			}
			return nil
		}
		if i == c.warmup && c.cpuProfile != "" {
			var err error
			if stopProfile, err = startCPUProfile(c.cpuProfile, m.name); err != nil {
				return err
			}
		}
		// As a training loop: the gradients stay on the device.
		res, err := e.Execute(ctx, p, pl.Chunks, cuda.ExecOptions{Feed: feed, Resident: true, Optimizer: opt, KeptOnDevice: true})
		if err != nil {
			return fmt.Errorf("%s step %d: %w", m.name, i, err)
		}
		for end := time.Now(); time.Since(end) < c.hostWork; {
		}
		lv := scalar(res.Outputs[0])
		if i == 0 {
			r.FirstLoss = lv
		}
		r.LastLoss = lv
		r.MeasuredPeakReserved = max(r.MeasuredPeakReserved, res.Usage.PeakReserved)
		r.MeasuredPeakAllocated = max(r.MeasuredPeakAllocated, res.Usage.PeakAllocated)
		if i == 0 || i == c.warmup-1 { // a steady loop's device use is the same at every step
			u, _, err := used(d)
			if err != nil {
				return err
			}
			r.DeviceUsedPeak = max(r.DeviceUsedPeak, u)
		}
		return nil
	}
	l.end = func() error {
		if err := d.Synchronize(); err != nil {
			return err
		}
		u, _, err := used(d)
		if err != nil {
			return err
		}
		r.DeviceUsedPeak = max(r.DeviceUsedPeak, u)
		stopProfile()
		st1 := e.Allocator().Stats()
		r.DeviceAllocs, r.DeviceFrees = st1.NumDeviceAlloc-st0.NumDeviceAlloc, st1.NumDeviceFree-st0.NumDeviceFree
		if c.profile > 0 {
			feed := func(id int) tensor.Tensor {
				if k := slices.Index(ids, id); k >= 0 {
					return feeds[0][k]
				}
				return nil
			}
			if err := profileStep(os.Stderr, e, p, pl.Chunks, feed, opt, m.name, c.profile); err != nil {
				return err
			}
			printChoices(os.Stderr, e, m.name)
		}
		if dnn := e.DNN(); dnn != nil {
			st := dnn.SearchStats()
			r.ConvSearched, r.ConvFromCache, r.ConvHeuristic = st.Searched, st.FromDisk+st.FromProcess, st.Heuristics
			r.ConvSearchMaxBytes = st.MaxBytes
		}
		r.setRates(m.batch)
		gs := e.GraphStats()
		r.GraphCaptures, r.GraphReplays, r.GraphEager, r.GraphDriverBytes = gs.Captures, gs.Replays, gs.Eager, gs.DriverBytes
		return nil
	}
	return l, nil
}

// interleaved writes model m's throughput and session records, their
// timed steps run in alternate blocks of c.interleave (runInterleaved).
func interleaved(w io.Writer, d *cuda.Device, c config, m benchModel) error {
	ex, err := newExecutorLoop(d, c, m)
	defer ex.close()
	if err != nil {
		ex.r.Error = err.Error()
		return writeRecord(w, *ex.r)
	}
	se, err := newSessionLoop(c, m)
	defer se.close()
	if err != nil {
		se.r.Error = err.Error()
		return errors.Join(writeRecord(w, *ex.r), writeRecord(w, *se.r))
	}
	if err := runInterleaved(ex, se, c, c.interleave); err != nil {
		ex.r.Error, se.r.Error = err.Error(), err.Error()
	}
	return errors.Join(writeRecord(w, *ex.r), writeRecord(w, *se.r))
}

// setRates fills the median step time and the rates it gives from
// StepSeconds, when there are any.
// median is the middle of xs (the mean of the two middle ones for an even
// count), 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}

func (r *Record) setRates(batch int) {
	if len(r.StepSeconds) == 0 {
		return
	}
	med := median(r.StepSeconds)
	r.MedianStepSeconds = med
	r.StepsPerSecond = 1 / med
	r.SamplesPerSecond = float64(batch) / med
}

// maxBatch asks the planner for the largest batch whose whole training
// step (one chunk) fits the card's free memory, as Lightning's
// BatchSizeFinder and accelerate's find_executable_batch_size do by
// trial, without a trial: batchfit.Session.MaxBatch builds the
// shape-only step at each candidate batch and plans it with the
// session's own compile path and budget (searchMaxBatch). It then runs
// one step at that batch on the card through the same session, with
// data, and records its measured peaks beside the plan's and the card's
// used memory (d: the card, for cuMemGetInfo).
func maxBatch(d *cuda.Device, c config, m benchModel) (Record, error) {
	r := Record{Kind: "maxbatch", Model: m.name, About: m.about, Seq: m.seq, Optimizer: m.optName, Upper: m.upper,
		TF32: c.tf32, Precision: c.precision, ChannelsLast: c.nhwc()}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA, TF32: c.tf32, Precision: c.precision,
		NoCUDAGraphs: !c.cudaGraphs, NoChannelsLast: !c.channelsLast, NoPointwiseFusion: c.noPointwise,
		NoFusedLoss: c.noFusedLoss, LossChunk: c.lossChunk})
	if err := sess.Err(); err != nil {
		return r, err
	}
	defer sess.Close()
	r.Overhead = sess.Overhead()

	start := time.Now()
	fit, err := searchMaxBatch(sess, m)
	r.SearchSeconds = time.Since(start).Seconds()
	if err != nil {
		return r, err
	}
	r.Batch, r.Replays = fit.Batch, fit.Plans
	if fit.Batch == 0 {
		return r, graph.Errorf(graph.ErrShape, "%s: not even one sample fits the card's free memory", m.name)
	}
	pl := fit.Plan.Plan
	r.Budget = pl.Budget
	r.PredictedPeakReserved, r.PredictedPeakAllocated = pl.PeakReserved, pl.PeakAllocated
	if fit.AtLimit {
		r.Error = fmt.Sprintf("the search's upper bound %d fits: the largest batch is at least that", m.upper)
	}
	if !c.verify {
		return r, nil
	}

	// One step at the found batch, on the card, with real data.
	real := m.module(nn.Seed(1))
	loss, _ := m.build(real, fit.Batch, rand.New(rand.NewPCG(4, 5)))
	start = time.Now()
	_, err = sess.Step(context.Background(), loss, nn.ParamTensors(real), m.optimizer())
	r.VerifySeconds = time.Since(start).Seconds()
	if err != nil {
		return r, fmt.Errorf("step at batch %d: %w", fit.Batch, err)
	}
	if err := sess.SyncParams(); err != nil {
		return r, err
	}
	r.Verified = true
	spl, u := sess.LastPlan(), sess.LastUsage()
	r.Chunks, r.StepPredictedPeakReserved = spl.Split.Len(), spl.PeakReserved
	r.MeasuredPeakReserved, r.MeasuredPeakAllocated = u.PeakReserved, u.PeakAllocated // Overhead included
	if r.DeviceUsedPeak, r.VerifyFreeLeft, err = used(d); err != nil {
		return r, err
	}
	return r, nil
}

// searchMaxBatch is maxBatch's search: Session.MaxBatch over m's training
// step, one shape-only module and a new graph over placeholders per
// batch, up to m.upper samples.
func searchMaxBatch(sess *batchfit.Session, m benchModel) (*batchfit.BatchFit, error) {
	mod := m.module(nn.Options{ShapeOnly: true})
	if err := nn.Check(mod); err != nil {
		return nil, err
	}
	params := nn.ParamTensors(mod)
	build := func(n int) (*lazy.Tensor, []*lazy.Tensor) {
		loss, _ := m.build(mod, n, nil)
		return loss, params
	}
	return sess.MaxBatch(build, m.optimizer(), batchfit.MaxBatchOptions{Limit: m.upper})
}

// executorOptions are the CUDA executor's options the flags ask for.
func (c config) executorOptions() cuda.ExecutorOptions {
	return cuda.ExecutorOptions{TF32: c.tf32, NoCuDNN: !c.cudnn, ConvHeuristics: !c.cudnnFind, ConvSearchAll: c.cudnnFindAll, NoCuDNNBatchNorm: !c.cudnnBN,
		NoCuDNNAttention: !c.cudnnAttn, NoCUDAGraphs: !c.cudaGraphs}
}

// loraAbout describes -llama-lora for a record, "" without it.
func loraAbout(c config) string {
	if c.llamaLoRA == 0 {
		return ""
	}
	return fmt.Sprintf(", LoRA rank %d alpha %d on %s (base frozen in bfloat16)", c.llamaLoRA, 2*c.llamaLoRA, c.llamaTargets)
}
