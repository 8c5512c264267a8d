package testutil

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// TrainModel is a model under training. Build makes a fresh training graph
// over n new samples drawn from rng, as a training loop does every step,
// and returns the mean cross-entropy loss and the parameters it trains.
// Two models made by the same constructor with the same arguments start
// from the same parameters.
type TrainModel struct {
	Name  string
	Build func(rng *rand.Rand, n int) (loss *lazy.Tensor, params []*lazy.Tensor)
}

// RandFloats returns n values drawn uniformly from [−1, 1).
func RandFloats(rng *rand.Rand, n int) []float32 {
	d := make([]float32, n)
	for i := range d {
		d[i] = float32(2*rng.Float64() - 1)
	}
	return d
}

// UniformF32 draws a float32 tensor of shape uniformly from [−1, 1).
func UniformF32(rng *rand.Rand, shape ...int) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(RandFloats(rng, graph.Numel(shape))))
}

// Classes draws an int64 tensor of shape with values in [0, k).
func Classes(rng *rand.Rand, k int, shape ...int) *tensor.Dense {
	d := make([]int64, graph.Numel(shape))
	for i := range d {
		d[i] = int64(rng.IntN(k))
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

// MLPModel is in → hidden → hidden → 10 with ReLU (parameters from
// nn.Seed(21), as nn.MLP makes them); with dropout, nn.Dropout in training
// mode drops inputs (p 0.2) and the first hidden layer (p 0.3).
func MLPModel(in, hidden int, dropout bool) TrainModel {
	opt := nn.Seed(21)
	mods := []nn.Module{nn.NewLinear(opt, in, hidden, true), nn.ReLU{}}
	if dropout {
		mods = append([]nn.Module{&nn.Dropout{P: 0.2, Training: true, Seed: 5}}, mods...)
		mods = append(mods, &nn.Dropout{P: 0.3, Training: true, Seed: 6})
	}
	mods = append(mods, nn.NewLinear(opt, hidden, hidden, true), nn.ReLU{}, nn.NewLinear(opt, hidden, 10, true))
	m := nn.NewSequential(mods...)
	return TrainModel{"mlp", func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Wrap(UniformF32(rng, n, in), 0)
		y := x.Graph().Wrap(Classes(rng, 10, n), 0)
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}}
}

// GPTModel is a two-layer GPT over 16 tokens of a vocabulary of vocab
// tokens: embedding, layer_norm, causal attention, gelu and their
// gradients; at a vocabulary of 512 the logits dominate the per-sample
// memory. With dropout, lazy Dropout (p 0.1) drops logits, with a counter
// that advances every build.
func GPTModel(vocab int, dropout bool) TrainModel { return gptModel("gpt", vocab, dropout, false) }

// FusedGPTModel is GPTModel with the fused attention op.
func FusedGPTModel(vocab int, dropout bool) TrainModel {
	return gptModel("gpt-fused", vocab, dropout, true)
}

// PaddedHeadGPTModel is FusedGPTModel without dropout over a vocabulary of
// 1,030 tokens: under bf16-mixed and fp16-mixed its head is padded to a
// multiple of precision's AlignOutputs, and its loss reads the padded
// logits (precision's fused loss, cross_entropy with Attrs.End).
func PaddedHeadGPTModel() TrainModel { return gptModel("gpt-padded-head", 1030, false, true) }

// HeadDim64GPTModel is FusedGPTModel without dropout at width 128 over 2
// heads: head dim 64, which cuDNN's fused attention takes in 16 bits, so
// attention_qkv runs there (strided, in place) rather than on copies.
func HeadDim64GPTModel() TrainModel {
	return gptModelOf("gpt-fused-d64", models.GPTConfig{Vocab: 64, Context: 16, Layers: 2, Heads: 2, Dim: 128}, false)
}

func gptModel(name string, vocab int, dropout, fused bool) TrainModel {
	return gptModelOf(name, models.GPTConfig{Vocab: vocab, Context: 16, Layers: 2, Heads: 2, Dim: 16, WrittenOutAttention: !fused}, dropout)
}

// gptModelOf is a GPT of cfg over sequences of cfg.Context tokens.
func gptModelOf(name string, cfg models.GPTConfig, dropout bool) TrainModel {
	seq, vocab := cfg.Context, cfg.Vocab
	m := models.NewGPT(nn.Seed(22), cfg)
	var step uint64
	return TrainModel{name, func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		tokens := lazy.Wrap(Classes(rng, vocab, n, seq), 0)
		targets := tokens.Graph().Wrap(Classes(rng, vocab, n, seq), 0)
		logits := m.Forward(tokens)
		if dropout {
			step++
			logits = logits.Dropout(0.1, 9, step)
		}
		return models.Loss(logits, targets), nn.ParamTensors(m)
	}}
}

// ConvModel is a two-stage ConvNet over 3×size×size images: conv2d,
// pooling and their gradients. With dropout, lazy Dropout (p 0.2) drops
// input pixels, with a counter that advances every build.
func ConvModel(size int, dropout bool) TrainModel {
	m := models.NewConvNet(nn.Seed(23), models.ConvNetConfig{Channels: 3, Size: size, Widths: []int{8, 8}, Classes: 10})
	var step uint64
	return TrainModel{"convnet", func(rng *rand.Rand, n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Wrap(UniformF32(rng, n, 3, size, size), 0)
		y := x.Graph().Wrap(Classes(rng, 10, n), 0)
		if dropout {
			step++
			x = x.Dropout(0.2, 11, step)
		}
		return m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(m)
	}}
}

// StepProgram compiles the program batchfit.Session.Step runs for loss on
// an executor whose kernels' workspace rule is ws (nil: none): outputs are
// the loss and the gradients of params (kept on the device), then extra;
// params are trained with slots optimizer state tensors each.
func StepProgram(t testing.TB, ws planner.WorkspaceFunc, loss *lazy.Tensor, params []*lazy.Tensor, slots int, extra ...int) *planner.Program {
	t.Helper()
	g, outs, co := Step(t, loss, params, slots, extra...)
	co.Workspace = ws
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, co)
	require.NoError(t, err)
	return p
}

// TrainProgram is StepProgram with the optimizer's device scalars in the
// finish workspace (planner.CompileOptions.OptimizerScalars), as a
// batchfit.Session compiles a training step: what the CUDA executor's SGD
// and Adam need.
func TrainProgram(t testing.TB, ws planner.WorkspaceFunc, loss *lazy.Tensor, params []*lazy.Tensor, slots int, extra ...int) *planner.Program {
	t.Helper()
	g, outs, co := Step(t, loss, params, slots, extra...)
	co.Workspace, co.OptimizerScalars = ws, true
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, co)
	require.NoError(t, err)
	return p
}

// Step appends the gradients of params to loss's graph and returns the
// graph, the outputs a Session's Step asks for (the loss, the gradients,
// then extra) and the compile options that keep the gradients and train
// params with slots state tensors each (no workspace rule).
func Step(t testing.TB, loss *lazy.Tensor, params []*lazy.Tensor, slots int, extra ...int) (*graph.Graph, []int, planner.CompileOptions) {
	t.Helper()
	require.NoError(t, loss.Err())
	g := loss.Graph()
	outs := []int{loss.ID()}
	trained := make([]int, len(params))
	for i, gr := range lazy.Grad(loss, params...) {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
		trained[i] = g.NodeOf(params[i])
	}
	kept := slices.Clone(outs[1:])
	return g.IR(), append(outs, extra...), planner.CompileOptions{Kept: kept, Trained: trained, StateSlots: slots}
}

// TightBudgets maps each chunk count the planner can choose for p to the
// smallest budget at which it chooses it. Every segment the allocator
// reserves is a multiple of 2 MiB, so budgets in 2 MiB steps find them all.
func TightBudgets(t testing.TB, p *planner.Program) map[int]int64 {
	t.Helper()
	budgets := map[int]int64{}
	for b := int64(alloc.RoundLarge); ; b += alloc.RoundLarge {
		pl, err := planner.Make(p, planner.Options{Budget: b})
		if err != nil {
			require.ErrorIs(t, err, planner.ErrDoesNotFit)
			continue
		}
		if _, ok := budgets[len(pl.Chunks)]; !ok {
			budgets[len(pl.Chunks)] = b
		}
		if len(pl.Chunks) == 1 {
			return budgets
		}
	}
}

// Counts lists the keys of budgets in increasing order.
func Counts(budgets map[int]int64) []int {
	var ks []int
	for k := range budgets {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}
