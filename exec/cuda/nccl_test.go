package cuda_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
)

// Without a GPU or without libnccl.so.2, NCCLUniqueID fails with a typed
// error, never a panic.
func TestNCCLWithoutLibrary(t *testing.T) {
	_, err := cuda.NCCLUniqueID()
	if err == nil {
		t.Skip("NCCL is present")
	}
	require.True(t, errors.Is(err, cuda.ErrNoGPU) || errors.Is(err, cuda.ErrNoLibrary), "%v", err)
	t.Log(err)
}

// ncclDevice is the shared device and a unique id, or skips: without a
// GPU, or without libnccl.so.2 (unless a GPU is required).
func ncclDevice(t *testing.T) (*cuda.Device, []byte) {
	d := device(t)
	id, err := cuda.NCCLUniqueID()
	if err != nil {
		if os.Getenv(testutil.RequireGPUEnv) != "" {
			t.Fatalf("%s is set and NCCL is unusable: %v", testutil.RequireGPUEnv, err)
		}
		t.Skipf("no NCCL: %v", err)
	}
	return d, id
}

// World size 1 on one GPU through real NCCL: all-reduce, broadcast,
// reduce-scatter and all-gather are identities, buffers larger than the staging buffer go in pieces, the
// overhead is measured, and an aborted communicator fails with
// ErrNCCLAborted. Runs on a single GPU (the H100).
func TestNCCLSingleRank(t *testing.T) {
	d, id := ncclDevice(t)
	v, err := cuda.NCCLVersion()
	require.NoError(t, err)
	t.Logf("NCCL %d, NCCL_NVLS_ENABLE=%q", v, os.Getenv("NCCL_NVLS_ENABLE"))
	require.Equal(t, "0", os.Getenv("NCCL_NVLS_ENABLE"))
	c, err := d.NewNCCL(id, 0, 1, cuda.NCCLOptions{Timeout: 30 * time.Second, StagingBytes: 1 << 10})
	require.NoError(t, err)
	t.Logf("NCCL overhead: %d B", c.Overhead())
	require.GreaterOrEqual(t, c.Overhead(), int64(1<<10), "the staging buffer at least")
	ctx := context.Background()
	buf := make([]float32, 1000) // 4000 B: four pieces of 1 KiB
	for i := range buf {
		buf[i] = float32(i) * 0.5
	}
	want := append([]float32(nil), buf...)
	require.NoError(t, c.AllReduceSum(ctx, buf))
	require.Equal(t, want, buf)
	require.NoError(t, c.Broadcast(ctx, buf, 0))
	require.Equal(t, want, buf)
	// Over one rank reduce-scatter and all-gather copy, in pieces of the
	// staging buffer; a send of another length is refused before NCCL.
	rs := make([]float32, len(buf))
	require.NoError(t, c.ReduceScatterSum(ctx, buf, rs))
	require.Equal(t, want, rs)
	ag := make([]float32, len(buf))
	require.NoError(t, c.AllGather(ctx, buf, ag))
	require.Equal(t, want, ag)
	require.Error(t, c.AllGather(ctx, buf, ag[:10]))
	require.NoError(t, c.Abort())
	require.ErrorIs(t, c.AllReduceSum(ctx, buf), cuda.ErrNCCLAborted)
	require.NoError(t, c.Close())
	require.ErrorIs(t, c.AllReduceSum(ctx, buf), cuda.ErrClosed)
}

// A world of 2 with only one rank: ncclCommInitRank waits for a peer that
// never comes, and NewNCCL returns ErrNCCLTimeout at the deadline. The
// device thread stays blocked in NCCL, so the test runs in a child process
// (this binary again), which exits when it has seen the error.
func TestNCCLInitTimeout(t *testing.T) {
	if os.Getenv(initTimeoutChild) != "" {
		d, err := cuda.Open(cuda.Options{})
		require.NoError(t, err)
		id, err := cuda.NCCLUniqueID()
		require.NoError(t, err)
		start := time.Now()
		_, err = d.NewNCCL(id, 0, 2, cuda.NCCLOptions{Timeout: 2 * time.Second})
		fmt.Printf("after %v: %v\n", time.Since(start).Round(time.Millisecond), err)
		if !errors.Is(err, cuda.ErrNCCLTimeout) || time.Since(start) > 10*time.Second {
			os.Exit(1)
		}
		os.Exit(0) // the blocked thread goes with the process
	}
	ncclDevice(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestNCCLInitTimeout$", "-test.count=1")
	cmd.Env = append(os.Environ(), initTimeoutChild+"=1")
	out, err := cmd.CombinedOutput()
	t.Logf("child: %s", out)
	require.NoError(t, err, "the child should see ErrNCCLTimeout within 10 s")
}

const initTimeoutChild = "BATCHFIT_NCCL_INIT_TIMEOUT_CHILD"

// The device collectives over one rank on one GPU: ReduceScatterDevice
// and AllGatherDevice copy send into recv on the communicator's stream,
// after the copy queued on stream 0 before them, bit for bit.
func TestNCCLDeviceCollectivesSingleRank(t *testing.T) {
	d, id := ncclDevice(t)
	c, err := d.NewNCCL(id, 0, 1, cuda.NCCLOptions{Timeout: 30 * time.Second, StagingBytes: 1 << 10})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	be := d.Backend()
	const n = 3000
	send, err := be.Malloc(4 * n)
	require.NoError(t, err)
	defer be.Free(send)
	recv, err := be.Malloc(4 * n)
	require.NoError(t, err)
	defer be.Free(recv)
	want := make([]float32, n)
	for i := range want {
		want[i] = float32(i)*0.25 - 100
	}
	ctx := context.Background()
	require.NoError(t, cuda.CopyHtoD(d, send, want))
	require.NoError(t, c.ReduceScatterDevice(ctx, send, recv, n))
	got := make([]float32, n)
	require.NoError(t, cuda.CopyDtoH(d, got, recv))
	require.Equal(t, want, got)
	require.NoError(t, cuda.CopyHtoD(d, recv, make([]float32, n)))
	require.NoError(t, c.AllGatherDevice(ctx, send, recv, n))
	require.NoError(t, cuda.CopyDtoH(d, got, recv))
	require.Equal(t, want, got)
}
