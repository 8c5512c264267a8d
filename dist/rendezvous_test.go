package dist_test

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/dist"
)

func TestEnvFrom(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	e, err := dist.EnvFrom(env(map[string]string{"RANK": "2", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}))
	require.NoError(t, err)
	require.Equal(t, dist.Env{Rank: 2, WorldSize: 4, LocalRank: 2, MasterAddr: "127.0.0.1", MasterPort: 29500}, e)
	for _, bad := range []map[string]string{
		{"WORLD_SIZE": "4", "MASTER_PORT": "1"},
		{"RANK": "4", "WORLD_SIZE": "4", "MASTER_PORT": "1"},
		{"RANK": "x", "WORLD_SIZE": "4", "MASTER_PORT": "1"},
		{"RANK": "0", "WORLD_SIZE": "0", "MASTER_PORT": "1"},
		{"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"},
		{"RANK": "0", "WORLD_SIZE": "1"},
	} {
		_, err := dist.EnvFrom(env(bad))
		require.ErrorIs(t, err, dist.ErrBadEnv, "%v", bad)
	}
}

// freePort is a loopback port free a moment ago.
func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Four ranks as goroutines over real loopback TCP: the clients start
// before rank 0 listens (they retry), and all get rank 0's id.
func TestExchangeIDLoopback(t *testing.T) {
	const world = 4
	port := freePort(t)
	id := bytes.Repeat([]byte{0xab, 0x01}, dist.IDSize/2)
	deadline := time.Now().Add(10 * time.Second)
	got := make([][]byte, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := world - 1; r >= 0; r-- {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r == 0 {
				time.Sleep(100 * time.Millisecond) // clients dial first and retry
			}
			e := dist.Env{Rank: r, WorldSize: world, LocalRank: r, MasterAddr: "127.0.0.1", MasterPort: port}
			var mine []byte
			if r == 0 {
				mine = id
			}
			got[r], errs[r] = dist.ExchangeID(context.Background(), e, mine, deadline)
		}()
	}
	wg.Wait()
	for r := range world {
		require.NoError(t, errs[r], "rank %d", r)
		require.Equal(t, id, got[r], "rank %d", r)
	}
}

// Without rank 0 a client gives up at its deadline with ErrTimeout; rank 0
// without its peers too.
func TestExchangeIDTimeouts(t *testing.T) {
	port := freePort(t)
	start := time.Now()
	_, err := dist.ExchangeID(context.Background(), dist.Env{Rank: 1, WorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: port}, nil, time.Now().Add(300*time.Millisecond))
	require.ErrorIs(t, err, dist.ErrTimeout)
	require.Less(t, time.Since(start), 5*time.Second)

	start = time.Now()
	_, err = dist.ExchangeID(context.Background(), dist.Env{Rank: 0, WorldSize: 3, MasterAddr: "127.0.0.1", MasterPort: port},
		make([]byte, dist.IDSize), time.Now().Add(300*time.Millisecond))
	require.ErrorIs(t, err, dist.ErrTimeout)
	require.Less(t, time.Since(start), 5*time.Second)
}

// A stray connection that sends garbage does not end the rendezvous: the
// real rank still gets the id.
func TestExchangeIDIgnoresStrangers(t *testing.T) {
	port := freePort(t)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(10 * time.Second)
	id := bytes.Repeat([]byte{7}, dist.IDSize)
	done := make(chan error, 1)
	go func() {
		_, err := dist.ExchangeID(context.Background(), dist.Env{Rank: 0, WorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: port}, id, deadline)
		done <- err
	}()
	var conn net.Conn
	require.Eventually(t, func() bool {
		var err error
		conn, err = net.Dial("tcp", addr)
		return err == nil
	}, 5*time.Second, 10*time.Millisecond)
	_, _ = conn.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
	conn.Close()
	got, err := dist.ExchangeID(context.Background(), dist.Env{Rank: 1, WorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: port}, nil, deadline)
	require.NoError(t, err)
	require.Equal(t, id, got)
	require.NoError(t, <-done)
}

func TestExchangeIDBadID(t *testing.T) {
	_, err := dist.ExchangeID(context.Background(), dist.Env{Rank: 0, WorldSize: 2, MasterAddr: "127.0.0.1", MasterPort: 1}, []byte{1}, time.Now().Add(time.Second))
	require.ErrorIs(t, err, dist.ErrRendezvous)
}
