package dist_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/optim"
)

// dyingComm is a communicator whose rank dies at its first all-reduce of
// one value (the loss's, after the gradients' and the update): it aborts
// the group and fails, as a peer that crashed there would.
type dyingComm struct{ dist.Communicator }

var errDied = errors.New("rank died")

func (c dyingComm) AllReduceSum(ctx context.Context, buf []float32) error {
	if len(buf) == 1 {
		_ = c.Abort()
		return errDied
	}
	return c.Communicator.AllReduceSum(ctx, buf)
}

// cancelling is an optimizer whose Step ends the rank's context once the
// update has run: the context ends between the update and the loss's
// all-reduce. It closes ended then.
type cancelling struct {
	optim.Optimizer
	cancel context.CancelFunc
	ended  chan struct{}
}

func (c *cancelling) Step(ps []optim.Param) error {
	err := c.Optimizer.Step(ps)
	c.cancel()
	close(c.ended)
	return err
}

// lagging is an optimizer whose Step returns 50 ms after ended is closed,
// so that the other rank is already waiting in the loss's all-reduce, its
// context ended, when this one arrives.
type lagging struct {
	optim.Optimizer
	ended chan struct{}
}

func (l *lagging) Step(ps []optim.Param) error {
	err := l.Optimizer.Step(ps)
	<-l.ended
	time.Sleep(50 * time.Millisecond)
	return err
}

// oneStep is the parameters after one SGD step of the whole batch in one
// process: what every rank holds after a data-parallel step that applied.
func oneStep(t *testing.T, x []float32, y []int64, n int) ([][]float32, float32) {
	ref := newModel(1)
	s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer s.Close()
	l, err := s.Step(context.Background(), ref.loss(x, y, 0, n), ref.params, optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	return ref.data, l
}

// A peer that dies after the update, at the loss's all-reduce: every rank
// has applied the step, so each rank's error wraps ErrStepApplied (and
// the communicator's own error): a retry would apply it twice. Parameters
// are the one-step ones on every rank.
func TestTrainerErrorAfterTheUpdateSaysApplied(t *testing.T) {
	const world, n = 2, 8
	x, y := batch(rand.New(rand.NewPCG(41, 42)), n)
	want, _ := oneStep(t, x, y, n)
	comms := dist.NewLocal(world, 10*time.Second)
	comms[1] = dyingComm{comms[1]}
	models := []*model{newModel(1), newModel(1)}
	errs := stepRanks(comms, func(r int, tr *dist.Trainer) error {
		lo, hi, _ := tr.Shard(n)
		_, err := tr.Step(context.Background(), n, models[r].loss(x, y, lo, hi), models[r].params, optim.NewSGD(0.1, 0))
		return err
	})
	require.ErrorIs(t, errs[0], dist.ErrStepApplied)
	require.ErrorIs(t, errs[0], dist.ErrAborted)
	require.ErrorIs(t, errs[1], dist.ErrStepApplied)
	require.ErrorIs(t, errs[1], errDied)
	for r, m := range models {
		for i := range want {
			close32(t, fmt.Sprintf("rank %d parameter %d", r, i), want[i], m.data[i])
		}
	}
}

// A rank's context that ends after its update no longer fails the step:
// the loss's all-reduce that completes it is bounded by the
// communicator's deadline, not the context, so every rank returns the
// global loss and the same parameters, as a step that was not disturbed.
func TestTrainerContextEndAfterTheUpdate(t *testing.T) {
	const world, n = 2, 8
	x, y := batch(rand.New(rand.NewPCG(43, 44)), n)
	want, wantLoss := oneStep(t, x, y, n)
	models := []*model{newModel(1), newModel(1)}
	losses := make([]float32, world)
	ended := make(chan struct{})
	errs := stepRanks(dist.NewLocal(world, 10*time.Second), func(r int, tr *dist.Trainer) error {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var opt optim.Optimizer = &lagging{Optimizer: optim.NewSGD(0.1, 0), ended: ended}
		if r == 1 {
			opt = &cancelling{Optimizer: optim.NewSGD(0.1, 0), cancel: cancel, ended: ended}
		}
		lo, hi, _ := tr.Shard(n)
		var err error
		losses[r], err = tr.Step(ctx, n, models[r].loss(x, y, lo, hi), models[r].params, opt)
		return err
	})
	for r := range world {
		require.NoError(t, errs[r], "rank %d", r)
		close32(t, fmt.Sprintf("rank %d loss", r), []float32{wantLoss}, losses[r:r+1])
		for i := range want {
			close32(t, fmt.Sprintf("rank %d parameter %d", r, i), want[i], models[r].data[i])
		}
	}
}

// An error before the update (a peer gone during the gradients'
// all-reduce) leaves every rank's parameters as they were and does not
// wrap ErrStepApplied: the step may be retried.
func TestTrainerErrorBeforeTheUpdateAppliesNothing(t *testing.T) {
	const world, n = 3, 6
	x, y := batch(rand.New(rand.NewPCG(45, 46)), n)
	models := []*model{newModel(1), newModel(1), newModel(1)}
	before := make([][][]float32, world)
	for r, m := range models {
		for _, d := range m.data {
			before[r] = append(before[r], slices.Clone(d))
		}
	}
	errs := stepRanks(dist.NewLocal(world, 300*time.Millisecond), func(r int, tr *dist.Trainer) error {
		if r == 2 {
			return nil // gone before its first collective
		}
		lo, hi, _ := tr.Shard(n)
		_, err := tr.Step(context.Background(), n, models[r].loss(x, y, lo, hi), models[r].params, optim.NewSGD(0.1, 0))
		return err
	})
	for r := range 2 {
		require.Error(t, errs[r], "rank %d", r)
		assert.NotErrorIs(t, errs[r], dist.ErrStepApplied, "rank %d", r)
		assert.Equal(t, before[r], models[r].data, "rank %d", r)
	}
}

// A rank whose loss covers 16 rows where its shard of the global 16 is 8
// is refused with ErrShard before anything runs (its gradients would be
// scaled by 8/16 twice over); its peer, waiting in the gradients'
// all-reduce, gets ErrAborted at once. Nothing is updated anywhere.
func TestTrainerRefusesALossOverTheWrongRows(t *testing.T) {
	const world, n = 2, 16
	x, y := batch(rand.New(rand.NewPCG(47, 48)), n)
	models := []*model{newModel(1), newModel(1)}
	var before [][]float32
	for _, d := range models[0].data {
		before = append(before, slices.Clone(d))
	}
	start := time.Now()
	errs := stepRanks(dist.NewLocal(world, time.Minute), func(r int, tr *dist.Trainer) error {
		lo, hi, _ := tr.Shard(n)
		if r == 0 {
			lo, hi = 0, n // the whole batch where the shard is [0, 8)
		}
		_, err := tr.Step(context.Background(), n, models[r].loss(x, y, lo, hi), models[r].params, optim.NewSGD(0.1, 0))
		return err
	})
	require.Less(t, time.Since(start), 10*time.Second)
	require.ErrorIs(t, errs[0], dist.ErrShard)
	assert.Contains(t, errs[0].Error(), "16 rows")
	require.ErrorIs(t, errs[1], dist.ErrAborted)
	for r := range world {
		assert.Equal(t, before, models[r].data, "rank %d", r)
	}
}
