package models_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// llamaNames lists Hugging Face LlamaForCausalLM's parameter names for cfg.
func llamaNames(cfg models.LlamaConfig) []string {
	s := []string{"model.embed_tokens.weight"}
	for i := range cfg.Layers {
		p := fmt.Sprintf("model.layers.%d.", i)
		for _, n := range []string{"q", "k", "v", "o"} {
			s = append(s, p+"self_attn."+n+"_proj.weight")
			if cfg.QKVBias && n != "o" || cfg.OutBias && n == "o" {
				s = append(s, p+"self_attn."+n+"_proj.bias")
			}
		}
		for _, n := range []string{"gate", "up", "down"} {
			s = append(s, p+"mlp."+n+"_proj.weight")
			if cfg.MLPBias {
				s = append(s, p+"mlp."+n+"_proj.bias")
			}
		}
		s = append(s, p+"input_layernorm.weight", p+"post_attention_layernorm.weight")
	}
	s = append(s, "model.norm.weight")
	if !cfg.TieEmbeddings {
		s = append(s, "lm_head.weight")
	}
	return s
}

func TestLlamaParamNames(t *testing.T) {
	qwen := models.LlamaTiny()
	qwen.QKVBias, qwen.TieEmbeddings = true, false
	allBias := models.LlamaTiny()
	allBias.QKVBias, allBias.OutBias, allBias.MLPBias = true, true, true
	for _, cfg := range []models.LlamaConfig{models.LlamaTiny(), qwen, allBias, models.Llama32_1B(), models.Llama3_8B()} {
		m := models.NewLlama(nn.Options{ShapeOnly: true}, cfg)
		require.NoError(t, nn.Check(m))
		assert.Equal(t, llamaNames(cfg), testutil.ParamNames(m), "Hugging Face's names, in its order")
		for _, p := range m.Params() {
			assert.Equal(t, p.Name(), p.Tensor().Name(), "the lazy leaf carries the full name")
		}
	}
	shapes := map[string][]int{}
	for _, p := range models.NewLlama(nn.Options{ShapeOnly: true}, models.Llama32_1B()).Params() {
		shapes[p.Name()] = p.Shape()
	}
	// Linear weights are [out, in], as in Hugging Face's files.
	assert.Equal(t, []int{128256, 2048}, shapes["model.embed_tokens.weight"])
	assert.Equal(t, []int{2048, 2048}, shapes["model.layers.0.self_attn.q_proj.weight"])
	assert.Equal(t, []int{512, 2048}, shapes["model.layers.15.self_attn.k_proj.weight"])
	assert.Equal(t, []int{8192, 2048}, shapes["model.layers.3.mlp.gate_proj.weight"])
	assert.Equal(t, []int{2048, 8192}, shapes["model.layers.3.mlp.down_proj.weight"])
	assert.Equal(t, []int{2048}, shapes["model.norm.weight"])
	assert.NotContains(t, shapes, "lm_head.weight", "tied: the head is the embedding")
}

// The zoo's sizes: Llama 3 8B has 8,030,261,248 parameters and Llama 3.2
// 1B 1,235,814,400 (the counts Meta and Hugging Face publish).
func TestLlamaParamCounts(t *testing.T) {
	for _, c := range []struct {
		cfg  models.LlamaConfig
		want int
	}{{models.Llama3_8B(), 8_030_261_248}, {models.Llama32_1B(), 1_235_814_400}} {
		m := models.NewLlama(nn.Options{ShapeOnly: true}, c.cfg)
		require.NoError(t, nn.Check(m))
		assert.Equal(t, c.want, nn.NumParams(m))
	}
}

// HF's initialisation: weights from N(0, 0.02²), norms one, biases zero.
func TestLlamaInit(t *testing.T) {
	cfg := models.LlamaTiny()
	cfg.QKVBias = true
	m := models.NewLlama(nn.Seed(3), cfg)
	require.NoError(t, nn.Check(m))
	var sum, sq float64
	var n int
	for _, p := range m.Params() {
		d := p.Value().Data().([]float32)
		switch name := p.Name(); {
		case len(p.Shape()) == 1 && slices.Contains([]string{"weight"}, name[len(name)-6:]):
			for _, v := range d {
				require.Equal(t, float32(1), v, name)
			}
		case len(p.Shape()) == 1:
			for _, v := range d {
				require.Zero(t, v, name)
			}
		default:
			for _, v := range d {
				sum += float64(v)
				sq += float64(v) * float64(v)
				n++
			}
		}
	}
	mean, std := sum/float64(n), math.Sqrt(sq/float64(n))
	// n ≈ 17,000 draws: the mean within 5 standard errors, the spread within 5%.
	assert.InDelta(t, 0, mean, 5*0.02/math.Sqrt(float64(n)))
	assert.InEpsilon(t, 0.02, std, 0.05)
}

func TestLlamaConfigErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		edit func(*models.LlamaConfig)
	}{
		{"no layers", func(c *models.LlamaConfig) { c.Layers = 0 }},
		{"kv heads do not divide heads", func(c *models.LlamaConfig) { c.KVHeads = 3 }},
		{"width not a multiple of heads", func(c *models.LlamaConfig) { c.Hidden = 30 }},
		{"odd head dim", func(c *models.LlamaConfig) { c.HeadDim = 7 }},
		{"eps 0", func(c *models.LlamaConfig) { c.RMSNormEps = 0 }},
		{"theta 0", func(c *models.LlamaConfig) { c.Rope.Theta = 0 }},
		{"unknown rope type", func(c *models.LlamaConfig) { c.Rope.Type = "yarn" }},
		{"llama3 without factors", func(c *models.LlamaConfig) { c.Rope.HighFreqFactor = 0 }},
		{"llama3 without original positions", func(c *models.LlamaConfig) { c.Rope.OriginalMaxPositions = 0 }},
		{"linear without factor", func(c *models.LlamaConfig) { c.Rope = models.RopeConfig{Theta: 1e4, Type: "linear"} }},
	} {
		cfg := models.LlamaTiny()
		c.edit(&cfg)
		m := models.NewLlama(nn.Options{ShapeOnly: true}, cfg)
		require.ErrorIs(t, nn.Check(m), graph.ErrAttr, c.name)
		x := lazy.Placeholder([]int{2, 4}, graph.Int64, 0)
		require.ErrorIs(t, m.Forward(x).Err(), graph.ErrAttr, "%s: Forward reports it", c.name)
	}
	m := models.NewLlama(nn.Options{ShapeOnly: true}, models.LlamaTiny())
	assert.ErrorIs(t, m.Forward(lazy.Placeholder([]int{2, 4, 3}, graph.Int64, 0)).Err(), graph.ErrShape, "rank 3 tokens")
	assert.ErrorIs(t, m.Forward(lazy.Placeholder([]int{2, 4}, graph.Float32, 0)).Err(), graph.ErrShape, "float tokens")
	head := 8 // the tiny head dim: HeadDim 0 means Hidden/Heads
	assert.Equal(t, head, models.LlamaTiny().HeadDimOrDefault())
}

// InvFreq follows transformers' rope functions: base^(−2i/d) by default;
// linear divides every frequency by the factor; llama3 keeps the high
// frequencies, divides the low ones by the factor and interpolates the
// band between. The values are checked one by one at Llama 3.2 1B's
// settings against the formulas written out here per band.
func TestRopeInvFreq(t *testing.T) {
	const d = 64
	plain, err := models.RopeConfig{Theta: 500000}.InvFreq(d)
	require.NoError(t, err)
	require.Len(t, plain, d/2)
	for i, f := range plain {
		require.InEpsilon(t, math.Pow(500000, -float64(2*i)/d), f, 1e-15)
	}
	lin, err := models.RopeConfig{Theta: 500000, Type: "linear", Factor: 4}.InvFreq(d)
	require.NoError(t, err)
	for i := range lin {
		require.InEpsilon(t, plain[i]/4, lin[i], 1e-15)
	}
	l3, err := models.Llama32_1B().Rope.InvFreq(d)
	require.NoError(t, err)
	bands := [3]int{}
	for i, f := range plain {
		wave := 2 * math.Pi / f
		switch {
		case wave < 8192/4.0: // high frequency
			require.Equal(t, f, l3[i], "index %d kept", i)
			bands[0]++
		case wave > 8192/1.0: // low frequency
			require.InEpsilon(t, f/32, l3[i], 1e-15, "index %d scaled", i)
			bands[2]++
		default:
			s := (8192/wave - 1) / (4 - 1)
			require.InEpsilon(t, (1-s)*f/32+s*f, l3[i], 1e-14, "index %d interpolated", i)
			require.Less(t, l3[i], f)
			require.Greater(t, l3[i], f/32)
			bands[1]++
		}
	}
	// 2π·500000^(i/32) < 2048 for i ≤ 14 and > 8192 for i ≥ 18.
	assert.Equal(t, [3]int{15, 3, 14}, bands, "Llama 3.2 frequencies fall in all three bands")
	// The lowest frequency, by hand: 500000^(−62/64)/32.
	assert.InEpsilon(t, math.Pow(500000, -62.0/64)/32, l3[31], 1e-15)
	_, err = models.RopeConfig{Theta: 1e4}.InvFreq(7)
	assert.ErrorIs(t, err, graph.ErrAttr, "odd head dim")
}

func TestRopeTable(t *testing.T) {
	r := models.LlamaTiny().Rope
	f, err := r.InvFreq(8)
	require.NoError(t, err)
	tab, err := r.Table(8, 5)
	require.NoError(t, err)
	assert.Equal(t, tensor.Shape{5, 8}, tab.Shape())
	d := tab.Data().([]float32)
	for p := range 5 {
		for i := range 4 {
			assert.Equal(t, float32(math.Cos(float64(p)*f[i])), d[p*8+i], "cos at %d, %d", p, i)
			assert.Equal(t, float32(math.Sin(float64(p)*f[i])), d[p*8+4+i], "sin at %d, %d", p, i)
		}
	}
	_, err = r.Table(8, 0)
	assert.ErrorIs(t, err, graph.ErrAttr)
}

// buildLlamaStep builds m's step for tokens [b, t] (labels: the tokens
// themselves, as Hugging Face's labels=input_ids, some ignored).
func buildLlamaStep(t *testing.T, m *models.Llama, b, n int, tokens, labels []int64) lmStep {
	t.Helper()
	x := lazy.Wrap(int64s([]int{b, n}, tokens), 0)
	y := x.Graph().Wrap(int64s([]int{b, n}, labels), 0)
	logits := m.Forward(x)
	loss := models.CausalLMLoss(logits, y)
	require.NoError(t, loss.Err())
	params := nn.ParamTensors(m)
	grads := lazy.Grad(loss, params...)
	s := lmStep{g: x.Graph().IR(), logits: logits, loss: loss, params: params, grads: grads, outputs: []int{logits.ID(), loss.ID()}}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		s.outputs = append(s.outputs, gr.ID())
	}
	return s
}

// ignoreSome sets every fifth label to graph.IgnoreLabel.
func ignoreSome(labels []int64) []int64 {
	out := slices.Clone(labels)
	for i := range out {
		if i%5 == 2 {
			out[i] = graph.IgnoreLabel
		}
	}
	return out
}

// TestTinyLlamaMatchesReference runs logits, loss and every gradient of a
// tiny Llama (grouped-query heads, llama3 rope scaling, q/k/v biases) on
// the CPU executor and on the float64 reference.
func TestTinyLlamaMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	cfg := models.LlamaTiny()
	cfg.QKVBias = true
	m := models.NewLlama(nn.Seed(21), cfg)
	require.NoError(t, nn.Check(m))
	randomize(t, m, rng, 0.5)
	const b, n = 3, 9
	tok := randTokens(rng, b, n, cfg.Vocab)
	s := buildLlamaStep(t, m, b, n, tok, ignoreSome(tok))
	assertStepMatchesReference(t, s, []int{b, n, cfg.Vocab})
}

// TestLlamaGradientsFiniteDifferences holds every gradient of a tiny
// Llama's causal LM loss to central finite differences, both in float64
// through the reference, on a sample of each parameter's elements (every
// element of the small ones). Tolerance: truncation O(h²) and rounding
// ε·|loss|/h ≈ 1e-9 with h = 1e-6, so 1e-6 relative to max(|grad|, 1e-2).
func TestLlamaGradientsFiniteDifferences(t *testing.T) {
	const h, tol = 1e-6, 1e-6
	rng := rand.New(rand.NewPCG(23, 24))
	cfg := models.LlamaTiny()
	cfg.Layers, cfg.Vocab, cfg.QKVBias, cfg.TieEmbeddings = 1, 16, true, false
	m := models.NewLlama(nn.Seed(23), cfg)
	randomize(t, m, rng, 0.5)
	const b, n = 2, 6
	tok := randTokens(rng, b, n, cfg.Vocab)
	s := buildLlamaStep(t, m, b, n, tok, ignoreSome(tok))
	ids := make([]int, len(s.params))
	for i, p := range s.params {
		ids[i] = -1
		for _, nd := range s.g.Nodes() {
			if nd.Op == graph.OpParam && nd.Name == p.Name() {
				ids[i] = nd.ID
			}
		}
		require.GreaterOrEqual(t, ids[i], 0, p.Name())
	}
	gradIDs := make([]int, len(s.grads))
	for i, g := range s.grads {
		gradIDs[i] = g.ID()
	}
	grads, err := ref.Eval(s.g, nil, gradIDs...)
	require.NoError(t, err)
	bases, err := ref.Eval(s.g, nil, ids...)
	require.NoError(t, err)
	checked := 0
	for k, p := range s.params {
		base := bases[k]
		step := max(1, len(base.Data)/24)
		for i := 0; i < len(base.Data); i += step {
			moved := base.Clone()
			moved.Data[i] += h
			plus, err := ref.Eval(s.g, map[int]ref.Value{ids[k]: moved}, s.loss.ID())
			require.NoError(t, err)
			moved.Data[i] = base.Data[i] - h
			minus, err := ref.Eval(s.g, map[int]ref.Value{ids[k]: moved}, s.loss.ID())
			require.NoError(t, err)
			fd := (plus[0].Data[0] - minus[0].Data[0]) / (2 * h)
			got := grads[k].Data[i]
			require.LessOrEqual(t, math.Abs(fd-got), tol*max(math.Abs(got), 1e-2),
				"d loss/d %s element %d: autodiff %v, finite difference %v", p.Name(), i, got, fd)
			checked++
		}
	}
	t.Logf("%d gradient elements checked over %d parameters", checked, len(s.params))
}

// The loss is Hugging Face's: the mean over the labels that are not −100
// of −log softmax(logits[b, t])[labels[b, t+1]], computed here by hand
// from the model's logits.
func TestCausalLMLossIsHuggingFaces(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 26))
	cfg := models.LlamaTiny()
	m := models.NewLlama(nn.Seed(25), cfg)
	randomize(t, m, rng, 0.5)
	const b, n = 2, 7
	tok := randTokens(rng, b, n, cfg.Vocab)
	labels := ignoreSome(tok)
	x := lazy.Wrap(int64s([]int{b, n}, tok), 0)
	logits := m.Forward(x)
	loss := models.CausalLMLoss(logits, x.Graph().Wrap(int64s([]int{b, n}, labels), 0))
	out, err := ref.Eval(x.Graph().IR(), nil, logits.ID(), loss.ID())
	require.NoError(t, err)
	lg := out[0]
	v := cfg.Vocab
	var sum float64
	count := 0
	for r := range b {
		for p := range n - 1 {
			y := labels[r*n+p+1]
			if y == graph.IgnoreLabel {
				continue
			}
			row := lg.Data[(r*n+p)*v : (r*n+p+1)*v]
			mx := slices.Max(row)
			z := 0.0
			for _, u := range row {
				z += math.Exp(u - mx)
			}
			sum += mx + math.Log(z) - row[y]
			count++
		}
	}
	require.Positive(t, count)
	// The reference evaluates 1/count as the float32 constant the loss holds.
	assert.InEpsilon(t, sum*float64(float32(1/float64(count))), out[1].Data[0], 1e-12)

	// Every label ignored: the loss is 0.
	all := make([]int64, b*n)
	for i := range all {
		all[i] = graph.IgnoreLabel
	}
	x2 := lazy.Wrap(int64s([]int{b, n}, tok), 0)
	zero := models.CausalLMLoss(m.Forward(x2), x2.Graph().Wrap(int64s([]int{b, n}, all), 0))
	z, err := ref.Eval(x2.Graph().IR(), nil, zero.ID())
	require.NoError(t, err)
	assert.Zero(t, z[0].Data[0])

	// Shapes are checked; errors stick.
	assert.ErrorIs(t, models.CausalLMLoss(logits, lazy.Placeholder([]int{b, n + 1}, graph.Int64, 0)).Err(), graph.ErrShape)
	bad := lazy.ErrorTensor("x", graph.Errorf(graph.ErrDType, "earlier"))
	assert.ErrorIs(t, models.CausalLMLoss(bad, x).Err(), graph.ErrDType)
}

func TestShiftLabels(t *testing.T) {
	got, n, err := models.ShiftLabels(int64s([]int{2, 3}, []int64{1, 2, 3, 4, graph.IgnoreLabel, 6}))
	require.NoError(t, err)
	assert.Equal(t, []int64{2, 3, graph.IgnoreLabel, graph.IgnoreLabel, 6, graph.IgnoreLabel}, got.Data())
	assert.Equal(t, 3, n)
	_, _, err = models.ShiftLabels(tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{1, 2, 3})))
	assert.ErrorIs(t, err, graph.ErrShape)
}

// TestLlamaCausal changes the token at position k of every sequence: the
// logits before k stay as they were, those from k on change.
func TestLlamaCausal(t *testing.T) {
	rng := rand.New(rand.NewPCG(27, 28))
	cfg := models.LlamaTiny()
	m := models.NewLlama(nn.Seed(27), cfg)
	randomize(t, m, rng, 0.5)
	const b, n, k = 2, 8, 5
	tok := randTokens(rng, b, n, cfg.Vocab)
	logitsOf := func(tok []int64) ref.Value {
		x := lazy.Wrap(int64s([]int{b, n}, tok), 0)
		lg := m.Forward(x)
		require.NoError(t, lg.Err())
		out, err := ref.Eval(x.Graph().IR(), nil, lg.ID())
		require.NoError(t, err)
		return out[0]
	}
	before := logitsOf(tok)
	changed := slices.Clone(tok)
	for r := range b {
		changed[r*n+k] = (changed[r*n+k] + 1) % int64(cfg.Vocab)
	}
	after := logitsOf(changed)
	v := cfg.Vocab
	for r := range b {
		for p := range n {
			row := func(l ref.Value) []float64 { return l.Data[(r*n+p)*v : (r*n+p+1)*v] }
			if p < k {
				require.Equal(t, row(before), row(after), "position %d before the change", p)
			} else {
				require.NotEqual(t, row(before), row(after), "position %d after the change", p)
			}
		}
	}
}

// The written-out Llama (LlamaConfig.WrittenOut: RMSNorm, rotary and
// SwiGLU as plain ops, q, k and v from three projections through the
// attention op) is the same model: from the same seed and parameters its
// logits, loss and every gradient equal models.Llama's in the float64
// reference (to 1e-9 of their magnitude: sums in another order), and the
// two have the same parameter names.
func TestWrittenLlamaIsLlama(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	cfg := models.LlamaTiny()
	w := cfg
	w.WrittenOut = true
	m, mw := models.NewLlama(nn.Seed(23), cfg), models.NewLlama(nn.Seed(23), w)
	randomize(t, m, rng, 0.5)
	rng = rand.New(rand.NewPCG(23, 24))
	randomize(t, mw, rng, 0.5)
	var names, wnames []string
	for _, p := range nn.ParamTensors(m) {
		names = append(names, p.Name())
	}
	for _, p := range nn.ParamTensors(mw) {
		wnames = append(wnames, p.Name())
	}
	require.Equal(t, names, wnames)
	const b, n = 2, 7
	tok := randTokens(rng, b, n, cfg.Vocab)
	s := buildLlamaStep(t, m, b, n, tok, tok)
	sw := buildLlamaStep(t, mw, b, n, tok, tok)
	want, err := ref.Eval(s.g, nil, s.outputs...)
	require.NoError(t, err)
	got, err := ref.Eval(sw.g, nil, sw.outputs...)
	require.NoError(t, err)
	require.Len(t, got, len(want))
	for i := range want {
		require.Equal(t, want[i].Shape, got[i].Shape)
		scale := 0.0
		for _, v := range want[i].Data {
			scale = max(scale, math.Abs(v))
		}
		for k, v := range want[i].Data {
			require.InDelta(t, v, got[i].Data[k], 1e-9*max(scale, 1e-3), "output %d element %d", i, k)
		}
	}
}
