package nn_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// loraNet is a two-layer model whose layers are named as a Llama's
// attention names its projections: q_proj [5, 6] with bias, a ReLU, then
// o_proj [3, 5] without.
func loraNet(seed uint64) *nn.Sequential {
	o := nn.Seed(seed)
	return nn.NewSequentialNamed(
		nn.Child{Name: "q_proj", Module: nn.NewLinear(o, 6, 5, true)},
		nn.Child{Name: "act", Module: nn.ReLU{}},
		nn.Child{Name: "o_proj", Module: nn.NewLinear(o, 5, 3, false)},
	)
}

// randomise fills p with values drawn uniformly from ±1 (a trained B,
// where Apply leaves zeros).
func randomise(rng *rand.Rand, p *nn.Param) {
	d := p.Value().Data().([]float32)
	for i := range d {
		d[i] = float32(2*rng.Float64() - 1)
	}
}

func f64(p *nn.Param) []float64 {
	d := p.Value().Data().([]float32)
	out := make([]float64, len(d))
	for i, v := range d {
		out[i] = float64(v)
	}
	return out
}

// linear64 is x [n, in] · Wᵀ [in, out] + b in float64.
func linear64(x []float64, n, in int, w []float64, out int, b []float64) []float64 {
	y := make([]float64, n*out)
	for i := range n {
		for o := range out {
			s := 0.0
			if b != nil {
				s = b[o]
			}
			for j := range in {
				s += x[i*in+j] * w[o*in+j]
			}
			y[i*out+o] = s
		}
	}
	return y
}

// lora64 is the adapted layer in float64: x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ.
func lora64(x []float64, n int, l *nn.LoRALinear, a, b []float64) []float64 {
	ws := l.Base.Weight.Shape()
	out, in := ws[0], ws[1]
	var bias []float64
	if l.Base.Bias != nil {
		bias = f64(l.Base.Bias)
	}
	y := linear64(x, n, in, f64(l.Base.Weight), out, bias)
	u := linear64(x, n, in, a, l.Rank, nil)
	d := linear64(u, n, l.Rank, b, out, nil)
	for i := range y {
		y[i] += l.Scale() * d[i]
	}
	return y
}

// netLoss64 is the model's loss sum(y²)/2 in float64 with q_proj adapted
// by A and B (o_proj plain).
func netLoss64(m *nn.Sequential, q *nn.LoRALinear, x []float64, n int, a, b []float64) float64 {
	h := lora64(x, n, q, a, b)
	for i, v := range h {
		h[i] = max(v, 0)
	}
	o := m.Get("o_proj").(*nn.Linear)
	y := linear64(h, n, 5, f64(o.Weight), 3, nil)
	s := 0.0
	for _, v := range y {
		s += v * v / 2
	}
	return s
}

func runCPU(t *testing.T, g *lazy.Graph, ts ...*lazy.Tensor) [][]float32 {
	t.Helper()
	ids := make([]int, len(ts))
	for i, x := range ts {
		require.NoError(t, x.Err())
		ids[i] = x.ID()
	}
	out, err := cpu.New().Run(context.Background(), g.IR(), ids...)
	require.NoError(t, err)
	res := make([][]float32, len(out))
	for i, o := range out {
		res[i] = o.Data().([]float32)
	}
	return res
}

func input(rng *rand.Rand, n, in int) (*tensor.Dense, []float64) {
	d := make([]float32, n*in)
	x64 := make([]float64, n*in)
	for i := range d {
		d[i] = float32(rng.NormFloat64())
		x64[i] = float64(d[i])
	}
	return tensor.New(tensor.WithShape(n, in), tensor.WithBacking(d)), x64
}

// Apply replaces q_proj by an adapter over it, named as PEFT names its
// tensors, freezes the base (bfloat16 linear weights by default, float32
// with Base Float32), and its forward pass is x·Wᵀ + b + (α/r)·x·Aᵀ·Bᵀ:
// the float32 CPU executor against a float64 reference with a random B.
//
// Tolerance: 1e-5 of the output's magnitude (float32 sums of 6 terms).
func TestLoRAForwardMatchesFloat64(t *testing.T) {
	m := loraNet(1)
	ls, err := nn.LoRA{Rank: 2, Alpha: 8, Targets: []string{"q_proj"}, Base: graph.Float32}.Apply(nn.Seed(2), m)
	require.NoError(t, err)
	require.Len(t, ls, 1)
	q := ls[0].Layer
	assert.Equal(t, "q_proj", ls[0].Path)
	assert.Same(t, q, m.Get("q_proj"))
	assert.Equal(t, 4.0, q.Scale())
	assert.Equal(t, "q_proj.lora_A.weight", q.A.Name())
	assert.Equal(t, "q_proj.lora_B.weight", q.B.Name())
	assert.Equal(t, []int{2, 6}, q.A.Shape())
	assert.Equal(t, []int{5, 2}, q.B.Shape())
	for _, v := range q.B.Value().Data().([]float32) {
		require.Zero(t, v, "B starts at zero")
	}
	bound := float32(1 / math.Sqrt(6))
	nonzero := 0
	for _, v := range q.A.Value().Data().([]float32) {
		require.LessOrEqual(t, v, bound)
		require.GreaterOrEqual(t, v, -bound)
		if v != 0 {
			nonzero++
		}
	}
	require.Equal(t, 12, nonzero, "A is drawn (kaiming-uniform, ±1/√in)")
	names := []string{}
	for _, p := range m.Params() {
		names = append(names, p.Name())
		assert.Equal(t, p == q.A || p == q.B, !p.Frozen(), p.Name())
		assert.Equal(t, graph.Float32, p.Tensor().DType(), p.Name())
	}
	assert.Equal(t, []string{"q_proj.weight", "q_proj.bias", "q_proj.lora_A.weight", "q_proj.lora_B.weight", "o_proj.weight"}, names)
	assert.Equal(t, []*nn.Param{q.A, q.B}, nn.LoRAParams(m))

	rng := rand.New(rand.NewPCG(3, 4))
	randomise(rng, q.B)
	xt, x64 := input(rng, 4, 6)
	x := lazy.Wrap(xt, 0)
	got := runCPU(t, x.Graph(), q.Forward(x))[0]
	want := lora64(x64, 4, q, f64(q.A), f64(q.B))
	scale := 0.0
	for _, v := range want {
		scale = max(scale, math.Abs(v))
	}
	for i := range want {
		require.InDelta(t, want[i], float64(got[i]), 1e-5*scale, "element %d", i)
	}

	// By default the base is stored in bfloat16; norms would stay float32.
	m2 := loraNet(1)
	_, err = nn.LoRA{Rank: 2, Targets: []string{"q_proj", "o_proj"}}.Apply(nn.Seed(2), m2)
	require.NoError(t, err)
	for _, p := range m2.Params() {
		if p.Frozen() {
			assert.Equal(t, graph.BFloat16, p.Tensor().DType(), p.Name())
		}
	}
	assert.Len(t, nn.LoRAAdapters(m2), 2)
}

// Gradients of A and B, through the adapted layer, a ReLU and another
// layer, against central finite differences of the float64 reference
// (step 1e-6), with a random B (at B = 0, A's gradient is zero).
//
// Tolerance: 2e-3 relative to the largest gradient (float32 forward and
// backward).
func TestLoRAGradientsMatchFiniteDifferences(t *testing.T) {
	m := loraNet(5)
	ls, err := nn.LoRA{Rank: 3, Alpha: 6, Targets: []string{"q_proj"}, Base: graph.Float32}.Apply(nn.Seed(6), m)
	require.NoError(t, err)
	q := ls[0].Layer
	rng := rand.New(rand.NewPCG(7, 8))
	randomise(rng, q.B)
	xt, x64 := input(rng, 4, 6)
	x := lazy.Wrap(xt, 0)
	y := m.Forward(x)
	loss := y.Mul(y).Sum().MulScalar(0.5)
	gs := lazy.Grad(loss, q.A.Tensor(), q.B.Tensor())
	got := runCPU(t, x.Graph(), gs...)

	a64, b64 := f64(q.A), f64(q.B)
	const h = 1e-6
	fd := func(v []float64) []float64 {
		g := make([]float64, len(v))
		for i := range v {
			old := v[i]
			v[i] = old + h
			up := netLoss64(m, q, x64, 4, a64, b64)
			v[i] = old - h
			down := netLoss64(m, q, x64, 4, a64, b64)
			v[i] = old
			g[i] = (up - down) / (2 * h)
		}
		return g
	}
	for k, want := range [][]float64{fd(a64), fd(b64)} {
		scale := 0.0
		for _, v := range want {
			scale = max(scale, math.Abs(v))
		}
		require.Greater(t, scale, 1e-3, "a gradient that is not all zero")
		for i := range want {
			require.InDelta(t, want[i], float64(got[k][i]), 2e-3*scale, "%s[%d]", []string{"A", "B"}[k], i)
		}
	}
}

// A fresh adapter (B = 0) computes exactly what its base does, bit for
// bit; MergeLoRA folds a trained one into the weight, and the merged
// model's output equals the adapted one's.
//
// Tolerance (merged): 1e-5 of the output's magnitude (float32 sums in
// another order).
func TestLoRAZeroInitAndMerge(t *testing.T) {
	base, adapted := loraNet(9), loraNet(9)
	_, err := nn.LoRA{Rank: 2, Alpha: 4, Targets: []string{"q_proj", "o_proj"}, Base: graph.Float32}.Apply(nn.Seed(1), adapted)
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(1, 2))
	xt, _ := input(rng, 3, 6)
	run := func(m nn.Module) []float32 {
		x := lazy.Wrap(xt.Clone().(*tensor.Dense), 0)
		return runCPU(t, x.Graph(), m.Forward(x))[0]
	}
	want := run(base)
	require.Equal(t, want, run(adapted), "B = 0: the base model's output exactly")

	for _, a := range nn.LoRAAdapters(adapted) {
		randomise(rng, a.Layer.B)
	}
	tuned := run(adapted)
	require.NotEqual(t, want, tuned)
	merged, err := nn.MergeLoRA(adapted)
	require.NoError(t, err)
	require.Len(t, merged, 3, "the base's parameters only")
	names := make([]string, len(merged))
	for i, p := range merged {
		names[i] = p.Name()
	}
	assert.Equal(t, []string{"q_proj.weight", "q_proj.bias", "o_proj.weight"}, names)
	// The merged weights, into a plain model of the base's shape.
	plain := loraNet(100)
	for i, p := range plain.Params() {
		copy(p.Value().Data().([]float32), merged[i].Value().Data().([]float32))
	}
	got := run(plain)
	scale := 0.0
	for _, v := range tuned {
		scale = max(scale, math.Abs(float64(v)))
	}
	for i := range tuned {
		require.InDelta(t, tuned[i], got[i], 1e-5*scale, "element %d", i)
	}
	// The adapted model is unchanged by merging.
	require.Equal(t, tuned, run(adapted))
}

// Bad settings and targets are typed errors, and leave the model as it
// was: no rank, a negative alpha, dropout 1, no targets, a target that
// matches nothing, a target that is not a linear layer, an adapted layer
// adapted again, a shape-only model merged.
func TestLoRAErrors(t *testing.T) {
	cases := []struct {
		name string
		c    nn.LoRA
		want error
	}{
		{"rank 0", nn.LoRA{Targets: []string{"q_proj"}}, graph.ErrAttr},
		{"alpha", nn.LoRA{Rank: 1, Alpha: -1, Targets: []string{"q_proj"}}, graph.ErrAttr},
		{"dropout", nn.LoRA{Rank: 1, Dropout: 1, Targets: []string{"q_proj"}}, graph.ErrAttr},
		{"no targets", nn.LoRA{Rank: 1}, graph.ErrAttr},
		{"empty target", nn.LoRA{Rank: 1, Targets: []string{""}}, graph.ErrAttr},
		{"unmatched", nn.LoRA{Rank: 1, Targets: []string{"q_proj", "k_proj"}}, graph.ErrAttr},
		{"not linear", nn.LoRA{Rank: 1, Targets: []string{"act"}}, graph.ErrAttr},
		{"base dtype", nn.LoRA{Rank: 1, Targets: []string{"q_proj"}, Base: graph.Int64}, graph.ErrDType},
	}
	for _, c := range cases {
		m := loraNet(1)
		_, err := c.c.Apply(nn.Seed(1), m)
		require.ErrorIs(t, err, c.want, c.name)
		_, isLinear := m.Get("q_proj").(*nn.Linear)
		require.True(t, isLinear, "%s: the model is unchanged", c.name)
		for _, p := range m.Params() {
			require.False(t, p.Frozen(), "%s: nothing frozen", c.name)
		}
	}
	m := loraNet(1)
	_, err := nn.LoRA{Rank: 1, Targets: []string{"q_proj"}}.Apply(nn.Seed(1), m)
	require.NoError(t, err)
	_, err = nn.LoRA{Rank: 1, Targets: []string{"q_proj"}}.Apply(nn.Seed(1), m)
	require.ErrorIs(t, err, graph.ErrAttr, "adapted twice")

	shape := loraNet(1)
	_, err = nn.LoRA{Rank: 1, Targets: []string{"q_proj"}}.Apply(nn.Options{ShapeOnly: true}, shape)
	require.NoError(t, err)
	so := nn.NewSequentialNamed(nn.Child{Name: "q_proj", Module: nn.NewLinear(nn.Options{ShapeOnly: true}, 4, 4, false)})
	_, err = nn.LoRA{Rank: 1, Targets: []string{"q_proj"}}.Apply(nn.Options{ShapeOnly: true}, so)
	require.NoError(t, err)
	_, err = nn.MergeLoRA(so)
	require.ErrorIs(t, err, graph.ErrNoData)
}

// Dropout on the adapter's input is a module of its own, reached by
// SetTraining and listed by Dropouts under PEFT's name.
func TestLoRADropoutModule(t *testing.T) {
	m := loraNet(1)
	ls, err := nn.LoRA{Rank: 2, Dropout: 0.1, Targets: []string{"q_proj"}}.Apply(nn.Seed(1), m)
	require.NoError(t, err)
	ds := nn.Dropouts(m)
	require.Len(t, ds, 1)
	assert.Equal(t, "q_proj.lora_dropout", ds[0].Path)
	nn.SetTraining(m, true)
	assert.True(t, ls[0].Layer.Dropout.Training)
}
