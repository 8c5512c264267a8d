package cuda_test

import (
	"context"
	"math"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/lazy"
)

// An input held in AllocHost's page-locked memory is uploaded by one DMA
// straight from it (PinnedUploads counts it; the staged path would not),
// and the step computes what it computes from Go memory: a row sum of
// x·2 + i, against float64 on the host (float32 sums of 256 terms of
// size ≤ 600: rtol 1e-5). FreeHost takes back only what AllocHost gave.
func TestAllocHostUploadsDirectly(t *testing.T) {
	d := device(t)
	e := freshExecutor(t, cuda.ExecutorOptions{})
	const rows, cols = 512, 256
	buf, err := d.AllocHost(4 * rows * cols)
	require.NoError(t, err)
	// cuMemHostAlloc promised no page alignment: the H200 host gave an
	// address 1024 bytes into a page. DMA needs none; 256 bytes is what
	// the driver's allocations hold to.
	assert.Zero(t, uintptr(unsafe.Pointer(unsafe.SliceData(buf)))%256, "256-byte aligned")
	pinned := unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(buf))), rows*cols)
	plain := make([]float32, rows*cols)
	rng := newRand(7)
	for i := range pinned {
		pinned[i] = float32(rng.Float64())
		plain[i] = pinned[i]
	}
	run := func(x []float32) []float32 {
		in := lazy.Wrap(tensor.New(tensor.WithShape(rows, cols), tensor.WithBacking(x)), 0)
		out := in.MulScalar(2).AddScalar(1).Sum(1)
		vals, err := e.Run(context.Background(), in.Graph().IR(), out.ID())
		require.NoError(t, err)
		return append([]float32(nil), vals[0].Data().([]float32)...)
	}
	before := d.PinnedUploads()
	got := run(pinned)
	assert.Equal(t, before+1, d.PinnedUploads(), "one upload straight from pinned memory")
	assert.Equal(t, run(plain), got, "the same values as from Go memory")
	assert.Equal(t, before+1, d.PinnedUploads(), "Go memory is staged")
	for r := range rows {
		var want float64
		for c := range cols {
			want += 2*float64(pinned[r*cols+c]) + 1
		}
		require.InEpsilon(t, want, float64(got[r]), 1e-5, "row %d", r)
	}

	require.NoError(t, d.FreeHost(buf))
	require.ErrorIs(t, d.FreeHost(buf), cuda.ErrNotPinned, "freed twice")
	require.ErrorIs(t, d.FreeHost(make([]byte, 8)), cuda.ErrNotPinned)
	_, err = d.AllocHost(0)
	require.Error(t, err)
	require.False(t, math.IsNaN(float64(got[0])))
}
