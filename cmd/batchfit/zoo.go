package main

import (
	"fmt"

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
	input   string // per sample, for the model list
	build   func(opt nn.Options, batch, seq int, train bool) built
}

func zoo() []zooModel {
	gpt := func(name, about string, cfg models.GPTConfig) zooModel {
		return zooModel{name: name, about: about, context: cfg.Context,
			input: fmt.Sprintf("tokens [≤%d] int64", cfg.Context),
			build: func(opt nn.Options, b, t int, train bool) built {
				m := models.NewGPT(opt, cfg)
				tokens := lazy.Placeholder([]int{b, t}, graph.Int64, 0)
				var targets *lazy.Tensor
				if train {
					targets = tokens.Graph().Placeholder([]int{b, t}, graph.Int64, 0)
				}
				out := built{module: m, output: m.Forward(tokens)}
				if train {
					out.loss = models.Loss(out.output, targets)
				}
				return out
			}}
	}
	classifier := func(name, about, input string, sample []int, newModule func(nn.Options) nn.Module) zooModel {
		return zooModel{name: name, about: about,
			input: fmt.Sprintf("%s %v", input, sample),
			build: func(opt nn.Options, b, _ int, train bool) built {
				m := newModule(opt)
				dt := opt.DType
				if dt == graph.InvalidDType {
					dt = graph.Float32
				}
				x := lazy.Placeholder(append([]int{b}, sample...), dt, 0)
				var labels *lazy.Tensor
				if train {
					labels = x.Graph().Placeholder([]int{b}, graph.Int64, 0)
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
	return []zooModel{
		classifier("mlp", "MLP 784→512→512→10 with ReLU (FashionMNIST-shaped)", "features", []int{784}, mlp(784, 512, 512, 10)),
		classifier("mlp-large", "MLP 784→4096→4096→10 with ReLU", "features", []int{784}, mlp(784, 4096, 4096, 10)),
		classifier("convnet", "CIFAR-10 ConvNet, 3 stages of conv 3×3 (32, 64, 128) → ReLU → max-pool, linear head",
			"images", []int{3, 32, 32}, func(opt nn.Options) nn.Module { return models.NewConvNet(opt, models.CIFAR10()) }),
		gpt("gpt-tiny", "GPT, 2 layers, width 32, 2 heads, 32 positions, vocab 32 (examples/transformer)",
			models.GPTConfig{Vocab: 32, Context: 32, Layers: 2, Heads: 2, Dim: 32}),
		gpt("gpt2-small", "GPT-2 small, 12 layers, width 768, 12 heads, 1024 positions, vocab 50257, tied head",
			models.GPT2Small()),
	}
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
