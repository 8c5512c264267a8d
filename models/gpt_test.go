package models_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/shapeinfer"
)

// tiny is the GPT the numeric tests run: small enough for the float64
// reference and for finite differences, with every part of GPT-2 present.
func tiny() models.GPTConfig {
	return models.GPTConfig{Vocab: 11, Context: 8, Layers: 2, Heads: 2, Dim: 8}
}

// hfNames lists Hugging Face GPT2Model's parameter names for cfg.
func hfNames(cfg models.GPTConfig) []string {
	s := []string{"wte.weight", "wpe.weight"}
	for i := range cfg.Layers {
		for _, p := range []string{"ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"} {
			s = append(s, fmt.Sprintf("h.%d.%s.weight", i, p), fmt.Sprintf("h.%d.%s.bias", i, p))
		}
	}
	return append(s, "ln_f.weight", "ln_f.bias")
}

func TestGPTParamNames(t *testing.T) {
	for _, cfg := range []models.GPTConfig{tiny(), models.GPT2Small()} {
		m := models.NewGPT(nn.Options{ShapeOnly: true}, cfg)
		require.NoError(t, nn.Check(m))
		got := testutil.ParamNames(m)
		assert.ElementsMatch(t, hfNames(cfg), got)
		for _, n := range []string{"wpe.weight", "wte.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight", "ln_f.bias"} {
			assert.Contains(t, got, n)
		}
		for _, p := range m.Params() {
			assert.Equal(t, p.Name(), p.Tensor().Name(), "the lazy leaf carries the full name")
		}
	}
	small := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	assert.Contains(t, testutil.ParamNames(small), "h.11.mlp.c_proj.bias")
	shapes := map[string][]int{}
	for _, p := range small.Params() {
		shapes[p.Name()] = p.Shape()
	}
	// Linear weights are [out, in] (PyTorch's nn.Linear); Hugging Face's
	// Conv1D stores the transpose, so only the names are shared.
	assert.Equal(t, []int{50257, 768}, shapes["wte.weight"])
	assert.Equal(t, []int{1024, 768}, shapes["wpe.weight"])
	assert.Equal(t, []int{3 * 768, 768}, shapes["h.0.attn.c_attn.weight"])
	assert.Equal(t, []int{768}, shapes["h.11.mlp.c_proj.bias"])
	assert.Equal(t, []int{768, 4 * 768}, shapes["h.11.mlp.c_proj.weight"])
}

func TestGPT2SmallShapeOnly(t *testing.T) {
	m := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	require.NoError(t, nn.Check(m))
	// Hugging Face's gpt2 checkpoint: 124,439,808 parameters, head tied.
	assert.Equal(t, 124_439_808, nn.NumParams(m))
	for _, p := range m.Params() {
		assert.Nil(t, p.Value(), "%s holds data in shape-only mode", p.Name())
	}

	tokens := lazy.Placeholder([]int{2, 1024}, graph.Int64, 0)
	logits := m.Forward(tokens)
	require.NoError(t, logits.Err())
	assert.Equal(t, []int{2, 1024, 50257}, logits.Shape())
	assert.Equal(t, 0, logits.BatchAxis())
	assert.Equal(t, graph.Float32, logits.DType())
}

// TestGPT2SmallTrainingGraph builds forward, loss and every parameter's
// gradient for GPT-2 small without data: the whole step must be chunkable
// along the batch, each gradient a sum over samples.
func TestGPT2SmallTrainingGraph(t *testing.T) {
	m := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	tokens := lazy.Placeholder([]int{2, 1024}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{2, 1024}, graph.Int64, 0)
	loss := models.Loss(m.Forward(tokens), targets)
	require.NoError(t, loss.Err())
	assert.Empty(t, loss.Shape())

	params := nn.ParamTensors(m)
	grads := lazy.Grad(loss, params...)
	outs := []int{loss.ID()}
	for i, gr := range grads {
		require.NoError(t, gr.Err())
		assert.Equal(t, params[i].Shape(), gr.Shape(), params[i].Name())
		outs = append(outs, gr.ID())
	}
	info, err := shapeinfer.Analyze(tokens.Graph().IR(), outs...)
	require.NoError(t, err)
	require.True(t, info.Chunkable(), "not chunkable: %v", info.NotChunkable)
	assert.Equal(t, 2, info.Batch)
	assert.Equal(t, shapeinfer.CrossBatch, info.Class[loss.ID()])
	assert.Equal(t, shapeinfer.CombineSum, info.Combine[loss.ID()])
	for i, gr := range grads {
		assert.Equal(t, shapeinfer.CrossBatch, info.Class[gr.ID()], params[i].Name())
		assert.Equal(t, shapeinfer.CombineSum, info.Combine[gr.ID()], params[i].Name())
		assert.Zero(t, info.PerSample[gr.ID()], "%s: a gradient's size does not grow with the batch", params[i].Name())
	}
}

func TestGPTConfigErrors(t *testing.T) {
	bad := map[string]models.GPTConfig{
		"dim not a multiple of heads": {Vocab: 11, Context: 8, Layers: 2, Heads: 3, Dim: 8},
		"zero vocab":                  {Vocab: 0, Context: 8, Layers: 2, Heads: 2, Dim: 8},
		"zero context":                {Vocab: 11, Context: 0, Layers: 2, Heads: 2, Dim: 8},
		"no layers":                   {Vocab: 11, Context: 8, Layers: 0, Heads: 2, Dim: 8},
		"zero heads":                  {Vocab: 11, Context: 8, Layers: 2, Heads: 0, Dim: 8},
		"negative dim":                {Vocab: 11, Context: 8, Layers: 2, Heads: 2, Dim: -8},
	}
	for name, cfg := range bad {
		t.Run(name, func(t *testing.T) {
			for _, opt := range []nn.Options{nn.Seed(1), {ShapeOnly: true}} {
				m := models.NewGPT(opt, cfg)
				assert.ErrorIs(t, nn.Check(m), graph.ErrAttr)
				assert.Empty(t, m.Params())
				out := m.Forward(lazy.Placeholder([]int{2, 4}, graph.Int64, 0))
				assert.ErrorIs(t, out.Err(), graph.ErrAttr)
				var oe *graph.OpError
				assert.ErrorAs(t, out.Err(), &oe)
			}
		})
	}

	m := models.NewGPT(nn.Options{ShapeOnly: true}, tiny())
	for _, shape := range [][]int{{2, 9}, {2}, {2, 4, 1}} {
		out := m.Forward(lazy.Placeholder(shape, graph.Int64, 0))
		assert.ErrorIs(t, out.Err(), graph.ErrShape, "tokens %v", shape)
	}
	out := m.Forward(lazy.Placeholder([]int{2, 4}, graph.Float32, 0))
	assert.ErrorIs(t, out.Err(), graph.ErrDType, "float tokens")
	assert.ErrorIs(t, models.Loss(lazy.Placeholder([]int{2, 11}, graph.Float32, 0), nil).Err(), graph.ErrShape)
}

// randomize overwrites every parameter with N(0, std²) draws. GPT-2's own
// initialisation (std 0.02) makes attention nearly uniform, which would let
// a wrong mask or softmax slip through the comparisons below.
func randomize(t *testing.T, m nn.Module, rng *rand.Rand, std float64) {
	t.Helper()
	for _, p := range m.Params() {
		data := p.Value().(*tensor.Dense).Data().([]float32)
		for i := range data {
			data[i] = float32(std * rng.NormFloat64())
		}
	}
}

func randTokens(rng *rand.Rand, b, t, vocab int) []int64 {
	tok := make([]int64, b*t)
	for i := range tok {
		tok[i] = int64(rng.IntN(vocab))
	}
	return tok
}

func int64s(shape []int, data []int64) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(data))
}

// lmStep is a language model's training step as a graph: its logits,
// loss and the gradients of every parameter (buildStep, buildLlamaStep).
type lmStep struct {
	g             *graph.Graph
	logits, loss  *lazy.Tensor
	params, grads []*lazy.Tensor
	tokens        *lazy.Tensor
	outputs       []int // logits, loss, gradients
}

// assertStepMatchesReference runs s on the CPU executor and through the
// float64 reference: logits of shape logits, the loss and every gradient
// within assertClose's tolerance.
func assertStepMatchesReference(t *testing.T, s lmStep, logits []int) {
	t.Helper()
	got, err := cpu.New().Run(context.Background(), s.g, s.outputs...)
	require.NoError(t, err)
	want, err := ref.Eval(s.g, nil, s.outputs...)
	require.NoError(t, err)
	assert.Equal(t, logits, want[0].Shape)
	assertClose(t, want[0], got[0], "logits")
	assertClose(t, want[1], got[1], "loss")
	for i, p := range s.params {
		assertClose(t, want[i+2], got[i+2], "gradient of "+p.Name())
	}
}

// buildStep builds m's step for tokens and targets [b, t].

func buildStep(t *testing.T, m *models.GPT, b, n int, tokens, targets []int64) lmStep {
	t.Helper()
	x := lazy.Wrap(int64s([]int{b, n}, tokens), 0)
	y := x.Graph().Wrap(int64s([]int{b, n}, targets), 0)
	logits := m.Forward(x)
	loss := models.Loss(logits, y)
	params := nn.ParamTensors(m)
	grads := lazy.Grad(loss, params...)
	s := lmStep{g: x.Graph().IR(), logits: logits, loss: loss, params: params, grads: grads, tokens: x,
		outputs: []int{logits.ID(), loss.ID()}}
	require.NoError(t, loss.Err())
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		s.outputs = append(s.outputs, gr.ID())
	}
	return s
}

// cpuTol bounds |cpu − ref| ≤ Norm·max|ref| + RTol·|ref| per element,
// where max runs over the compared tensor. The CPU executor computes in
// float32 (unit roundoff 6e-8), and its rounding errors scale with the
// magnitudes flowing through a tensor's computation rather than with each
// element, hence the normwise term. Measured on the tiny GPT below: at
// most 2e-7·max|ref| for logits and 1.3e-6·max|ref| for gradients; the
// bound leaves a margin of 15 while a wrong mask, scale or sign is off by
// order one.
var cpuTol = struct{ Norm, RTol float64 }{Norm: 2e-5, RTol: 1e-4}

func assertClose(t *testing.T, want ref.Value, got *tensor.Dense, what string) {
	t.Helper()
	assertCloseTol(t, want, got, what, cpuTol.Norm, cpuTol.RTol)
}

// assertCloseTol is assertClose with the bound's two coefficients given.
func assertCloseTol(t *testing.T, want ref.Value, got *tensor.Dense, what string, norm, rtol float64) {
	t.Helper()
	gv, err := ref.FromTensor(got)
	require.NoError(t, err)
	require.Equal(t, want.Shape, gv.Shape, what)
	scale := 0.0
	for _, w := range want.Data {
		scale = max(scale, math.Abs(w))
	}
	require.Greater(t, scale, 0.0, "%s is all zero: the comparison would prove nothing", what)
	worst := 0.0
	for i, w := range want.Data {
		d := math.Abs(gv.Data[i] - w)
		require.LessOrEqual(t, d, norm*scale+rtol*math.Abs(w),
			"%s element %d: cpu %.8g, reference %.8g", what, i, gv.Data[i], w)
		worst = max(worst, d)
	}
	t.Logf("%s: max |cpu − ref| = %.3g·max|ref|", what, worst/scale)
}

// TestTinyGPTMatchesReference runs logits, loss and every gradient of a
// seeded tiny GPT on the CPU executor and on the float64 reference.
func TestTinyGPTMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	cfg := tiny()
	m := models.NewGPT(nn.Seed(7), cfg)
	require.NoError(t, nn.Check(m))
	randomize(t, m, rng, 0.5)
	const b, n = 3, 8
	s := buildStep(t, m, b, n, randTokens(rng, b, n, cfg.Vocab), randTokens(rng, b, n, cfg.Vocab))
	assertStepMatchesReference(t, s, []int{b, n, cfg.Vocab})
}

// TestTiedHeadGradient holds the token embedding's gradient, which sums
// the embedding lookup's and the output head's contributions, to central
// finite differences of the loss, both in float64 through the reference.
// The tokens use only the lower half of the vocabulary, so the upper rows
// get gradient from the head alone and the lower rows from both uses.
//
// Tolerance: truncation error is O(h²) ≈ 1e-12 times the third derivative
// and rounding about ε·|loss|/h ≈ 1e-9, so with h = 1e-6 the difference
// holds to 1e-6 relative to max(|grad|, 1e-2).
func TestTiedHeadGradient(t *testing.T) {
	const h, tol = 1e-6, 1e-6
	rng := rand.New(rand.NewPCG(9, 10))
	cfg := tiny()
	m := models.NewGPT(nn.Seed(9), cfg)
	randomize(t, m, rng, 0.5)
	const b, n, used = 2, 8, 5
	s := buildStep(t, m, b, n, randTokens(rng, b, n, used), randTokens(rng, b, n, cfg.Vocab))

	var wte *lazy.Tensor
	var wteGrad *lazy.Tensor
	for i, p := range s.params {
		if p.Name() == "wte.weight" {
			wte, wteGrad = p, s.grads[i]
		}
	}
	require.NotNil(t, wte)
	wteID := -1
	for _, nd := range s.g.Nodes() {
		if nd.Op == graph.OpParam && nd.Name == "wte.weight" {
			wteID = nd.ID
		}
	}
	require.GreaterOrEqual(t, wteID, 0)

	vals, err := ref.Eval(s.g, nil, wteGrad.ID(), wteID)
	require.NoError(t, err)
	grad, base := vals[0], vals[1]
	lossAt := func(w ref.Value) float64 {
		v, err := ref.Eval(s.g, map[int]ref.Value{wteID: w}, s.loss.ID())
		require.NoError(t, err)
		return v[0].Data[0]
	}
	headOnly := 0.0
	for i := range base.Data {
		moved := base.Clone()
		moved.Data[i] += h
		plus := lossAt(moved)
		moved.Data[i] = base.Data[i] - h
		minus := lossAt(moved)
		fd := (plus - minus) / (2 * h)
		require.LessOrEqual(t, math.Abs(fd-grad.Data[i]), tol*max(math.Abs(grad.Data[i]), 1e-2),
			"d loss/d wte element %d: autodiff %v, finite difference %v", i, grad.Data[i], fd)
		if i/cfg.Dim >= used {
			headOnly = max(headOnly, math.Abs(grad.Data[i]))
		}
	}
	assert.Greater(t, headOnly, 1e-3, "rows of unused tokens get the head's gradient")

	// The CPU executor agrees with the reference on the summed gradient.
	got, err := cpu.New().Run(context.Background(), s.g, wteGrad.ID())
	require.NoError(t, err)
	assertClose(t, grad, got[0], "gradient of wte.weight")
}

// TestGPTCausal changes the token at position k of every sequence and
// checks that logits before k are unchanged and those from k on change.
func TestGPTCausal(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	cfg := tiny()
	m := models.NewGPT(nn.Seed(11), cfg)
	randomize(t, m, rng, 0.5)
	const b, n = 2, 8
	logitsOf := func(tok []int64) []float32 {
		x := lazy.Wrap(int64s([]int{b, n}, tok), 0)
		logits := m.Forward(x)
		require.NoError(t, logits.Err())
		out, err := cpu.New().Run(context.Background(), x.Graph().IR(), logits.ID())
		require.NoError(t, err)
		return out[0].Data().([]float32)
	}
	tok := randTokens(rng, b, n, cfg.Vocab)
	base := logitsOf(tok)
	for k := range n {
		changed := append([]int64(nil), tok...)
		for s := range b {
			changed[s*n+k] = (changed[s*n+k] + 1 + int64(rng.IntN(cfg.Vocab-1))) % int64(cfg.Vocab)
		}
		got := logitsOf(changed)
		for s := range b {
			for pos := range n {
				row := (s*n + pos) * cfg.Vocab
				diff := 0.0
				for v := range cfg.Vocab {
					diff = max(diff, math.Abs(float64(got[row+v]-base[row+v])))
				}
				if pos < k {
					assert.Zero(t, diff, "sequence %d: changing token %d moved logits at %d", s, k, pos)
				} else {
					assert.Greater(t, diff, 1e-3, "sequence %d: changing token %d left logits at %d alone", s, k, pos)
				}
			}
		}
	}
}

// TestErrorSite checks that errors raised inside the model zoo name the
// caller's line, not a line of package models.
func TestErrorSite(t *testing.T) {
	logits := lazy.Placeholder([]int{2, 3, 5}, graph.Float32, 0)
	targets := logits.Graph().Placeholder([]int{2, 4}, graph.Int64, 0)
	for name, err := range map[string]error{
		"loss":    models.Loss(logits, targets).Err(),
		"forward": models.NewGPT(nn.Options{ShapeOnly: true}, tiny()).Forward(lazy.Placeholder([]int{2, 9}, graph.Int64, 0)).Err(),
	} {
		var oe *graph.OpError
		require.ErrorAs(t, err, &oe, name)
		assert.True(t, strings.HasPrefix(oe.Site, "models/gpt_test.go:"), "%s: OpError.Site = %q", name, oe.Site)
	}
}

// TestFirstErrorWins checks that an error an input already holds comes
// back as it is from Loss, GPT.Forward and a misconfigured model's
// Forward, not masked by their shape checks (a failed input has no shape,
// which used to read as a rank error) or configuration errors: here
// ErrDType and ErrNilTensor, which a mask would turn into ErrShape or
// ErrAttr.
func TestFirstErrorWins(t *testing.T) {
	badLogits := lazy.Const(tensor.New(tensor.WithBacking([]float64{1, 2}))) // float64: ErrDType
	require.ErrorIs(t, badLogits.Err(), graph.ErrDType)
	badTargets := lazy.Param(nil, "targets") // ErrNilTensor
	require.ErrorIs(t, badTargets.Err(), graph.ErrNilTensor)
	logits := lazy.Placeholder([]int{2, 3, 5}, graph.Float32, 0)
	targets := logits.Graph().Placeholder([]int{2, 3}, graph.Int64, 0)
	wrongRank := lazy.Placeholder([]int{6, 5}, graph.Float32, 0)
	gpt := models.NewGPT(nn.Options{ShapeOnly: true}, tiny())

	for name, c := range map[string]struct{ got, want error }{
		"loss, logits failed":                   {models.Loss(badLogits, targets).Err(), badLogits.Err()},
		"loss, targets failed":                  {models.Loss(logits, badTargets).Err(), badTargets.Err()},
		"loss, targets failed, logits rank 2":   {models.Loss(wrongRank, badTargets).Err(), badTargets.Err()},
		"loss, both failed: the logits' first":  {models.Loss(badLogits, badTargets).Err(), badLogits.Err()},
		"gpt forward, tokens failed":            {gpt.Forward(badTargets).Err(), badTargets.Err()},
		"gpt forward, then loss, tokens failed": {models.Loss(gpt.Forward(badTargets), targets).Err(), badTargets.Err()},
		// The input's error comes before the model's own, as in nn.
		"broken gpt, tokens failed":    {models.NewGPT(nn.Options{ShapeOnly: true}, models.GPTConfig{}).Forward(badTargets).Err(), badTargets.Err()},
		"broken convnet, input failed": {models.NewConvNet(nn.Options{ShapeOnly: true}, models.ConvNetConfig{}).Forward(badLogits).Err(), badLogits.Err()},
	} {
		assert.Same(t, c.want, c.got, name)
	}
	// Without an earlier error the shape check still reports the shape.
	assert.ErrorIs(t, models.Loss(wrongRank, targets).Err(), graph.ErrShape)
}
