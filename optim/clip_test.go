package optim_test

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/optim"
)

// Hand-computed norms: gradients (3, 4) and (12) have 2-norm 13 and
// ∞-norm 12; a NaN makes either NaN; an inf makes the 2-norm inf.
func TestGradNorm(t *testing.T) {
	g := [][]float32{{3, 4}, {12}}
	require.Equal(t, 13.0, optim.GradNorm(g, false))
	require.Equal(t, 12.0, optim.GradNorm(g, true))
	nan := [][]float32{{1, float32(math.NaN()), 100}}
	require.True(t, math.IsNaN(optim.GradNorm(nan, false)))
	require.True(t, math.IsNaN(optim.GradNorm(nan, true)))
	inf := [][]float32{{1, float32(math.Inf(-1))}}
	require.True(t, math.IsInf(optim.GradNorm(inf, false), 1))
	require.True(t, math.IsInf(optim.GradNorm(inf, true), 1))
}

// ClipCoef is PyTorch's float32 arithmetic: 1/(norm + 1e-6) rounded, then
// times max_norm; at most 1; 0 for an infinite norm; NaN for a NaN one.
func TestClipCoef(t *testing.T) {
	want := float32(1/(float32(13)+float32(1e-6))) * float32(1)
	require.Equal(t, want, optim.ClipCoef(13, 1))
	require.Equal(t, float32(1), optim.ClipCoef(0.5, 1), "below max_norm")
	require.Equal(t, float32(0), optim.ClipCoef(math.Inf(1), 1))
	require.True(t, math.IsNaN(float64(optim.ClipCoef(math.NaN(), 1))))
}

// SGD without momentum makes the clipped gradient visible: p ← p − lr·g·coef.
// Gradients (3, 4) and (12), max norm 1: the step is lr·g/13 (to float32
// rounding of coef); with ∞-norm, lr·g/12. LastGradNorm gives 13 and 12.
func TestClipScalesTheUpdate(t *testing.T) {
	for _, c := range []struct {
		norm     float64
		normType float64
	}{{13, 2}, {12, math.Inf(1)}} {
		o := optim.NewSGD(0.1, 0)
		o.Clip = optim.Clip{MaxNorm: 1, NormType: c.normType}
		_, err := o.LastGradNorm()
		require.True(t, errors.Is(err, optim.ErrNoGradNorm))
		a := optim.Param{Key: "a", Data: []float32{0, 0}, Grad: []float32{3, 4}}
		b := optim.Param{Key: "b", Data: []float32{0}, Grad: []float32{12}}
		require.NoError(t, o.Step([]optim.Param{a, b}))
		coef := optim.ClipCoef(c.norm, 1)
		for i, g := range []float32{3, 4} {
			require.Equal(t, float32(-0.1*float64(g*coef)), a.Data[i])
		}
		require.Equal(t, float32(-0.1*float64(12*coef)), b.Data[0])
		near(t, -0.1*12/c.norm, b.Data[0], "the step of a gradient clipped to max norm 1")
		n, err := o.LastGradNorm()
		require.NoError(t, err)
		require.Equal(t, c.norm, n)
		require.Equal(t, []float32{3, 4}, a.Grad, "the gradients are left as they are")
	}
}

// A norm below MaxNorm leaves the update as without clipping; an inf
// gradient zeroes the finite ones' updates (coef 0), as PyTorch's does.
func TestClipBelowMaxAndNonFinite(t *testing.T) {
	plain, clipped := optim.NewAdam(1e-2), optim.NewAdam(1e-2)
	clipped.Clip.MaxNorm = 100
	a := optim.Param{Key: "w", Data: []float32{1, 2}, Grad: []float32{0.5, -1}}
	b := optim.Param{Key: "w", Data: []float32{1, 2}, Grad: []float32{0.5, -1}}
	require.NoError(t, plain.Step([]optim.Param{a}))
	require.NoError(t, clipped.Step([]optim.Param{b}))
	require.Equal(t, a.Data, b.Data)

	o := optim.NewSGD(0.1, 0)
	o.Clip.MaxNorm = 1
	p := optim.Param{Key: "w", Data: []float32{1, 2}, Grad: []float32{float32(math.Inf(1)), 3}}
	require.NoError(t, o.Step([]optim.Param{p}))
	require.True(t, math.IsNaN(float64(p.Data[0])), "inf·0")
	require.Equal(t, float32(2), p.Data[1], "coef 0: no step")
	n, err := o.LastGradNorm()
	require.NoError(t, err)
	require.True(t, math.IsInf(n, 1))
}

// Bad clip settings are errors of the step.
func TestClipErrors(t *testing.T) {
	w := optim.Param{Key: "w", Data: []float32{1}, Grad: []float32{1}}
	for _, c := range []optim.Clip{{MaxNorm: -1}, {MaxNorm: math.NaN()}, {MaxNorm: 1, NormType: 1}, {MaxNorm: 1, NormType: math.Inf(-1)}} {
		o := optim.NewSGD(0.1, 0)
		o.Clip = c
		require.ErrorIs(t, o.Step([]optim.Param{w}), optim.ErrOptim, "%+v", c)
	}
}

// A reader set by an executor is called only when LastGradNorm is, once:
// its value is kept until the next step sets another.
func TestGradNormReader(t *testing.T) {
	o := optim.NewAdam(1e-3)
	calls := 0
	o.SetGradNormReader(func() (float64, error) { calls++; return 2.5, nil })
	require.Zero(t, calls)
	for range 2 {
		n, err := o.LastGradNorm()
		require.NoError(t, err)
		require.Equal(t, 2.5, n)
	}
	require.Equal(t, 1, calls)
	boom := errors.New("device fault")
	o.SetGradNormReader(func() (float64, error) { return 0, boom })
	_, err := o.LastGradNorm()
	require.ErrorIs(t, err, boom)
}

// The no-decay rule: fewer than two dimensions, a bias, or a norm's
// parameter; weight matrices and embeddings decay.
func TestNoDecay(t *testing.T) {
	for _, c := range []struct {
		name  string
		shape []int
		no    bool
	}{
		{"h.0.attn.c_attn.weight", []int{768, 2304}, false},
		{"h.0.attn.c_attn.bias", []int{2304}, true},
		{"h.0.ln_1.weight", []int{768}, true},
		{"model.layers.3.input_layernorm.weight", []int{2048}, true},
		{"model.norm.weight", []int{2048}, true},
		{"model.embed_tokens.weight", []int{32000, 2048}, false},
		{"wte.weight", []int{50257, 768}, false},
		{"conv.bias", []int{4, 4}, true},
		{"layer1.0.bn1.weight", []int{64}, true},
		{"scale", []int{}, true},
		{"encoder.rmsnorm.weight", []int{8, 8}, true},
		{"bnet.weight", []int{8, 8}, false},
	} {
		require.Equal(t, c.no, optim.NoDecay(c.name, c.shape), c.name)
	}
}

// SetNormOf: a host step that clips takes the norm from the function (a
// norm of 26 for gradients whose own is 13 halves the clip factor), it
// is LastGradNorm, an error from it fails the step with nothing updated,
// and nil restores GradNorm.
func TestSetNormOf(t *testing.T) {
	o := optim.NewSGD(1, 0)
	o.Clip = optim.Clip{MaxNorm: 1, NormType: 2}
	data := []float32{0, 0}
	step := func() error {
		return o.Step([]optim.Param{{Key: 1, Name: "p", Data: data, Grad: []float32{3, 4}}, {Key: 2, Name: "q", Data: make([]float32, 1), Grad: []float32{12}}})
	}
	o.SetNormOf(func(grads [][]float32, inf bool) (float64, error) {
		require.False(t, inf)
		require.Len(t, grads, 2)
		return 26, nil
	})
	require.NoError(t, step())
	n, err := o.LastGradNorm()
	require.NoError(t, err)
	require.Equal(t, 26.0, n)
	coef := optim.ClipCoef(26, 1)
	require.Equal(t, []float32{-3 * coef, -4 * coef}, data)

	boom := errors.New("peer gone")
	o.SetNormOf(func([][]float32, bool) (float64, error) { return 0, boom })
	before := append([]float32(nil), data...)
	require.ErrorIs(t, step(), boom)
	require.Equal(t, before, data)
	require.Equal(t, 1, o.Steps())

	o.SetNormOf(nil)
	require.NoError(t, step())
	n, err = o.LastGradNorm()
	require.NoError(t, err)
	require.Equal(t, 13.0, n)
}
