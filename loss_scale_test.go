package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
)

// Dynamic loss scaling under fp16-mixed (precision.LossScale), on the CPU
// executor.

// gradRecorder is an optimizer that keeps a copy of the gradients it is
// given and updates nothing.
type gradRecorder struct {
	grads [][]float32
	steps int
}

func (*gradRecorder) Name() string          { return "recorder" }
func (*gradRecorder) StateSlots() int       { return 0 }
func (*gradRecorder) State(any) [][]float32 { return nil }
func (r *gradRecorder) Steps() int          { return r.steps }
func (r *gradRecorder) Step(ps []optim.Param) error {
	r.grads = r.grads[:0]
	for _, p := range ps {
		r.grads = append(r.grads, slices.Clone(p.Grad))
	}
	r.steps++
	return nil
}

// smallNet is a two-layer network over inputs of 8 features and 4
// classes, whose inputs the caller gives: an input beyond float16's range
// (65504) overflows in the step's float16 copy.
type smallNet struct{ m *nn.Sequential }

func newSmallNet() smallNet {
	o := nn.Seed(5)
	return smallNet{nn.NewSequential(nn.NewLinear(o, 8, 16, true), nn.ReLU{}, nn.NewLinear(o, 16, 4, true))}
}

// step builds the loss over n samples drawn from rng, the first input
// value replaced by first when it is not 0.
func (s smallNet) step(rng *rand.Rand, n int, first float32) (*lazy.Tensor, []*lazy.Tensor) {
	xs := testutil.RandFloats(rng, n*8)
	if first != 0 {
		xs[0] = first
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(n, 8), tensor.WithBacking(xs)), 0)
	y := x.Graph().Wrap(testutil.Classes(rng, 4, n), 0)
	return s.m.Forward(x).CrossEntropy(y, graph.ReduceMean), nn.ParamTensors(s.m)
}

func copyParams(params []*lazy.Tensor) [][]float32 {
	out := make([][]float32, len(params))
	for i, p := range params {
		out[i] = slices.Clone(p.Value().(*tensor.Dense).Float32s())
	}
	return out
}

func allFinite(t *testing.T, params []*lazy.Tensor) {
	t.Helper()
	for _, p := range params {
		for i, v := range p.Value().(*tensor.Dense).Float32s() {
			require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 0), "%s[%d] = %g", p.Name(), i, v)
		}
	}
}

// fp16-mixed scales by default, GradScaler's defaults; LossScale.Off and
// the other policies do not scale; options out of range are an error.
func TestLossScaleOptions(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		precision string
		o         precision.LossScale
		scale     float32
	}{
		{"fp16-mixed", precision.LossScale{}, 1 << 16},
		{"fp16-mixed", precision.LossScale{Init: 128}, 128},
		{"fp16-mixed", precision.LossScale{Off: true}, 0},
		{"bf16-mixed", precision.LossScale{}, 0},
		{"fp32", precision.LossScale{}, 0},
	} {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: c.precision, LossScale: c.o})
		require.NoError(t, sess.Err())
		assert.Equal(t, precision.ScalerStats{Scale: c.scale}, sess.LossScale(), "%s %+v", c.precision, c.o)
		net := newSmallNet()
		loss, params := net.step(rand.New(rand.NewPCG(1, 1)), 4, 0)
		_, err := sess.Step(ctx, loss, params, optim.NewSGD(0.1, 0))
		require.NoError(t, err)
		scaled := false
		for _, nd := range sess.LastProgram().Graph.Nodes() {
			scaled = scaled || nd.Name == "loss_scale"
		}
		assert.Equal(t, c.scale != 0, scaled, "%s %+v: the step's graph has a loss scale", c.precision, c.o)
		assert.Equal(t, c.scale != 0, sess.LastProgram().CallerFinish() >= exec.UnscaleBytes, "the flag's bytes, before the optimizer's scalars")
		if c.scale != 0 {
			assert.Equal(t, precision.ScalerStats{Scale: c.scale, Steps: 1, GoodInARow: 1}, sess.LossScale())
		}
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", LossScale: precision.LossScale{Backoff: 1}})
	require.ErrorIs(t, sess.Err(), precision.ErrLossScale)
	assert.Contains(t, sess.Err().Error(), "Options.LossScale")
	sess = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", LossScale: precision.LossScale{Interval: -1}})
	require.ErrorIs(t, sess.Err(), precision.ErrLossScale, "checked under every policy")
}

// A step whose scaled gradients overflow float16 is skipped: no error, the
// parameters stay as they were, finite, bit for bit, Adam takes no step
// and keeps no state, the skip is counted and the scale halves. Steps go
// on being skipped until the scale is small enough; then the update runs.
// The reported loss is the unscaled one, and every step reuses one
// compiled program although the scale changed each time. Whole and in
// chunks.
func TestLossScaleOverflowSkipsStep(t *testing.T) {
	ctx := context.Background()
	const n = 1000
	for _, chunked := range []bool{false, true} {
		o := batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", LossScale: precision.LossScale{Init: 1 << 40}}
		if chunked {
			// Plan one step to find a budget that needs chunks.
			probe := batchfit.NewSession(o)
			loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(9, 9)), n)
			_, err := probe.Step(ctx, loss, params, optim.NewAdam(1e-2))
			require.NoError(t, err)
			budgets := testutil.TightBudgets(t, probe.LastProgram())
			ks := testutil.Counts(budgets)
			require.Greater(t, len(ks), 1)
			o.Budget = budgets[ks[len(ks)-1]]
		}
		sess := batchfit.NewSession(o)
		off := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", LossScale: precision.LossScale{Off: true}})
		net, netOff := mlpModel(false), mlpModel(false) // equal parameters, of their own
		opt := optim.NewAdam(1e-2)
		rng := rand.New(rand.NewPCG(2, 3))
		skipped := 0
		for step := range 40 {
			seed := rng.Uint64()
			loss, params := net.Build(rand.New(rand.NewPCG(seed, 1)), n)
			before := copyParams(params)
			scale := sess.LossScale().Scale
			l, err := sess.Step(ctx, loss, params, opt)
			require.NoError(t, err, "step %d", step)
			if chunked {
				require.Greater(t, len(sess.LastPlan().Chunks), 1)
			}
			st := sess.LossScale()
			allFinite(t, params)
			if st.LastSkipped {
				skipped++
				require.Equal(t, scale/2, st.Scale, "step %d: the scale halves", step)
				require.Equal(t, skipped, st.Skipped)
				require.Zero(t, opt.Steps(), "step %d: Adam's step count", step)
				require.Nil(t, opt.State(params[0].Value()), "step %d: no optimizer state", step)
				require.Equal(t, before, copyParams(params), "step %d: parameters unchanged", step)
				// The unscaled loss: a session without scaling over the
				// same parameters and data reports the same, bit for bit
				// in one chunk (in chunks, summed in float32 over the
				// session's own chunks: within rounding).
				lossOff, paramsOff := netOff.Build(rand.New(rand.NewPCG(seed, 1)), n)
				lOff, err := off.Step(ctx, lossOff, paramsOff, &gradRecorder{})
				require.NoError(t, err)
				if chunked {
					require.InEpsilon(t, lOff, l, 1e-6, "step %d: the reported loss is unscaled", step)
				} else {
					require.Equal(t, lOff, l, "step %d: the reported loss is unscaled", step)
				}
				continue
			}
			require.Positive(t, skipped, "the first step at 2⁴⁰ overflows")
			assert.Equal(t, float32(math.Ldexp(1, 40-skipped)), st.Scale, "unchanged by a good step")
			assert.Equal(t, 1, st.GoodInARow)
			assert.Equal(t, 1, opt.Steps(), "the first good step is Adam's first")
			assert.NotEqual(t, before, copyParams(params), "a good step updates")
			break
		}
		assert.Equal(t, skipped+1, sess.LossScale().Steps)
		assert.Greater(t, skipped, 10, "2⁴⁰ is far beyond float16's range")
		assert.GreaterOrEqual(t, sess.CacheHits(), skipped, "one program for every scale")
		t.Logf("chunked %v: %d steps skipped, scale %g", chunked, skipped, sess.LossScale().Scale)
	}
}

// Inputs beyond float16's range make infinite or NaN gradients at any
// scale: the step is skipped and counted, the weights stay finite and
// unchanged, the scale halves; after Interval good steps in a row it
// doubles, and a skipped step restarts the count.
func TestLossScaleBackoffAndGrowth(t *testing.T) {
	ctx := context.Background()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed",
		LossScale: precision.LossScale{Init: 8, Interval: 3}})
	require.NoError(t, sess.Err())
	net := newSmallNet()
	opt := optim.NewSGD(0.1, 0.9)
	rng := rand.New(rand.NewPCG(4, 4))
	good := 0
	for i, c := range []struct {
		poison bool
		scale  float32
	}{
		{false, 8}, {false, 8}, {true, 4}, {false, 4}, {false, 4}, {false, 8},
		{false, 8}, {true, 4}, {false, 4}, {false, 4}, {false, 8}, {false, 8}, {false, 8}, {false, 16},
	} {
		first := float32(0)
		if c.poison {
			first = 1e6 // float16 holds at most 65504: the input's copy is inf
		}
		loss, params := net.step(rng, 8, first)
		before := copyParams(params)
		_, err := sess.Step(ctx, loss, params, opt)
		require.NoError(t, err, "step %d", i)
		st := sess.LossScale()
		require.Equal(t, c.scale, st.Scale, "after step %d", i)
		require.Equal(t, c.poison, st.LastSkipped, "step %d", i)
		allFinite(t, params)
		if c.poison {
			require.Equal(t, before, copyParams(params), "step %d: parameters unchanged", i)
		} else {
			good++
			require.NotEqual(t, before, copyParams(params), "step %d", i)
		}
		require.Equal(t, good, opt.Steps(), "step %d: SGD counts the steps that ran", i)
	}
	assert.Equal(t, precision.ScalerStats{Scale: 16, Steps: 14, Skipped: 2}, sess.LossScale())
}

// The gradients a loss-scaled step hands the optimizer are the scaled
// graph's gradients times 1/S, exactly when S is a power of two (the
// default 2¹⁶) and rounded once otherwise; they equal fp16-mixed's without
// scaling within 2e-3 (relative, per parameter: both round in float16,
// and S moves values out of float16's subnormal range, where rounding is
// coarser; measured: 2.3e-5 MLP, 1.1e-3 GPT, 4e-7 ConvNet at 2¹⁶) and
// fp32's within 2% (TestMixedGradientsNearFloat32's tolerance; measured
// at most 1.4e-3, where unscaled fp16-mixed is at 1.5e-3).
func TestLossScaleGradients(t *testing.T) {
	ctx := context.Background()
	const tolOff, tol32 = 2e-3, 2e-2
	for _, c := range []struct {
		model func(dropout bool) testutil.TrainModel
		n     int
	}{{mlpModel, 16}, {gptModel(64), 4}, {convModel(8), 4}} {
		name := c.model(false).Name
		grads := func(o batchfit.Options) [][]float32 {
			loss, params := c.model(false).Build(rand.New(rand.NewPCG(7, 7)), c.n)
			rec := &gradRecorder{}
			_, err := batchfit.NewSession(o).Step(ctx, loss, params, rec)
			require.NoError(t, err)
			return rec.grads
		}
		fp32 := grads(batchfit.Options{Device: batchfit.DeviceCPU})
		off := grads(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", LossScale: precision.LossScale{Off: true}})
		worstOff32 := 0.0
		for i := range off {
			worstOff32 = max(worstOff32, relErr(off[i], fp32[i]))
		}
		t.Logf("%s: unscaled fp16-mixed: worst relative gradient difference %.2g from fp32", name, worstOff32)
		for _, s := range []float64{1 << 16, 1 << 10, 3000} {
			o := batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", LossScale: precision.LossScale{Init: s}}
			got := grads(o)

			// The scaled graph's own gradients, run as they are.
			loss, params := c.model(false).Build(rand.New(rand.NewPCG(7, 7)), c.n)
			wrt, err := lazy.ParamIDs(loss, params...)
			require.NoError(t, err)
			st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: precision.FP16Mixed, LossScale: true, Scale: tensor.New(tensor.FromScalar(float32(s)))})
			require.NoError(t, err)
			out, err := cpu.New().Run(ctx, st.Graph, st.Grads...)
			require.NoError(t, err)
			inv := exec.InvScale(float32(s))
			worstOff, worst32 := 0.0, 0.0
			for i, d := range out {
				scaled := testutil.Float32s(t, d)
				for k, v := range scaled {
					require.Equal(t, v*inv, got[i][k], "%s S=%g: gradient %d[%d] is the scaled one times float32(1/S)", name, s, i, k)
					if s == 1<<16 || s == 1<<10 {
						require.Equal(t, float64(v)/s, float64(got[i][k]), "%s S=%g: unscaling is exact", name, s)
					}
				}
				e := relErr(got[i], off[i])
				worstOff = max(worstOff, e)
				assert.LessOrEqual(t, e, tolOff, "%s S=%g: gradient %d against fp16-mixed without scaling", name, s, i)
				e = relErr(got[i], fp32[i])
				worst32 = max(worst32, e)
				assert.LessOrEqual(t, e, tol32, "%s S=%g: gradient %d against fp32", name, s, i)
			}
			t.Logf("%s S=%g: worst relative gradient difference %.2g from unscaled fp16-mixed, %.2g from fp32", name, s, worstOff, worst32)
		}
	}
}

// What loss scaling is for: a loss a million times smaller (loss·1e-7)
// makes float16 gradients of about 1e-9, below float16's smallest
// subnormal (6e-8). Unscaled, the first layer's weight gradient, a GEMM of
// those float16 values, is all zero; at the default scale 2¹⁶ it is
// fp32's within 2%.
func TestLossScaleRescuesUnderflow(t *testing.T) {
	ctx := context.Background()
	grads := func(o batchfit.Options) [][]float32 {
		o.Device = batchfit.DeviceCPU
		loss, params := newSmallNet().step(rand.New(rand.NewPCG(8, 8)), 16, 0)
		rec := &gradRecorder{}
		_, err := batchfit.NewSession(o).Step(ctx, loss.MulScalar(1e-7), params, rec)
		require.NoError(t, err)
		return rec.grads
	}
	fp32 := grads(batchfit.Options{})
	off := grads(batchfit.Options{Precision: "fp16-mixed", LossScale: precision.LossScale{Off: true}})
	scaled := grads(batchfit.Options{Precision: "fp16-mixed"})
	w0 := 0 // the first layer's weight
	require.NotZero(t, slices.Max(fp32[w0]))
	for _, v := range off[w0] {
		require.Zero(t, v, "unscaled, the float16 gradients underflow")
	}
	for i := range fp32 {
		e := relErr(scaled[i], fp32[i])
		t.Logf("gradient %d: scaled fp16-mixed %.2g from fp32, unscaled %.2g", i, e, relErr(off[i], fp32[i]))
		assert.LessOrEqual(t, e, 2e-2, "gradient %d", i)
	}
}

// Predicted == measured, to the byte, with loss scaling: the scale
// constant, the scaled loss and the flag are planned like any buffer, at
// every chunk count, over Adam steps.
func TestLossScalePlannedPeaksAreMeasured(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		model func(dropout bool) testutil.TrainModel
		n     int
	}{{mlpModel, 1000}, {gptModel(512), 40}} {
		name := c.model(false).Name
		// Unfused heads: the small GPT's logits make its per-sample memory.
		probe := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", NoFusedLoss: true})
		loss, params := c.model(false).Build(rand.New(rand.NewPCG(uint64(c.n), 1)), c.n)
		_, err := probe.Step(ctx, loss, params, optim.NewAdam(1e-3))
		require.NoError(t, err)
		budgets := testutil.TightBudgets(t, probe.LastProgram())
		ks := testutil.Counts(budgets)
		require.Greater(t, len(ks), 1, "%s: chunk counts %v", name, ks)
		for _, k := range slices.Compact([]int{ks[0], ks[1], ks[len(ks)-1]}) {
			m, rng := c.model(false), rand.New(rand.NewPCG(uint64(c.n), uint64(k)))
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[k], Precision: "fp16-mixed", NoFusedLoss: true})
			opt := optim.NewAdam(1e-3)
			for step := range 2 {
				loss, params := m.Build(rng, c.n)
				_, err := sess.Step(ctx, loss, params, opt)
				require.NoError(t, err, "%s budget %d step %d", name, budgets[k], step)
				pl, used, st := sess.LastPlan(), sess.LastUsage(), sess.Allocator().Stats()
				require.GreaterOrEqual(t, sess.LastProgram().CallerFinish(), int64(exec.UnscaleBytes))
				require.Equal(t, pl.PeakReserved, used.PeakReserved, "%s %d chunks step %d: reserved", name, len(pl.Chunks), step)
				require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "%s %d chunks step %d: allocated", name, len(pl.Chunks), step)
				require.Equal(t, pl.PeakReserved, st.ReservedBytes[alloc.All].Peak)
				require.Zero(t, st.NumOOMs)
			}
			assert.False(t, sess.LossScale().LastSkipped)
		}
	}
}

// A GPT trained under fp16-mixed with loss scaling (the default) ends
// within 2% of fp32's final loss.
func TestLossScaleTrainingMatchesFloat32(t *testing.T) {
	steps := 40
	if !testing.Short() {
		steps = 100
	}
	fp32 := trainGPT(t, "fp32", steps)
	fp16 := trainGPT(t, "fp16-mixed", steps)
	t.Logf("%d steps: final loss fp32 %.4f, fp16-mixed with loss scaling %.4f", steps, fp32, fp16)
	require.Less(t, fp32, math.Log(32)*0.8, "fp32 did not learn")
	require.InEpsilon(t, fp32, fp16, 0.02)
}

// A plan's graph keeps the scale out of its attributes: a session that
// compiled a step at one scale reuses the program at another, and the
// planner caches one plan for both.
func TestLossScaleReusesProgram(t *testing.T) {
	ctx := context.Background()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed",
		LossScale: precision.LossScale{Init: 4, Interval: 1}})
	net := newSmallNet()
	rng := rand.New(rand.NewPCG(6, 6))
	var sig uint64
	var plan *planner.Plan
	for step := range 5 {
		loss, params := net.step(rng, 8, 0)
		_, err := sess.Step(ctx, loss, params, optim.NewSGD(0.01, 0))
		require.NoError(t, err)
		require.Equal(t, float32(math.Ldexp(4, step+1)), sess.LossScale().Scale, "grows every good step at Interval 1")
		if step == 0 {
			sig, plan = sess.LastProgram().Graph.Signature(), sess.LastPlan()
			continue
		}
		assert.Equal(t, sig, sess.LastProgram().Graph.Signature())
		assert.Equal(t, plan.PeakReserved, sess.LastPlan().PeakReserved)
	}
	assert.Equal(t, 4, sess.CacheHits(), "compiled once")
}

// Recompute keeps the loss scale: the scale and the scaled loss are forward
// nodes (the backward pass starts after them), and a recomputed step's
// gradients equal the plain scaled step's, as its peaks its plan's.
func TestLossScaleWithRecompute(t *testing.T) {
	ctx := context.Background()
	grads := func(mode recompute.Mode) ([][]float32, *batchfit.Session) {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed", Recompute: mode})
		loss, params := gptModel(64)(false).Build(rand.New(rand.NewPCG(4, 4)), 4)
		rec := &gradRecorder{}
		_, err := sess.Step(ctx, loss, params, rec)
		require.NoError(t, err, "%s", mode)
		return rec.grads, sess
	}
	want, _ := grads(recompute.Off)
	for _, mode := range []recompute.Mode{recompute.SelectiveOnly, recompute.FullCheckpoint} {
		got, sess := grads(mode)
		assert.NotEqual(t, "none", sess.LastRecompute().Strategy, "%s", mode)
		assert.Equal(t, want, got, "%s", mode)
		assert.Equal(t, sess.LastPlan().PeakReserved, sess.LastUsage().PeakReserved, "%s", mode)
		assert.Equal(t, sess.LastPlan().PeakAllocated, sess.LastUsage().PeakAllocated, "%s", mode)
		assert.Equal(t, precision.ScalerStats{Scale: 1 << 16, Steps: 1, GoodInARow: 1}, sess.LossScale(), "%s", mode)
	}
}

// Inputs beyond float16's range in every step overflow at any scale: the
// scale backs off to its floor (1 by default) and no further, and each
// step skipped there returns an error wrapping precision.ErrScaleCollapse
// instead of nil while the scale sinks below 2⁻¹²⁶ (where 1/S overflows
// and clean steps are skipped too). Clean steps afterwards run at once.
func TestLossScaleCollapseIsReported(t *testing.T) {
	ctx := context.Background()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "fp16-mixed"})
	require.NoError(t, sess.Err())
	defer sess.Close()
	net := newSmallNet()
	opt := optim.NewSGD(0.1, 0)
	rng := rand.New(rand.NewPCG(6, 6))
	collapsed := 0
	for i := range 160 {
		loss, params := net.step(rng, 8, 1e6)
		before := copyParams(params)
		_, err := sess.Step(ctx, loss, params, opt)
		st := sess.LossScale()
		require.True(t, st.LastSkipped, "step %d", i)
		require.Equal(t, before, copyParams(params), "step %d: parameters unchanged", i)
		require.GreaterOrEqual(t, st.Scale, float32(1), "step %d: the scale stays at its floor", i)
		if i < 16 { // 2¹⁶ halves to 1
			require.NoError(t, err, "step %d", i)
			continue
		}
		require.ErrorIs(t, err, precision.ErrScaleCollapse, "step %d", i)
		collapsed++
	}
	assert.Equal(t, 144, collapsed)
	assert.Zero(t, opt.Steps())
	for i := range 5 {
		loss, params := net.step(rng, 8, 0)
		before := copyParams(params)
		_, err := sess.Step(ctx, loss, params, opt)
		require.NoError(t, err, "clean step %d", i)
		require.False(t, sess.LossScale().LastSkipped, "clean step %d is not skipped", i)
		require.NotEqual(t, before, copyParams(params), "clean step %d updates", i)
	}
	assert.Equal(t, 5, opt.Steps())
}
