package precision_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// The zero LossScale is GradScaler's defaults: 2¹⁶, halved by a skipped
// step, doubled by the 2000th good step in a row.
func TestScalerDefaults(t *testing.T) {
	s, err := precision.NewScaler(precision.LossScale{})
	require.NoError(t, err)
	assert.Equal(t, float32(1<<16), s.Scale())
	s.Update(false)
	assert.Equal(t, float32(1<<15), s.Scale())
	assert.Equal(t, precision.ScalerStats{Scale: 1 << 15, Steps: 1, Skipped: 1, SkippedInARow: 1, LastSkipped: true}, s.Stats())
	for range 1999 {
		s.Update(true)
	}
	assert.Equal(t, float32(1<<15), s.Scale(), "1999 good steps")
	assert.Equal(t, 1999, s.Stats().GoodInARow)
	s.Update(true)
	assert.Equal(t, float32(1<<16), s.Scale(), "2000 good steps")
	assert.Equal(t, precision.ScalerStats{Scale: 1 << 16, Steps: 2001, Skipped: 1}, s.Stats())
}

// A skipped step restarts the run of good steps; growth that would
// overflow float32 leaves the scale as it is; backoff stops at the floor.
func TestScalerUpdate(t *testing.T) {
	s, err := precision.NewScaler(precision.LossScale{Init: 8, Growth: 4, Backoff: 0.25, Interval: 3})
	require.NoError(t, err)
	want := []float32{8, 8, 2, 2, 2, 8, 8, 8, 32}
	for i, finite := range []bool{true, true, false, true, true, true, true, true, true} {
		s.Update(finite)
		require.Equal(t, want[i], s.Scale(), "after step %d", i)
	}
	assert.Equal(t, precision.ScalerStats{Scale: 32, Steps: 9, Skipped: 1}, s.Stats())

	s, err = precision.NewScaler(precision.LossScale{Init: math.MaxFloat32, Interval: 1})
	require.NoError(t, err)
	s.Update(true)
	assert.Equal(t, float32(math.MaxFloat32), s.Scale(), "2·MaxFloat32 is inf: no growth")
	assert.Zero(t, s.Stats().GoodInARow, "the tracker restarts all the same, as GradScaler's")

	s, err = precision.NewScaler(precision.LossScale{Init: 1e-30})
	require.NoError(t, err)
	for range 5 {
		s.Update(false)
	}
	assert.Equal(t, float32(1e-30), s.Scale(), "an Init below 1 is the floor")
}

func TestLossScaleValidate(t *testing.T) {
	require.NoError(t, precision.LossScale{}.Validate())
	require.NoError(t, precision.LossScale{Off: true}.Validate())
	for _, o := range []precision.LossScale{
		{Init: -1}, {Init: math.NaN()}, {Init: math.Inf(1)}, {Init: 1e39}, {Init: 1e-50}, {Init: 1e-44},
		{Growth: 1}, {Growth: 0.5}, {Growth: math.Inf(1)}, {Growth: math.NaN()},
		{Backoff: 1}, {Backoff: -0.5}, {Backoff: 2}, {Backoff: math.NaN()},
		{Interval: -1},
	} {
		err := o.Validate()
		require.ErrorIs(t, err, precision.ErrLossScale, "%+v", o)
		_, err = precision.NewScaler(o)
		require.ErrorIs(t, err, precision.ErrLossScale, "%+v", o)
	}
}

// Data is one float32 scalar tensor per value of the scale.
func TestScalerData(t *testing.T) {
	s, err := precision.NewScaler(precision.LossScale{Init: 4})
	require.NoError(t, err)
	d := s.Data()
	assert.Equal(t, float32(4), d.Data())
	assert.True(t, d.Shape().IsScalar())
	assert.Same(t, d, s.Data(), "same scale, same tensor")
	s.Update(true)
	assert.Same(t, d, s.Data())
	s.Update(false)
	d2 := s.Data()
	assert.NotSame(t, d, d2)
	assert.Equal(t, float32(2), d2.Data())
	assert.Equal(t, float32(4), d.Data(), "the old tensor is not changed")
}

// The loss-scale pass appends the scale as a float32 scalar constant and
// the scaled loss, from which the backward pass starts; the graph's
// signature does not depend on the scale's value, so a new scale compiles
// nothing anew.
func TestLossScalePass(t *testing.T) {
	for name, build := range map[string]func(*testing.T, nn.Options) model{"mlp": mlp, "gpt": gpt, "convnet": convnet} {
		m := build(t, nn.Options{ShapeOnly: true})
		wrt, err := lazy.ParamIDs(m.loss, m.params...)
		require.NoError(t, err)
		g := m.loss.Graph().IR()
		plain, err := trainStep(g, m.loss.ID(), wrt, compile.Options{Policy: precision.FP16Mixed})
		require.NoError(t, err)
		assert.Equal(t, -1, plain.Scale, name)
		assert.Equal(t, plain.Loss, plain.Scaled, name)

		sigs := map[uint64]bool{}
		for _, v := range []float32{1 << 16, 3, 0.5} {
			st, err := trainStep(g, m.loss.ID(), wrt, compile.Options{Policy: precision.FP16Mixed, LossScale: true, Scale: tensor.New(tensor.FromScalar(v))})
			require.NoError(t, err, name)
			sc := st.Graph.Node(st.Scale)
			assert.Equal(t, graph.OpConst, sc.Op, name)
			assert.Equal(t, "loss_scale", sc.Name, name)
			assert.Equal(t, graph.Type{Shape: []int{}, DType: graph.Float32, BatchAxis: -1, PerSample: 1}, sc.Type, name)
			assert.Equal(t, v, sc.Value.Data(), name)
			mul := st.Graph.Node(st.Scaled)
			assert.Equal(t, graph.OpMul, mul.Op, name)
			assert.Equal(t, []int{st.Loss, st.Scale}, mul.Inputs, name)
			assert.Equal(t, graph.Float32, mul.Type.DType, name)
			assert.Equal(t, st.Scaled+1, st.Scale+2, "the scale and the product come right after the forward pass")
			assert.Equal(t, plain.Loss, st.Loss, "%s: the loss is the same node", name)
			assert.Equal(t, plain.Params, st.Params, name)
			assert.Len(t, st.Grads, len(plain.Grads), name)
			for _, gr := range st.Grads {
				assert.Greater(t, gr, st.Scaled, "%s: gradients come after the scaled loss", name)
			}
			sigs[st.Graph.Signature()] = true
		}
		assert.Len(t, sigs, 1, "%s: the scale's value is not part of the signature", name)
		assert.False(t, sigs[plain.Graph.Signature()], name)
	}
}

// A shape-only step takes no data for the scale; data that is not a
// float32 scalar is refused.
func TestLossScalePassData(t *testing.T) {
	m := mlp(t, nn.Options{ShapeOnly: true})
	wrt, err := lazy.ParamIDs(m.loss, m.params...)
	require.NoError(t, err)
	g := m.loss.Graph().IR()
	st, err := trainStep(g, m.loss.ID(), wrt, compile.Options{Policy: precision.FP16Mixed, LossScale: true})
	require.NoError(t, err)
	assert.Nil(t, st.Graph.Node(st.Scale).Value)
	for _, bad := range []tensor.Tensor{
		tensor.New(tensor.FromScalar(float64(2))),
		tensor.New(tensor.WithShape(1), tensor.WithBacking([]float32{2})),
	} {
		_, err := trainStep(g, m.loss.ID(), wrt, compile.Options{Policy: precision.FP16Mixed, LossScale: true, Scale: bad})
		require.ErrorIs(t, err, graph.ErrDType)
	}
}

// A scaler restored with SetStats from another's Stats continues as that
// one does: the same scales and counts through skips and growth; bad
// states are refused with precision.ErrLossScale and change nothing.
func TestScalerSetStatsResumes(t *testing.T) {
	o := precision.LossScale{Init: 1024, Interval: 3}
	a, err := precision.NewScaler(o)
	require.NoError(t, err)
	outcomes := []bool{true, false, true, true, true, true, false, true}
	for _, ok := range outcomes[:4] {
		require.NoError(t, a.Update(ok))
	}
	b, err := precision.NewScaler(o)
	require.NoError(t, err)
	require.NoError(t, b.SetStats(a.Stats()))
	for _, ok := range outcomes[4:] {
		require.NoError(t, a.Update(ok))
		require.NoError(t, b.Update(ok))
		require.Equal(t, a.Stats(), b.Stats())
	}
	before := b.Stats()
	for _, bad := range []precision.ScalerStats{
		{Scale: 0}, {Scale: float32(math.Inf(1))}, {Scale: float32(math.NaN())},
		{Scale: 1, GoodInARow: 3}, {Scale: 1, GoodInARow: -1},
		{Scale: 1, Steps: 1, Skipped: 2}, {Scale: 1, LastSkipped: true},
		{Scale: 0.5}, // below the default MinScale, 1
		{Scale: 1, Steps: 2, Skipped: 1, SkippedInARow: 2, LastSkipped: true},
		{Scale: 1, Steps: 1, Skipped: 1, SkippedInARow: 1},
		{Scale: 1, Steps: 2, Skipped: 1, SkippedInARow: 1, GoodInARow: 1, LastSkipped: true},
	} {
		require.ErrorIs(t, b.SetStats(bad), precision.ErrLossScale, "%+v", bad)
	}
	require.Equal(t, before, b.Stats())

	// Restored in a run of skips at the floor, it collapses as the saved
	// one does, counting the skips before the save.
	o = precision.LossScale{Init: 4}
	a, err = precision.NewScaler(o)
	require.NoError(t, err)
	for range 2 { // 4, 2, then the floor
		require.NoError(t, a.Update(false))
	}
	require.Equal(t, precision.ScalerStats{Scale: 1, Steps: 2, Skipped: 2, SkippedInARow: 2, LastSkipped: true}, a.Stats())
	b, err = precision.NewScaler(o)
	require.NoError(t, err)
	require.NoError(t, b.SetStats(a.Stats()))
	require.ErrorIs(t, a.Update(false), precision.ErrScaleCollapse)
	require.ErrorIs(t, b.Update(false), precision.ErrScaleCollapse, "restored at the floor")
	require.Equal(t, a.Stats(), b.Stats())
	require.Equal(t, 3, b.Stats().SkippedInARow, "the skips before the save count")
}

// Backoff stops at MinScale (1 by default, DeepSpeed's min_loss_scale),
// so 1/S stays finite and a clean step after a run of bad ones is not
// skipped. A step that is not finite at the floor is a collapse: Update
// reports it, an error wrapping ErrScaleCollapse, each time, instead of
// letting the scale sink to float32's subnormals and every later step be
// skipped. A good step at the floor runs.
func TestScalerCollapse(t *testing.T) {
	s, err := precision.NewScaler(precision.LossScale{})
	require.NoError(t, err)
	for i := range 16 {
		require.NoError(t, s.Update(false), "skipped step %d: the scale backs off", i)
	}
	assert.Equal(t, float32(1), s.Scale())
	for i := range 200 {
		err := s.Update(false)
		require.ErrorIs(t, err, precision.ErrScaleCollapse, "skipped step %d at the floor", 16+i)
		require.Equal(t, float32(1), s.Scale(), "never below the floor")
	}
	assert.Equal(t, 216, s.Stats().Skipped)
	require.NoError(t, s.Update(true), "a good step at the floor")
	assert.Equal(t, float32(1), s.Scale())
	assert.Equal(t, 1, s.Stats().GoodInARow)
	require.ErrorIs(t, s.Update(false), precision.ErrScaleCollapse, "a bad step at the floor, after a good one")

	// The floor is configurable down to 2⁻¹²⁶, float32's smallest normal,
	// whose reciprocal is finite; below it, or above Init, is refused.
	s, err = precision.NewScaler(precision.LossScale{Init: 1, MinScale: 0x1p-126})
	require.NoError(t, err)
	for range 126 {
		require.NoError(t, s.Update(false))
	}
	assert.Equal(t, float32(0x1p-126), s.Scale())
	assert.False(t, math.IsInf(float64(1/s.Scale()), 0), "1/S is finite at the floor")
	require.ErrorIs(t, s.Update(false), precision.ErrScaleCollapse)
	for _, o := range []precision.LossScale{{MinScale: 0x1p-127}, {MinScale: -1}, {MinScale: math.NaN()}, {Init: 4, MinScale: 8}} {
		require.ErrorIs(t, o.Validate(), precision.ErrLossScale, "%+v", o)
	}
	// An Init below 1 is its own floor unless MinScale says otherwise.
	s, err = precision.NewScaler(precision.LossScale{Init: 0.25})
	require.NoError(t, err)
	require.ErrorIs(t, s.Update(false), precision.ErrScaleCollapse)
	assert.Equal(t, float32(0.25), s.Scale())
}
