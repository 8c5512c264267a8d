package cuda_test

import (
	"errors"
	"os"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
)

// TestOpenWithoutGPU runs where there is no GPU (CI): Open must return an
// error wrapping ErrNoGPU, not panic, and say why.
func TestOpenWithoutGPU(t *testing.T) {
	d, err := cuda.Open(cuda.Options{})
	if err == nil {
		require.NoError(t, d.Close())
		t.Skip("a GPU is present")
	}
	if os.Getenv(testutil.RequireGPUEnv) != "" {
		t.Fatalf("%s is set: %v", testutil.RequireGPUEnv, err)
	}
	assert.Nil(t, d)
	require.ErrorIs(t, err, cuda.ErrNoGPU)
	assert.NotEqual(t, cuda.ErrNoGPU.Error(), err.Error(), "the error should carry the reason")
	t.Log(err)
}

func TestOpenDescribe(t *testing.T) {
	d := device(t)
	major, minor := d.ComputeCapability()
	assert.GreaterOrEqual(t, major, 3)
	assert.GreaterOrEqual(t, minor, 0)
	assert.Regexp(t, regexp.MustCompile(`^sm_\d+$`), d.Arch())
	assert.NotEmpty(t, d.Name())
	assert.Positive(t, d.TotalMem())
	assert.GreaterOrEqual(t, d.DriverVersion(), 11000)
	assert.Equal(t, 0, d.Ordinal())
	assert.Regexp(t, regexp.MustCompile(`^cuda: .+ \(sm_\d+, \d+\.\d GiB, driver \d+\.\d+\)$`), d.Describe())
	t.Log(d.Describe())
}

func TestOpenBadOrdinal(t *testing.T) {
	device(t)
	for _, o := range []int{-1, 1 << 20} {
		d, err := cuda.Open(cuda.Options{Ordinal: o})
		assert.Nil(t, d)
		assert.ErrorIs(t, err, graph.ErrAttr, "ordinal %d", o)
	}
}

// TestClosedDevice: calls after Close fail with ErrClosed; Close twice is
// harmless. A second device shares the primary context with the first.
func TestClosedDevice(t *testing.T) {
	device(t)
	d, err := cuda.Open(cuda.Options{})
	require.NoError(t, err)
	require.NoError(t, d.Close())
	require.NoError(t, d.Close())
	assert.ErrorIs(t, d.Synchronize(), cuda.ErrClosed)
	_, err = d.Backend().Malloc(1024)
	assert.ErrorIs(t, err, cuda.ErrClosed)
	// The shared device still works.
	require.NoError(t, device(t).Synchronize())
}

// TestCUDAErrorTyped: a driver failure is a *CUDAError naming the call and
// the CUresult.
func TestCUDAErrorTyped(t *testing.T) {
	d := device(t)
	err := d.Backend().Free(alloc.Ptr(0xdead0000))
	var ce *cuda.CUDAError
	require.True(t, errors.As(err, &ce), "got %v", err)
	assert.Equal(t, "cuMemFree_v2", ce.Func)
	assert.Equal(t, 1, ce.Code)
	assert.Equal(t, "CUDA_ERROR_INVALID_VALUE", ce.Name)
	assert.NotErrorIs(t, err, alloc.ErrDeviceOOM)
	assert.NotErrorIs(t, err, cuda.ErrNoGPU)
	// The error is not sticky: the device goes on working.
	require.NoError(t, d.Synchronize())
}

// TestDoReentrant: a closure on the device goroutine may call anything
// that hops there itself — a nested do, the allocator's backend, copies —
// and it runs at once instead of deadlocking.
func TestDoReentrant(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	var got []float32
	err := d.Do(func() error {
		if err := d.Do(func() error { return nil }); err != nil {
			return err
		}
		b, err := a.Malloc(3<<20, alloc.Tag{Node: -1, Op: "test"}) // a new segment: Backend.Malloc
		if err != nil {
			return err
		}
		if err := cuda.CopyHtoD(d, b.Ptr(), []float32{1, 2, 3}); err != nil {
			return err
		}
		got = make([]float32, 3)
		if err := cuda.CopyDtoH(d, got, b.Ptr()); err != nil {
			return err
		}
		if err := a.Free(b); err != nil {
			return err
		}
		return a.EmptyCache() // Backend.Free
	})
	require.NoError(t, err)
	assert.Equal(t, []float32{1, 2, 3}, got)
	assert.Zero(t, a.Stats().ReservedBytes[alloc.All].Current)
}
