package batchfit_test

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
)

// mlpStep is a step of a two-layer MLP (in → hidden → ReLU → 4, MSE) over n
// samples drawn from rng.
func mlpStep(m *nn.Sequential, rng *rand.Rand, n, in int) *lazy.Tensor {
	x := lazy.Wrap(testutil.UniformF32(rng, n, in), 0)
	y := x.Graph().Wrap(testutil.UniformF32(rng, n, 4), 0)
	return m.Forward(x).MSE(y, graph.ReduceMean)
}

func newTwoLayer(seed uint64, in, hidden int) *nn.Sequential {
	o := nn.Seed(seed)
	return nn.NewSequential(nn.NewLinear(o, in, hidden, true), nn.ReLU{}, nn.NewLinear(o, hidden, 4, true))
}

// A parameter belongs to the session that trains it first: another
// session's Step fails with ErrParamOwned, naming it, and changes nothing;
// once the owner is closed the other session may train it.
func TestParamOwnedBySession(t *testing.T) {
	ctx := context.Background()
	m := newTwoLayer(1, 8, 16)
	rng := rand.New(rand.NewPCG(1, 2))
	a := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	b := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer b.Close()
	_, err := a.Step(ctx, mlpStep(m, rng, 8, 8), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	before := hostValues(nn.ParamTensors(m))
	_, err = b.Step(ctx, mlpStep(m, rng, 8, 8), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, batchfit.ErrParamOwned)
	var oe *graph.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, before, hostValues(nn.ParamTensors(m)), "the refused step changed nothing")
	// Another model's parameters are b's to train meanwhile.
	other := newTwoLayer(2, 8, 16)
	_, err = b.Step(ctx, mlpStep(other, rng, 8, 8), nn.ParamTensors(other), optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	require.NoError(t, a.Close())
	_, err = b.Step(ctx, mlpStep(m, rng, 8, 8), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.NoError(t, err, "the owner is closed")
}

// Planning trains nothing, so a session's Plan leaves the parameters
// free: another session's Step trains them while the planner is open, as
// MaxBatch's callers do.
func TestPlanClaimsNoParams(t *testing.T) {
	ctx := context.Background()
	m := newTwoLayer(4, 8, 16)
	rng := rand.New(rand.NewPCG(5, 6))
	planner := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 64 << 20})
	defer planner.Close()
	_, err := planner.Plan(mlpStep(m, rng, 8, 8), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	trainer := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer trainer.Close()
	_, err = trainer.Step(ctx, mlpStep(m, rng, 8, 8), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.NoError(t, err, "the planning session does not own the parameters")
	// The trainer does now: the planner's own Step is refused.
	_, err = planner.Step(ctx, mlpStep(m, rng, 8, 8), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, batchfit.ErrParamOwned)
}

// Two sessions stepping the same parameters from two goroutines: one
// trains, the other is refused every time, and nothing races (run with
// -race).
func TestParamOwnershipConcurrent(t *testing.T) {
	ctx := context.Background()
	m := newTwoLayer(3, 8, 16)
	params := nn.ParamTensors(m)
	sessions := []*batchfit.Session{
		batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU}),
		batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU}),
	}
	for _, s := range sessions {
		defer s.Close()
	}
	// Graphs are built one at a time (a lazy graph is not for concurrent
	// building); the steps run concurrently.
	var build sync.Mutex
	rng := rand.New(rand.NewPCG(3, 4))
	const steps = 8
	ok, owned := make([]int, 2), make([]int, 2)
	var wg sync.WaitGroup
	for i, s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opt := optim.NewAdam(1e-2)
			for range steps {
				build.Lock()
				loss := mlpStep(m, rng, 8, 8)
				build.Unlock()
				_, err := s.Step(ctx, loss, params, opt)
				switch {
				case err == nil:
					ok[i]++
				case errors.Is(err, batchfit.ErrParamOwned):
					owned[i]++
				default:
					t.Errorf("session %d: %v", i, err)
				}
			}
		}()
	}
	wg.Wait()
	require.ElementsMatch(t, []int{0, steps}, ok, "one session trains every step")
	require.ElementsMatch(t, []int{0, steps}, owned, "the other is refused every step")
}

func hostValues(ps []*lazy.Tensor) [][]float32 {
	out := make([][]float32, len(ps))
	for i, p := range ps {
		out[i] = slices.Clone(p.Value().(*tensor.Dense).Float32s())
	}
	return out
}

// Freezing a 4096×2048 layer (W = 32 MiB in float32) leaves its gradient
// buffer and its Adam state out of the step: the plan's peak drops by
// exactly 3W. Storing it in bfloat16 (FreezeAs) under bf16-mixed drops it
// by W more: half the resident weight, and the bfloat16 copy a float32
// weight is cast to for its matrix product. On the CPU executor every
// plan's peaks are the measured ones to the byte.
// The frozen weight does not move; the others train. (The layer is large
// enough that each of its buffers, 16 MiB and up, is a segment of its own:
// smaller ones share 20 MiB segments, which hide what they free.)
func TestFrozenParamsPlanDrop(t *testing.T) {
	const in, hidden, n = 4096, 2048, 8
	w := int64(in * hidden * 4) // the layer's float32 weight: 32 MiB
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		peak := func(freeze func(m *nn.Sequential) error) (int64, *nn.Sequential) {
			m := newTwoLayer(5, in, hidden)
			require.NoError(t, freeze(m))
			s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec})
			defer s.Close()
			rng := rand.New(rand.NewPCG(5, 6))
			opt := optim.NewAdamW(1e-3)
			for step := range 2 {
				_, err := s.Step(ctx, mlpStep(m, rng, n, in), nn.ParamTensors(m), opt)
				require.NoError(t, err, "%s step %d", prec, step)
				pl, used := s.LastPlan(), s.LastUsage()
				require.Equal(t, pl.PeakReserved, used.PeakReserved, "%s step %d: reserved, predicted = measured", prec, step)
				require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "%s step %d: allocated, predicted = measured", prec, step)
			}
			return s.LastPlan().PeakReserved, m
		}
		first := func(m *nn.Sequential) *nn.Param { return m.Params()[0] }
		trained, _ := peak(func(*nn.Sequential) error { return nil })
		var frozenW []float32
		frozen, fm := peak(func(m *nn.Sequential) error {
			frozenW = slices.Clone(first(m).Value().(*tensor.Dense).Float32s())
			nn.Freeze(first(m))
			return nil
		})
		require.Equal(t, frozenW, first(fm).Value().(*tensor.Dense).Float32s(), "%s: the frozen weight does not move", prec)
		require.NotEqual(t, newTwoLayer(5, in, hidden).Params()[2].Value().(*tensor.Dense).Float32s(),
			fm.Params()[2].Value().(*tensor.Dense).Float32s(), "%s: the other layer trains", prec)
		t.Logf("%s: peak reserved %d trained, %d frozen (%d less; the weight is %d)", prec, trained, frozen, trained-frozen, w)
		require.Equal(t, 3*w, trained-frozen, "%s: its gradient and two state slots", prec)
		if prec != "bf16-mixed" {
			continue
		}
		half, hm := peak(func(m *nn.Sequential) error { return nn.FreezeAs(graph.BFloat16, first(m)) })
		require.Equal(t, graph.BFloat16, first(hm).Tensor().DType())
		t.Logf("%s: bfloat16 frozen %d (%d less than float32 frozen)", prec, half, frozen-half)
		require.Equal(t, w, frozen-half, "%s: half the weight's resident bytes, and its 16-bit cast copy", prec)
	}
}

// A 16-bit frozen weight computes what its rounded float32 values do:
// under bf16-mixed the matrix products read bfloat16 either way, so the
// losses of a model whose first weight is FreezeAs(BFloat16) and of one
// whose first weight holds the bfloat16-rounded values, frozen in
// float32, are equal.
//
// Tolerance: none (the same bfloat16 operands and kernels).
func TestFrozen16BitMatchesRounded(t *testing.T) {
	ctx := context.Background()
	a, b := newTwoLayer(7, 16, 32), newTwoLayer(7, 16, 32)
	require.NoError(t, nn.FreezeAs(graph.BFloat16, a.Params()[0]))
	wb := b.Params()[0].Value().(*tensor.Dense).Float32s()
	for i, v := range wb {
		wb[i] = roundBF16(v)
	}
	nn.Freeze(b.Params()[0])
	sa := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
	sb := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
	defer sa.Close()
	defer sb.Close()
	ra, rb := rand.New(rand.NewPCG(7, 8)), rand.New(rand.NewPCG(7, 8))
	for step := range 3 {
		la, err := sa.Step(ctx, mlpStep(a, ra, 8, 16), nn.ParamTensors(a), optim.NewSGD(0.1, 0))
		require.NoError(t, err)
		lb, err := sb.Step(ctx, mlpStep(b, rb, 8, 16), nn.ParamTensors(b), optim.NewSGD(0.1, 0))
		require.NoError(t, err)
		require.Equal(t, lb, la, "step %d", step)
	}
	// Unfrozen, a 16-bit parameter is refused: trained ones are float32.
	a.Params()[0].SetFrozen(false)
	_, err := sa.Step(ctx, mlpStep(a, ra, 8, 16), nn.ParamTensors(a), optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, graph.ErrDType)
	require.ErrorIs(t, nn.FreezeAs(graph.Int64, a.Params()[0]), graph.ErrDType)
	require.Len(t, nn.Trainable(b), 3, "the frozen weight is not listed")
}

func roundBF16(v float32) float32 {
	b := math.Float32bits(v)
	b = (b + 0x7fff + (b>>16)&1) &^ 0xffff
	return math.Float32frombits(b)
}

// Adam, then SGD, then the same Adam again through one session: each
// optimizer keeps its own state (PyTorch's semantics), so Adam's return
// continues its moments and its per-parameter steps.
func TestSessionAdamSGDAdam(t *testing.T) {
	ctx := context.Background()
	m := newTwoLayer(9, 8, 16)
	s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer s.Close()
	rng := rand.New(rand.NewPCG(9, 10))
	adam, sgd := optim.NewAdam(1e-2), optim.NewSGD(0.05, 0.9)
	params := nn.ParamTensors(m)
	key := params[0].Value()
	for _, phase := range []struct {
		opt   optim.Optimizer
		steps int
	}{{adam, 2}, {sgd, 2}, {adam, 1}} {
		before := slices.Clone(adam.State(key))
		for range phase.steps {
			_, err := s.Step(ctx, mlpStep(m, rng, 8, 8), params, phase.opt)
			require.NoError(t, err)
		}
		if phase.opt == sgd {
			require.Equal(t, before, adam.State(key), "SGD's steps leave Adam's moments alone")
		}
	}
	require.Equal(t, 3, adam.ParamStep(key))
	require.Equal(t, 2, sgd.ParamStep(key))
}

// Clipping through a session: SGD without momentum at lr 1 steps each
// parameter by −g·coef, so the step's size is min(norm, max_norm) (to
// float32 rounding), and LastGradNorm is the norm of the gradients the
// same step computes.
//
// Tolerance: rtol 1e-5 (float32 steps of about a thousand parameters).
func TestSessionClipping(t *testing.T) {
	ctx := context.Background()
	for _, maxNorm := range []float64{1e-3, 1e6} {
		m := newTwoLayer(11, 8, 16)
		s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		opt := optim.NewSGD(1, 0)
		opt.Clip.MaxNorm = maxNorm
		rng := rand.New(rand.NewPCG(11, 12))
		params := nn.ParamTensors(m)
		before := hostValues(params)
		_, err := s.Step(ctx, mlpStep(m, rng, 8, 8), params, opt)
		require.NoError(t, err)
		norm, err := opt.LastGradNorm()
		require.NoError(t, err)
		var moved float64
		for i, v := range hostValues(params) {
			for j, x := range v {
				d := float64(x) - float64(before[i][j])
				moved += d * d
			}
		}
		moved = math.Sqrt(moved)
		require.InEpsilon(t, min(norm, maxNorm), moved, 1e-5, "max norm %g: norm %g", maxNorm, norm)
		require.NoError(t, s.Close())
	}
}

// A run resumed from what a checkpoint holds (parameter values, each
// optimizer's Keys/ParamStep/State/Steps, the loss scaler's stats) in a
// new session with a new optimizer continues bit for bit as the
// uninterrupted run: fp32 and fp16-mixed (with its scaler), AdamW under a
// cosine schedule with clipping, a parameter group, and one parameter
// joining late.
func TestSessionResumeBitIdentical(t *testing.T) {
	ctx := context.Background()
	const total, cut = 8, 4
	for _, prec := range []string{"fp32", "fp16-mixed"} {
		mkOpt := func(m *nn.Sequential) *optim.Adam {
			o := optim.NewAdamW(1e-2)
			o.Schedule = optim.Cosine{Warmup: 2, Total: total, MinRatio: 0.1}
			o.Clip.MaxNorm = 0.5
			_, noDecay := optim.SplitDecay(m.Params())
			o.AddGroup("no_decay", optim.Keys(noDecay)...).WeightDecay = 0
			return o
		}
		// listed leaves the last bias out for the first two steps.
		listed := func(m *nn.Sequential, step int) []*lazy.Tensor {
			ps := nn.ParamTensors(m)
			if step < 2 {
				return ps[:len(ps)-1]
			}
			return ps
		}
		run := func(m *nn.Sequential, s *batchfit.Session, o *optim.Adam, rng *rand.Rand, from, to int) {
			for step := from; step < to; step++ {
				_, err := s.Step(ctx, mlpStep(m, rng, 8, 8), listed(m, step), o)
				require.NoError(t, err, "%s step %d", prec, step)
			}
		}
		opts := batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec}
		straight := newTwoLayer(13, 8, 16)
		ss := batchfit.NewSession(opts)
		run(straight, ss, mkOpt(straight), rand.New(rand.NewPCG(13, 14)), 0, total)
		require.NoError(t, ss.Close())

		first := newTwoLayer(13, 8, 16)
		s1 := batchfit.NewSession(opts)
		o1 := mkOpt(first)
		rng := rand.New(rand.NewPCG(13, 14))
		run(first, s1, o1, rng, 0, cut)
		require.NoError(t, s1.SyncParams())
		require.NoError(t, s1.SyncState())
		// The checkpoint: copies of everything, by parameter name.
		vals := hostValues(nn.ParamTensors(first))
		type saved struct {
			step  int
			slots [][]float32
		}
		state := map[string]saved{}
		for i, p := range first.Params() {
			k := p.Value()
			if o1.ParamStep(k) == 0 {
				continue
			}
			var sl [][]float32
			for _, x := range o1.State(k) {
				sl = append(sl, slices.Clone(x))
			}
			state[first.Params()[i].Name()] = saved{o1.ParamStep(k), sl}
		}
		steps, scaler := o1.Steps(), s1.LossScale()
		require.NoError(t, s1.Close())

		resumed := newTwoLayer(99, 8, 16) // other initial values, overwritten
		for i, p := range resumed.Params() {
			copy(p.Value().(*tensor.Dense).Float32s(), vals[i])
		}
		o2 := mkOpt(resumed)
		for i, p := range resumed.Params() {
			if st, ok := state[p.Name()]; ok {
				require.NoError(t, o2.SetState(p.Value(), len(vals[i]), st.step, st.slots))
			}
		}
		require.NoError(t, o2.SetSteps(steps))
		s2 := batchfit.NewSession(opts)
		if prec == "fp16-mixed" {
			require.NoError(t, s2.SetLossScale(scaler))
		} else {
			require.ErrorIs(t, s2.SetLossScale(scaler), precision.ErrLossScale, "no scaler to restore")
		}
		run(resumed, s2, o2, rng, cut, total)
		require.NoError(t, s2.Close())
		require.Equal(t, hostValues(nn.ParamTensors(straight)), hostValues(nn.ParamTensors(resumed)), prec)
	}
}
