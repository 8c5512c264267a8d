package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// TestSessionCUDAOptimizerMatchesCPU: the training workflow's optimizer on
// CUDA (the update on the device: AdamW with a no-decay group, a
// warmup-cosine schedule, 2-norm clipping, the last bias joining at the
// third step) trains as the CPU does, and LastGradNorm reads the device's
// norm.
//
// Tolerance: rtol 1e-4 on losses, norms and parameters (float32 kernels
// summing in other orders than the CPU, carried through 6 Adam steps).
func TestSessionCUDAOptimizerMatchesCPU(t *testing.T) {
	ctx := context.Background()
	gpu := cudaSession(t, batchfit.Options{})
	cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer cpu.Close()
	mk := func(m *nn.Sequential) *optim.Adam {
		o := optim.NewAdamW(1e-2)
		o.Schedule = optim.Cosine{Warmup: 2, Total: 6, MinRatio: 0.1}
		o.Clip.MaxNorm = 0.5
		_, noDecay := optim.SplitDecay(m.Params())
		o.AddGroup("no_decay", optim.Keys(noDecay)...).WeightDecay = 0
		return o
	}
	cm, gm := newTwoLayer(21, 32, 64), newTwoLayer(21, 32, 64)
	co, goo := mk(cm), mk(gm)
	crng, grng := rand.New(rand.NewPCG(21, 22)), rand.New(rand.NewPCG(21, 22))
	for step := range 6 {
		cps, gps := nn.ParamTensors(cm), nn.ParamTensors(gm)
		if step < 2 {
			cps, gps = cps[:3], gps[:3]
		}
		want, err := cpu.Step(ctx, mlpStep(cm, crng, 16, 32), cps, co)
		require.NoError(t, err)
		got, err := gpu.Step(ctx, mlpStep(gm, grng, 16, 32), gps, goo)
		require.NoError(t, err)
		require.InEpsilon(t, want, got, 1e-4, "step %d loss", step)
		wn, err := co.LastGradNorm()
		require.NoError(t, err)
		gn, err := goo.LastGradNorm()
		require.NoError(t, err)
		require.InEpsilon(t, wn, gn, 1e-4, "step %d norm", step)
	}
	require.NoError(t, gpu.SyncParams())
	want, got := hostValues(nn.ParamTensors(cm)), hostValues(nn.ParamTensors(gm))
	for i := range want {
		for j := range want[i] {
			require.InDelta(t, want[i][j], got[i][j], 1e-4*math.Abs(float64(want[i][j]))+1e-6, "parameter %d[%d]", i, j)
		}
	}
	require.Equal(t, 4, goo.ParamStep(nn.ParamTensors(gm)[3].Value()), "the late bias's own step count")
}

// TestSessionCUDAFrozen16Bit: on CUDA as on the CPU, a frozen weight
// leaves the step its gradient and state, and a bfloat16 one
// (nn.FreezeAs) resident at half its bytes, read by its matrix product
// without a cast copy: the peak drops by 3W and then W (W = 32 MiB; on
// CUDA at least that, its GEMM workspaces aside), the
// planned peaks are the measured ones, and the losses follow the CPU's.
//
// Tolerance: rtol 1e-2 on the losses (bfloat16 products in other orders).
func TestSessionCUDAFrozen16Bit(t *testing.T) {
	const in, hidden, n = 4096, 2048, 8
	w := int64(in * hidden * 4)
	ctx := context.Background()
	peaks := func(s *batchfit.Session, freeze func(*nn.Sequential) error, cudaSide bool) (int64, []float32) {
		m := newTwoLayer(23, in, hidden)
		require.NoError(t, freeze(m))
		rng := rand.New(rand.NewPCG(23, 24))
		opt := optim.NewAdamW(1e-3)
		var losses []float32
		for step := range 3 {
			l, err := s.Step(ctx, mlpStep(m, rng, n, in), nn.ParamTensors(m), opt)
			require.NoError(t, err, "step %d", step)
			losses = append(losses, l)
			pl, used := s.LastPlan(), s.LastUsage()
			over := int64(0)
			if cudaSide {
				over = s.Overhead()
			}
			require.Equal(t, pl.PeakReserved+over, used.PeakReserved, "step %d: reserved", step)
			require.Equal(t, pl.PeakAllocated+over, used.PeakAllocated, "step %d: allocated", step)
		}
		return s.LastPlan().PeakReserved, losses
	}
	first := func(m *nn.Sequential) *nn.Param { return m.Params()[0] }
	ways := []func(*nn.Sequential) error{
		func(*nn.Sequential) error { return nil },
		func(m *nn.Sequential) error { nn.Freeze(first(m)); return nil },
		func(m *nn.Sequential) error { return nn.FreezeAs(graph.BFloat16, first(m)) },
	}
	var gp, cp [3]int64
	for i, f := range ways {
		g := cudaSession(t, batchfit.Options{Precision: "bf16-mixed"})
		c := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
		var gl, cl []float32
		gp[i], gl = peaks(g, f, true)
		cp[i], cl = peaks(c, f, false)
		require.NoError(t, c.Close())
		for s := range gl {
			require.InEpsilon(t, cl[s], gl[s], 1e-2, "way %d step %d loss", i, s)
		}
	}
	t.Logf("peaks reserved: cuda %v, cpu %v", gp, cp)
	require.Equal(t, [3]int64{0, 3 * w, 4 * w}, [3]int64{0, cp[0] - cp[1], cp[0] - cp[2]}, "the CPU's drops")
	// CUDA's GEMMs may take planned workspaces of their own, which the
	// weight's gradient no longer needs: at least the CPU's drops.
	require.GreaterOrEqual(t, gp[0]-gp[1], 3*w, "frozen: its gradient and state")
	require.GreaterOrEqual(t, gp[1]-gp[2], w, "bfloat16: half the weight and no cast copy")
}
