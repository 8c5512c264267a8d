package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/checkpoint"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// offloadAdamW is AdamW with weight decay on the matrices, a no-decay
// group of its own rate for the norms, and clipping that binds.
func offloadAdamW(m nn.Module) *optim.Adam {
	o := optim.NewAdamW(3e-3)
	o.WeightDecay = 0.1
	_, noDecay := optim.SplitDecay(nn.ParamTensors(m))
	g := o.AddGroup("no_decay", optim.Keys(noDecay)...)
	g.WeightDecay, g.LR = 0, 5e-3
	o.Clip = optim.Clip{MaxNorm: 0.05}
	return o
}

// offloadRun trains llama-tiny on the CPU under bf16-mixed for steps
// steps, offloaded or not, and returns the model, the optimizer, the
// session (open) and the losses.
func offloadRun(t *testing.T, offload batchfit.Offload, steps int, disable ...string) (*models.Llama, *optim.Adam, *batchfit.Session, []float32) {
	t.Helper()
	cfg := models.LlamaTiny()
	m := models.NewLlama(nn.Seed(3), cfg)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: offload, DisablePasses: disable})
	require.NoError(t, sess.Err())
	opt := offloadAdamW(m)
	rng := rand.New(rand.NewPCG(5, 5))
	var losses []float32
	for step := range steps {
		l, err := sess.Step(context.Background(), llamaLoss(m, llamaCorpus(rng, cfg.Vocab, 2, 16)), nn.ParamTensors(m), opt)
		require.NoError(t, err, "step %d", step)
		losses = append(losses, l)
	}
	return m, opt, sess, losses
}

func paramValues(m nn.Module) [][]float32 {
	var out [][]float32
	for _, p := range m.Params() {
		out = append(out, append([]float32(nil), f32s(p)...))
	}
	return out
}

// Tolerance: the offloaded step computes forward and backward from
// bfloat16 weights into bfloat16 gradients, the plain bf16-mixed step
// from float32 weights into float32 gradients, so they differ by bfloat16
// rounding (2⁻⁹ relative) carried through the model: over four AdamW
// steps with weight decay, a group of its own and binding clipping, the
// losses agree to 2 % and the parameters' total updates point the same
// way (cosine ≥ 0.97, norms within 10 %). The plan's host bytes are what
// the executor holds, to the byte: 14 bytes a parameter (master, m and v
// in float32, a bfloat16 staging buffer), and the plan's device
// parameters are 2 bytes a parameter.
func TestOffloadMatchesDeviceOptimizerCPU(t *testing.T) {
	const steps = 4
	m0 := models.NewLlama(nn.Seed(3), models.LlamaTiny())
	init := paramValues(m0)
	ref, _, rs, refLoss := offloadRun(t, batchfit.OffloadNone, steps)
	defer rs.Close()
	off, _, os, offLoss := offloadRun(t, batchfit.OffloadOptimizer, steps)
	defer os.Close()
	for i := range refLoss {
		require.InEpsilon(t, refLoss[i], offLoss[i], 0.02, "step %d loss", i)
	}
	a, b := paramValues(ref), paramValues(off)
	var dot, na, nb float64
	for i := range a {
		for j := range a[i] {
			da, db := float64(a[i][j]-init[i][j]), float64(b[i][j]-init[i][j])
			dot, na, nb = dot+da*db, na+da*da, nb+db*db
		}
	}
	cos := dot / math.Sqrt(na*nb)
	require.Greater(t, na, 0.0)
	require.GreaterOrEqual(t, cos, 0.97, "update direction")
	require.InEpsilon(t, math.Sqrt(na), math.Sqrt(nb), 0.10, "update size")

	pl := os.LastPlan()
	n := int64(nn.NumParams(off))
	require.Equal(t, 14*n, pl.HostPinned, "masters, m, v and staging")
	require.Equal(t, pl.HostPinned, os.HostPinned(), "predicted = measured host bytes")
	require.Equal(t, pl.HostPinned, os.LastUsage().HostPinned)
	require.Equal(t, pl.PeakReserved, os.LastUsage().PeakReserved, "predicted = measured device bytes")
	require.Equal(t, 10*n, rs.LastPlan().Persistent-pl.Persistent, "bfloat16 parameters on the device, no state")
	require.Zero(t, rs.LastPlan().HostPinned)
}

// Tolerance: none. After offloaded steps Eval reads the device's
// bfloat16 copies, as the next step's forward pass does: the loss Eval
// gives on a batch is the loss the next Step returns on it (with the
// training steps' fuse-pointwise pass off, which evaluations do not run
// and which rounds the forward pass otherwise). The masters, the host
// tensors, are float32 values, not all bfloat16 ones.
func TestOffloadEvalReadsDeviceCopies(t *testing.T) {
	off, opt, os, _ := offloadRun(t, batchfit.OffloadOptimizer, 2, compile.FusePointwise)
	defer os.Close()
	tok := llamaCorpus(rand.New(rand.NewPCG(9, 9)), models.LlamaTiny().Vocab, 2, 16)
	got, err := os.Eval(context.Background(), llamaLoss(off, tok))
	require.NoError(t, err)
	l, err := os.Step(context.Background(), llamaLoss(off, tok), nn.ParamTensors(off), opt)
	require.NoError(t, err)
	require.Equal(t, l, got[0].Data().(float32))
	inexact := 0
	for _, p := range off.Params() {
		for _, x := range f32s(p) {
			if half.RoundBF16(x) != x {
				inexact++
			}
		}
	}
	require.Positive(t, inexact)

	// An Eval before the first step reads the same bfloat16 copies the
	// step then trains: its loss is the step's.
	fresh := models.NewLlama(nn.Seed(3), models.LlamaTiny())
	fs := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: batchfit.OffloadOptimizer,
		DisablePasses: []string{compile.FusePointwise}})
	defer fs.Close()
	before, err := fs.Eval(context.Background(), llamaLoss(fresh, tok))
	require.NoError(t, err)
	l, err = fs.Step(context.Background(), llamaLoss(fresh, tok), nn.ParamTensors(fresh), offloadAdamW(fresh))
	require.NoError(t, err)
	require.Equal(t, l, before[0].Data().(float32))
	require.Equal(t, fs.LastPlan().HostPinned, fs.HostPinned())
}

// Tolerance: none. An offloaded run saved after two steps and resumed in
// a fresh session, model and optimizer continues as the run that never
// stopped: the same losses and parameters to the bit.
func TestOffloadCheckpointResume(t *testing.T) {
	cfg := models.LlamaTiny()
	rng := rand.New(rand.NewPCG(5, 5))
	toks := make([]*tensor.Dense, 4)
	for i := range toks {
		toks[i] = llamaCorpus(rng, cfg.Vocab, 2, 16)
	}
	run := func(m *models.Llama, opt *optim.Adam, sess *batchfit.Session, from, to int) []float32 {
		var ls []float32
		for s := from; s < to; s++ {
			l, err := sess.Step(context.Background(), llamaLoss(m, toks[s]), nn.ParamTensors(m), opt)
			require.NoError(t, err, "step %d", s)
			ls = append(ls, l)
		}
		return ls
	}
	newSess := func() *batchfit.Session {
		s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: batchfit.OffloadOptimizer})
		require.NoError(t, s.Err())
		return s
	}
	whole := models.NewLlama(nn.Seed(3), cfg)
	ws := newSess()
	defer ws.Close()
	wantLoss := run(whole, offloadAdamW(whole), ws, 0, 4)

	dir := t.TempDir()
	first := models.NewLlama(nn.Seed(3), cfg)
	fs := newSess()
	fo := offloadAdamW(first)
	run(first, fo, fs, 0, 2)
	_, err := (&checkpoint.Training{Model: first, Optimizer: fo, Session: fs, Step: 2}).Save(dir)
	require.NoError(t, err)
	require.NoError(t, fs.Close())

	resumed := models.NewLlama(nn.Seed(4), cfg) // other weights: the checkpoint sets them
	rs := newSess()
	defer rs.Close()
	ro := offloadAdamW(resumed)
	ck := &checkpoint.Training{Model: resumed, Optimizer: ro, Session: rs}
	require.NoError(t, ck.Load(dir))
	require.Equal(t, 2, ck.Step)
	gotLoss := run(resumed, ro, rs, 2, 4)
	require.Equal(t, wantLoss[2:], gotLoss)
	require.Equal(t, paramValues(whole), paramValues(resumed))
}

// Offload needs bf16-mixed and Adam: another policy or optimizer, or an
// unknown mode, is an error wrapping ErrOffload.
func TestOffloadErrors(t *testing.T) {
	s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Offload: batchfit.OffloadOptimizer})
	require.ErrorIs(t, s.Err(), batchfit.ErrOffload)
	s = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: "gradients"})
	require.ErrorIs(t, s.Err(), batchfit.ErrOffload)
	_, err := batchfit.ParseOffload("disk")
	require.ErrorIs(t, err, batchfit.ErrOffload)

	s = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: batchfit.OffloadOptimizer})
	require.NoError(t, s.Err())
	defer s.Close()
	m := models.NewLlama(nn.Seed(3), models.LlamaTiny())
	tok := llamaCorpus(rand.New(rand.NewPCG(1, 1)), models.LlamaTiny().Vocab, 1, 8)
	_, err = s.Step(context.Background(), llamaLoss(m, tok), nn.ParamTensors(m), optim.NewSGD(0.1, 0.9))
	require.ErrorIs(t, err, batchfit.ErrOffload)
	var oe *graph.OpError
	require.ErrorAs(t, err, &oe)
}

// The plan of an offloaded step counts 2 bytes a parameter on the device
// (bfloat16 weights; their gradients are the step's) and 14 on the host.
func TestOffloadPlan(t *testing.T) {
	m := models.NewLlama(nn.Options{ShapeOnly: true}, models.LlamaTiny())
	loss := llamaLoss(m, llamaCorpus(rand.New(rand.NewPCG(1, 1)), models.LlamaTiny().Vocab, 1, 8))
	plan := func(o batchfit.Offload) *planner.Plan {
		s := batchfit.NewSession(batchfit.Options{Precision: "bf16-mixed", Offload: o, DryRun: &batchfit.DryRun{Workspace: cpu.Workspace}})
		require.NoError(t, s.Err())
		defer s.Close()
		sp, err := s.Plan(loss, nn.ParamTensors(m), optim.NewAdamW(1e-3))
		require.NoError(t, err)
		return sp.Plan
	}
	on, off := plan(batchfit.OffloadOptimizer), plan(batchfit.OffloadNone)
	n := int64(nn.NumParams(m))
	require.Equal(t, 14*n, on.HostPinned)
	require.Equal(t, 10*n, off.Persistent-on.Persistent, "float32 parameters and two moments against bfloat16 parameters")
	require.Zero(t, off.HostPinned)
	require.Less(t, on.PeakAllocated, off.PeakAllocated)
}

// f32s is p's host values.
func f32s(p *nn.Param) []float32 { return p.Value().(*tensor.Dense).Float32s() }

// A frozen parameter of an offloaded session is held in bfloat16 on the
// device and gets no host memory: the host holds 14 bytes a trained
// parameter only, and the frozen weights do not change.
func TestOffloadFrozen(t *testing.T) {
	m := models.NewLlama(nn.Seed(3), models.LlamaTiny())
	frozen := m.Params()[0]
	nn.Freeze(frozen)
	was := append([]float32(nil), f32s(frozen)...)
	s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", Offload: batchfit.OffloadOptimizer})
	defer s.Close()
	tok := llamaCorpus(rand.New(rand.NewPCG(1, 1)), models.LlamaTiny().Vocab, 2, 16)
	opt := offloadAdamW(m)
	for range 2 {
		_, err := s.Step(context.Background(), llamaLoss(m, tok), nn.ParamTensors(m), opt)
		require.NoError(t, err)
	}
	n := int64(nn.NumParams(m) - len(was))
	require.Equal(t, 14*n, s.LastPlan().HostPinned)
	require.Equal(t, 14*n, s.HostPinned())
	require.Equal(t, was, f32s(frozen))
}
