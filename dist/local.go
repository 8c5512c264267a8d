package dist

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// NewLocal returns size communicators over one in-process group: ranks as
// goroutines, the fake that CPU tests and CPU data-parallel training use.
// It keeps NCCL's contract (same collectives in the same order on every
// rank, a deadline per call, abort of the whole group) and sums in rank
// order, so its results do not depend on which rank arrives last. timeout
// bounds every call (DefaultTimeout if 0).
func NewLocal(size int, timeout time.Duration) []Communicator {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	h := &hub{size: size, timeout: timeout, rounds: map[int]*round{}, aborted: make(chan struct{})}
	cs := make([]Communicator, size)
	for r := range cs {
		cs[r] = &local{h: h, rank: r}
	}
	return cs
}

// hub is the group's shared state: one round per collective, numbered by
// each rank's call count.
type hub struct {
	size    int
	timeout time.Duration

	mu      sync.Mutex
	rounds  map[int]*round
	aborted chan struct{} // closed by abort
	cause   error         // why, set before aborted is closed
}

type round struct {
	op     string
	n      int // buffer length (the send buffer's, for reduce-scatter and all-gather)
	root   int
	bufs   [][]float32
	count  int
	result []float32
	done   chan struct{}
}

func (h *hub) abort(cause error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.aborted:
	default:
		h.cause = cause
		close(h.aborted)
	}
}

type local struct {
	h      *hub
	rank   int
	calls  int
	closed bool
}

func (c *local) Rank() int       { return c.rank }
func (c *local) Size() int       { return c.h.size }
func (c *local) Overhead() int64 { return 0 }

func (c *local) Abort() error {
	c.h.abort(fmt.Errorf("rank %d called Abort", c.rank))
	return nil
}

func (c *local) Close() error {
	c.closed = true
	return nil
}

func (c *local) AllReduceSum(ctx context.Context, buf []float32) error {
	return c.collective(ctx, "all-reduce", buf, -1)
}

func (c *local) Broadcast(ctx context.Context, buf []float32, root int) error {
	if root < 0 || root >= c.h.size {
		return &RankError{Rank: c.rank, Op: "broadcast", Err: fmt.Errorf("%w: root %d of %d ranks", ErrMismatch, root, c.h.size)}
	}
	return c.collective(ctx, "broadcast", buf, root)
}

// ReduceScatterSum sums each block in rank order (as AllReduceSum does),
// so its block r is bit for bit block r of the all-reduce's result.
func (c *local) ReduceScatterSum(ctx context.Context, send, recv []float32) error {
	if err := blocks(c.rank, "reduce-scatter", len(send), len(recv), c.h.size); err != nil {
		return err
	}
	return c.collectiveTo(ctx, "reduce-scatter", send, recv, -1)
}

// AllGather copies every rank's send into its block of recv.
func (c *local) AllGather(ctx context.Context, send, recv []float32) error {
	if err := blocks(c.rank, "all-gather", len(recv), len(send), c.h.size); err != nil {
		return err
	}
	return c.collectiveTo(ctx, "all-gather", send, recv, -1)
}

// blocks checks that a collective's whole buffer of n values is size
// blocks of its per-rank buffer of m: an ErrMismatch naming both
// otherwise, before anything is sent.
func blocks(rank int, op string, n, m, size int) error {
	if n == m*size {
		return nil
	}
	return &RankError{Rank: rank, Op: op, Err: fmt.Errorf("%w: a buffer of %d values is not %d blocks of the other's %d", ErrMismatch, n, size, m)}
}

// collective joins this rank's next round and waits for the others, for
// an abort, for ctx or for the deadline.
func (c *local) collective(ctx context.Context, op string, buf []float32, root int) error {
	return c.collectiveTo(ctx, op, buf, buf, root)
}

// collectiveTo is collective with this rank's input in send and its
// result written to out: the whole result, or this rank's block of it
// for reduce-scatter.
func (c *local) collectiveTo(ctx context.Context, op string, buf, out []float32, root int) error {
	h := c.h
	fail := func(err error) error { return &RankError{Rank: c.rank, Op: op, Err: err} }
	if c.closed {
		return fail(ErrClosed)
	}
	select {
	case <-h.aborted:
		return fail(fmt.Errorf("%w: %v", ErrAborted, h.cause))
	default:
	}
	k := c.calls
	c.calls++
	h.mu.Lock()
	r := h.rounds[k]
	if r == nil {
		r = &round{op: op, n: len(buf), root: root, bufs: make([][]float32, h.size), done: make(chan struct{})}
		h.rounds[k] = r
	}
	if r.op != op || r.n != len(buf) || r.root != root {
		h.mu.Unlock()
		err := fmt.Errorf("%w: call %d is %s of %d (root %d) here, %s of %d (root %d) on another rank",
			ErrMismatch, k, op, len(buf), root, r.op, r.n, r.root)
		h.abort(err)
		return fail(err)
	}
	r.bufs[c.rank] = buf
	r.count++
	if r.count == h.size { // the last arrival computes, in rank order
		var res []float32
		switch op {
		case "broadcast":
			res = append(res, r.bufs[root]...)
		case "all-gather":
			res = make([]float32, 0, len(buf)*h.size)
			for _, b := range r.bufs {
				res = append(res, b...)
			}
		default: // all-reduce, reduce-scatter: the sum in rank order
			res = make([]float32, len(buf))
			for _, b := range r.bufs {
				for i, v := range b {
					res[i] += v
				}
			}
		}
		r.result, r.bufs = res, nil
		delete(h.rounds, k)
		close(r.done)
	}
	h.mu.Unlock()

	timer := time.NewTimer(h.timeout)
	defer timer.Stop()
	select {
	case <-r.done:
		if op == "reduce-scatter" {
			copy(out, r.result[c.rank*len(out):])
		} else {
			copy(out, r.result)
		}
		return nil
	case <-h.aborted:
		return fail(fmt.Errorf("%w: %v", ErrAborted, h.cause))
	case <-ctx.Done():
		err := fmt.Errorf("%w: %w", ErrAborted, ctx.Err())
		h.abort(fmt.Errorf("rank %d: %s: %w", c.rank, op, ctx.Err()))
		return fail(err)
	case <-timer.C:
		err := fmt.Errorf("%w: %s waited %v for its peers", ErrTimeout, op, h.timeout)
		h.abort(fmt.Errorf("rank %d timed out in %s", c.rank, op))
		return fail(err)
	}
}
