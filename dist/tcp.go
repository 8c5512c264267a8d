package dist

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
	"time"
)

// TCPOptions configures NewTCP.
type TCPOptions struct {
	// Timeout bounds every collective (DefaultTimeout if 0).
	Timeout time.Duration
	// RendezvousTimeout bounds the connection of every rank to rank 0
	// (1 minute if 0).
	RendezvousTimeout time.Duration
}

// NewTCP joins the job e describes (torchrun's variables, EnvFromOS) as a
// host Communicator over TCP, for CPU data parallel across processes and
// machines: rank 0 listens on MASTER_ADDR:MASTER_PORT, the others dial it
// with retries, and every collective goes through rank 0, which sums in
// rank order as the in-process communicator does (so results are bit for
// bit NewLocal's). It keeps the Communicator contract: the same
// collectives in the same order on every rank (a disagreement is
// ErrMismatch on every rank), a deadline per call (ErrTimeout), and a
// rank that dies or aborts makes the others' calls fail with ErrAborted
// (its connections close) or ErrTimeout. Overhead is 0: nothing is on a
// device. It does not pretend to be fast: every value crosses rank 0.
func NewTCP(ctx context.Context, e Env, o TCPOptions) (Communicator, error) {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.RendezvousTimeout <= 0 {
		o.RendezvousTimeout = time.Minute
	}
	if e.WorldSize < 1 || e.Rank < 0 || e.Rank >= e.WorldSize {
		return nil, fmt.Errorf("%w: rank %d of %d", ErrBadEnv, e.Rank, e.WorldSize)
	}
	c := &tcpComm{rank: e.Rank, size: e.WorldSize, timeout: o.Timeout}
	rctx, cancel := context.WithTimeout(ctx, o.RendezvousTimeout)
	defer cancel()
	var err error
	if e.Rank == 0 {
		err = c.accept(rctx, e)
	} else {
		err = c.dial(rctx, e)
	}
	if err != nil {
		c.closeConns()
		return nil, &RankError{Rank: e.Rank, Op: "tcp rendezvous", Err: err}
	}
	return c, nil
}

var tcpMagic = [4]byte{'b', 'f', 't', 'c'}

// Frame kinds rank 0 answers with.
const (
	tcpOK       = 0
	tcpMismatch = 1
)

// Collective codes on the wire.
var tcpOps = map[string]byte{"all-reduce": 1, "broadcast": 2, "reduce-scatter": 3, "all-gather": 4}

type tcpComm struct {
	rank, size int
	timeout    time.Duration

	mu      sync.Mutex
	conns   []net.Conn // rank 0: one per peer rank (nil at 0); others: conns[0] to rank 0
	aborted bool
	closed  bool
	cause   string
}

func (c *tcpComm) Rank() int       { return c.rank }
func (c *tcpComm) Size() int       { return c.size }
func (c *tcpComm) Overhead() int64 { return 0 }

func (c *tcpComm) accept(ctx context.Context, e Env) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", e.Addr())
	if err != nil {
		return fmt.Errorf("%w: rank 0 cannot listen on %s: %v", ErrRendezvous, e.Addr(), err)
	}
	defer ln.Close()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	c.conns = make([]net.Conn, c.size)
	for joined := 1; joined < c.size; {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("%w: rank 0 heard from %d of %d ranks at %s", ErrTimeout, joined-1, c.size-1, e.Addr())
			}
			return fmt.Errorf("%w: accept: %v", ErrRendezvous, err)
		}
		if d, ok := ctx.Deadline(); ok {
			_ = conn.SetDeadline(d)
		}
		var hello [12]byte
		if _, err := io.ReadFull(conn, hello[:]); err != nil {
			conn.Close()
			continue
		}
		rank, world := int(be32(hello[4:])), int(be32(hello[8:]))
		if !bytes.Equal(hello[:4], tcpMagic[:]) || world != c.size || rank <= 0 || rank >= world || c.conns[rank] != nil {
			conn.Close() // a stray or duplicate client: refused, the rendezvous goes on
			continue
		}
		_ = conn.SetDeadline(time.Time{})
		c.conns[rank] = conn
		joined++
	}
	// Everyone is here: let them go.
	for _, conn := range c.conns[1:] {
		if _, err := conn.Write([]byte{tcpOK}); err != nil {
			return fmt.Errorf("%w: %v", ErrRendezvous, err)
		}
	}
	return nil
}

func (c *tcpComm) dial(ctx context.Context, e Env) error {
	var d net.Dialer
	backoff := 20 * time.Millisecond
	var last error
	for {
		conn, err := d.DialContext(ctx, "tcp", e.Addr())
		if err == nil {
			if dl, ok := ctx.Deadline(); ok {
				_ = conn.SetDeadline(dl)
			}
			var hello [12]byte
			copy(hello[:], tcpMagic[:])
			put32(hello[4:], uint32(e.Rank))
			put32(hello[8:], uint32(e.WorldSize))
			var ready [1]byte
			if _, err = conn.Write(hello[:]); err == nil {
				_, err = io.ReadFull(conn, ready[:])
			}
			if err == nil {
				_ = conn.SetDeadline(time.Time{})
				c.conns = []net.Conn{conn}
				return nil
			}
			conn.Close()
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: rank %d could not join rank 0 at %s: %v", ErrTimeout, e.Rank, e.Addr(), last)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// Abort closes every connection: this rank's calls fail with ErrAborted,
// and so do its peers' (rank 0 closes its other connections when one
// fails).
func (c *tcpComm) Abort() error {
	c.abort(fmt.Sprintf("rank %d called Abort", c.rank))
	return nil
}

func (c *tcpComm) abort(cause string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.aborted {
		c.aborted, c.cause = true, cause
	}
	for _, conn := range c.conns {
		if conn != nil {
			conn.Close()
		}
	}
}

func (c *tcpComm) closeConns() {
	for _, conn := range c.conns {
		if conn != nil {
			conn.Close()
		}
	}
}

func (c *tcpComm) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	c.closeConns()
	return nil
}

func (c *tcpComm) AllReduceSum(ctx context.Context, buf []float32) error {
	return c.collective(ctx, "all-reduce", buf, buf, -1)
}

func (c *tcpComm) Broadcast(ctx context.Context, buf []float32, root int) error {
	if root < 0 || root >= c.size {
		return &RankError{Rank: c.rank, Op: "broadcast", Err: fmt.Errorf("%w: root %d of %d ranks", ErrMismatch, root, c.size)}
	}
	return c.collective(ctx, "broadcast", buf, buf, root)
}

func (c *tcpComm) ReduceScatterSum(ctx context.Context, send, recv []float32) error {
	if err := blocks(c.rank, "reduce-scatter", len(send), len(recv), c.size); err != nil {
		return err
	}
	return c.collective(ctx, "reduce-scatter", send, recv, -1)
}

func (c *tcpComm) AllGather(ctx context.Context, send, recv []float32) error {
	if err := blocks(c.rank, "all-gather", len(recv), len(send), c.size); err != nil {
		return err
	}
	return c.collective(ctx, "all-gather", send, recv, -1)
}

// collective runs one call: the peers send rank 0 a header (op, send
// length, root) and their send buffer (a broadcast's non-roots send
// none), rank 0 checks the headers against its own, computes in rank
// order and answers each peer with a status byte and its result.
func (c *tcpComm) collective(ctx context.Context, op string, send, out []float32, root int) error {
	fail := func(err error) error { return &RankError{Rank: c.rank, Op: op, Err: err} }
	c.mu.Lock()
	closed, aborted, cause := c.closed, c.aborted, c.cause
	c.mu.Unlock()
	switch {
	case closed:
		return fail(ErrClosed)
	case aborted:
		return fail(fmt.Errorf("%w: %s", ErrAborted, cause))
	}
	deadline := time.Now().Add(c.timeout)
	for _, conn := range c.conns {
		if conn != nil {
			_ = conn.SetDeadline(deadline)
		}
	}
	stop := context.AfterFunc(ctx, func() { c.abort(fmt.Sprintf("rank %d: %s: %v", c.rank, op, ctx.Err())) })
	defer stop()
	var err error
	if c.rank == 0 {
		err = c.serve(op, send, out, root)
	} else {
		err = c.ask(op, send, out, root)
	}
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrMismatch) {
		c.abort(err.Error())
		return fail(err)
	}
	var ne net.Error
	switch {
	case ctx.Err() != nil:
		err = fmt.Errorf("%w: %w", ErrAborted, ctx.Err())
	case errors.As(err, &ne) && ne.Timeout():
		err = fmt.Errorf("%w: %s waited %v for its peers", ErrTimeout, op, c.timeout)
	default:
		c.mu.Lock()
		cause := c.cause
		c.mu.Unlock()
		if cause == "" {
			cause = "a peer's connection closed"
		}
		err = fmt.Errorf("%w: %s: %v", ErrAborted, cause, err)
	}
	c.abort(err.Error())
	return fail(err)
}

// header is a peer's description of its call.
type header struct {
	op   byte
	n    uint64
	root int32
}

func (h header) bytes() []byte {
	b := make([]byte, 13)
	b[0] = h.op
	binary.LittleEndian.PutUint64(b[1:], h.n)
	binary.LittleEndian.PutUint32(b[9:], uint32(h.root))
	return b
}

func readHeader(r io.Reader) (header, error) {
	var b [13]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return header{}, err
	}
	return header{op: b[0], n: binary.LittleEndian.Uint64(b[1:]), root: int32(binary.LittleEndian.Uint32(b[9:]))}, nil
}

// sends reports whether a rank sends its buffer for the call.
func sends(op string, rank, root int) bool { return op != "broadcast" || rank == root }

func (c *tcpComm) ask(op string, send, out []float32, root int) error {
	conn := c.conns[0]
	w := bufio.NewWriterSize(conn, 1<<16)
	if _, err := w.Write(header{op: tcpOps[op], n: uint64(len(send)), root: int32(root)}.bytes()); err != nil {
		return err
	}
	if sends(op, c.rank, root) {
		if err := writeFloats(w, send); err != nil {
			return err
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	r := bufio.NewReaderSize(conn, 1<<16)
	status, err := r.ReadByte()
	if err != nil {
		return err
	}
	if status != tcpOK {
		var n [4]byte
		if _, err := io.ReadFull(r, n[:]); err != nil {
			return err
		}
		msg := make([]byte, min(be32(n[:]), 1<<12))
		_, _ = io.ReadFull(r, msg)
		return fmt.Errorf("%w: %s", ErrMismatch, msg)
	}
	return readFloats(r, out)
}

func (c *tcpComm) serve(op string, send, out []float32, root int) error {
	want := header{op: tcpOps[op], n: uint64(len(send)), root: int32(root)}
	bufs := make([][]float32, c.size)
	bufs[0] = send
	readers := make([]*bufio.Reader, c.size)
	var mismatch error
	for r := 1; r < c.size; r++ { // in rank order: the sum's order
		readers[r] = bufio.NewReaderSize(c.conns[r], 1<<16)
		h, err := readHeader(readers[r])
		if err != nil {
			return err
		}
		if h != want {
			mismatch = fmt.Errorf("%w: rank 0 called %s of %d (root %d); rank %d sent op %d of %d (root %d)",
				ErrMismatch, op, len(send), root, r, h.op, h.n, h.root)
			break
		}
		if sends(op, r, root) {
			bufs[r] = make([]float32, len(send))
			if err := readFloats(readers[r], bufs[r]); err != nil {
				return err
			}
		}
	}
	if mismatch != nil {
		msg := []byte(mismatch.Error())
		for r := 1; r < c.size; r++ {
			frame := append([]byte{tcpMismatch, 0, 0, 0, 0}, msg...)
			put32(frame[1:], uint32(len(msg)))
			_, _ = c.conns[r].Write(frame)
		}
		return mismatch
	}
	var res []float32
	switch op {
	case "broadcast":
		res = bufs[root]
	case "all-gather":
		res = make([]float32, 0, len(send)*c.size)
		for _, b := range bufs {
			res = append(res, b...)
		}
	default: // the sum in rank order, as NewLocal's
		res = make([]float32, len(send))
		for _, b := range bufs {
			for i, v := range b {
				res[i] += v
			}
		}
	}
	for r := 1; r < c.size; r++ {
		part := res
		if op == "reduce-scatter" {
			m := len(send) / c.size
			part = res[r*m : (r+1)*m]
		}
		w := bufio.NewWriterSize(c.conns[r], 1<<16)
		if err := w.WriteByte(tcpOK); err != nil {
			return err
		}
		if err := writeFloats(w, part); err != nil {
			return err
		}
		if err := w.Flush(); err != nil {
			return err
		}
	}
	if op == "reduce-scatter" {
		copy(out, res[:len(out)])
	} else {
		copy(out, res)
	}
	return nil
}

func writeFloats(w *bufio.Writer, v []float32) error {
	var b [4]byte
	for _, x := range v {
		binary.LittleEndian.PutUint32(b[:], math.Float32bits(x))
		if _, err := w.Write(b[:]); err != nil {
			return err
		}
	}
	return nil
}

func readFloats(r *bufio.Reader, v []float32) error {
	var b [4]byte
	for i := range v {
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return err
		}
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[:]))
	}
	return nil
}
