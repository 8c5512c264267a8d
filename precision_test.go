package batchfit_test

import (
	"context"
	"fmt"
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
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Mixed precision on the CPU executor.

// mixedProgram compiles the training step a Session with policy p runs
// for loss and params, as stepProgram does for float32: channels last
// under bf16-mixed, a Session's default there, and the head and loss
// unfused (a Session with Options.NoFusedLoss): these tests' small
// models take their per-sample memory from the logits.
func mixedProgram(t *testing.T, p precision.Policy, loss *lazy.Tensor, params []*lazy.Tensor, slots int) *planner.Program {
	t.Helper()
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, params...)
	require.NoError(t, err)
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: p, ChannelsLast: p == precision.BF16Mixed, Disable: []string{compile.FuseLinearCrossEntropy}})
	require.NoError(t, err)
	outs := append([]int{st.Loss}, st.Grads...)
	info, err := shapeinfer.Analyze(st.Graph, outs...)
	require.NoError(t, err)
	prog, err := planner.Compile(st.Graph, info, outs, planner.CompileOptions{Kept: st.Grads, Trained: st.Params,
		StateSlots: slots, Workspace: cpu.Workspace})
	require.NoError(t, err)
	return prog
}

// Predicted == measured, to the byte, in bf16-mixed: whole and chunked
// (two and the most chunks the planner chooses), over Adam steps. The
// 16-bit copies count 2 bytes an element. A bf16-mixed step is not always
// smaller than fp32's: the MLP keeps a bf16 copy of its 784-wide input for
// the first weight's gradient beside the float32 input, as autocast does;
// the GPT, whose logits dominate, is.
func TestMixedPlannedPeaksAreMeasured(t *testing.T) {
	const steps = 2
	ctx := context.Background()
	for _, c := range []struct {
		model func(dropout bool) testutil.TrainModel
		n     int
	}{
		{mlpModel, 1000},
		{gptModel(512), 40},
		{func(bool) testutil.TrainModel { return testutil.PaddedHeadGPTModel() }, 40}, // its loss reads the padded head
		{convModel(32), 30},
	} {
		name := c.model(false).Name
		loss, params := c.model(false).Build(rand.New(rand.NewPCG(uint64(c.n), 1)), c.n)
		prog := mixedProgram(t, precision.BF16Mixed, loss, params, 2)
		whole, err := planner.Make(prog, planner.Options{Budget: 1 << 40})
		require.NoError(t, err)
		loss32, params32 := c.model(false).Build(rand.New(rand.NewPCG(uint64(c.n), 1)), c.n)
		whole32, err := planner.Make(stepProgram(t, loss32, params32, 2), planner.Options{Budget: 1 << 40})
		require.NoError(t, err)
		t.Logf("%s N=%d: peak allocated bf16-mixed %d B, fp32 %d B", name, c.n, whole.PeakAllocated, whole32.PeakAllocated)
		if name == "gpt" { // logits dominate, and they are bf16 until cross_entropy's float32 copy
			assert.Less(t, whole.PeakAllocated, whole32.PeakAllocated, "%s: bf16-mixed allocates less than fp32", name)
		}
		budgets := testutil.TightBudgets(t, prog)
		ks := testutil.Counts(budgets)
		seen := map[int]bool{}
		require.Greater(t, len(ks), 1, "%s: chunk counts %v", name, ks)
		for _, k := range slices.Compact([]int{ks[0], ks[1], ks[len(ks)-1]}) {
			budget := budgets[k]
			m, rng := c.model(false), rand.New(rand.NewPCG(uint64(c.n), uint64(k)))
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budget, Precision: "bf16-mixed", NoFusedLoss: true})
			require.NoError(t, sess.Err())
			opt := optim.NewAdam(1e-3)
			for step := range steps {
				loss, params := m.Build(rng, c.n)
				l, err := sess.Step(ctx, loss, params, opt)
				require.NoError(t, err, "%s budget %d step %d", name, budget, step)
				require.False(t, math.IsNaN(float64(l)) || math.IsInf(float64(l), 0), "loss %g", l)
				pl, used, st := sess.LastPlan(), sess.LastUsage(), sess.Allocator().Stats()
				// The session planned the program mixedProgram compiles.
				require.Equal(t, prog.Graph.Signature(), sess.LastProgram().Graph.Signature(), "step %d", step)
				seen[len(pl.Chunks)] = true
				at := fmt.Sprintf("%s budget %d (%d chunks) step %d", name, budget, len(pl.Chunks), step)
				require.LessOrEqual(t, pl.PeakReserved, budget, at)
				require.Equal(t, pl.PeakReserved, used.PeakReserved, "%s: reserved", at)
				require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "%s: allocated", at)
				require.Equal(t, pl.PeakReserved, st.ReservedBytes[alloc.All].Peak, "%s: stats reserved", at)
				require.Equal(t, pl.PeakAllocated, st.AllocatedBytes[alloc.All].Peak, "%s: stats allocated", at)
				require.Zero(t, st.NumOOMs, at)
			}
		}
		require.True(t, seen[1], "%s: no whole-batch run: %v", name, seen)
		require.Greater(t, len(seen), 1, "%s: no chunked run: %v", name, seen)
	}
}

// relErr is ‖got − want‖ / ‖want‖.
func relErr(got, want []float32) float64 {
	var d, n float64
	for i, w := range want {
		e := float64(got[i]) - float64(w)
		d += e * e
		n += float64(w) * float64(w)
	}
	return math.Sqrt(d / n)
}

// Gradients in bf16-mixed and fp16-mixed, over each parameter's whole
// gradient (‖got − want‖/‖want‖):
//   - against the float64 reference evaluating the same rewritten graph,
//     which rounds where the CPU executor rounds, within 2% (bf16) and
//     0.5% (fp16): the executor computes every op right in 16 bits;
//   - against fp32's gradients within 25% (bf16) and 2% (fp16). Each
//     per-sample gradient carries 2⁻⁹ (2⁻¹²) relative rounding, and the
//     batch sums that make weight and bias gradients cancel (random labels
//     at initialisation: sums ten times smaller than their terms), so the
//     first layers of the MLP and the ConvNet lose that much in bf16, as
//     PyTorch's autocast does; GPT's gradients stay within 1%.
func TestMixedGradientsNearFloat32(t *testing.T) {
	ctx := context.Background()
	tol := map[precision.Policy]float64{precision.BF16Mixed: 0.25, precision.FP16Mixed: 2e-2}
	tolRef := map[precision.Policy]float64{precision.BF16Mixed: 2e-2, precision.FP16Mixed: 5e-3}
	for _, c := range []struct {
		model func(dropout bool) testutil.TrainModel
		n     int
	}{{mlpModel, 16}, {gptModel(64), 4}, {convModel(8), 4}} {
		want := func() [][]float32 {
			loss, params := c.model(false).Build(rand.New(rand.NewPCG(7, 7)), c.n)
			grads := lazy.Grad(loss, params...)
			ids := make([]int, len(grads))
			for i, g := range grads {
				ids[i] = g.ID()
			}
			out, err := cpu.New().Run(ctx, loss.Graph().IR(), ids...)
			require.NoError(t, err)
			vals := make([][]float32, len(out))
			for i, d := range out {
				vals[i] = testutil.Float32s(t, d)
			}
			return vals
		}()
		for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
			loss, params := c.model(false).Build(rand.New(rand.NewPCG(7, 7)), c.n)
			wrt, err := lazy.ParamIDs(loss, params...)
			require.NoError(t, err)
			st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: p})
			require.NoError(t, err)
			out, err := cpu.New().Run(ctx, st.Graph, st.Grads...)
			require.NoError(t, err)
			exact, err := ref.Eval(st.Graph, nil, st.Grads...)
			require.NoError(t, err)
			worst, worstRef := 0.0, 0.0
			for i, d := range out {
				got := testutil.Float32s(t, d)
				r := make([]float32, len(exact[i].Data))
				for k, v := range exact[i].Data {
					r[k] = float32(v)
				}
				eRef := relErr(got, r)
				worstRef = max(worstRef, eRef)
				assert.LessOrEqual(t, eRef, tolRef[p], "%s %s: gradient of %s against the reference", c.model(false).Name, p, params[i].Name())
				e := relErr(got, want[i])
				worst = max(worst, e)
				assert.LessOrEqual(t, e, tol[p], "%s %s: gradient of %s", c.model(false).Name, p, params[i].Name())
				assert.Positive(t, e, "%s %s: gradient of %s equals fp32's: no rounding happened", c.model(false).Name, p, params[i].Name())
			}
			t.Logf("%s %s: worst relative gradient error %.2g against fp32 (tolerance %g), %.2g against the reference (%g)",
				c.model(false).Name, p, worst, tol[p], worstRef, tolRef[p])
		}
	}
}

// trainGPT trains a small GPT (examples/transformer's shape) for steps
// Adam steps under policy p on the CPU and returns the final loss, the
// mean of the last five.
func trainGPT(t *testing.T, p string, steps int) float64 {
	t.Helper()
	const vocab, seq, batch = 32, 16, 8
	m := models.NewGPT(nn.Seed(3), models.GPTConfig{Vocab: vocab, Context: seq, Layers: 2, Heads: 2, Dim: 32})
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: p})
	require.NoError(t, sess.Err())
	opt := optim.NewAdam(3e-3)
	rng := rand.New(rand.NewPCG(5, 5))
	var last []float64
	for step := range steps {
		// A learnable sequence: each token is the previous one plus one or
		// two, mod vocab.
		tok := make([]int64, batch*seq)
		tgt := make([]int64, batch*seq)
		for b := range batch {
			x := int64(rng.IntN(vocab))
			for i := range seq {
				tok[b*seq+i] = x
				x = (x + 1 + int64(rng.IntN(2))) % vocab
				tgt[b*seq+i] = x
			}
		}
		x := lazy.Wrap(tensor.New(tensor.WithShape(batch, seq), tensor.WithBacking(tok)), 0)
		y := x.Graph().Wrap(tensor.New(tensor.WithShape(batch, seq), tensor.WithBacking(tgt)), 0)
		l, err := sess.Step(context.Background(), models.Loss(m.Forward(x), y), nn.ParamTensors(m), opt)
		require.NoError(t, err, "%s step %d", p, step)
		if step >= steps-5 {
			last = append(last, float64(l))
		}
	}
	s := 0.0
	for _, l := range last {
		s += l
	}
	return s / float64(len(last))
}

// bf16-mixed training ends within 2% of fp32's final loss.
func TestMixedTrainingMatchesFloat32(t *testing.T) {
	steps := 40
	if !testing.Short() {
		steps = 200 // the version
	}
	fp32 := trainGPT(t, "fp32", steps)
	bf16 := trainGPT(t, "bf16-mixed", steps)
	t.Logf("%d steps: final loss fp32 %.4f, bf16-mixed %.4f", steps, fp32, bf16)
	require.Less(t, fp32, math.Log(32)*0.8, "fp32 did not learn")
	require.InEpsilon(t, fp32, bf16, 0.02)
}

// Values cross the boundary as float32 tensors: a 16-bit output comes back
// holding exactly representable values.
func TestMixedEvalOutputsAreRounded(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
	x := lazy.Wrap(testutil.UniformF32(rand.New(rand.NewPCG(1, 1)), 8, 784), 0)
	out, err := sess.Eval(context.Background(), nn.NewSequential(nn.NewLinear(nn.Seed(1), 784, 5, true)).Forward(x), x.Sum(1))
	require.NoError(t, err)
	for i, v := range testutil.Float32s(t, out[0]) {
		require.Equal(t, half.RoundBF16(v), v, "linear output %d is a bfloat16 value", i)
	}
	inexact := false
	for _, v := range testutil.Float32s(t, out[1]) {
		inexact = inexact || half.RoundBF16(v) != v
	}
	require.True(t, inexact, "a float32 reduction's output is not rounded to bfloat16")
}

// An unknown precision is a typed error from the session and every call.
func TestSessionUnknownPrecision(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16"})
	require.ErrorIs(t, sess.Err(), precision.ErrUnknown)
	assert.Contains(t, sess.Err().Error(), "Options.Precision")
	loss, params := mlpModel(false).Build(rand.New(rand.NewPCG(1, 1)), 4)
	_, err := sess.Step(context.Background(), loss, params, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, precision.ErrUnknown)
	for _, p := range []string{"", "fp32", "tf32", "bf16-mixed", "fp16-mixed"} {
		require.NoError(t, batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: p}).Err(), "%q", p)
	}
}
