package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// The device optimizer's plan on the GPU: per-parameter steps, groups,
// schedules and clipping from device scalars, its update as one replayed
// CUDA graph, and state kept per optimizer. Every test here compares the
// device update with optim.go's on the host (ExecOptions.Update on a twin
// of the same parameters), which the CPU tests of package optim hold to
// PyTorch.

// params makes fresh parameters holding m.init.
func (m manyParams) params() []*lazy.Tensor {
	ps := make([]*lazy.Tensor, len(m.init))
	for i, v := range m.init {
		ps[i] = lazy.Param(tensor.New(tensor.WithShape(len(v)), tensor.WithBacking(slices.Clone(v))), fmt.Sprintf("p%d", i))
	}
	return ps
}

// lossOf is manyParams.build's loss over the parameters ps.
func (m manyParams) lossOf(ps []*lazy.Tensor) *lazy.Tensor {
	dense := func(v []float32) *tensor.Dense {
		return tensor.New(tensor.WithShape(len(v)), tensor.WithBacking(slices.Clone(v)))
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(manyParamsBatch, 5), tensor.WithBacking(slices.Clone(m.x))), 0)
	y := x.Sum(0).Add(ps[0]).Add(ps[1])
	loss := y.Mul(y).Mul(lazy.Const(dense(m.consts[0]))).Sum()
	for i, p := range ps[2:] {
		loss = loss.Add(p.Mul(p).Mul(lazy.Const(dense(m.consts[i+1]))).Sum())
	}
	return loss
}

// twin is one step's device run and host run of the same parameters on one
// executor: dev trains with the optimizer on the device, host with the
// same optimizer's host Step through ExecOptions.Update.
type twin struct {
	t          *testing.T
	e          *cuda.Executor
	m          manyParams
	dev, host  []*lazy.Tensor
	devO, hstO optim.Optimizer
}

// step trains the first k parameters once on both, with o's other options
// for the device run, and holds the losses equal.
func (tw *twin) step(k int, o cuda.ExecOptions) {
	t := tw.t
	ctx := context.Background()
	chunks := planner.Chunks(manyParamsBatch, 1)
	dp := stepProgram(t, tw.m.lossOf(tw.dev), tw.dev[:k], tw.devO.StateSlots())
	o.Resident, o.Optimizer = true, tw.devO
	dres, err := tw.e.Execute(ctx, dp, chunks, o)
	require.NoError(t, err)
	hp := stepProgram(t, tw.m.lossOf(tw.host), tw.host[:k], tw.hstO.StateSlots())
	update := func(kept [][]float32) error {
		ps := make([]optim.Param, k)
		for i, pt := range tw.host[:k] {
			ps[i] = optim.Param{Key: pt.Value(), Name: pt.Name(), Data: pt.Value().(*tensor.Dense).Float32s(), Grad: kept[i]}
		}
		return tw.hstO.Step(ps)
	}
	hres, err := tw.e.Execute(ctx, hp, chunks, cuda.ExecOptions{Resident: true, Update: update})
	require.NoError(t, err)
	require.Equal(t, scalarOf(t, hres.Outputs[0]), scalarOf(t, dres.Outputs[0]), "loss")
}

// equal holds the device run's parameters to the host run's: bit for bit
// with rtol 0, else within rtol of each tensor's largest magnitude.
func (tw *twin) equal(rtol float64, what string) {
	t := tw.t
	require.NoError(t, tw.e.SyncParams())
	want, got := hostParams(t, tw.host), hostParams(t, tw.dev)
	for i := range want {
		if rtol == 0 {
			require.Equal(t, want[i], got[i], "%s: parameter %s", what, tw.dev[i].Name())
			continue
		}
		big := 0.0
		for _, w := range want[i] {
			big = max(big, math.Abs(float64(w)))
		}
		for j := range want[i] {
			require.InDelta(t, want[i][j], got[i][j], rtol*big+1e-30, "%s: parameter %s[%d]", what, tw.dev[i].Name(), j)
		}
	}
}

// groups puts every third parameter in a group with its own learning
// rate, weight decay and betas or momentum; keys are ps's host tensors.
func groups(o optim.Optimizer, ps []*lazy.Tensor) {
	var keys []any
	for i := 2; i < len(ps); i += 3 {
		keys = append(keys, ps[i].Value())
	}
	switch v := o.(type) {
	case *optim.Adam:
		g := v.AddGroup("third", keys...)
		g.LR, g.WeightDecay, g.Beta1, g.Beta2, g.Eps = 3e-2, 0, 0.8, 0.99, 1e-6
	case *optim.SGD:
		g := v.AddGroup("third", keys...)
		g.LR, g.WeightDecay, g.Momentum, g.Dampening, g.Nesterov = 0.02, 0, 0.5, 0.1, false
	}
}

// TestDeviceOptimizerLateParamsGroupsSchedule: a third of the 150
// parameters join at the fourth step, so their Adam bias corrections are
// their own first steps' (PyTorch's state["step"]) and SGD starts their
// momentum from their gradients; every third parameter is in a group of its
// own hyperparameters; the rate follows a cosine schedule with warmup and
// floor. The device update (learning rates, bias corrections and fresh
// flags as device scalars) equals optim.go's on the host bit for bit, over
// 6 steps, for SGD with momentum and Nesterov, Adam and AdamW.
//
// Tolerance: none (the same float64 operations in the same order on the
// same values; see TestDeviceOptimizerManyParams).
func TestDeviceOptimizerLateParamsGroupsSchedule(t *testing.T) {
	device(t)
	m := newManyParams(rand.New(rand.NewPCG(51, 52)))
	for _, c := range []struct {
		name string
		opt  func() optim.Optimizer
	}{
		{"sgd", func() optim.Optimizer {
			o := optim.NewSGD(0.05, 0.9)
			o.Nesterov, o.WeightDecay = true, 1e-2
			return o
		}},
		{"adam", func() optim.Optimizer { o := optim.NewAdam(1e-2); o.WeightDecay = 1e-2; return o }},
		{"adamw", func() optim.Optimizer { return optim.NewAdamW(1e-2) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			tw := &twin{t: t, e: freshExecutor(t, cuda.ExecutorOptions{}), m: m, dev: m.params(), host: m.params(), devO: c.opt(), hstO: c.opt()}
			groups(tw.devO, tw.dev)
			groups(tw.hstO, tw.host)
			sched := optim.Cosine{Warmup: 2, Total: 6, MinRatio: 0.1}
			setSchedule(tw.devO, sched)
			setSchedule(tw.hstO, sched)
			for step := range 6 {
				k := 100
				if step >= 3 {
					k = 150
				}
				tw.step(k, cuda.ExecOptions{})
			}
			tw.equal(0, c.name)
			type stepper interface{ ParamStep(any) int }
			require.Equal(t, 6, tw.devO.(stepper).ParamStep(tw.dev[0].Value()))
			require.Equal(t, 3, tw.devO.(stepper).ParamStep(tw.dev[120].Value()), "a late parameter's own count")
		})
	}
}

func setSchedule(o optim.Optimizer, s optim.Schedule) {
	switch v := o.(type) {
	case *optim.Adam:
		v.Schedule = s
	case *optim.SGD:
		v.Schedule = s
	}
}

func setClip(o optim.Optimizer, c optim.Clip) {
	switch v := o.(type) {
	case *optim.Adam:
		v.Clip = c
	case *optim.SGD:
		v.Clip = c
	}
}

type normer interface{ LastGradNorm() (float64, error) }

// TestDeviceClipNoHostSync: global-norm clipping on the device, 2-norm and
// ∞-norm. The norm is computed by kernels into the device scalars and
// applied inside the update: a step with clipping waits for the device
// exactly as often as one without (cuda's count of the host's waits,
// steps 2 to 5); LastGradNorm waits once, when called, and gives the
// host's norm of the same gradients; the parameters follow optim.go's
// clipped update on the host.
//
// Tolerance: the norm rtol 1e-12 (float64 sums of the same float32
// squares in another order); parameters rtol 1e-6 of each tensor's
// largest magnitude (a clip factor rounded to float32 from norms a few
// float64 roundings apart may differ by one float32 ulp).
func TestDeviceClipNoHostSync(t *testing.T) {
	device(t)
	m := newManyParams(rand.New(rand.NewPCG(53, 54)))
	for _, normType := range []float64{2, math.Inf(1)} {
		t.Run(fmt.Sprint(normType), func(t *testing.T) {
			e := freshExecutor(t, cuda.ExecutorOptions{})
			clip := optim.Clip{MaxNorm: 0.5, NormType: normType}
			tw := &twin{t: t, e: e, m: m, dev: m.params(), host: m.params(), devO: optim.NewAdamW(1e-2), hstO: optim.NewAdamW(1e-2)}
			setClip(tw.devO, clip)
			setClip(tw.hstO, clip)
			plain := m.params()
			plainOpt := optim.NewAdamW(1e-2)
			ctx := context.Background()
			chunks := planner.Chunks(manyParamsBatch, 1)
			// One program each, so their constants are uploaded once.
			pp := stepProgram(t, m.lossOf(plain), plain, 2)
			dp := stepProgram(t, m.lossOf(tw.dev), tw.dev, 2)
			hp := stepProgram(t, m.lossOf(tw.host), tw.host, 2)
			for step := range 6 {
				// Waits of a device step without clipping, then with.
				w0 := cuda.HostWaits(e)
				_, err := e.Execute(ctx, pp, chunks, cuda.ExecOptions{Resident: true, Optimizer: plainOpt, KeptOnDevice: true})
				require.NoError(t, err)
				plainWaits := cuda.HostWaits(e) - w0
				w0 = cuda.HostWaits(e)
				_, err = e.Execute(ctx, dp, chunks, cuda.ExecOptions{Resident: true, Optimizer: tw.devO, KeptOnDevice: true})
				require.NoError(t, err)
				clipWaits := cuda.HostWaits(e) - w0
				if step >= 2 {
					require.Equal(t, plainWaits, clipWaits, "step %d: clipping adds no wait for the device", step)
				}
				w0 = cuda.HostWaits(e)
				got, err := tw.devO.(normer).LastGradNorm()
				require.NoError(t, err)
				require.Equal(t, int64(1), cuda.HostWaits(e)-w0, "LastGradNorm waits once")
				// The host run of the same parameters (bitwise equal so far
				// up to the clip factor's ulp) gives the reference norm.
				update := func(kept [][]float32) error {
					ps := make([]optim.Param, len(tw.host))
					for i, pt := range tw.host {
						ps[i] = optim.Param{Key: pt.Value(), Name: pt.Name(), Data: pt.Value().(*tensor.Dense).Float32s(), Grad: kept[i]}
					}
					return tw.hstO.Step(ps)
				}
				_, err = e.Execute(ctx, hp, chunks, cuda.ExecOptions{Resident: true, Update: update})
				require.NoError(t, err)
				want, err := tw.hstO.(normer).LastGradNorm()
				require.NoError(t, err)
				require.Greater(t, want, clip.MaxNorm, "the case under test clips")
				require.InEpsilon(t, want, got, 1e-12, "step %d norm", step)
			}
			tw.equal(1e-6, "clipped")
		})
	}
}

// TestDeviceOptimizerGraphsNoRecapture: with CUDA graphs on, an AdamW
// update under a warmup-cosine schedule (a new learning rate every step),
// per-parameter bias corrections (a new pair every step) and clipping is
// captured once, on the third step, and replayed on every later one: the
// per-step values are device scalars, so the update's fingerprint does not
// change. Its results equal an executor's without graphs bit for bit.
func TestDeviceOptimizerGraphsNoRecapture(t *testing.T) {
	const steps = 8
	device(t)
	m := newManyParams(rand.New(rand.NewPCG(55, 56)))
	run := func(o cuda.ExecutorOptions) ([][]float32, cuda.GraphStats) {
		e := freshExecutor(t, o)
		ps := m.params()
		opt := optim.NewAdamW(1e-2)
		opt.Schedule = optim.Cosine{Warmup: 3, Total: steps, WarmupStart: 0.1, MinRatio: 0.1}
		opt.Clip = optim.Clip{MaxNorm: 0.5}
		p := stepProgram(t, m.lossOf(ps), ps, 2)
		capturedAt := -1
		for step := range steps {
			_, err := e.Execute(context.Background(), p, planner.Chunks(manyParamsBatch, 1), cuda.ExecOptions{Resident: true, Optimizer: opt, KeptOnDevice: true})
			require.NoError(t, err, "step %d", step)
			st := e.GraphStats()
			if o.NoCUDAGraphs {
				continue
			}
			// Captured on the second sighting of its fingerprint: the
			// second step, or the third if the first step's allocations
			// (the persistent buffers made then) laid the scalars out
			// elsewhere.
			require.LessOrEqual(t, st.OptimizerCaptures, 1, "step %d: never captured again", step)
			if capturedAt < 0 && st.OptimizerCaptures == 1 {
				capturedAt = step
			}
			if step >= 2 {
				require.GreaterOrEqual(t, capturedAt, 1, "step %d: captured by the third step", step)
			}
			if capturedAt >= 0 {
				require.Equal(t, step-capturedAt+1, st.OptimizerReplays, "step %d: replayed every step from the capture on", step)
			}
		}
		require.NoError(t, e.SyncParams())
		return hostParams(t, ps), e.GraphStats()
	}
	eager, _ := run(cuda.ExecutorOptions{NoCUDAGraphs: true})
	graphs, st := run(cuda.ExecutorOptions{})
	t.Logf("graphs: %+v", st)
	require.NoError(t, st.LastFailure)
	require.Zero(t, st.Failed)
	require.Equal(t, eager, graphs)
}

// TestDeviceAdamSGDAdam: the device's state buffers belong to the
// optimizer that last stepped them. Adam, then SGD with momentum, then the
// same Adam again: SGD's first step starts its momentum from the
// gradients (not from Adam's first moment), and Adam's return continues
// its own moments and step counts, bit for bit as the host optimizers,
// which each keep their own state, do (PyTorch's semantics).
func TestDeviceAdamSGDAdam(t *testing.T) {
	device(t)
	m := newManyParams(rand.New(rand.NewPCG(57, 58)))
	e := freshExecutor(t, cuda.ExecutorOptions{})
	devAdam, hostAdam := optim.NewAdam(1e-2), optim.NewAdam(1e-2)
	devSGD, hostSGD := optim.NewSGD(0.05, 0.9), optim.NewSGD(0.05, 0.9)
	tw := &twin{t: t, e: e, m: m, dev: m.params(), host: m.params()}
	for _, phase := range []struct {
		dev, host optim.Optimizer
		steps     int
	}{{devAdam, hostAdam, 2}, {devSGD, hostSGD, 2}, {devAdam, hostAdam, 2}} {
		tw.devO, tw.hstO = phase.dev, phase.host
		for range phase.steps {
			tw.step(150, cuda.ExecOptions{})
		}
		tw.equal(0, phase.dev.Name())
	}
	require.Equal(t, 4, devAdam.ParamStep(tw.dev[3].Value()))
	require.Equal(t, 2, devSGD.ParamStep(tw.dev[3].Value()))
	require.NoError(t, e.SyncState())
	require.Equal(t, hostAdam.State(tw.host[3].Value()), devAdam.State(tw.dev[3].Value()), "Adam's moments")
	require.Equal(t, hostSGD.State(tw.host[3].Value()), devSGD.State(tw.dev[3].Value()), "SGD's buffer, handed back when Adam took the slot")
}

// TestDeviceStateResume: SyncState gives the host the device's state
// (optim's State), a fresh optimizer restored from it (SetState,
// SetSteps) continues on a fresh executor bit for bit as the uninterrupted
// run; and an executor's Close leaves an unsynced optimizer refusing to
// step with state it lost.
func TestDeviceStateResume(t *testing.T) {
	device(t)
	m := newManyParams(rand.New(rand.NewPCG(59, 60)))
	ctx := context.Background()
	chunks := planner.Chunks(manyParamsBatch, 1)
	mk := func() *optim.Adam {
		o := optim.NewAdamW(1e-2)
		o.Schedule = optim.WarmupLinear{Warmup: 2, Total: 8}
		return o
	}
	train := func(e *cuda.Executor, ps []*lazy.Tensor, o *optim.Adam, steps int) {
		p := stepProgram(t, m.lossOf(ps), ps, 2)
		for range steps {
			_, err := e.Execute(ctx, p, chunks, cuda.ExecOptions{Resident: true, Optimizer: o, KeptOnDevice: true})
			require.NoError(t, err)
		}
		require.NoError(t, e.SyncParams())
	}
	straight, straightOpt := m.params(), mk()
	train(freshExecutor(t, cuda.ExecutorOptions{}), straight, straightOpt, 6)

	ps, first := m.params(), mk()
	e1, err := cuda.NewExecutor(device(t), cuda.ExecutorOptions{})
	require.NoError(t, err)
	train(e1, ps, first, 3)
	require.NoError(t, e1.SyncState())
	resumed := mk()
	for _, k := range first.Keys() {
		st := first.State(k)
		require.Len(t, st, 2)
		require.NoError(t, resumed.SetState(k, len(st[0]), first.ParamStep(k), st))
	}
	require.NoError(t, resumed.SetSteps(first.Steps()))
	require.NoError(t, e1.Close())
	_, err = first.PlanDevice([]optim.DeviceParam{{Key: ps[0].Value(), Name: "p0", N: len(m.init[0])}})
	require.NoError(t, err, "synced before Close: the host copy stands")
	train(freshExecutor(t, cuda.ExecutorOptions{}), ps, resumed, 3)
	require.Equal(t, hostParams(t, straight), hostParams(t, ps))

	lost, lostOpt := m.params(), mk()
	e2, err := cuda.NewExecutor(device(t), cuda.ExecutorOptions{})
	require.NoError(t, err)
	train(e2, lost, lostOpt, 1)
	require.NoError(t, e2.Close())
	p := stepProgram(t, m.lossOf(lost), lost, 2)
	_, err = freshExecutor(t, cuda.ExecutorOptions{}).Execute(ctx, p, chunks, cuda.ExecOptions{Resident: true, Optimizer: lostOpt})
	require.ErrorIs(t, err, optim.ErrOptim, "the state went with the closed executor")
}
