package cuda_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
)

const mib = 1 << 20

func TestBackendMallocFreeMemInfo(t *testing.T) {
	d := device(t)
	be := d.Backend()
	free0, total, err := be.MemInfo()
	require.NoError(t, err)
	assert.Equal(t, d.TotalMem(), total)
	assert.Positive(t, free0)
	assert.LessOrEqual(t, free0, total)

	const size = 64 * mib
	p, err := be.Malloc(size)
	require.NoError(t, err)
	assert.NotZero(t, p)
	free1, _, err := be.MemInfo()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, free0-free1, int64(size), "free memory drops by at least the allocation")
	require.NoError(t, be.Free(p))
	free2, _, err := be.MemInfo()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, free2-free1, int64(size), "freeing gives it back")

	_, err = be.Malloc(0)
	assert.ErrorIs(t, err, alloc.ErrInvalid)
}

// TestBackendOOM: more than the device holds is an out-of-memory CUresult
// that matches alloc.ErrDeviceOOM, and the caching allocator turns it into
// an *alloc.OOMError after its release-and-retry.
func TestBackendOOM(t *testing.T) {
	d := device(t)
	be := d.Backend()
	_, err := be.Malloc(d.TotalMem() + 1<<30)
	require.ErrorIs(t, err, alloc.ErrDeviceOOM)
	var ce *cuda.CUDAError
	require.True(t, errors.As(err, &ce))
	assert.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", ce.Name)
	assert.Equal(t, 2, ce.Code)

	a := newAllocator(t, d)
	_, err = a.Malloc(d.TotalMem()+1<<30, alloc.Tag{Node: -1, Op: "too_big"})
	var oom *alloc.OOMError
	require.True(t, errors.As(err, &oom), "got %v", err)
	assert.ErrorIs(t, err, alloc.ErrOutOfMemory)
	st := a.Stats()
	assert.Equal(t, int64(1), st.NumAllocRetries)
	assert.Equal(t, int64(1), st.NumOOMs)
	assert.Equal(t, d.TotalMem(), oom.DeviceTotal)
}

// TestCachingAllocatorOverCUDA: the allocator's segments are real device
// memory, freed blocks are reused without device calls, and EmptyCache
// gives the memory back to the device.
func TestCachingAllocatorOverCUDA(t *testing.T) {
	d := device(t)
	be := d.Backend()
	// Let the driver set up whatever it sets up on the first allocation.
	p, err := be.Malloc(2 * mib)
	require.NoError(t, err)
	require.NoError(t, be.Free(p))
	free0, _, err := be.MemInfo()
	require.NoError(t, err)

	a := alloc.New(be, alloc.Options{})
	tag := alloc.Tag{Node: -1, Op: "test"}
	sizes := []int64{4 << 10, 100 << 10, 3 * mib, 50 * mib}
	var blocks []*alloc.Block
	for _, s := range sizes {
		b, err := a.Malloc(s, tag)
		require.NoError(t, err)
		blocks = append(blocks, b)
	}
	st := a.Stats()
	// 4 KiB and 100 KiB share one 2 MiB small segment; 3 MiB takes a
	// 20 MiB segment; 50 MiB its own.
	assert.Equal(t, int64(3), st.NumDeviceAlloc)
	assert.Equal(t, int64(2+20+50)*mib, st.ReservedBytes[alloc.All].Current)
	assert.Equal(t, int64(4<<10+100<<10+3*mib+50*mib), st.AllocatedBytes[alloc.All].Current)
	free1, _, err := be.MemInfo()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, free0-free1, st.ReservedBytes[alloc.All].Current)

	// Free everything and allocate the same sizes in the same order: all
	// come from the cache, at the same addresses. The addresses are kept as
	// values: Malloc may hand out a freed *Block object again, so an old
	// handle can point elsewhere by now.
	addrs := make([]alloc.Ptr, len(blocks))
	for i, b := range blocks {
		addrs[i] = b.Ptr()
	}
	for _, b := range blocks {
		require.NoError(t, a.Free(b))
	}
	for i, s := range sizes {
		b, err := a.Malloc(s, tag)
		require.NoError(t, err)
		assert.Equal(t, addrs[i], b.Ptr(), "size %d reuses its block", s)
		blocks[i] = b
	}
	for _, b := range blocks {
		require.NoError(t, a.Free(b))
	}
	st = a.Stats()
	assert.Equal(t, int64(3), st.NumDeviceAlloc)
	assert.Zero(t, st.AllocatedBytes[alloc.All].Current)
	assert.Equal(t, int64(72*mib), st.ReservedBytes[alloc.All].Current)
	assert.Equal(t, int64(2*len(sizes)), st.Allocation[alloc.All].Allocated)

	require.NoError(t, a.EmptyCache())
	st = a.Stats()
	assert.Zero(t, st.ReservedBytes[alloc.All].Current)
	assert.Equal(t, int64(3), st.NumDeviceFree)
	free2, _, err := be.MemInfo()
	require.NoError(t, err)
	// A little slack for the driver's own bookkeeping pages.
	assert.GreaterOrEqual(t, free2, free0-4*mib, "EmptyCache returns the memory to the device")
}

func TestCopyRoundTrip(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	r := newRand(1)
	for _, n := range []int{1, 7, 1000, 1<<20 + 3} {
		x := testutil.RandFloats(r, n)
		b := upload(t, d, a, x)
		got := download(t, d, b, n)
		assert.Equal(t, x, got, "float32 × %d", n)
		require.NoError(t, a.Free(b))

		idx := make([]int64, n)
		for i := range idx {
			idx[i] = r.Int64() - r.Int64()
		}
		bi := upload(t, d, a, idx)
		goti := make([]int64, n)
		require.NoError(t, cuda.CopyDtoH(d, goti, bi.Ptr()))
		assert.Equal(t, idx, goti, "int64 × %d", n)
		require.NoError(t, a.Free(bi))
	}
	// Empty slices copy nothing, whatever the address.
	require.NoError(t, cuda.CopyHtoD(d, 0, []float32{}))
	require.NoError(t, cuda.CopyDtoH(d, []int64(nil), 0))
}

func TestMemzero(t *testing.T) {
	d := device(t)
	a := newAllocator(t, d)
	x := testutil.RandFloats(newRand(2), 1000)
	b := upload(t, d, a, x)
	// Zero elements [100, 300).
	require.NoError(t, d.Memzero(b.Ptr()+100*4, 200*4))
	got := download(t, d, b, len(x))
	for i := range x {
		want := x[i]
		if i >= 100 && i < 300 {
			want = 0
		}
		require.Equal(t, want, got[i], "element %d", i)
	}
	require.NoError(t, d.Memzero(b.Ptr(), 0))
	assert.ErrorIs(t, d.Memzero(b.Ptr(), -1), alloc.ErrInvalid)
	require.NoError(t, a.Free(b))
}

// Uploads at and above the staging threshold go through the pinned
// buffers in pieces; below it straight through. Each size (below the
// threshold, at it, several pieces with an odd tail) comes back bit for
// bit, also when several staged uploads follow one another before any
// download (each pinned buffer reused only after its DMA), and the
// executor's no-wait uploads (exported for tests as CopyHtoDNoWait) are
// ordered before later stream-0 work.
func TestStagedUploads(t *testing.T) {
	d := device(t)
	be := d.Backend()
	rng := rand.New(rand.NewPCG(9, 10))
	sizes := []int{cuda.StageMin/4 - 3, cuda.StageMin / 4, 3*cuda.StagePiece/4 + 5, 5 * cuda.StagePiece / 4}
	var ptrs []alloc.Ptr
	var want [][]float32
	for k, n := range sizes {
		src := make([]float32, n)
		for i := range src {
			src[i] = rng.Float32()*2 - 1
		}
		p, err := be.Malloc(int64(4 * n))
		require.NoError(t, err)
		defer be.Free(p)
		if k%2 == 0 {
			require.NoError(t, cuda.CopyHtoD(d, p, src))
		} else {
			require.NoError(t, cuda.CopyHtoDNoWait(d, p, src))
		}
		ptrs, want = append(ptrs, p), append(want, src)
	}
	for k, p := range ptrs {
		got := make([]float32, len(want[k]))
		require.NoError(t, cuda.CopyDtoH(d, got, p))
		require.Equal(t, want[k], got, "upload of %d floats", len(want[k]))
	}
}

// TestMemInfoSampledAfterExecute: right after an Execute the backend
// answers MemInfo from the sample the step took at its end, without a
// request to the device goroutine (a steady training loop plans each step
// without that hop); any later request, here an allocation, retires the
// sample, so the next MemInfo asks the driver and sees the memory taken.
func TestMemInfoSampledAfterExecute(t *testing.T) {
	e := freshExecutor(t, cuda.ExecutorOptions{})
	rng := rand.New(rand.NewPCG(3, 9))
	h := &halfGraph{t: t, g: graph.New(), dt: graph.Float32}
	x := h.input(64, 32)
	y := h.op(graph.OpTanh, graph.Attrs{}, x)
	_, err := runOn(e)(h.g, feedsFor(h, rng, x), y)
	require.NoError(t, err)
	be := e.Device().Backend()
	jobs := cuda.DeviceJobs()
	free1, total, err := be.MemInfo()
	require.NoError(t, err)
	require.Equal(t, jobs, cuda.DeviceJobs(), "MemInfo right after a step needs no device request")
	assert.Equal(t, e.Device().TotalMem(), total)

	const size = 64 * mib
	p, err := be.Malloc(size)
	require.NoError(t, err)
	free2, _, err := be.MemInfo()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, free1-free2, int64(size), "the allocation retired the sample")
	require.NoError(t, be.Free(p))
}
