package main

import (
	"fmt"
	"math/rand/v2"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// built is one model's graph: the module, its output over placeholder
// inputs, and in training mode the mean cross-entropy against placeholder
// labels. Inputs come first, then labels, then the model's nodes, the order
// a training loop builds them in.
type built struct {
	module nn.Module
	output *lazy.Tensor
	loss   *lazy.Tensor // nil unless train
}

// zooModel is a model the CLI can plan without data.
type zooModel struct {
	name  string
	about string
	// context is the longest sequence of a sequence model, its --seq
	// default; 0 for models without a sequence axis.
	context int
	// seqDefault is the --seq default when it is less than context (a
	// Hugging Face config's long max_position_embeddings); 0: context.
	seqDefault int
	input      string // per sample, for the model list
	// checkSeq, when set, says why the model cannot be built at seq
	// tokens (a usage error), or nil.
	checkSeq func(seq int) error
	// withContext is the same model with n positions (--context); nil
	// for models without a sequence axis.
	withContext func(n int) zooModel
	// build makes the model and its graph. With data nil the inputs and
	// labels are placeholders (shape-only); otherwise they hold values
	// drawn from data, so the step can run: float features from N(0, 1),
	// tokens and labels uniform over the vocabulary or the classes.
	build func(opt nn.Options, batch, seq int, train bool, data *rand.Rand, adapt adaptFunc) built
}

// adaptFunc changes a zoo model after it is made and before its graph is
// built (estimate's --lora: nn.LoRA.Apply); nil changes nothing.
// It is given the options the model was made with.
type adaptFunc func(nn.Options, nn.Module) error

func (f adaptFunc) apply(opt nn.Options, m nn.Module) error {
	if f == nil {
		return nil
	}
	return f(opt, m)
}

// failed is a model whose adapting failed: its output and loss carry err.
func failed(m nn.Module, err error) built {
	e := lazy.ErrorTensor("batchfit estimate", err)
	return built{module: m, output: e, loss: e}
}

// source is an input of the given shape: a placeholder, or with data a
// tensor drawn from it (int64 uniform in [0, k), floats from N(0, 1)).
func source(g *lazy.Graph, data *rand.Rand, shape []int, dt graph.DType, k int) *lazy.Tensor {
	if data == nil {
		if g == nil {
			return lazy.Placeholder(shape, dt, 0)
		}
		return g.Placeholder(shape, dt, 0)
	}
	var t *tensor.Dense
	if dt == graph.Int64 {
		d := make([]int64, graph.Numel(shape))
		for i := range d {
			d[i] = int64(data.IntN(k))
		}
		t = tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
	} else {
		d := make([]float32, graph.Numel(shape))
		for i := range d {
			d[i] = float32(data.NormFloat64())
		}
		t = tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
	}
	if g == nil {
		return lazy.Wrap(t, 0)
	}
	return g.Wrap(t, 0)
}

// gptEntry is a GPT of cfg as a zoo entry, its context the --seq default
// and bound; --context (withContext) gives its position table n rows.
func gptEntry(name, about string, cfg models.GPTConfig) zooModel {
	withContext := func(n int) zooModel {
		c := cfg
		c.Context = n
		return gptEntry(name, fmt.Sprintf("%s; %d positions (--context)", about, n), c)
	}
	return zooModel{name: name, about: about, context: cfg.Context, withContext: withContext,
		input: fmt.Sprintf("tokens [≤%d] int64", cfg.Context),
		build: func(opt nn.Options, b, t int, train bool, data *rand.Rand, adapt adaptFunc) built {
			m := models.NewGPT(opt, cfg)
			if err := adapt.apply(opt, m); err != nil {
				return failed(m, err)
			}
			tokens := source(nil, data, []int{b, t}, graph.Int64, cfg.Vocab)
			var targets *lazy.Tensor
			if train {
				targets = source(tokens.Graph(), data, []int{b, t}, graph.Int64, cfg.Vocab)
			}
			out := built{module: m, output: m.Forward(tokens)}
			if train {
				out.loss = models.Loss(out.output, targets)
			}
			return out
		}}
}

// llamaEntry is a Llama of cfg as a zoo entry. A Llama's positions are
// rotary angles, with no table to outgrow: context is only the --seq
// default and bound.
func llamaEntry(name, about string, cfg models.LlamaConfig, context int) zooModel {
	withContext := func(n int) zooModel {
		return llamaEntry(name, fmt.Sprintf("%s; --seq default %d (--context)", about, n), cfg, n)
	}
	return zooModel{name: name, about: about, context: context, withContext: withContext,
		input: fmt.Sprintf("tokens [%d] int64", context),
		build: func(opt nn.Options, b, t int, train bool, data *rand.Rand, adapt adaptFunc) built {
			m := models.NewLlama(opt, cfg)
			if err := adapt.apply(opt, m); err != nil {
				return failed(m, err)
			}
			tokens := source(nil, data, []int{b, t}, graph.Int64, cfg.Vocab)
			out := built{module: m, output: m.Forward(tokens)}
			if train {
				// Hugging Face's labels=: the tokens' own ids, shifted by
				// the loss (a dry run's placeholder labels count as
				// shifted already).
				labels := source(tokens.Graph(), data, []int{b, t}, graph.Int64, cfg.Vocab)
				out.loss = models.CausalLMLoss(out.output, labels)
			}
			return out
		}}
}

func zoo() []zooModel {
	gpt, llama := gptEntry, llamaEntry
	classifier := func(name, about, input string, sample []int, classes int, newModule func(nn.Options) nn.Module) zooModel {
		return zooModel{name: name, about: about,
			input: fmt.Sprintf("%s %v", input, sample),
			build: func(opt nn.Options, b, _ int, train bool, data *rand.Rand, adapt adaptFunc) built {
				m := newModule(opt)
				if err := adapt.apply(opt, m); err != nil {
					return failed(m, err)
				}
				// Batch norms normalise with the batch's statistics in
				// training mode and with their running ones for inference,
				// as after PyTorch's train() and eval().
				nn.SetTraining(m, train)
				dt := opt.DType
				if dt == graph.InvalidDType {
					dt = graph.Float32
				}
				x := source(nil, data, append([]int{b}, sample...), dt, 0)
				var labels *lazy.Tensor
				if train {
					labels = source(x.Graph(), data, []int{b}, graph.Int64, classes)
				}
				out := built{module: m, output: m.Forward(x)}
				if train {
					out.loss = out.output.CrossEntropy(labels, graph.ReduceMean)
				}
				return out
			}}
	}
	mlp := func(sizes ...int) func(nn.Options) nn.Module {
		return func(opt nn.Options) nn.Module { return nn.MLP(opt, sizes, nn.ReLU{}) }
	}
	resnet := func(cfg models.ResNetConfig) func(nn.Options) nn.Module {
		return func(opt nn.Options) nn.Module { return models.NewResNet(opt, cfg) }
	}
	return []zooModel{
		classifier("mlp", "MLP 784→512→512→10 with ReLU (FashionMNIST-shaped)", "features", []int{784}, 10, mlp(784, 512, 512, 10)),
		classifier("mlp-large", "MLP 784→4096→4096→10 with ReLU", "features", []int{784}, 10, mlp(784, 4096, 4096, 10)),
		classifier("convnet", "CIFAR-10 ConvNet, 3 stages of conv 3×3 (32, 64, 128) → ReLU → max-pool, linear head",
			"images", []int{3, 32, 32}, models.CIFAR10().Classes, func(opt nn.Options) nn.Module { return models.NewConvNet(opt, models.CIFAR10()) }),
		classifier("resnet18", "ResNet-18, torchvision layout, ImageNet 224×224, 1000 classes (training-mode batch norm: the batch runs whole unless --batchnorm per-chunk)",
			"images", []int{3, 224, 224}, 1000, resnet(models.ResNet18(1000))),
		classifier("resnet50", "ResNet-50, torchvision layout (Bottleneck v1.5), ImageNet 224×224, 1000 classes (training-mode batch norm: the batch runs whole unless --batchnorm per-chunk)",
			"images", []int{3, 224, 224}, 1000, resnet(models.ResNet50(1000))),
		classifier("resnet18-cifar", "ResNet-18 with a CIFAR stem (conv 3×3, no max-pool), 32×32, 10 classes (training-mode batch norm: the batch runs whole unless --batchnorm per-chunk)",
			"images", []int{3, 32, 32}, 10, resnet(models.ResNet18CIFAR(10))),
		gpt("gpt-tiny", "GPT, 2 layers, width 32, 2 heads, 32 positions, vocab 32 (examples/transformer)",
			models.GPTConfig{Vocab: 32, Context: 32, Layers: 2, Heads: 2, Dim: 32}),
		gpt("gpt2-small", "GPT-2 small, 12 layers, width 768, 12 heads, 1024 positions, vocab 50257, tied head",
			models.GPT2Small()),
		llama("llama-tiny", "Llama, 2 layers, width 32, 4 query and 2 key/value heads, SwiGLU 64, vocab 64, tied, llama3 rope scaling (the CPU's)",
			models.LlamaTiny(), 64),
		llama("llama3.2-1b", "Llama 3.2 1B: 16 layers, width 2048, 32 query and 8 key/value heads of 64, SwiGLU 8192, vocab 128256, tied, rope theta 500000 with llama3 scaling (factor 32)",
			models.Llama32_1B(), 2048),
		llama("llama3.2-3b", "Llama 3.2 3B: 28 layers, width 3072, 24 query and 8 key/value heads of 128, SwiGLU 8192, vocab 128256, tied, rope theta 500000 with llama3 scaling (factor 32)",
			models.Llama32_3B(), 2048),
		llama("llama3-8b", "Llama 3 8B: 32 layers, width 4096, 32 query and 8 key/value heads of 128, SwiGLU 14336, vocab 128256, untied head, rope theta 500000 (shape only: 32 GB of float32 parameters)",
			models.Llama3_8B(), 8192),
		gpt("gpt2-small-written", "GPT-2 small with attention written out (q·kᵀ, scale, causal mask, softmax, ·v: five [B, 12, T, T] values) instead of the fused op",
			writtenOut(models.GPT2Small())),
		llama("llama3.2-1b-written", "Llama 3.2 1B written out with plain ops as a user writes it (RMSNorm, rotary embedding and SwiGLU from elementwise ops, slices and concat; three projections into the attention op): what the pointwise fusion compiles (--passes)",
			writtenLlama(models.Llama32_1B()), 2048),
	}
}

// writtenLlama is cfg built with plain ops (models.LlamaConfig.WrittenOut),
// for comparison with the hand-fused ops of the zoo's other Llamas.
func writtenLlama(cfg models.LlamaConfig) models.LlamaConfig {
	cfg.WrittenOut = true
	return cfg
}

// writtenOut is cfg with attention written out as PyTorch's eager code
// writes it, for comparison with the fused op the zoo's other GPTs use.
func writtenOut(cfg models.GPTConfig) models.GPTConfig {
	cfg.WrittenOutAttention = true
	return cfg
}

func zooNames() []string {
	var names []string
	for _, m := range zoo() {
		names = append(names, m.name)
	}
	return names
}

func findModel(name string) (zooModel, bool) {
	for _, m := range zoo() {
		if m.name == name {
			return m, true
		}
	}
	return zooModel{}, false
}
