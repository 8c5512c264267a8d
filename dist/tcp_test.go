package dist_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/optim"
)

// tcpWorld joins size ranks (goroutines) over loopback TCP.
func tcpWorld(t *testing.T, size int, timeout time.Duration) []dist.Communicator {
	t.Helper()
	port := freePort(t)
	comms := make([]dist.Communicator, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e := dist.Env{Rank: r, WorldSize: size, LocalRank: r, MasterAddr: "127.0.0.1", MasterPort: port}
			comms[r], errs[r] = dist.NewTCP(context.Background(), e, dist.TCPOptions{Timeout: timeout, RendezvousTimeout: 10 * time.Second})
		}()
	}
	wg.Wait()
	for r := range size {
		require.NoError(t, errs[r], "rank %d", r)
	}
	t.Cleanup(func() {
		for _, c := range comms {
			c.Close()
		}
	})
	return comms
}

// Every collective over TCP gives what the in-process communicator gives,
// bit for bit (rank 0 sums in rank order as it does); calls that do not
// pair up are ErrMismatch on every rank.
func TestTCPEqualsLocal(t *testing.T) {
	const size, m = 3, 7
	rng := rand.New(rand.NewPCG(4, 4))
	in := make([][]float32, size)
	for r := range in {
		in[r] = make([]float32, size*m)
		for i := range in[r] {
			in[r][i] = float32(rng.NormFloat64())
		}
	}
	run := func(comms []dist.Communicator) [][][]float32 {
		out := make([][][]float32, size)
		errs := make([]error, size)
		var wg sync.WaitGroup
		for r := range size {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, c := context.Background(), comms[r]
				ar := append([]float32(nil), in[r]...)
				bc := append([]float32(nil), in[r]...)
				rs := make([]float32, m)
				ag := make([]float32, size*m)
				errs[r] = errors.Join(c.AllReduceSum(ctx, ar), c.Broadcast(ctx, bc, 2), c.ReduceScatterSum(ctx, in[r], rs),
					c.AllGather(ctx, in[r][:m], ag))
				out[r] = [][]float32{ar, bc, rs, ag}
			}()
		}
		wg.Wait()
		for r := range size {
			require.NoError(t, errs[r], "rank %d", r)
		}
		return out
	}
	want := run(dist.NewLocal(size, 5*time.Second))
	tcp := tcpWorld(t, size, 5*time.Second)
	require.Equal(t, want, run(tcp))

	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = tcp[r].AllReduceSum(context.Background(), make([]float32, 3+min(r, 1))) // rank 0's length differs
		}()
	}
	wg.Wait()
	for r := range size {
		require.ErrorIs(t, errs[r], dist.ErrMismatch, "rank %d", r)
	}
}

const (
	tcpChildEnv = "BATCHFIT_TCP_CHILD" // the directory a child rank writes its result to
	tcpStageEnv = "BATCHFIT_TCP_STAGE" // the ZeRO stage the child runs
	tcpFailEnv  = "BATCHFIT_TCP_FAIL"  // set: the last rank exits after joining; the others must get a typed error
)

// startRanks runs this test binary again as world processes with
// torchrun's variables over a loopback port, and returns each one's
// output and error.
func startRanks(t *testing.T, test string, world int, env ...string) ([][]byte, []error) {
	port := freePort(t)
	outs := make([][]byte, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.v")
		cmd.Env = append(append(os.Environ(), env...), "RANK="+strconv.Itoa(r), "LOCAL_RANK="+strconv.Itoa(r),
			"WORLD_SIZE="+strconv.Itoa(world), "MASTER_ADDR=127.0.0.1", "MASTER_PORT="+strconv.Itoa(port))
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[r], errs[r] = cmd.CombinedOutput()
		}()
	}
	wg.Wait()
	return outs, errs
}

// Three processes (this test binary run again, torchrun's variables set)
// join over loopback TCP (NewTCP, through MASTER_ADDR and MASTER_PORT)
// and train 4 AdamW steps under each ZeRO stage on the CPU: every rank's
// parameters are bit for bit those of one process over the same
// micro-batches (the TCP communicator sums in the in-process one's
// order).
func TestTCPMultiProcessZeRO(t *testing.T) {
	const world, n, hidden, steps, lr = 3, 12, 16, 4, 0.01
	if dir := os.Getenv(tcpChildEnv); dir != "" {
		tcpChild(t, dir, n, hidden, steps, lr)
		return
	}
	rng := rand.New(rand.NewPCG(31, 32))
	var xs [][]float32
	var ys [][]int64
	for range steps {
		x, y := batch(rng, n)
		xs, ys = append(xs, x), append(ys, y)
	}
	_, ref := oneRank(t, world, n, hidden, steps, xs, ys, lr)
	for _, stage := range []int{dist.ZeRO1, dist.ZeRO2, dist.ZeRO3} {
		t.Run(fmt.Sprintf("stage=%d", stage), func(t *testing.T) {
			dir := t.TempDir()
			outs, errs := startRanks(t, "TestTCPMultiProcessZeRO", world, tcpChildEnv+"="+dir, tcpStageEnv+"="+strconv.Itoa(stage))
			for r := range world {
				require.NoError(t, errs[r], "rank %d:\n%s", r, outs[r])
				b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rank%d.json", r)))
				require.NoError(t, err)
				var got [][]float32
				require.NoError(t, json.Unmarshal(b, &got))
				require.Equal(t, ref, got, "rank %d's parameters, bit for bit", r)
			}
		})
	}
}

// Three processes over loopback TCP; the last exits after the parameters'
// broadcast, and the other two's ZeRO-3 step returns ErrAborted (its connection
// closed) or ErrTimeout within their 3 s deadline.
func TestTCPMultiProcessRankDies(t *testing.T) {
	const world = 3
	if dir := os.Getenv(tcpChildEnv); dir != "" {
		tcpChild(t, dir, 6, 8, 1, 0.01)
		return
	}
	dir := t.TempDir()
	outs, errs := startRanks(t, "TestTCPMultiProcessRankDies", world, tcpChildEnv+"="+dir, tcpStageEnv+"=3", tcpFailEnv+"=1")
	require.Error(t, errs[world-1], "the last rank should have exited with status 3")
	for r := range world - 1 {
		require.NoError(t, errs[r], "rank %d:\n%s", r, outs[r])
		b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rank%d.err", r)))
		require.NoError(t, err)
		t.Logf("rank %d: %s", r, b)
	}
}

// tcpChild is one rank of the multi-process tests.
func tcpChild(t *testing.T, dir string, n, hidden, steps int, lr float64) {
	ctx := context.Background()
	env, err := dist.EnvFromOS()
	require.NoError(t, err)
	stage, err := strconv.Atoi(os.Getenv(tcpStageEnv))
	require.NoError(t, err)
	fail := os.Getenv(tcpFailEnv) != ""
	timeout := time.Minute
	if fail {
		timeout = 3 * time.Second
	}
	comm, err := dist.NewTCP(ctx, env, dist.TCPOptions{Timeout: timeout, RendezvousTimeout: 30 * time.Second})
	require.NoError(t, err)
	defer comm.Close()
	tr, err := dist.New(comm, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, BucketBytes: 200, ZeRO: stage})
	require.NoError(t, err)
	defer tr.Close()
	m := newWide(1+uint64(env.Rank), hidden)
	rng := rand.New(rand.NewPCG(31, 32))
	opt := optim.NewAdamW(lr)
	err = tr.BroadcastParams(ctx, m.params)
	if fail && env.Rank == env.WorldSize-1 {
		os.Exit(3) // gone after the broadcast, before its first step
	}
	start := time.Now()
	for s := 0; s < steps && err == nil; s++ {
		x, y := batch(rng, n)
		lo, hi, _ := tr.Shard(n)
		_, err = tr.Step(ctx, n, m.loss(x, y, lo, hi), m.params, opt)
	}
	if fail {
		elapsed := time.Since(start)
		t.Logf("rank %d after %v: %v", env.Rank, elapsed, err)
		require.True(t, errors.Is(err, dist.ErrAborted) || errors.Is(err, dist.ErrTimeout), "%v", err)
		require.Less(t, elapsed, 2*timeout)
		require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank%d.err", env.Rank)),
			[]byte(fmt.Sprintf("after %v: %v", elapsed.Round(time.Millisecond), err)), 0o644))
		return
	}
	require.NoError(t, err)
	require.NoError(t, tr.GatherParams(ctx, m.params))
	b, err := json.Marshal(m.data)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank%d.json", env.Rank)), b, 0o644))
}

// A peer that hangs (joined, never calls): rank 0's collective returns
// ErrTimeout at its deadline, and its peer's next call ErrAborted.
func TestTCPPeerHangs(t *testing.T) {
	const timeout = 300 * time.Millisecond
	comms := tcpWorld(t, 2, timeout)
	start := time.Now()
	err := comms[0].AllReduceSum(context.Background(), make([]float32, 4))
	require.ErrorIs(t, err, dist.ErrTimeout)
	require.Less(t, time.Since(start), timeout+time.Second)
	require.ErrorIs(t, comms[1].AllReduceSum(context.Background(), make([]float32, 4)), dist.ErrAborted)
}
