package data

import (
	"context"
	"errors"
	"io"
	"runtime"
	"runtime/debug"
	"sync"
	"unsafe"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// Options configures a Loader.
type Options struct {
	// Batch is the samples per batch (required).
	Batch int
	// DropLast drops each epoch's last batch when it is short (fewer than
	// Batch samples), as PyTorch's DataLoader(drop_last=True); otherwise
	// the last batch holds what is left.
	DropLast bool
	// Shuffle draws each epoch's order from (Seed, epoch): the same seed
	// gives the same batches, however the loader's goroutines run.
	Shuffle bool
	Seed    uint64
	// Epochs is the number of passes over the dataset after which Next
	// returns io.EOF (0: no end). Epochs count from 0, a resumed loader's
	// included.
	Epochs int
	// Prefetch is how many batches are filled ahead of the consumer, in
	// a goroutine (0: 2). The loader holds Prefetch + 2 batches of storage:
	// those queued, the one being filled and the one Next returned last.
	Prefetch int
	// Workers is how many goroutines fill one batch's samples (0: up to 4,
	// as many as GOMAXPROCS allows). Small batches are filled by one.
	Workers int
	// Start is where to begin: the zero Position is the first epoch's
	// first sample; a Position a loader over the same dataset reported
	// (Loader.Position, Batch.Next) continues exactly where it was, the
	// same batches following as without the interruption.
	Start Position
	// Host allocates the batches' storage: page-locked memory on CUDA
	// (batchfit.Session.HostMemory), so a batch's upload is a DMA straight
	// from it. Nil: ordinary Go memory.
	Host HostMemory
}

// HostMemory allocates host memory for batches, and frees it. AllocHost
// returns n bytes aligned to at least 8.
type HostMemory interface {
	AllocHost(n int) ([]byte, error)
	FreeHost(b []byte) error
}

// Position is where a loader stands: in epoch Epoch, Index samples of
// that epoch's order consumed, of a dataset of Len samples, ordered by
// (Seed, Shuffle). A checkpoint stores it (its fields are JSON's);
// Options.Start resumes from it.
type Position struct {
	Epoch   int    `json:"epoch"`
	Index   int    `json:"index"`
	Seed    uint64 `json:"seed"`
	Shuffle bool   `json:"shuffle"`
	Len     int    `json:"len"`
}

// Batch is a batch of samples: one tensor per field, [Size, shape...],
// ready for lazy.Wrap(t, 0). Its storage is the loader's: it stays valid
// until the next call to Next (or Close), which may refill it.
type Batch struct {
	Tensors []*tensor.Dense
	Fields  []Field
	Size    int
	// Epoch and Index locate the batch's first sample in the epoch's
	// order; Next is the loader's position after this batch, to resume
	// from.
	Epoch, Index int
	Next         Position
}

// Tensor is the tensor of the named field, nil when there is none.
func (b *Batch) Tensor(name string) *tensor.Dense {
	for k, f := range b.Fields {
		if f.Name == name {
			return b.Tensors[k]
		}
	}
	return nil
}

// Loader yields a dataset's samples in batches, filled ahead by a
// goroutine into a bounded ring of storage. One goroutine calls Next and
// Close.
type Loader struct {
	ds     Dataset
	fields []Field
	o      Options
	n      int
	start  Position

	mu     sync.Mutex
	pos    Position // after the latest batch Next returned
	held   *slot    // the latest batch's storage, back to free at the next Next
	err    error    // sticky: io.EOF, a fill's error, ErrClosed
	slots  []*slot
	free   chan *slot
	ready  chan item
	cancel context.CancelFunc
	done   chan struct{}
	bytes  int64 // of all the storage
	// sampleBytes is one sample's storage, over every field.
	sampleBytes int64
}

// slot is one batch's storage: per field its values and, for HostMemory,
// the allocation.
type slot struct {
	f   [][]float32
	i   [][]int64
	raw [][]byte
}

type item struct {
	b   *Batch
	s   *slot
	err error
}

// NewLoader starts a loader over ds. Options out of range, a dataset
// without a batch per epoch, and a Start position of another dataset,
// seed or order are ErrOptions or ErrPosition errors.
func NewLoader(ds Dataset, o Options) (*Loader, error) {
	if ds == nil {
		return nil, errorf(ErrOptions, "nil dataset")
	}
	fields := ds.Fields()
	if err := checkFields(fields); err != nil {
		return nil, err
	}
	if o.Batch < 1 || o.Epochs < 0 || o.Prefetch < 0 || o.Workers < 0 {
		return nil, errorf(ErrOptions, "batch %d, epochs %d, prefetch %d, workers %d", o.Batch, o.Epochs, o.Prefetch, o.Workers)
	}
	if o.Prefetch == 0 {
		o.Prefetch = 2
	}
	if o.Workers == 0 {
		o.Workers = min(4, runtime.GOMAXPROCS(0))
	}
	l := &Loader{ds: ds, fields: fields, o: o, n: ds.Len()}
	if l.n < 0 || l.batches() == 0 {
		return nil, errorf(ErrOptions, "%d samples make no batch of %d (drop last %v)", l.n, o.Batch, o.DropLast)
	}
	start, err := l.resume(o.Start)
	if err != nil {
		return nil, err
	}
	l.start, l.pos = start, start
	if err := l.allocate(o.Prefetch + 2); err != nil {
		return nil, errors.Join(err, l.release())
	}
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel, l.done = cancel, make(chan struct{})
	l.ready = make(chan item, o.Prefetch)
	go l.produce(ctx)
	return l, nil
}

// batches is the number of batches per epoch.
func (l *Loader) batches() int {
	if l.o.DropLast {
		return l.n / l.o.Batch
	}
	return (l.n + l.o.Batch - 1) / l.o.Batch
}

// BatchesPerEpoch is the number of batches in an epoch.
func (l *Loader) BatchesPerEpoch() int { return l.batches() }

// resume checks a start position and normalises it: at an epoch's end
// (or where only a dropped short batch is left), the next epoch's start.
func (l *Loader) resume(p Position) (Position, error) {
	fresh := Position{Seed: l.o.Seed, Shuffle: l.o.Shuffle, Len: l.n}
	if p == (Position{}) {
		return fresh, nil
	}
	switch {
	case p.Len != l.n:
		return p, errorf(ErrPosition, "a position over %d samples, this dataset holds %d", p.Len, l.n)
	case p.Seed != l.o.Seed || p.Shuffle != l.o.Shuffle:
		return p, errorf(ErrPosition, "a position of seed %d (shuffle %v), this loader's is %d (shuffle %v)", p.Seed, p.Shuffle, l.o.Seed, l.o.Shuffle)
	case p.Epoch < 0 || p.Index < 0 || p.Index > l.n:
		return p, errorf(ErrPosition, "epoch %d, index %d of %d samples", p.Epoch, p.Index, l.n)
	}
	return l.normal(p), nil
}

// normal moves p past an epoch's end.
func (l *Loader) normal(p Position) Position {
	if left := l.n - p.Index; left <= 0 || l.o.DropLast && left < l.o.Batch {
		p.Epoch, p.Index = p.Epoch+1, 0
	}
	return p
}

// allocate makes k batches of storage.
func (l *Loader) allocate(k int) error {
	l.free = make(chan *slot, k)
	for range k {
		s := &slot{f: make([][]float32, len(l.fields)), i: make([][]int64, len(l.fields))}
		l.slots = append(l.slots, s)
		for j, f := range l.fields {
			n := l.o.Batch * f.numel()
			size := 8 * n
			if f.DType == graph.Float32 {
				size = 4 * n
			}
			var b []byte
			if l.o.Host != nil {
				var err error
				if b, err = l.o.Host.AllocHost(size); err != nil {
					return err
				}
				s.raw = append(s.raw, b)
				if len(b) < size || uintptr(unsafe.Pointer(unsafe.SliceData(b)))%8 != 0 {
					return errorf(ErrOptions, "HostMemory gave %d bytes at %p for %d, 8-aligned", len(b), unsafe.SliceData(b), size)
				}
			}
			switch {
			case f.DType == graph.Float32 && b == nil:
				s.f[j] = make([]float32, n)
			case f.DType == graph.Float32:
				s.f[j] = unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), n)
			case b == nil:
				s.i[j] = make([]int64, n)
			default:
				s.i[j] = unsafe.Slice((*int64)(unsafe.Pointer(unsafe.SliceData(b))), n)
			}
			l.bytes += int64(size)
		}
		l.sampleBytes = l.bytes / int64(len(l.slots)) / int64(l.o.Batch)
		l.free <- s
	}
	return nil
}

// HostBytes is the host memory the loader's batches take.
func (l *Loader) HostBytes() int64 { return l.bytes }

// produce fills batches in order from the start position until the last
// epoch ends, an error, or cancellation; it closes ready when it stops.
func (l *Loader) produce(ctx context.Context) {
	defer close(l.done)
	defer close(l.ready)
	p := l.start
	var ord order
	ordEpoch := -1
	for l.o.Epochs == 0 || p.Epoch < l.o.Epochs {
		if p.Epoch != ordEpoch {
			ord, ordEpoch = newOrder(l.n, l.o.Shuffle, l.o.Seed, p.Epoch), p.Epoch
		}
		var s *slot
		select {
		case s = <-l.free:
		case <-ctx.Done():
			return
		}
		size := min(l.o.Batch, l.n-p.Index)
		b := &Batch{Fields: l.fields, Size: size, Epoch: p.Epoch, Index: p.Index}
		err := l.fill(s, &ord, p.Index, size)
		next := p
		next.Index += size
		next = l.normal(next)
		b.Next = next
		if err == nil {
			b.Tensors = make([]*tensor.Dense, len(l.fields))
			for k, f := range l.fields {
				shape := append([]int{size}, f.Shape...)
				n := size * f.numel()
				if f.DType == graph.Float32 {
					b.Tensors[k] = tensor.New(tensor.WithShape(shape...), tensor.WithBacking(s.f[k][:n]))
				} else {
					b.Tensors[k] = tensor.New(tensor.WithShape(shape...), tensor.WithBacking(s.i[k][:n]))
				}
			}
		}
		select {
		case l.ready <- item{b: b, s: s, err: err}:
		case <-ctx.Done():
			return
		}
		if err != nil {
			return
		}
		p = next
	}
}

// fillParallelBytes is the batch size from which fill splits the samples
// between workers.
const fillParallelBytes = 256 << 10

// fill writes the size samples from the epoch's position index on into s.
func (l *Loader) fill(s *slot, ord *order, index, size int) error {
	workers := min(l.o.Workers, size)
	if int64(size)*l.sampleBytes < fillParallelBytes {
		workers = 1
	}
	if workers <= 1 {
		return l.fillRows(s, ord, index, 0, size)
	}
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := size*w/workers, size*(w+1)/workers
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = l.fillRows(s, ord, index, lo, hi)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fillRows fills rows lo…hi−1 of a batch starting at the epoch's
// position index. A fault reading a mapped file (truncated under it)
// comes back as ErrChanged rather than killing the process.
func (l *Loader) fillRows(s *slot, ord *order, index, lo, hi int) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if r := recover(); r != nil {
			f, ok := r.(interface{ Addr() uintptr })
			if !ok {
				panic(r)
			}
			err = errorf(ErrChanged, "reading sample %d faulted at %#x", ord.at(index+lo), f.Addr())
		}
	}()
	dst := make([]Slot, len(l.fields))
	for r := lo; r < hi; r++ {
		for k, f := range l.fields {
			e := f.numel()
			if f.DType == graph.Float32 {
				dst[k] = Slot{F: s.f[k][r*e : (r+1)*e]}
			} else {
				dst[k] = Slot{I: s.i[k][r*e : (r+1)*e]}
			}
		}
		i := ord.at(index + r)
		if err := l.ds.Fill(i, dst); err != nil {
			return err
		}
	}
	return nil
}

// Next returns the next batch: io.EOF after the last epoch, the error of
// the sample that could not be read (and the same error after), ErrClosed
// after Close, ctx's error when it ends first. The batch Next returned
// before is given back to the loader to refill.
func (l *Loader) Next(ctx context.Context) (*Batch, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	if l.held != nil {
		l.free <- l.held // never blocks: free holds every slot
		l.held = nil
	}
	select {
	case it, ok := <-l.ready:
		switch {
		case !ok:
			l.err = io.EOF
		case it.err != nil:
			l.err = it.err
			l.free <- it.s
		default:
			l.held, l.pos = it.s, it.b.Next
			return it.b, nil
		}
		return nil, l.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Position is the loader's position after the latest batch Next
// returned (the start before the first): a loader made with it as
// Options.Start yields the batches this one yields next.
func (l *Loader) Position() Position {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pos
}

// Close stops the loader and frees its batches' storage: batches Next
// returned are no longer valid. Closing again does nothing.
func (l *Loader) Close() error {
	l.cancel()
	<-l.done
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.slots == nil {
		return nil
	}
	l.held = nil
	l.err = ErrClosed
	return l.release()
}

// release frees the storage HostMemory gave.
func (l *Loader) release() error {
	var errs []error
	if l.o.Host != nil {
		for _, s := range l.slots {
			for _, b := range s.raw {
				errs = append(errs, l.o.Host.FreeHost(b))
			}
		}
	}
	l.slots = nil
	return errors.Join(errs...)
}
