package cuda_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// deepNet is 37 linear layers of width 8 with biases (GELU between): 74 parameters, so
// unscaling its gradients takes two grad_unscale_f32 launches (64 tensors
// each at most).
type deepNet struct{ m *nn.Sequential }

func newDeepNet() deepNet {
	o := nn.Seed(11)
	var mods []nn.Module
	for range 36 {
		mods = append(mods, nn.NewLinear(o, 8, 8, true), nn.GELU{})
	}
	return deepNet{nn.NewSequential(append(mods, nn.NewLinear(o, 8, 4, true))...)}
}

// step is the network's cross-entropy over n samples from rng; with boost
// ≠ 0 the loss adds boost·Σ params[blow], whose gradient is then about
// boost in every element.
func (d deepNet) step(rng *rand.Rand, n, blow int, boost float64) (*lazy.Tensor, []*lazy.Tensor) {
	x := lazy.Wrap(tensor.New(tensor.WithShape(n, 8), tensor.WithBacking(testutil.RandFloats(rng, n*8))), 0)
	y := x.Graph().Wrap(testutil.Classes(rng, 4, n), 0)
	params := nn.ParamTensors(d.m)
	loss := d.m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	if boost != 0 {
		loss = loss.Add(params[blow].Sum().MulScalar(boost))
	}
	return loss, params
}

// program compiles the step with the loss scaler's finish workspace.
func lossScaleProgram(t *testing.T, ws planner.WorkspaceFunc, loss *lazy.Tensor, params []*lazy.Tensor, slots int) *planner.Program {
	t.Helper()
	g, outs, co := testutil.Step(t, loss, params, slots)
	co.Workspace, co.FinishWorkspace, co.OptimizerScalars = ws, exec.UnscaleBytes, true
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, co)
	require.NoError(t, err)
	return p
}

func keptGrads(t *testing.T, res *exec.Result) [][]float32 {
	t.Helper()
	var gs [][]float32
	for _, d := range res.Outputs[1:] {
		require.NotNil(t, d)
		gs = append(gs, slices.Clone(d.Data().([]float32)))
	}
	return gs
}

// TestLossScaleOnDevice: grad_unscale_f32 multiplies every kept gradient by
// float32(1/S) on the device, as exec.Unscale does on the host, bit for
// bit, over two launches, whole and in chunks; the CPU executor's unscaled
// gradients agree within FP32 tolerance.
func TestLossScaleOnDevice(t *testing.T) {
	const n = 12
	ctx := context.Background()
	e := freshExecutor(t, cuda.ExecutorOptions{})
	net := newDeepNet()
	loss, params := net.step(rand.New(rand.NewPCG(1, 2)), n, 0, 0)
	p := lossScaleProgram(t, cuda.Workspace, loss, params, 0)
	require.Greater(t, len(p.Kept), 64, "two launches")
	loss, params = net.step(rand.New(rand.NewPCG(1, 2)), n, 0, 0) // the same step, a graph of its own
	cp := lossScaleProgram(t, cpu.Workspace, loss, params, 0)
	for _, k := range []int{1, 3} {
		plain, err := e.Execute(ctx, p, planner.Chunks(n, k), cuda.ExecOptions{})
		require.NoError(t, err)
		want := keptGrads(t, plain)
		for _, s := range []float32{1024, 3, 1.0 / 64} {
			res, err := e.Execute(ctx, p, planner.Chunks(n, k), cuda.ExecOptions{LossScale: s})
			require.NoError(t, err)
			require.False(t, res.Skipped, "%d chunks, S = %g", k, s)
			assert.Equal(t, scalarOf(t, plain.Outputs[0]), scalarOf(t, res.Outputs[0]), "the loss is untouched")
			host := make([][]float32, len(want))
			for i := range want {
				host[i] = slices.Clone(want[i])
			}
			require.True(t, exec.Unscale(host, s))
			got := keptGrads(t, res)
			for i := range host {
				require.Equal(t, host[i], got[i], "%d chunks, S = %g: gradient %d (%s)", k, s, i, params[i].Name())
			}
			onCPU, err := cpu.New().Execute(ctx, cp, planner.Chunks(n, k), cpu.ExecOptions{LossScale: s})
			require.NoError(t, err)
			for i, g := range keptGrads(t, onCPU) {
				for j := range g {
					require.InDelta(t, g[j], got[i][j], 1e-5+1e-4*math.Abs(float64(g[j])), "%d chunks, S = %g: gradient %d[%d] against the CPU", k, s, i, j)
				}
			}
		}
	}
}

// TestLossScaleFlagOnDevice: the device's inf/NaN flag catches one
// overflowing gradient in either launch, and agrees with the host's check:
// a loss with boost·Σ p makes p's gradient about 1e30, and S = 1e30 /
// MaxFloat32 · f puts its unscaled value just past float32's range (f =
// 0.5) or just inside it (f = 2), while every other gradient stays small.
// A skipped step leaves parameters and Adam as they were. (One chunk: the
// boost term is batch-independent, which a chunked run refuses.)
func TestLossScaleFlagOnDevice(t *testing.T) {
	const n = 8
	ctx := context.Background()
	e := freshExecutor(t, cuda.ExecutorOptions{})
	for _, blow := range []int{0, 63, 64, 73} {
		net := newDeepNet()
		loss, params := net.step(rand.New(rand.NewPCG(3, uint64(blow))), n, blow, 1e30)
		p := lossScaleProgram(t, cuda.Workspace, loss, params, 2)
		plain, err := e.Execute(ctx, p, planner.Chunks(n, 1), cuda.ExecOptions{})
		require.NoError(t, err)
		want := keptGrads(t, plain)
		for _, f := range []float64{0.5, 2} {
			s := float32(1e30 / math.MaxFloat32 * f)
			host := make([][]float32, len(want))
			for i := range want {
				host[i] = slices.Clone(want[i])
			}
			finite := exec.Unscale(host, s)
			require.Equal(t, f == 2, finite, "the host's check: parameter %d, S = %g", blow, s)
			res, err := e.Execute(ctx, p, planner.Chunks(n, 1), cuda.ExecOptions{LossScale: s})
			require.NoError(t, err)
			assert.Equal(t, !finite, res.Skipped, "parameter %d, S = %g", blow, s)
			assert.Equal(t, host, keptGrads(t, res), "parameter %d, S = %g", blow, s)
		}
		// A device optimizer step: skipped, then run.
		before := hostParams(t, params)
		opt := optim.NewAdam(1e-3)
		res, err := e.Execute(ctx, p, planner.Chunks(n, 1), cuda.ExecOptions{Resident: true, Optimizer: opt, KeptOnDevice: true,
			SyncParams: true, LossScale: float32(1e30 / math.MaxFloat32 * 0.5)})
		require.NoError(t, err)
		require.True(t, res.Skipped)
		require.Zero(t, opt.Steps())
		require.NoError(t, e.SyncParams())
		assert.Equal(t, before, hostParams(t, params), "parameter %d: a skipped step updates nothing", blow)
		res, err = e.Execute(ctx, p, planner.Chunks(n, 1), cuda.ExecOptions{Resident: true, Optimizer: opt, KeptOnDevice: true,
			SyncParams: true, LossScale: 1 << 16})
		require.NoError(t, err)
		require.False(t, res.Skipped)
		require.Equal(t, 1, opt.Steps())
		require.NoError(t, e.SyncParams())
		assert.NotEqual(t, before, hostParams(t, params))
		for _, ps := range hostParams(t, params) {
			for _, v := range ps {
				require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 0))
			}
		}
		require.NoError(t, e.Close()) // forget the residents
		e = freshExecutor(t, cuda.ExecutorOptions{})
	}
}

// A loss scale without the flag's finish workspace is refused before
// anything runs.
func TestLossScaleNeedsFinishWorkspace(t *testing.T) {
	e := executor(t)
	loss, params := newDeepNet().step(rand.New(rand.NewPCG(5, 5)), 4, 0, 0)
	_, err := e.Execute(context.Background(), stepProgram(t, loss, params, 0), planner.Chunks(4, 1), cuda.ExecOptions{LossScale: 2})
	require.ErrorIs(t, err, graph.ErrAttr)
}
