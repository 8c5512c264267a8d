package data_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/graph"
)

// numbered is n samples whose int64 field "id" holds the sample's index
// and whose float32 field "x" [2, 3] holds index·10 + j, so a batch says
// which samples it holds. With jitter, one Fill in eight sleeps a random
// few microseconds, to shake the loader's goroutines' timing.
type numbered struct {
	n      int
	jitter bool
	fail   int // Fill of this sample fails (−1: none)
}

var errBadSample = errors.New("bad sample")

func (d *numbered) Len() int { return d.n }
func (d *numbered) Fields() []data.Field {
	return []data.Field{{Name: "id", Shape: []int{}, DType: graph.Int64}, {Name: "x", Shape: []int{2, 3}, DType: graph.Float32}}
}
func (d *numbered) Fill(i int, dst []data.Slot) error {
	if i == d.fail {
		return errBadSample
	}
	if d.jitter && rand.IntN(8) == 0 {
		time.Sleep(time.Duration(rand.IntN(50)) * time.Microsecond)
	}
	dst[0].I[0] = int64(i)
	for j := range dst[1].F {
		dst[1].F[j] = float32(i*10 + j)
	}
	return nil
}

// ids reads a batch's samples from its "id" field, checking "x" agrees.
func ids(t *testing.T, b *data.Batch) []int {
	t.Helper()
	id := b.Tensor("id").Data().([]int64)
	x := b.Tensor("x").Data().([]float32)
	require.Equal(t, []int{b.Size}, []int(b.Tensor("id").Shape()))
	require.Equal(t, []int{b.Size, 2, 3}, []int(b.Tensor("x").Shape()))
	out := make([]int, b.Size)
	for r := range b.Size {
		out[r] = int(id[r])
		for j := range 6 {
			require.Equal(t, float32(out[r]*10+j), x[r*6+j])
		}
	}
	return out
}

// drain reads up to max batches (0: to the end), returning each batch's
// samples and the positions after them.
func drain(t *testing.T, l *data.Loader, max int) ([][]int, []data.Position) {
	t.Helper()
	var got [][]int
	var pos []data.Position
	for max == 0 || len(got) < max {
		b, err := l.Next(context.Background())
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		got = append(got, ids(t, b))
		pos = append(pos, b.Next)
		require.Equal(t, b.Next, l.Position())
	}
	return got, pos
}

func newLoader(t *testing.T, ds data.Dataset, o data.Options) *data.Loader {
	t.Helper()
	l, err := data.NewLoader(ds, o)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, l.Close()) })
	return l
}

// Batching: in order, a short last batch or none with DropLast, every
// epoch the same; io.EOF after Epochs, and again after.
func TestLoaderBatches(t *testing.T) {
	ds := &numbered{n: 10, fail: -1}
	got, _ := drain(t, newLoader(t, ds, data.Options{Batch: 4, Epochs: 2}), 0)
	assert.Equal(t, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}, {0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}, got)

	l := newLoader(t, ds, data.Options{Batch: 4, Epochs: 2, DropLast: true})
	got, pos := drain(t, l, 0)
	assert.Equal(t, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {0, 1, 2, 3}, {4, 5, 6, 7}}, got)
	assert.Equal(t, data.Position{Epoch: 1, Index: 0, Len: 10}, pos[1], "the dropped batch's samples end the epoch")
	assert.Equal(t, 2, l.BatchesPerEpoch())
	_, err := l.Next(context.Background())
	require.ErrorIs(t, err, io.EOF)

	_, err = data.NewLoader(ds, data.Options{Batch: 11, DropLast: true})
	require.ErrorIs(t, err, data.ErrOptions, "no batch in an epoch")
	for _, o := range []data.Options{{}, {Batch: 2, Epochs: -1}, {Batch: 2, Prefetch: -1}, {Batch: 2, Workers: -1}} {
		_, err = data.NewLoader(ds, o)
		require.ErrorIs(t, err, data.ErrOptions)
	}
	_, err = data.NewLoader(nil, data.Options{Batch: 1})
	require.ErrorIs(t, err, data.ErrOptions)
}

// Shuffling: every epoch holds every sample once, in an order that is
// not the identity, differs between epochs and seeds, and is the same for
// the same seed, whatever the prefetch depth, the workers and their
// timing.
func TestLoaderShuffle(t *testing.T) {
	const n, batch, epochs = 1000, 64, 3
	run := func(seed uint64, prefetch, workers int, jitter bool) [][]int {
		l := newLoader(t, &numbered{n: n, jitter: jitter, fail: -1},
			data.Options{Batch: batch, Shuffle: true, Seed: seed, Epochs: epochs, Prefetch: prefetch, Workers: workers})
		got, _ := drain(t, l, 0)
		var perEpoch [][]int
		for e := range epochs {
			var all []int
			for _, b := range got[e*16 : (e+1)*16] {
				all = append(all, b...)
			}
			perEpoch = append(perEpoch, all)
		}
		return perEpoch
	}
	a := run(7, 1, 1, false)
	for e, order := range a {
		sorted := slices.Sorted(slices.Values(order))
		for i, v := range sorted {
			require.Equal(t, i, v, "epoch %d holds every sample once", e)
		}
		fixed := 0
		for i, v := range order {
			if i == v {
				fixed++
			}
		}
		assert.Less(t, fixed, 20, "epoch %d is shuffled (a random permutation fixes about one)", e)
	}
	assert.NotEqual(t, a[0], a[1])
	assert.NotEqual(t, a[1], a[2])
	assert.NotEqual(t, a[0], run(8, 1, 1, false)[0])
	assert.Equal(t, a, run(7, 8, 4, true), "prefetch, workers and timing change nothing")
}

// The permutation is a bijection of [0, n) for every n, shuffled for
// n > 1: small n exhaustively, and sizes around powers of two and four.
func TestShuffleIsPermutation(t *testing.T) {
	sizes := []int{}
	for n := 1; n <= 300; n++ {
		sizes = append(sizes, n)
	}
	for k := 9; k <= 17; k++ {
		sizes = append(sizes, 1<<k-1, 1<<k, 1<<k+1)
	}
	for _, n := range sizes {
		l, err := data.NewLoader(&numbered{n: n, fail: -1}, data.Options{Batch: n, Shuffle: true, Seed: uint64(n), Workers: 1})
		require.NoError(t, err)
		b, err := l.Next(context.Background())
		require.NoError(t, err)
		got := slices.Clone(b.Tensor("id").Data().([]int64))
		require.NoError(t, l.Close())
		seen := make([]bool, n)
		for _, v := range got {
			require.False(t, seen[v], "n %d: %d twice", n, v)
			seen[v] = true
		}
		if n > 8 {
			require.False(t, slices.IsSorted(got), "n %d: shuffled", n)
		}
	}
}

// Resuming from any batch's position gives the batches that followed it,
// across epoch ends, with or without shuffling, a short last batch or
// none, and another batch size after the resume (positions count
// samples); and a position survives JSON.
func TestLoaderResume(t *testing.T) {
	for _, o := range []data.Options{
		{Batch: 7, Shuffle: true, Seed: 3, Epochs: 3},
		{Batch: 7, Shuffle: true, Seed: 3, Epochs: 3, DropLast: true},
		{Batch: 5, Epochs: 2},
	} {
		ds := &numbered{n: 40, fail: -1}
		want, pos := drain(t, newLoader(t, ds, o), 0)
		for k := range len(pos) - 1 {
			b, err := json.Marshal(pos[k])
			require.NoError(t, err)
			var p data.Position
			require.NoError(t, json.Unmarshal(b, &p))
			ro := o
			ro.Start = p
			got, _ := drain(t, newLoader(t, ds, ro), 0)
			require.Equal(t, want[k+1:], got, "resumed after batch %d of %+v", k, o)
		}
		ro := o
		ro.Start, ro.Batch = pos[2], 3
		got, _ := drain(t, newLoader(t, ds, ro), 0)
		var flat, wantFlat []int
		for _, b := range got {
			flat = append(flat, b...)
		}
		for _, b := range want[3:] {
			wantFlat = append(wantFlat, b...)
		}
		if !o.DropLast {
			assert.Equal(t, wantFlat, flat, "the same samples in batches of 3")
		}
	}

	ds := &numbered{n: 40, fail: -1}
	good := data.Position{Epoch: 1, Index: 14, Seed: 3, Shuffle: true, Len: 40}
	for _, c := range []struct {
		name string
		p    data.Position
	}{
		{"another seed", data.Position{Epoch: 1, Index: 14, Seed: 4, Shuffle: true, Len: 40}},
		{"another order", data.Position{Epoch: 1, Index: 14, Seed: 3, Len: 40}},
		{"another dataset", data.Position{Epoch: 1, Index: 14, Seed: 3, Shuffle: true, Len: 41}},
		{"a negative epoch", data.Position{Epoch: -1, Index: 14, Seed: 3, Shuffle: true, Len: 40}},
		{"past the epoch", data.Position{Epoch: 1, Index: 41, Seed: 3, Shuffle: true, Len: 40}},
	} {
		_, err := data.NewLoader(ds, data.Options{Batch: 7, Shuffle: true, Seed: 3, Start: c.p})
		require.ErrorIs(t, err, data.ErrPosition, c.name)
	}
	l := newLoader(t, ds, data.Options{Batch: 7, Shuffle: true, Seed: 3, Start: good})
	assert.Equal(t, good, l.Position(), "before the first batch, the start")
	end := good
	end.Index = 40
	l = newLoader(t, ds, data.Options{Batch: 7, Shuffle: true, Seed: 3, Start: end})
	assert.Equal(t, data.Position{Epoch: 2, Seed: 3, Shuffle: true, Len: 40}, l.Position(), "an epoch's end is the next one's start")
}

// A sample that cannot be read ends the loader with its error, every
// batch before it delivered; Next keeps returning it.
func TestLoaderFillError(t *testing.T) {
	l := newLoader(t, &numbered{n: 20, fail: 13}, data.Options{Batch: 4, Workers: 2})
	got, _ := drain(t, l, 3)
	assert.Equal(t, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}}, got)
	_, err := l.Next(context.Background())
	require.ErrorIs(t, err, errBadSample)
	_, err = l.Next(context.Background())
	require.ErrorIs(t, err, errBadSample)
}

// Close stops a producer blocked on a full ring; Next after Close is
// ErrClosed; a cancelled context ends a Next waiting for a batch.
func TestLoaderClose(t *testing.T) {
	l, err := data.NewLoader(&numbered{n: 1000, fail: -1}, data.Options{Batch: 10, Prefetch: 2})
	require.NoError(t, err)
	_, err = l.Next(context.Background())
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond) // the producer fills the ring and waits
	require.NoError(t, l.Close())
	require.NoError(t, l.Close())
	_, err = l.Next(context.Background())
	require.ErrorIs(t, err, data.ErrClosed)

	slow := &slowSet{numbered: numbered{n: 10, fail: -1}, gate: make(chan struct{})}
	l = newLoader(t, slow, data.Options{Batch: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = l.Next(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	close(slow.gate)
	b, err := l.Next(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []int{0, 1}, ids(t, b))
}

// slowSet's Fill waits for gate.
type slowSet struct {
	numbered
	gate chan struct{}
}

func (s *slowSet) Fill(i int, dst []data.Slot) error {
	<-s.gate
	return s.numbered.Fill(i, dst)
}

// countingHost is a HostMemory that records what it gave and took back.
type countingHost struct {
	mu    sync.Mutex
	live  map[*byte]int
	total int
}

func (h *countingHost) AllocHost(n int) ([]byte, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	b := make([]byte, n)
	if h.live == nil {
		h.live = map[*byte]int{}
	}
	h.live[unsafe.SliceData(b)] = n
	h.total += n
	return b, nil
}

func (h *countingHost) FreeHost(b []byte) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.live[unsafe.SliceData(b)]; !ok {
		return errors.New("freed what was not allocated")
	}
	delete(h.live, unsafe.SliceData(b))
	return nil
}

// inside reports whether address p lies in one of h's live allocations.
func (h *countingHost) inside(p uintptr) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for base, n := range h.live {
		if p >= uintptr(unsafe.Pointer(base)) && p < uintptr(unsafe.Pointer(base))+uintptr(n) {
			return true
		}
	}
	return false
}

// With Options.Host every batch lives in the host memory it gives, the
// ring's worth is allocated once (Prefetch + 2 batches) and all of it is
// freed by Close; the batches are the ones Go memory gives.
func TestLoaderHostMemory(t *testing.T) {
	h := &countingHost{}
	ds := &numbered{n: 50, fail: -1}
	l, err := data.NewLoader(ds, data.Options{Batch: 8, Prefetch: 3, Host: h, Shuffle: true, Seed: 1, Epochs: 2})
	require.NoError(t, err)
	perBatch := 8 * (8 + 6*4)
	assert.Equal(t, 5*perBatch, h.total)
	assert.Equal(t, int64(5*perBatch), l.HostBytes())
	var got [][]int
	for {
		b, err := l.Next(context.Background())
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		for _, x := range b.Tensors {
			require.True(t, h.inside(x.Uintptr()), "batch storage from HostMemory")
		}
		got = append(got, ids(t, b))
	}
	assert.Equal(t, 5*perBatch, h.total, "nothing allocated per batch")
	require.NoError(t, l.Close())
	assert.Empty(t, h.live, "Close freed everything")
	want, _ := drain(t, newLoader(t, ds, data.Options{Batch: 8, Shuffle: true, Seed: 1, Epochs: 2}), 0)
	assert.Equal(t, want, got)
}

// Arrays batches tensors' rows, the shuffled order the numbered dataset's.
func TestArrays(t *testing.T) {
	const n = 30
	rng := rand.New(rand.NewPCG(1, 2))
	img := make([]float32, n*3*4*4)
	for i := range img {
		img[i] = rng.Float32()
	}
	lab := make([]int64, n)
	for i := range lab {
		lab[i] = int64(rng.IntN(10))
	}
	a, err := data.NewArrays([]string{"images", "labels"}, tensor.New(tensor.WithShape(n, 3, 4, 4), tensor.WithBacking(img)),
		tensor.New(tensor.WithShape(n), tensor.WithBacking(lab)))
	require.NoError(t, err)
	assert.Equal(t, []data.Field{{Name: "images", Shape: []int{3, 4, 4}, DType: graph.Float32}, {Name: "labels", Shape: []int{}, DType: graph.Int64}}, a.Fields())
	o := data.Options{Batch: 8, Shuffle: true, Seed: 5}
	order, _ := drain(t, newLoader(t, &numbered{n: n, fail: -1}, o), 4)
	l := newLoader(t, a, o)
	for k := range 4 {
		b, err := l.Next(context.Background())
		require.NoError(t, err)
		im, lb := b.Tensor("images").Data().([]float32), b.Tensor("labels").Data().([]int64)
		for r, i := range order[k] {
			require.Equal(t, img[i*48:(i+1)*48], im[r*48:(r+1)*48])
			require.Equal(t, lab[i], lb[r])
		}
	}
	for _, bad := range [][]*tensor.Dense{
		{tensor.New(tensor.WithShape(n, 2), tensor.WithBacking(make([]float32, 2*n))), tensor.New(tensor.WithShape(n+1), tensor.WithBacking(make([]int64, n+1)))},
		{tensor.New(tensor.WithShape(n), tensor.WithBacking(make([]float64, n))), tensor.New(tensor.WithShape(n), tensor.WithBacking(make([]int64, n)))},
	} {
		_, err := data.NewArrays([]string{"a", "b"}, bad...)
		require.ErrorIs(t, err, data.ErrOptions)
	}
	_, err = data.NewArrays([]string{"a"})
	require.ErrorIs(t, err, data.ErrOptions)
}

// A token file truncated while mapped: reading past the new end faults,
// and the loader returns ErrChanged instead of dying of SIGBUS.
func TestTruncatedWhileMapped(t *testing.T) {
	toks := narrow(randomTokens(5, 1<<20, 50257))
	path := writeFile(t, "train.bin", llmcFile(20240520, 1, int32(len(toks)), toks))
	f, err := data.OpenTokens(path, data.FormatAuto)
	require.NoError(t, err)
	defer f.Close()
	w, err := data.NewWindows(f.Tokens, 1024, data.WindowOptions{Vocab: 50257})
	require.NoError(t, err)
	require.NoError(t, os.Truncate(path, 4096))
	l := newLoader(t, w, data.Options{Batch: 4, Shuffle: true, Seed: 1})
	var last error
	for range w.Len() {
		if _, last = l.Next(context.Background()); last != nil {
			break
		}
	}
	require.ErrorIs(t, last, data.ErrChanged)
}
