package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// A training loop that makes a small constant anew every step (a loss's
// scale) keeps its device as it was when the value stays the same: the
// resident constant stands for the new one, so no segment goes back to
// the device and none is taken again after the first step, the plan is
// the last step's, and Plan predicts the step that follows it; the peaks
// are measured as predicted. When the value changes, or the caller reuses
// one backing array and writes a new value into it, the step reads the
// new value: the loss is the plain loss times it, to the last bit of a
// float32 product.
//
// Tolerance: none. The loss with scale s is float32(s · plain), which the
// executor computes as the same product.
func TestConstantMadeEveryStepKeepsTheCache(t *testing.T) {
	ctx := context.Background()
	const in, hidden, n = 32, 2048, 1024 // activations of 8 MiB: segments of their own
	m := newTwoLayer(7, in, hidden)
	data := func(step int) (*tensor.Dense, *tensor.Dense) {
		rng := rand.New(rand.NewPCG(uint64(step), 3))
		return testutil.UniformF32(rng, n, in), testutil.UniformF32(rng, n, 4)
	}
	loss := func(step int, scale *lazy.Tensor) *lazy.Tensor {
		x, y := data(step)
		xt := lazy.Wrap(x, 0)
		l := m.Forward(xt).MSE(xt.Graph().Wrap(y, 0), graph.ReduceMean)
		if scale == nil {
			return l
		}
		return l.Mul(scale)
	}
	scalar := func(v float32) *lazy.Tensor { return lazy.Const(tensor.New(tensor.FromScalar(v))) }
	// The plain loss of each step's data at each step's parameters: an
	// SGD with rate 0 leaves them as they are.
	plain := make([]float32, 8)
	ref := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	for step := range plain {
		var err error
		plain[step], err = ref.Step(ctx, loss(step, nil), nn.ParamTensors(m), optim.NewSGD(0, 0))
		require.NoError(t, err)
	}
	require.NoError(t, ref.Close())

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 256 << 20})
	defer sess.Close()
	opt := optim.NewSGD(0, 0)
	var after alloc.Stats
	for step := range 4 { // the same value, a new tensor every step
		if step > 1 {
			sp, err := sess.Plan(loss(step, scalar(0.5)), nn.ParamTensors(m), opt)
			require.NoError(t, err)
			require.Equal(t, sess.LastPlan().PeakReserved, sp.Plan.PeakReserved, "step %d: Plan predicts the step", step)
		}
		got, err := sess.Step(ctx, loss(step, scalar(0.5)), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		require.Equal(t, 0.5*plain[step], got, "step %d", step)
		pl, u := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, pl.PeakReserved, u.PeakReserved, "step %d: predicted = measured", step)
		require.Equal(t, pl.PeakAllocated, u.PeakAllocated, "step %d", step)
		st := sess.Allocator().Stats()
		if step > 0 {
			require.Equal(t, after.NumDeviceAlloc, st.NumDeviceAlloc, "step %d: no segment taken again", step)
			require.Equal(t, after.NumDeviceFree, st.NumDeviceFree, "step %d: no segment given back", step)
		}
		after = st
	}
	// Another value each step, and one backing array written over: the
	// step reads the value it is given.
	buf := []float32{0}
	for step, v := range []float32{0.25, 2, 0.25, 3} {
		s := scalar(v)
		if step >= 2 {
			buf[0] = v
			s = lazy.Const(tensor.New(tensor.WithShape(), tensor.WithBacking(buf)))
		}
		got, err := sess.Step(ctx, loss(4+step, s), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		require.Equal(t, v*plain[4+step], got, "value %g", v)
		require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved)
	}
}

// The zoo's language models in a steady training loop under a budget take
// no segment from the device and give none back after the first step: the
// Llama's loss scale, made every step (models.ShiftedCausalLMLoss), is the
// resident one renamed, and the written-out and LoRA Llamas and GPT-2 make
// no other per-step constant.
func TestLanguageModelLoopsKeepTheirSegments(t *testing.T) {
	cfg := wideLlamaTiny()
	llama := func(written, lora bool) func() (func(*rand.Rand) *lazy.Tensor, []*lazy.Tensor) {
		return func() (func(*rand.Rand) *lazy.Tensor, []*lazy.Tensor) {
			c := cfg
			c.WrittenOut = written
			m := models.NewLlama(nn.Seed(3), c)
			if lora {
				_, err := nn.LoRA{Rank: 4, Targets: nn.DefaultLoRATargets}.Apply(nn.Seed(4), m)
				require.NoError(t, err)
			}
			return func(rng *rand.Rand) *lazy.Tensor { return llamaLoss(m, llamaCorpus(rng, c.Vocab, 4, 32)) }, nn.ParamTensors(m)
		}
	}
	gpt := func() (func(*rand.Rand) *lazy.Tensor, []*lazy.Tensor) {
		g := models.NewGPT(nn.Seed(2), models.GPTConfig{Vocab: 2048, Context: 32, Layers: 2, Heads: 2, Dim: 128})
		return func(rng *rand.Rand) *lazy.Tensor {
			x := lazy.Wrap(llamaCorpus(rng, 2048, 4, 32), 0)
			return models.Loss(g.Forward(x), x.Graph().Wrap(llamaCorpus(rng, 2048, 4, 32), 0))
		}, nn.ParamTensors(g)
	}
	for _, c := range []struct {
		name, precision string
		model           func() (func(*rand.Rand) *lazy.Tensor, []*lazy.Tensor)
	}{
		{"llama", "bf16-mixed", llama(false, false)},
		{"llama fp16-mixed", "fp16-mixed", llama(false, false)},
		{"llama written out", "bf16-mixed", llama(true, false)},
		{"llama lora", "bf16-mixed", llama(false, true)},
		{"gpt", "bf16-mixed", gpt},
	} {
		t.Run(c.name, func(t *testing.T) {
			loss, params := c.model()
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: c.precision, Budget: 1 << 30})
			defer sess.Close()
			opt := optim.NewAdamW(1e-3)
			rng := rand.New(rand.NewPCG(5, 5))
			var first alloc.Stats
			for step := range 4 {
				_, err := sess.Step(context.Background(), loss(rng), params, opt)
				require.NoError(t, err)
				require.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved, "step %d", step)
				st := sess.Allocator().Stats()
				if step == 0 {
					first = st
					continue
				}
				require.Equal(t, first.NumDeviceAlloc, st.NumDeviceAlloc, "step %d: segments taken again", step)
				require.Equal(t, first.NumDeviceFree, st.NumDeviceFree, "step %d: segments given back", step)
			}
		})
	}
}
