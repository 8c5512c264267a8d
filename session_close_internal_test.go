package batchfit

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// A Close that overtakes a step between its plan and its run stops it: the
// step returns ErrClosed having updated nothing (the parameters are the
// previous step's, synced to the host by Close), Close returns once the
// step has, and the allocator then holds no byte, allocated or reserved.
// A step after Close is ErrClosed at once. On CUDA the step never runs on
// the released context. go test -race checks the hand-over.
func TestCloseStopsTheStepInFlight(t *testing.T) {
	t.Run("cpu", func(t *testing.T) {
		closeDuringStep(t, NewSession(Options{Device: DeviceCPU}))
	})
	t.Run("cuda", func(t *testing.T) {
		sess := NewSession(Options{Device: DeviceCUDA})
		testutil.SkipWithoutGPU(t, sess.Err(), cuda.ErrNoGPU)
		closeDuringStep(t, sess)
	})
}

func closeDuringStep(t *testing.T, sess *Session) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(31, 32))
	const n, in, hidden, classes = 64, 8, 16, 4
	var data [][]float32
	var params []*lazy.Tensor
	for i, shape := range [][]int{{hidden, in}, {hidden}, {classes, hidden}, {classes}} {
		d := make([]float32, graph.Numel(shape))
		for j := range d {
			d[j] = float32(rng.Float64()*2 - 1)
		}
		data = append(data, d)
		params = append(params, lazy.Param(tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d)), []string{"w1", "b1", "w2", "b2"}[i]))
	}
	lossOf := func() *lazy.Tensor {
		x := make([]float32, n*in)
		for i := range x {
			x[i] = float32(rng.Float64()*2 - 1)
		}
		y := make([]int64, n)
		for i := range y {
			y[i] = int64(rng.IntN(classes))
		}
		xs := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(x)), 0)
		ys := xs.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(y)), 0)
		return xs.Linear(params[0], params[1]).Tanh().Linear(params[2], params[3]).CrossEntropy(ys, graph.ReduceMean)
	}
	snapshot := func() [][]float32 {
		s := make([][]float32, len(data))
		for i, d := range data {
			s[i] = slices.Clone(d)
		}
		return s
	}
	opt := optim.NewAdam(1e-2)
	_, err := sess.Step(ctx, lossOf(), params, opt)
	require.NoError(t, err)
	require.NoError(t, sess.SyncParams())
	before := snapshot()

	closed := make(chan error, 1)
	sess.beforeRun = func() {
		sess.beforeRun = nil
		go func() { closed <- sess.Close() }()
		for !sess.closed.Load() {
			time.Sleep(time.Millisecond)
		}
		// A Close that does not wait for the step has returned by now;
		// one that waits is still waiting (and has stopped the step).
		select {
		case err := <-closed:
			closed <- err
		case <-time.After(100 * time.Millisecond):
		}
	}
	_, err = sess.Step(ctx, lossOf(), params, opt)
	require.ErrorIs(t, err, ErrClosed)
	require.NoError(t, <-closed)
	st := sess.Allocator().Stats()
	assert.Zero(t, st.AllocatedBytes[alloc.All].Current, "allocated bytes after Close")
	assert.Zero(t, st.ReservedBytes[alloc.All].Current, "reserved bytes after Close")
	assert.Equal(t, before, snapshot(), "the stopped step updated a parameter")
	assert.Equal(t, 1, opt.Steps(), "the stopped step counted as Adam's")

	_, err = sess.Step(ctx, lossOf(), params, opt)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, sess.SyncParams(), ErrClosed)
}
