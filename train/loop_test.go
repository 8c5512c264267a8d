package train_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/train"
)

// clock advances by step at every reading.
func clock(step time.Duration) func() time.Time {
	t := time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
	return func() time.Time { t = t.Add(step); return t }
}

// A resumed run of steps 4…11: log lines every 3 steps and after the
// last with the interval's mean loss, its token rate and the time left
// at that rate; evaluations every 4 steps done and after the last;
// checkpoints every 5 steps done (the first after step 4) and after the
// last, given the steps done.
func TestRunSchedule(t *testing.T) {
	var out strings.Builder
	var ran, evals, ckpts []int
	cfg := train.Config{Steps: 12, Start: 4, LogEvery: 3, EvalEvery: 4, CheckpointEvery: 5, Out: &out, Now: clock(time.Second),
		Eval: func(_ context.Context, done int) (float32, error) {
			evals = append(evals, done)
			return float32(done) / 100, nil
		},
		Checkpoint: func(_ context.Context, done int) error { ckpts = append(ckpts, done); return nil }}
	sum, err := train.Run(context.Background(), cfg, func(_ context.Context, s int) (train.Result, error) {
		ran = append(ran, s)
		return train.Result{Loss: float32(s), Tokens: 1000, LR: 3e-4}, nil
	})
	require.NoError(t, err)
	assert.Equal(t, []int{4, 5, 6, 7, 8, 9, 10, 11}, ran)
	assert.Equal(t, []int{8, 12}, evals)
	assert.Equal(t, []int{5, 10, 12}, ckpts)
	assert.Equal(t, train.Summary{Steps: 8, Loss: 11, EvalLoss: 0.12, Elapsed: sum.Elapsed}, sum)
	// The clock is read at the start and at each log line (evaluations
	// and checkpoints read none), a second apart: the first line covers
	// steps 4 and 5 (2000 tokens in 1 s, 6 steps left at 0.5 s each), the
	// others three steps each.
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	assert.Equal(t, []string{
		"step  6/12  loss 4.5000  lr 3.00e-04  2k tok/s  eta 3s",
		"eval step 8  loss 0.0800",
		"step  9/12  loss 7.0000  lr 3.00e-04  3k tok/s  eta 1s",
		"step 12/12  loss 10.0000  lr 3.00e-04  3k tok/s",
		"eval step 12  loss 0.1200",
	}, lines)
}

// Samples/s when a step counts samples only; no rate without either; the
// learning rate only when given.
func TestRunRates(t *testing.T) {
	var out strings.Builder
	_, err := train.Run(context.Background(), train.Config{Steps: 2, LogEvery: 1, Out: &out, Now: clock(500 * time.Millisecond)},
		func(_ context.Context, s int) (train.Result, error) {
			if s == 0 {
				return train.Result{Loss: 1, Samples: 64}, nil
			}
			return train.Result{Loss: 2}, nil
		})
	require.NoError(t, err)
	assert.Equal(t, "step 1/2  loss 1.0000  128 samples/s  eta 1s\nstep 2/2  loss 2.0000\n", out.String())
}

// Errors stop the loop with the step they came from; a cancelled context
// stops it before the next step; a bad configuration runs nothing.
func TestRunErrors(t *testing.T) {
	boom := errors.New("boom")
	ok := func(context.Context, int) (train.Result, error) { return train.Result{Loss: 1}, nil }
	_, err := train.Run(context.Background(), train.Config{Steps: 5, Out: &strings.Builder{}},
		func(_ context.Context, s int) (train.Result, error) {
			if s == 2 {
				return train.Result{}, boom
			}
			return train.Result{Loss: 1}, nil
		})
	require.ErrorIs(t, err, boom)
	assert.Contains(t, err.Error(), "step 2")

	_, err = train.Run(context.Background(), train.Config{Steps: 5, Out: &strings.Builder{}, CheckpointEvery: 2,
		Checkpoint: func(context.Context, int) error { return boom }}, ok)
	require.ErrorIs(t, err, boom)
	assert.Contains(t, err.Error(), "checkpoint after step 1")

	_, err = train.Run(context.Background(), train.Config{Steps: 5, Out: &strings.Builder{}, EvalEvery: 1,
		Eval: func(context.Context, int) (float32, error) { return 0, boom }}, ok)
	require.ErrorIs(t, err, boom)

	ctx, cancel := context.WithCancel(context.Background())
	sum, err := train.Run(ctx, train.Config{Steps: 5, Out: &strings.Builder{}}, func(_ context.Context, s int) (train.Result, error) {
		if s == 1 {
			cancel()
		}
		return train.Result{Loss: 1}, nil
	})
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 2, sum.Steps)

	for _, cfg := range []train.Config{{Steps: -1}, {Steps: 3, Start: 4}, {Steps: 3, LogEvery: -1}} {
		_, err := train.Run(context.Background(), cfg, ok)
		require.ErrorIs(t, err, train.ErrConfig)
	}
	_, err = train.Run(context.Background(), train.Config{Steps: 1}, nil)
	require.ErrorIs(t, err, train.ErrConfig)
}
