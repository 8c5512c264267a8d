package cpu_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// scaledStep compiles an MLP's training step over n samples with the loss
// scaler's finish workspace (or without).
func scaledStep(t *testing.T, n int, finish bool) (*planner.Program, []*lazy.Tensor) {
	t.Helper()
	loss, params := testutil.MLPModel(16, 8, false).Build(rand.New(rand.NewPCG(3, 4)), n)
	g, outs, co := testutil.Step(t, loss, params, 2)
	co.Workspace = cpu.Workspace
	if finish {
		co.FinishWorkspace = exec.UnscaleBytes
	}
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, co)
	require.NoError(t, err)
	return p, params
}

func gradsOf(t *testing.T, res *exec.Result) [][]float32 {
	t.Helper()
	var gs [][]float32
	for _, d := range res.Outputs[1:] {
		gs = append(gs, slices.Clone(d.Data().([]float32)))
	}
	return gs
}

// Options.LossScale multiplies the summed gradients by float32(1/S), as
// exec.Unscale does: exactly by 2⁻¹⁰ for S = 1024, one rounded product
// for S = 3, whole or in chunks. The loss is untouched.
func TestLossScaleUnscales(t *testing.T) {
	const n = 12
	ctx := context.Background()
	p, _ := scaledStep(t, n, true)
	e := cpu.New()
	for _, k := range []int{1, 3} {
		plain, err := e.Execute(ctx, p, planner.Chunks(n, k), cpu.ExecOptions{})
		require.NoError(t, err)
		want := gradsOf(t, plain)
		for _, s := range []float32{1024, 3} {
			res, err := e.Execute(ctx, p, planner.Chunks(n, k), cpu.ExecOptions{LossScale: s})
			require.NoError(t, err)
			assert.False(t, res.Skipped)
			assert.Equal(t, plain.Outputs[0].Data(), res.Outputs[0].Data(), "the loss")
			got := gradsOf(t, res)
			inv := exec.InvScale(s)
			if s == 1024 {
				require.Equal(t, float32(1.0/1024), inv)
			}
			for i := range want {
				for j, w := range want[i] {
					require.Equal(t, w*inv, got[i][j], "%d chunks, S = %g: gradient %d[%d]", k, s, i, j)
				}
			}
		}
	}
}

// A non-finite unscaled gradient skips the update: neither Optimizer nor
// Update runs, parameters and optimizer state (its step count too) stay as
// they were, and Result.Skipped says so. A good step's update is timed
// once (ExecOptions.UpdateTime). S = the smallest float32 makes
// 1/S infinite, so every non-zero gradient overflows.
func TestLossScaleSkipsUpdate(t *testing.T) {
	const n = 12
	ctx := context.Background()
	for _, k := range []int{1, 2} {
		p, params := scaledStep(t, n, true)
		before := make([][]float32, len(params))
		for i, pt := range params {
			before[i] = slices.Clone(pt.Value().(*tensor.Dense).Float32s())
		}
		e := cpu.New()
		opt := optim.NewAdam(1e-2)
		res, err := e.Execute(ctx, p, planner.Chunks(n, k), cpu.ExecOptions{Resident: true, Optimizer: opt, LossScale: math.SmallestNonzeroFloat32})
		require.NoError(t, err)
		assert.True(t, res.Skipped)
		assert.Zero(t, opt.Steps(), "Adam's step count")
		assert.Nil(t, opt.State(params[0].Value()), "no optimizer state")
		for i, pt := range params {
			require.Equal(t, before[i], pt.Value().(*tensor.Dense).Float32s(), "%s", pt.Name())
		}
		updated := false
		res, err = e.Execute(ctx, p, planner.Chunks(n, k), cpu.ExecOptions{Resident: true, LossScale: math.SmallestNonzeroFloat32,
			Update: func([][]float32) error { updated = true; return nil }})
		require.NoError(t, err)
		assert.True(t, res.Skipped)
		assert.False(t, updated, "Update is not called")

		var updates []time.Duration
		res, err = e.Execute(ctx, p, planner.Chunks(n, k), cpu.ExecOptions{Resident: true, Optimizer: opt, LossScale: 1,
			UpdateTime: func(d time.Duration) { updates = append(updates, d) }})
		require.NoError(t, err)
		assert.False(t, res.Skipped)
		assert.Equal(t, 1, opt.Steps())
		assert.Len(t, updates, 1, "UpdateTime: once a step, after the last chunk")
		assert.NotEqual(t, before[0], params[0].Value().(*tensor.Dense).Float32s(), "a good step updates")
	}
}

// A loss scale needs a program with the flag's finish workspace, and must
// be a finite positive float32.
func TestLossScaleErrors(t *testing.T) {
	const n = 4
	ctx := context.Background()
	bare, _ := scaledStep(t, n, false)
	_, err := cpu.New().Execute(ctx, bare, planner.Chunks(n, 1), cpu.ExecOptions{LossScale: 2})
	require.ErrorIs(t, err, graph.ErrAttr)
	assert.Contains(t, err.Error(), "FinishWorkspace")
	_, err = cpu.New().Execute(ctx, bare, planner.Chunks(n, 1), cpu.ExecOptions{})
	require.NoError(t, err, "without a loss scale the workspace is not needed")
	p, _ := scaledStep(t, n, true)
	for _, s := range []float32{-1, float32(math.NaN()), float32(math.Inf(1))} {
		_, err := cpu.New().Execute(ctx, p, planner.Chunks(n, 1), cpu.ExecOptions{LossScale: s})
		require.ErrorIs(t, err, graph.ErrAttr, "S = %g", s)
	}
}

// exec.Unscale flags exactly the non-finite results.
func TestUnscale(t *testing.T) {
	g := [][]float32{{1, -2, 0}, {3e38}}
	require.True(t, exec.Unscale(g, 4))
	assert.Equal(t, [][]float32{{0.25, -0.5, 0}, {7.5e37}}, g)
	require.False(t, exec.Unscale([][]float32{{1}, {3e38}}, 0.5), "3e38·2 overflows")
	require.False(t, exec.Unscale([][]float32{{float32(math.NaN())}}, 1))
	require.False(t, exec.Unscale([][]float32{{0}, {float32(math.Inf(-1))}}, 1))
	require.True(t, exec.Unscale(nil, 2))
}

// nopReducer is an exec.Reducer that does nothing.
type nopReducer struct{}

func (nopReducer) Add(alloc.Ptr, int64) error { return nil }
func (nopReducer) Wait() error                { return nil }

// ExecOptions.Reduce sums device gradients; the CPU executor has none and
// says so before running anything.
func TestReduceRefused(t *testing.T) {
	p, _ := scaledStep(t, 8, false)
	_, err := cpu.New().Execute(context.Background(), p, planner.Chunks(8, 1), cpu.ExecOptions{Reduce: nopReducer{}})
	require.ErrorIs(t, err, graph.ErrAttr)
}
