package dist

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"
)

// IDSize is the size of an NCCL unique id (ncclUniqueId, 128 bytes).
const IDSize = 128

// Env is a rank's place in the job, read from torchrun's variables.
type Env struct {
	Rank, WorldSize, LocalRank int
	// MasterAddr and MasterPort are where rank 0 serves the unique id.
	MasterAddr string
	MasterPort int
}

// Addr is MasterAddr:MasterPort.
func (e Env) Addr() string { return net.JoinHostPort(e.MasterAddr, strconv.Itoa(e.MasterPort)) }

// EnvFromOS reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
// MASTER_PORT as torchrun (and batchfit launch) set them. LOCAL_RANK
// defaults to RANK, MASTER_ADDR to 127.0.0.1; the others are required.
// Anything missing, malformed or inconsistent is an error wrapping
// ErrBadEnv.
func EnvFromOS() (Env, error) { return EnvFrom(os.Getenv) }

// EnvFrom is EnvFromOS over any lookup (tests).
func EnvFrom(getenv func(string) string) (Env, error) {
	var e Env
	num := func(name string, def int, required bool) (int, error) {
		s := getenv(name)
		if s == "" {
			if required {
				return 0, fmt.Errorf("%w: %s is not set", ErrBadEnv, name)
			}
			return def, nil
		}
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			return 0, fmt.Errorf("%w: %s=%q is not a non-negative integer", ErrBadEnv, name, s)
		}
		return v, nil
	}
	var err error
	if e.Rank, err = num("RANK", 0, true); err != nil {
		return e, err
	}
	if e.WorldSize, err = num("WORLD_SIZE", 0, true); err != nil {
		return e, err
	}
	if e.LocalRank, err = num("LOCAL_RANK", e.Rank, false); err != nil {
		return e, err
	}
	if e.MasterPort, err = num("MASTER_PORT", 0, true); err != nil {
		return e, err
	}
	if e.MasterAddr = getenv("MASTER_ADDR"); e.MasterAddr == "" {
		e.MasterAddr = "127.0.0.1"
	}
	switch {
	case e.WorldSize == 0:
		return e, fmt.Errorf("%w: WORLD_SIZE is 0", ErrBadEnv)
	case e.Rank >= e.WorldSize:
		return e, fmt.Errorf("%w: RANK %d is not below WORLD_SIZE %d", ErrBadEnv, e.Rank, e.WorldSize)
	case e.MasterPort == 0 || e.MasterPort > 65535:
		return e, fmt.Errorf("%w: MASTER_PORT %d is not a port", ErrBadEnv, e.MasterPort)
	}
	return e, nil
}

// handshake is what a client sends before reading the id: a magic, its
// rank and the world size it believes in, so a stray or misconfigured
// process is refused rather than handed the id.
var magic = [4]byte{'b', 'f', 'i', 'd'}

// ExchangeID gives every rank the same IDSize-byte id before deadline:
// rank 0 (which passes its id) listens on e.Addr() and serves it to every
// other rank, once each; the others (which pass nil) dial with retries
// until they get it. Failures wrap ErrTimeout (the deadline passed) or
// ErrRendezvous. Rank 0 returns when WorldSize−1 distinct ranks have their
// copy, so every rank knows the others reached the rendezvous.
func ExchangeID(ctx context.Context, e Env, id []byte, deadline time.Time) ([]byte, error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if e.Rank == 0 {
		if len(id) != IDSize {
			return nil, fmt.Errorf("%w: rank 0's id is %d bytes, want %d", ErrRendezvous, len(id), IDSize)
		}
		return id, serveID(ctx, e, id)
	}
	return fetchID(ctx, e)
}

func serveID(ctx context.Context, e Env, id []byte) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", e.Addr())
	if err != nil {
		return fmt.Errorf("%w: rank 0 cannot listen on %s: %v", ErrRendezvous, e.Addr(), err)
	}
	defer ln.Close()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	served := map[int]bool{}
	for len(served) < e.WorldSize-1 {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("%w: rank 0 served %d of %d ranks at %s", ErrTimeout, len(served), e.WorldSize-1, e.Addr())
			}
			return fmt.Errorf("%w: accept: %v", ErrRendezvous, err)
		}
		rank, err := serveOne(ctx, conn, e, id)
		if err == nil {
			served[rank] = true
		}
	}
	return nil
}

// serveOne checks a client's hello and sends the id; a bad client is
// dropped without ending the rendezvous.
func serveOne(ctx context.Context, conn net.Conn, e Env, id []byte) (int, error) {
	defer conn.Close()
	if d, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(d)
	}
	var hello [12]byte
	if _, err := io.ReadFull(conn, hello[:]); err != nil {
		return 0, err
	}
	rank, world := int(be32(hello[4:])), int(be32(hello[8:]))
	if !bytes.Equal(hello[:4], magic[:]) || world != e.WorldSize || rank <= 0 || rank >= world {
		return 0, fmt.Errorf("%w: bad hello", ErrRendezvous)
	}
	_, err := conn.Write(id)
	return rank, err
}

func fetchID(ctx context.Context, e Env) ([]byte, error) {
	var d net.Dialer
	backoff := 20 * time.Millisecond
	var last error
	for {
		id, err := fetchOnce(ctx, &d, e)
		if err == nil {
			return id, nil
		}
		if errors.Is(err, ErrRendezvous) {
			return nil, err
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: rank %d got no id from %s: %v", ErrTimeout, e.Rank, e.Addr(), last)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

func fetchOnce(ctx context.Context, d *net.Dialer, e Env) ([]byte, error) {
	conn, err := d.DialContext(ctx, "tcp", e.Addr())
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	var hello [12]byte
	copy(hello[:], magic[:])
	put32(hello[4:], uint32(e.Rank))
	put32(hello[8:], uint32(e.WorldSize))
	if _, err := conn.Write(hello[:]); err != nil {
		return nil, err
	}
	id := make([]byte, IDSize)
	if _, err := io.ReadFull(conn, id); err != nil {
		return nil, err // rank 0 refused us or went away: retry until the deadline
	}
	return id, nil
}

func be32(b []byte) uint32 {
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

func put32(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
}
