package dist_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/dist"
)

// each runs fn on every rank of comms in its own goroutine and returns
// their errors.
func each(comms []dist.Communicator, fn func(c dist.Communicator) error) []error {
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = fn(c)
		}()
	}
	wg.Wait()
	return errs
}

func TestLocalAllReduceAndBroadcast(t *testing.T) {
	ctx := context.Background()
	comms := dist.NewLocal(4, 5*time.Second)
	out := make([][]float32, 4)
	errs := each(comms, func(c dist.Communicator) error {
		r := float32(c.Rank())
		buf := []float32{r, 10 * r, 1}
		if err := c.AllReduceSum(ctx, buf); err != nil {
			return err
		}
		b := []float32{r, r}
		if err := c.Broadcast(ctx, b, 2); err != nil {
			return err
		}
		out[c.Rank()] = append(buf, b...)
		return nil
	})
	for r := range 4 {
		require.NoError(t, errs[r])
		require.Equal(t, []float32{6, 60, 4, 2, 2}, out[r])
	}
}

// A rank that never joins: the others time out within the deadline with
// ErrTimeout or ErrAborted (whoever times out first aborts the group).
func TestLocalHungRankTimesOut(t *testing.T) {
	const deadline = 200 * time.Millisecond
	comms := dist.NewLocal(3, deadline)
	start := time.Now()
	errs := each(comms, func(c dist.Communicator) error {
		if c.Rank() == 1 {
			return nil // hangs: never calls
		}
		return c.AllReduceSum(context.Background(), []float32{1})
	})
	require.Less(t, time.Since(start), 10*deadline)
	for _, r := range []int{0, 2} {
		require.True(t, errors.Is(errs[r], dist.ErrTimeout) || errors.Is(errs[r], dist.ErrAborted), "rank %d: %v", r, errs[r])
		var re *dist.RankError
		require.ErrorAs(t, errs[r], &re)
		require.Equal(t, r, re.Rank)
	}
	// The group stays aborted.
	require.ErrorIs(t, comms[1].AllReduceSum(context.Background(), []float32{1}), dist.ErrAborted)
}

// A rank that fails and aborts: the others get ErrAborted at once, long
// before the deadline.
func TestLocalAbortReachesPeers(t *testing.T) {
	comms := dist.NewLocal(3, time.Minute)
	start := time.Now()
	errs := each(comms, func(c dist.Communicator) error {
		if c.Rank() == 0 {
			time.Sleep(20 * time.Millisecond)
			return c.Abort()
		}
		return c.Broadcast(context.Background(), []float32{1, 2}, 0)
	})
	require.Less(t, time.Since(start), 10*time.Second)
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], dist.ErrAborted)
	require.ErrorIs(t, errs[2], dist.ErrAborted)
}

func TestLocalMismatchIsTyped(t *testing.T) {
	comms := dist.NewLocal(2, 5*time.Second)
	errs := each(comms, func(c dist.Communicator) error {
		return c.AllReduceSum(context.Background(), make([]float32, 1+c.Rank()))
	})
	// The second arrival sees the mismatch; the first is aborted by it.
	require.True(t, errors.Is(errs[0], dist.ErrMismatch) || errors.Is(errs[1], dist.ErrMismatch), "%v", errs)
	for _, err := range errs {
		require.True(t, errors.Is(err, dist.ErrMismatch) || errors.Is(err, dist.ErrAborted), "%v", err)
	}
}

func TestLocalContextCancel(t *testing.T) {
	comms := dist.NewLocal(2, time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := comms[0].AllReduceSum(ctx, []float32{1})
	require.ErrorIs(t, err, dist.ErrAborted)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

func TestBuckets(t *testing.T) {
	// 4-byte elements, 40-byte buckets: reverse order, a big tensor alone.
	require.Equal(t, [][]int{{4, 3}, {2}, {1, 0}}, dist.Buckets([]int{3, 2, 20, 5, 4}, 40))
	require.Equal(t, [][]int{{1, 0}}, dist.Buckets([]int{1, 1}, 0))
	require.Empty(t, dist.Buckets(nil, 40))
}

func TestShard(t *testing.T) {
	var got [][2]int
	for r := range 4 {
		lo, hi, err := dist.Shard(10, r, 4)
		require.NoError(t, err)
		got = append(got, [2]int{lo, hi})
	}
	require.Equal(t, [][2]int{{0, 3}, {3, 6}, {6, 8}, {8, 10}}, got)
	_, _, err := dist.Shard(3, 0, 4)
	require.ErrorIs(t, err, dist.ErrShard)
}
