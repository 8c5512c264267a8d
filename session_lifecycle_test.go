package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// sessionOn returns a session on device, closed when the test ends; a CUDA
// one skips without a GPU.
func sessionOn(t *testing.T, device string, o batchfit.Options) *batchfit.Session {
	t.Helper()
	o.Device = device
	sess := batchfit.NewSession(o)
	if device == batchfit.DeviceCUDA {
		testutil.SkipWithoutGPU(t, sess.Err(), cuda.ErrNoGPU)
	}
	require.NoError(t, sess.Err())
	t.Cleanup(func() { require.NoError(t, sess.Close()) })
	return sess
}

// Stepping one loss tensor again and again leaves its graph as the caller
// built it, under every policy: the backward pass is built on a copy. The
// second step onwards reuses the first one's step graph and program (the
// caches hit), and every step computes the same gradients from the same
// data, so repeated SGD steps of one batch lower its loss.
func TestStepLeavesTheCallersGraphAlone(t *testing.T) {
	const steps = 40
	ctx := context.Background()
	for _, device := range []string{batchfit.DeviceCPU, batchfit.DeviceCUDA} {
		for _, policy := range []string{"fp32", "tf32", "bf16-mixed"} {
			t.Run(device+"/"+policy, func(t *testing.T) {
				sess := sessionOn(t, device, batchfit.Options{Precision: policy})
				rng := rand.New(rand.NewPCG(21, 22))
				m := newMLP(rng)
				_, loss := m.loss(batchOf(rng, batch))
				nodes := loss.Graph().IR().Len()
				opt := optim.NewSGD(0.1, 0)
				var first, last float32
				for step := range steps {
					l, err := sess.Step(ctx, loss, m.params, opt)
					require.NoError(t, err, "step %d", step)
					require.Equal(t, nodes, loss.Graph().IR().Len(), "step %d: nodes of the caller's graph", step)
					if step == 0 {
						first = l
					}
					last = l
				}
				assert.Equal(t, steps-1, sess.StepGraphHits(), "step graphs from the template")
				assert.Equal(t, steps-1, sess.CacheHits(), "programs reused")
				assert.Less(t, last, first, "SGD on one batch lowers its loss")
			})
		}
	}
}

// Two goroutines stepping one loss tensor through one session: each step
// is one of the serial steps (the executor runs one at a time), the
// caller's graph is not written (go test -race checks it), and the
// parameters end where 2·steps serial steps of the same batch end: every
// step is SGD without momentum on the same gradient function of the
// parameters the previous step wrote. Bit for bit on the CPU; on CUDA
// within 1e-6 + 1e-5 relative (the same kernels, but two sessions).
func TestConcurrentStepsOfOneLoss(t *testing.T) {
	const steps = 10
	ctx := context.Background()
	for _, device := range []string{batchfit.DeviceCPU, batchfit.DeviceCUDA} {
		t.Run(device, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(23, 24))
			x, y := batchOf(rng, batch)

			ss := sessionOn(t, device, batchfit.Options{})
			serial := newMLP(rand.New(rand.NewPCG(25, 26)))
			_, sl := serial.loss(x, y)
			sopt := optim.NewSGD(0.05, 0)
			for range 2 * steps {
				_, err := ss.Step(ctx, sl, serial.params, sopt)
				require.NoError(t, err)
			}
			require.NoError(t, ss.SyncParams())

			sess := sessionOn(t, device, batchfit.Options{})
			m := newMLP(rand.New(rand.NewPCG(25, 26)))
			_, loss := m.loss(x, y)
			nodes := loss.Graph().IR().Len()
			opt := optim.NewSGD(0.05, 0)
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for g := range errs {
				wg.Go(func() {
					for range steps {
						if _, err := sess.Step(ctx, loss, m.params, opt); err != nil {
							errs[g] = err
							return
						}
					}
				})
			}
			wg.Wait()
			for g, err := range errs {
				require.NoError(t, err, "goroutine %d", g)
			}
			require.NoError(t, sess.SyncParams())
			require.Equal(t, nodes, loss.Graph().IR().Len())
			require.Equal(t, 2*steps, opt.Steps())
			if device == batchfit.DeviceCPU {
				assert.Equal(t, serial.snapshot(), m.snapshot())
				return
			}
			for i, want := range serial.data {
				for k, v := range want {
					assert.InDelta(t, v, m.data[i][k], 1e-6+1e-5*math.Abs(float64(v)), "%s[%d]", m.names[i], k)
				}
			}
		})
	}
}

// A step's parameter list holds parameters only: an input, a constant or a
// computed value there is a *graph.OpError wrapping graph.ErrNotParam, at
// the caller's Step (this file), naming the list entry and what it is
// (never `parameter ""`). Nothing is updated.
func TestStepRefusesNonParameters(t *testing.T) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(27, 28))
	for _, c := range []struct {
		name string
		pick func(in, labels, logits *lazy.Tensor) *lazy.Tensor
		what string
	}{
		{"input", func(in, _, _ *lazy.Tensor) *lazy.Tensor { return in }, "the input"},
		{"labels", func(_, labels, _ *lazy.Tensor) *lazy.Tensor { return labels }, "the input"},
		{"constant", func(*lazy.Tensor, *lazy.Tensor, *lazy.Tensor) *lazy.Tensor {
			return lazy.Const(tensor.New(tensor.WithShape(nClasses), tensor.WithBacking(make([]float32, nClasses))))
		}, "the const"},
		{"computed", func(_, _, logits *lazy.Tensor) *lazy.Tensor { return logits }, "the linear (node"},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := newMLP(rng)
			before := m.snapshot()
			x, y := batchOf(rng, batch)
			in := lazy.Wrap(x, 0)
			labels := in.Graph().Wrap(y, 0)
			logits := in.Linear(m.params[0], m.params[1]).Tanh().Linear(m.params[2], m.params[3])
			loss := logits.CrossEntropy(labels, graph.ReduceMean)
			params := append(slices.Clone(m.params[:2]), c.pick(in, labels, logits))
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
			defer sess.Close()
			_, err := sess.Step(ctx, loss, params, optim.NewSGD(0.1, 0))
			require.ErrorIs(t, err, graph.ErrNotParam)
			var oe *graph.OpError
			require.ErrorAs(t, err, &oe)
			assert.Equal(t, "step", oe.Op)
			assert.Contains(t, oe.Site, "session_lifecycle_test.go:")
			assert.Contains(t, err.Error(), "params[2]: "+c.what)
			assert.NotContains(t, err.Error(), `parameter ""`)
			assert.Equal(t, before, m.snapshot())
		})
	}
}
