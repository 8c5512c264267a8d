package batchfit_test

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

const (
	nIn, nHidden, nClasses = 4, 5, 3
	batch                  = 6
)

// mlp is linear → tanh → linear with float32 parameters held as lazy
// Params; data aliases their storage, which Step updates in place.
type mlp struct {
	names  []string
	data   [][]float32 // backing arrays of the parameter tensors
	params []*lazy.Tensor
}

func newMLP(rng *rand.Rand) *mlp {
	m := &mlp{}
	for _, p := range []struct {
		name  string
		shape []int
	}{
		{"l1.weight", []int{nHidden, nIn}}, {"l1.bias", []int{nHidden}},
		{"l2.weight", []int{nClasses, nHidden}}, {"l2.bias", []int{nClasses}},
	} {
		d := randF32(rng, graph.Numel(p.shape))
		m.names = append(m.names, p.name)
		m.data = append(m.data, d)
		m.params = append(m.params, lazy.Param(tensor.New(tensor.WithShape(p.shape...), tensor.WithBacking(d)), p.name))
	}
	return m
}

// loss builds a fresh graph over one batch: mean cross-entropy of the MLP's
// logits against labels.
func (m *mlp) loss(x *tensor.Dense, labels *tensor.Dense) (logits, loss *lazy.Tensor) {
	in := lazy.Wrap(x, 0)
	y := in.Graph().Wrap(labels, 0)
	logits = in.Linear(m.params[0], m.params[1]).Tanh().Linear(m.params[2], m.params[3])
	return logits, logits.CrossEntropy(y, graph.ReduceMean)
}

func (m *mlp) snapshot() [][]float32 {
	s := make([][]float32, len(m.data))
	for i, d := range m.data {
		s[i] = slices.Clone(d)
	}
	return s
}

// randF32 draws n values uniformly from [−1, 1).
func randF32(rng *rand.Rand, n int) []float32 {
	d := make([]float32, n)
	for i := range d {
		d[i] = float32(rng.Float64()*2 - 1)
	}
	return d
}

// batchOf draws inputs [n, nIn] and labels [n].
func batchOf(rng *rand.Rand, n int) (*tensor.Dense, *tensor.Dense) {
	labels := make([]int64, n)
	for i := range labels {
		labels[i] = int64(rng.IntN(nClasses))
	}
	return tensor.New(tensor.WithShape(n, nIn), tensor.WithBacking(randF32(rng, n*nIn))),
		tensor.New(tensor.WithShape(n), tensor.WithBacking(labels))
}

func to64(d []float32) []float64 {
	out := make([]float64, len(d))
	for i, v := range d {
		out[i] = float64(v)
	}
	return out
}

// Step's float32 result against a float64 hand run: the reference evaluates
// the same forward+backward graph with ref.Eval, its parameters overridden by
// float64 copies, and applies SGD (momentum μ, weight decay wd, dampening 0,
// PyTorch's update) in plain float64 loops. The two runs differ by float32
// rounding in the executor, the optimizer's float32 state and the stored
// parameters, about 1e-7 relative per step (differences of 5e-8 seen here);
// over three steps every value is held to atol 1e-6 + rtol 1e-6.
func TestStepMatchesHandRun(t *testing.T) {
	const lr, mu, wd, steps = 0.1, 0.9, 0.01, 3
	const atol, rtol = 1e-6, 1e-6
	rng := rand.New(rand.NewPCG(1, 2))
	m := newMLP(rng)
	w := make([][]float64, len(m.data)) // the reference's parameters
	buf := make([][]float64, len(m.data))
	for i, d := range m.data {
		w[i] = to64(d)
		buf[i] = make([]float64, len(d))
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	opt := optim.NewSGD(lr, mu)
	opt.WeightDecay = wd
	ctx := context.Background()
	for step := range steps {
		x, y := batchOf(rng, batch)

		// Reference: a separate graph of the same computation, in float64.
		_, rloss := m.loss(x, y)
		rgrads := lazy.Grad(rloss, m.params...)
		ir := rloss.Graph().IR()
		over := map[int]ref.Value{}
		outs := []int{rloss.ID()}
		for i, name := range m.names {
			id := ir.NodeNamed(name)
			require.GreaterOrEqual(t, id, 0, name)
			over[id] = ref.Value{Shape: m.params[i].Shape(), Data: slices.Clone(w[i])}
			require.NoError(t, rgrads[i].Err())
			outs = append(outs, rgrads[i].ID())
		}
		vals, err := ref.Eval(ir, over, outs...)
		require.NoError(t, err)
		wantLoss := vals[0].Data[0]
		for i := range w {
			for k, g := range vals[i+1].Data {
				g += wd * w[i][k]
				if step == 0 {
					buf[i][k] = g
				} else {
					buf[i][k] = mu*buf[i][k] + g
				}
				w[i][k] -= lr * buf[i][k]
			}
		}

		_, loss := m.loss(x, y)
		got, err := sess.Step(ctx, loss, m.params, opt)
		require.NoError(t, err)
		assert.InDelta(t, wantLoss, float64(got), atol+rtol*math.Abs(wantLoss), "loss at step %d", step)
		for i := range w {
			for k, want := range w[i] {
				assert.InDelta(t, want, float64(m.data[i][k]), atol+rtol*math.Abs(want),
					"step %d: %s[%d]", step, m.names[i], k)
			}
		}
	}
	assert.Equal(t, steps, opt.Steps())
}

// A training loop that rebuilds an identical graph each step reuses the
// first step's analysis; a graph with another batch size is new.
func TestStepCachesAnalysisBySignature(t *testing.T) {
	const steps = 5
	rng := rand.New(rand.NewPCG(3, 4))
	m := newMLP(rng)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	opt := optim.NewSGD(0.05, 0)
	ctx := context.Background()
	for range steps {
		_, loss := m.loss(batchOf(rng, batch))
		_, err := sess.Step(ctx, loss, m.params, opt)
		require.NoError(t, err)
	}
	require.Equal(t, steps-1, sess.CacheHits())

	_, loss := m.loss(batchOf(rng, batch-1))
	_, err := sess.Step(ctx, loss, m.params, opt)
	require.NoError(t, err)
	require.Equal(t, steps-1, sess.CacheHits(), "a smaller batch reused an analysis")

	_, loss = m.loss(batchOf(rng, batch-1))
	_, err = sess.Step(ctx, loss, m.params, opt)
	require.NoError(t, err)
	require.Equal(t, steps, sess.CacheHits(), "the second step at the smaller batch missed")
}

// Eval returns the values the float64 reference computes (within float32
// rounding: rtol 1e-5, atol 1e-6) and leaves the parameters alone.
func TestEvalLeavesParametersAlone(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	m := newMLP(rng)
	before := m.snapshot()
	logits, loss := m.loss(batchOf(rng, batch))
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	got, err := sess.Eval(context.Background(), logits, loss)
	require.NoError(t, err)
	require.Len(t, got, 2)
	want, err := ref.Eval(logits.Graph().IR(), nil, logits.ID(), loss.ID())
	require.NoError(t, err)
	require.Equal(t, []int{batch, nClasses}, []int(got[0].Shape()))
	gotLogits := got[0].Data().([]float32)
	for i, v := range want[0].Data {
		assert.InDelta(t, v, float64(gotLogits[i]), 1e-6+1e-5*math.Abs(v), "logits[%d]", i)
	}
	gotLoss, ok := got[1].Data().(float32)
	require.True(t, ok, "loss data is %T", got[1].Data())
	assert.InDelta(t, want[1].Data[0], float64(gotLoss), 1e-6+1e-5*math.Abs(want[1].Data[0]))
	require.Equal(t, before, m.snapshot(), "Eval changed a parameter")

	// Eval adds no nodes: a second Eval of the same graph is a cache hit.
	n := loss.Graph().IR().Len()
	_, err = sess.Eval(context.Background(), logits, loss)
	require.NoError(t, err)
	require.Equal(t, n, loss.Graph().IR().Len())
	require.Equal(t, 1, sess.CacheHits())
}

// A parameter of shape [] is updated like any other; gorgonia hands back a
// scalar Dense's data as a bare float32, not a slice. Σ x² over 24 float32
// products is held to rtol 1e-5, in the loss and in the step it drives.
func TestStepScalarParameter(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	x, _ := batchOf(rng, batch)
	s := lazy.Param(tensor.New(tensor.FromScalar(float32(0.5))), "scale")
	in := lazy.Wrap(x, 0)
	loss := in.Mul(s).Mul(in).Sum() // Σ s·x², so d/ds = Σ x²
	var sumSq float64
	for _, v := range x.Data().([]float32) {
		sumSq += float64(v) * float64(v)
	}
	const lr = 0.01
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	var got float32
	var err error
	require.NotPanics(t, func() { got, err = sess.Step(context.Background(), loss, []*lazy.Tensor{s}, optim.NewSGD(lr, 0)) })
	require.NoError(t, err)
	assert.InDelta(t, 0.5*sumSq, float64(got), 1e-5*0.5*sumSq)
	after, ok := s.Value().(*tensor.Dense).Data().(float32)
	require.True(t, ok)
	assert.InDelta(t, 0.5-lr*sumSq, float64(after), 1e-6+1e-5*lr*sumSq)
}

func TestSessionErrors(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	ctx := context.Background()
	newParams := func() *mlp { return newMLP(rng) }

	for _, c := range []struct {
		name string
		run  func(sess *batchfit.Session) error
		want error
		op   bool // the error is a *graph.OpError
	}{
		{"sticky loss", func(sess *batchfit.Session) error {
			m := newParams()
			x, y := batchOf(rng, batch)
			in := lazy.Wrap(x, 0)
			bad := in.Linear(m.params[2], m.params[3]) // [6, 4] · [3, 5]ᵀ: inner sizes differ
			loss := bad.CrossEntropy(in.Graph().Wrap(y, 0), graph.ReduceMean)
			_, err := sess.Step(ctx, loss, m.params, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrShape, true},
		{"eval outputs from two graphs", func(sess *batchfit.Session) error {
			m := newParams()
			a, _ := m.loss(batchOf(rng, batch))
			b, _ := m.loss(batchOf(rng, batch))
			_, err := sess.Eval(ctx, a, b)
			return err
		}, graph.ErrMixedGraphs, true},
		{"step parameter from another graph", func(sess *batchfit.Session) error {
			m := newParams()
			_, loss := m.loss(batchOf(rng, batch))
			other, _ := m.loss(batchOf(rng, batch))
			_, err := sess.Step(ctx, loss, []*lazy.Tensor{other}, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrMixedGraphs, true},
		{"shape-only parameter", func(sess *batchfit.Session) error {
			m := newParams()
			x, y := batchOf(rng, batch)
			in := lazy.Wrap(x, 0)
			w := lazy.ParamSpec([]int{nClasses, nIn}, graph.Float32, "spec.weight")
			loss := in.Linear(w, m.params[3]).CrossEntropy(in.Graph().Wrap(y, 0), graph.ReduceMean)
			_, err := sess.Step(ctx, loss, []*lazy.Tensor{w, m.params[3]}, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrNoData, false},
		{"non-scalar loss", func(sess *batchfit.Session) error {
			m := newParams()
			logits, _ := m.loss(batchOf(rng, batch))
			_, err := sess.Step(ctx, logits, m.params, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrShape, true},
		{"int64 parameter", func(sess *batchfit.Session) error {
			m := newParams()
			idx := lazy.Param(tensor.New(tensor.WithShape(2), tensor.WithBacking([]int64{0, 2})), "idx")
			loss := idx.Embedding(m.params[0]).Sum() // rows 0 and 2 of l1.weight
			_, err := sess.Step(ctx, loss, []*lazy.Tensor{m.params[0], idx}, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrDType, true},
		{"transposed view as parameter", func(sess *batchfit.Session) error {
			// The optimizer would write the row-major gradient over the
			// view's column-major storage.
			d := tensor.New(tensor.WithShape(nIn, nClasses), tensor.WithBacking(randF32(rng, nIn*nClasses)))
			if err := d.T(); err != nil {
				return err
			}
			before := slices.Clone(d.Float32s())
			x, y := batchOf(rng, batch)
			in := lazy.Wrap(x, 0)
			w := lazy.Param(d, "w") // [nClasses, nIn]
			loss := in.Linear(w, nil).CrossEntropy(in.Graph().Wrap(y, 0), graph.ReduceMean)
			_, err := sess.Step(ctx, loss, []*lazy.Tensor{w}, optim.NewSGD(0.1, 0))
			if !slices.Equal(before, d.Float32s()) {
				return errors.New("the view's storage changed")
			}
			return err
		}, graph.ErrAttr, true},
		{"nil loss", func(sess *batchfit.Session) error {
			_, err := sess.Step(ctx, nil, nil, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrNilTensor, true},
		{"free parameter as loss", func(sess *batchfit.Session) error {
			p := lazy.Param(tensor.New(tensor.FromScalar(float32(1))), "p")
			_, err := sess.Step(ctx, p, []*lazy.Tensor{p}, optim.NewSGD(0.1, 0))
			return err
		}, graph.ErrArity, true},
		{"eval of nothing", func(sess *batchfit.Session) error {
			_, err := sess.Eval(ctx)
			return err
		}, graph.ErrArity, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
			var err error
			require.NotPanics(t, func() { err = c.run(sess) })
			require.ErrorIs(t, err, c.want)
			if c.op {
				var oe *graph.OpError
				require.ErrorAs(t, err, &oe)
			}
		})
	}

	// An optimizer error leaves every parameter as it was.
	t.Run("optimizer error", func(t *testing.T) {
		m := newParams()
		before := m.snapshot()
		_, loss := m.loss(batchOf(rng, batch))
		var err error
		require.NotPanics(t, func() {
			_, err = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU}).Step(ctx, loss, m.params, optim.NewSGD(-0.1, 0))
		})
		require.ErrorIs(t, err, optim.ErrOptim)
		require.Equal(t, before, m.snapshot())
	})

	// A cancelled context stops the run before any update.
	t.Run("cancelled context", func(t *testing.T) {
		m := newParams()
		before := m.snapshot()
		_, loss := m.loss(batchOf(rng, batch))
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU}).Step(cctx, loss, m.params, optim.NewSGD(0.1, 0))
		require.True(t, errors.Is(err, context.Canceled), "%v", err)
		require.Equal(t, before, m.snapshot())
	})
}

// Two goroutines train their own models through one Session. Each ends
// where the same steps run alone on a fresh session end, bit for bit: the
// shared analysis cache hands each graph an analysis of its own signature.
func TestSessionConcurrentSteps(t *testing.T) {
	const steps = 8
	run := func(sess *batchfit.Session, seed uint64, n int) ([][]float32, error) {
		rng := rand.New(rand.NewPCG(seed, seed+1))
		m := newMLP(rng)
		opt := optim.NewAdam(0.01)
		for range steps {
			_, loss := m.loss(batchOf(rng, n))
			if _, err := sess.Step(context.Background(), loss, m.params, opt); err != nil {
				return nil, err
			}
		}
		return m.snapshot(), nil
	}
	seeds, sizes := []uint64{11, 13}, []int{batch, batch + 2}
	want := make([][][]float32, len(seeds))
	for i := range seeds {
		var err error
		want[i], err = run(batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU}), seeds[i], sizes[i])
		require.NoError(t, err)
	}

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	got := make([][][]float32, len(seeds))
	errs := make([]error, len(seeds))
	var wg sync.WaitGroup
	for i := range seeds {
		wg.Go(func() { got[i], errs[i] = run(sess, seeds[i], sizes[i]) })
	}
	wg.Wait()
	for i := range seeds {
		require.NoError(t, errs[i])
		require.Equal(t, want[i], got[i], "goroutine %d", i)
	}
	require.Equal(t, 2*(steps-1), sess.CacheHits())
}

// A run that fails while uploading a parameter (here one without data)
// gives back the block it allocated for it: the allocator holds nothing.
func TestFailedUploadHoldsNoBlock(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	x, _ := batchOf(rng, batch)
	w := lazy.ParamSpec([]int{nClasses, nIn}, graph.Float32, "spec.weight")
	out := lazy.Wrap(x, 0).Linear(w, nil).Sum()
	_, err := sess.Eval(context.Background(), out)
	require.ErrorIs(t, err, graph.ErrNoData)
	st := sess.Allocator().Stats()
	assert.Zero(t, st.AllocatedBytes[alloc.All].Current, "allocated bytes after the failed run")
	assert.Zero(t, st.Allocation[alloc.All].Current, "live blocks after the failed run")
}

// Options.MaxChunk runs the batch as micro-batches of at most MaxChunk
// samples (here 6 as 2 + 2 + 2) where memory holds it whole; after three
// SGD steps the parameters equal the whole batch's within float32 sums'
// reordering (atol 1e-6 + rtol 1e-6). A negative MaxChunk is ErrBudget.
func TestMaxChunkMicroBatches(t *testing.T) {
	const atol, rtol = 1e-6, 1e-6
	rng := rand.New(rand.NewPCG(5, 6))
	whole := newMLP(rand.New(rand.NewPCG(7, 8)))
	micro := newMLP(rand.New(rand.NewPCG(7, 8)))
	sw := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	sm := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, MaxChunk: 2})
	defer sw.Close()
	defer sm.Close()
	ow, om := optim.NewSGD(0.1, 0.9), optim.NewSGD(0.1, 0.9)
	ctx := context.Background()
	for step := range 3 {
		x, y := batchOf(rng, batch)
		_, lw := whole.loss(x, y)
		_, lm := micro.loss(x, y)
		a, err := sw.Step(ctx, lw, whole.params, ow)
		require.NoError(t, err)
		b, err := sm.Step(ctx, lm, micro.params, om)
		require.NoError(t, err)
		assert.InDelta(t, a, b, atol+rtol*math.Abs(float64(a)), "loss at step %d", step)
		assert.Equal(t, []int{2, 2, 2}, sizesOf(sm.LastPlan().Chunks), "step %d", step)
		assert.Len(t, sw.LastPlan().Chunks, 1, "step %d: the session without MaxChunk", step)
	}
	for i := range whole.data {
		for k, want := range whole.data[i] {
			assert.InDelta(t, want, micro.data[i][k], atol+rtol*math.Abs(float64(want)), "%s[%d]", whole.names[i], k)
		}
	}
	bad := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, MaxChunk: -1})
	assert.ErrorIs(t, bad.Err(), planner.ErrBudget)
}

func sizesOf(cs []planner.Chunk) []int {
	out := make([]int, len(cs))
	for i, c := range cs {
		out[i] = c.Size
	}
	return out
}
