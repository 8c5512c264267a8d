package dist_test

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

const nIn, nClasses = 8, 4

// model is linear → tanh → linear; data aliases the parameters' host
// tensors, which steps update in place on the CPU.
type model struct {
	data   [][]float32
	params []*lazy.Tensor
}

func newModel(seed uint64) *model { return newWide(seed, 16) }

func newWide(seed uint64, nHidden int) *model {
	rng := rand.New(rand.NewPCG(seed, 7))
	m := &model{}
	for i, shape := range [][]int{{nHidden, nIn}, {nHidden}, {nClasses, nHidden}, {nClasses}} {
		d := make([]float32, graph.Numel(shape))
		for j := range d {
			d[j] = float32(rng.Float64()*2 - 1)
		}
		m.data = append(m.data, d)
		m.params = append(m.params, lazy.Param(tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d)), []string{"w1", "b1", "w2", "b2"}[i]))
	}
	return m
}

// loss is the mean cross-entropy over rows [lo, hi) of the batch.
func (m *model) loss(x []float32, y []int64, lo, hi int) *lazy.Tensor {
	xs := tensor.New(tensor.WithShape(hi-lo, nIn), tensor.WithBacking(slices.Clone(x[lo*nIn:hi*nIn])))
	ys := tensor.New(tensor.WithShape(hi-lo), tensor.WithBacking(slices.Clone(y[lo:hi])))
	in := lazy.Wrap(xs, 0)
	logits := in.Linear(m.params[0], m.params[1]).Tanh().Linear(m.params[2], m.params[3])
	return logits.CrossEntropy(in.Graph().Wrap(ys, 0), graph.ReduceMean)
}

func batch(rng *rand.Rand, n int) ([]float32, []int64) {
	x := make([]float32, n*nIn)
	for i := range x {
		x[i] = float32(rng.Float64()*2 - 1)
	}
	y := make([]int64, n)
	for i := range y {
		y[i] = int64(rng.IntN(nClasses))
	}
	return x, y
}

// recorder keeps a copy of the gradients of every step.
type recorder struct {
	optim.Optimizer
	grads [][][]float32
}

func (r *recorder) Step(ps []optim.Param) error {
	g := make([][]float32, len(ps))
	for i, p := range ps {
		g[i] = slices.Clone(p.Grad)
	}
	r.grads = append(r.grads, g)
	return r.Optimizer.Step(ps)
}

// close32 holds got to want within 1e-6 relative to the tensor's scale:
// |Δ_i| ≤ 1e-6·max_j |want_j|. Element-wise relative error is meaningless
// for values that cancel to near 0 (a parameter of 1e-3 after updates of
// order 1 differs by 1e-7 absolute, 1e-4 relative).
func close32(t *testing.T, what string, want, got []float32) { closeTol(t, what, want, got, 1e-6) }

func closeTol(t *testing.T, what string, want, got []float32, tol float64) {
	t.Helper()
	require.Len(t, got, len(want), what)
	scale := 0.0
	for _, w := range want {
		scale = math.Max(scale, math.Abs(float64(w)))
	}
	for i := range want {
		w, g := float64(want[i]), float64(got[i])
		if d := math.Abs(w - g); d > tol*scale {
			t.Fatalf("%s[%d]: whole batch %g, data parallel %g (|Δ| %g > %g × max|whole batch| %g)", what, i, w, g, d, tol, scale)
		}
	}
}

// Data parallel over 3 fake ranks (shards of 4, 3 and 3 of 10 samples)
// against one process training on the whole batch: losses and gradients
// of every step and parameters after 4 SGD steps with momentum agree
// within 1e-6 relative to each tensor's largest value. Ranks 1 and 2
// start from other parameters, so the broadcast from rank 0 is tested
// too; 300-byte buckets make several all-reduces per step.
func TestGradientsEqualWholeBatch(t *testing.T) {
	dataParallel(t, 10, 16, 0, 1e-6)
}

// As TestGradientsEqualWholeBatch with 240 samples and 4096 hidden units,
// rank 1 planned in 2 chunks within a 4 MiB budget of its own, ranks 0 and
// 2 whole. The tolerance is 4e-6: the whole batch's own float32 sums over
// 240 rows differ from any other order by about 1e-6 of the tensor's
// largest value already in step 0 (measured 1.0e-6 on w1), and the
// difference grows to 2e-6 over four steps.
func TestChunkedRankEqualsWholeBatch(t *testing.T) {
	dataParallel(t, 240, 4096, budgetForChunks, 4e-6)
}

func dataParallel(t *testing.T, n, hidden int, budget1 int64, tol float64) {
	const world, steps = 3, 4
	ctx := context.Background()

	ref := newWide(1, hidden)
	refOpt := &recorder{Optimizer: optim.NewSGD(0.2, 0.9)}
	refSess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer refSess.Close()
	var refLoss []float32
	rng := rand.New(rand.NewPCG(3, 4))
	var xs [][]float32
	var ys [][]int64
	for range steps {
		x, y := batch(rng, n)
		xs, ys = append(xs, x), append(ys, y)
		l, err := refSess.Step(ctx, ref.loss(x, y, 0, n), ref.params, refOpt)
		require.NoError(t, err)
		refLoss = append(refLoss, l)
	}

	comms := dist.NewLocal(world, 10*time.Second)
	models := make([]*model, world)
	opts := make([]*recorder, world)
	losses := make([][]float32, world)
	chunks := make([]int, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		models[r] = newWide(1+uint64(r), hidden) // only rank 0 starts where the reference did
		opts[r] = &recorder{Optimizer: optim.NewSGD(0.2, 0.9)}
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, BucketBytes: 300} // several buckets
			if r == 1 {
				o.Session.Budget = budget1
			}
			tr, err := dist.New(comms[r], o)
			if err != nil {
				errs[r] = err
				return
			}
			defer tr.Close()
			if errs[r] = tr.BroadcastParams(ctx, models[r].params); errs[r] != nil {
				return
			}
			for s := range steps {
				lo, hi, err := tr.Shard(n)
				if err != nil {
					errs[r] = err
					return
				}
				l, err := tr.Step(ctx, n, models[r].loss(xs[s], ys[s], lo, hi), models[r].params, opts[r])
				if err != nil {
					errs[r] = err
					return
				}
				losses[r] = append(losses[r], l)
				chunks[r] = max(chunks[r], len(tr.Session().LastPlan().Chunks))
			}
		}()
	}
	wg.Wait()
	for r := range world {
		require.NoError(t, errs[r], "rank %d", r)
	}
	if budget1 > 0 {
		require.Greater(t, chunks[1], 1, "rank 1 should run its shard in chunks within its budget")
	}
	for r := range world {
		closeTol(t, "loss", refLoss, losses[r], tol)
		for s := range steps {
			for i := range ref.data {
				closeTol(t, "gradient", refOpt.grads[s][i], opts[r].grads[s][i], tol)
			}
		}
		for i := range ref.data {
			closeTol(t, "parameter", ref.data[i], models[r].data[i], tol)
		}
	}
}

// A summed loss needs no rescale: Options.SumLoss.
func TestSumLossNeedsNoScale(t *testing.T) {
	const world, n = 2, 5
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(5, 6))
	x, y := batch(rng, n)
	sumLoss := func(m *model, lo, hi int) *lazy.Tensor {
		xs := tensor.New(tensor.WithShape(hi-lo, nIn), tensor.WithBacking(slices.Clone(x[lo*nIn:hi*nIn])))
		ys := tensor.New(tensor.WithShape(hi-lo), tensor.WithBacking(slices.Clone(y[lo:hi])))
		in := lazy.Wrap(xs, 0)
		logits := in.Linear(m.params[0], m.params[1]).Tanh().Linear(m.params[2], m.params[3])
		return logits.CrossEntropy(in.Graph().Wrap(ys, 0), graph.ReduceSum)
	}
	ref := newModel(9)
	s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer s.Close()
	want, err := s.Step(ctx, sumLoss(ref, 0, n), ref.params, optim.NewSGD(0.01, 0))
	require.NoError(t, err)

	comms := dist.NewLocal(world, 10*time.Second)
	got := make([]float32, world)
	ms := make([]*model, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		ms[r] = newModel(9)
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr, err := dist.New(comms[r], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, SumLoss: true})
			if err != nil {
				errs[r] = err
				return
			}
			defer tr.Close()
			lo, hi, _ := tr.Shard(n)
			got[r], errs[r] = tr.Step(ctx, n, sumLoss(ms[r], lo, hi), ms[r].params, optim.NewSGD(0.01, 0))
		}()
	}
	wg.Wait()
	for r := range world {
		require.NoError(t, errs[r])
		close32(t, "loss", []float32{want}, got[r:r+1])
		for i := range ref.data {
			close32(t, "parameter", ref.data[i], ms[r].data[i])
		}
	}
}

// A rank that fails before its all-reduce (here: its step errors out)
// makes the other ranks' Step return a typed error within the deadline,
// not hang.
func TestTrainerRankFailureIsTypedError(t *testing.T) {
	const world, n = 3, 6
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 8))
	x, y := batch(rng, n)
	start := time.Now()
	errs := stepRanks(dist.NewLocal(world, 300*time.Millisecond), func(r int, tr *dist.Trainer) error {
		if r == 2 {
			return nil // dies before its first collective, without a word
		}
		m := newModel(1)
		lo, hi, _ := tr.Shard(n)
		_, err := tr.Step(ctx, n, m.loss(x, y, lo, hi), m.params, optim.NewSGD(0.1, 0))
		return err
	})
	require.Less(t, time.Since(start), 5*time.Second)
	for r := range 2 {
		require.Error(t, errs[r], "rank %d", r)
		require.True(t, errors.Is(errs[r], dist.ErrTimeout) || errors.Is(errs[r], dist.ErrAborted), "rank %d: %v", r, errs[r])
	}
}

func TestNewTakesOverheadFromBudget(t *testing.T) {
	_, err := dist.New(overheadComm{dist.NewLocal(1, 0)[0], 1 << 20}, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU, Budget: 1 << 20}})
	require.Error(t, err)
	tr, err := dist.New(overheadComm{dist.NewLocal(1, 0)[0], 1 << 20}, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU, Budget: 64 << 20}})
	require.NoError(t, err)
	defer tr.Close()
	free, total, err := tr.Session().Allocator().Backend().MemInfo()
	require.NoError(t, err)
	require.Equal(t, int64(63<<20), total, "the CPU session's simulated device is the budget less the communicator's overhead")
	require.Equal(t, total, free)
}

type overheadComm struct {
	dist.Communicator
	over int64
}

func (c overheadComm) Overhead() int64 { return c.over }

// A rank whose own step fails (here: no optimizer) aborts the group: the
// others return ErrAborted at once, long before their one-minute deadline.
func TestTrainerFailingRankAbortsPeers(t *testing.T) {
	const world, n = 3, 6
	ctx := context.Background()
	x, y := batch(rand.New(rand.NewPCG(9, 9)), n)
	start := time.Now()
	errs := stepRanks(dist.NewLocal(world, time.Minute), func(r int, tr *dist.Trainer) error {
		var opt optim.Optimizer = optim.NewSGD(0.1, 0)
		if r == 2 {
			opt = nil
		}
		m := newModel(1)
		lo, hi, _ := tr.Shard(n)
		_, err := tr.Step(ctx, n, m.loss(x, y, lo, hi), m.params, opt)
		return err
	})
	require.Less(t, time.Since(start), 10*time.Second)
	require.Error(t, errs[2])
	require.ErrorIs(t, errs[0], dist.ErrAborted)
	require.ErrorIs(t, errs[1], dist.ErrAborted)
}

// stepRanks runs body for every rank of comms concurrently, each on a CPU
// Trainer of its own, and returns each rank's error (New's, or body's).
func stepRanks(comms []dist.Communicator, body func(r int, tr *dist.Trainer) error) []error {
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr, err := dist.New(comms[r], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}})
			if err != nil {
				errs[r] = err
				return
			}
			defer tr.Close()
			errs[r] = body(r, tr)
		}()
	}
	wg.Wait()
	return errs
}
