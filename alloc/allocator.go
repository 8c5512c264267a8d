package alloc

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
)

// Size classes, as in PyTorch's CUDA caching allocator.
const (
	MinBlockSize  = 512      // every size rounds up to a multiple of this
	SmallSize     = 1 << 20  // largest request served from the small pool
	SmallBuffer   = 2 << 20  // small-pool segment
	LargeBuffer   = 20 << 20 // large-pool segment for requests below MinLargeAlloc
	MinLargeAlloc = 10 << 20 // requests from here on get segments of their own size
	RoundLarge    = 2 << 20  // … rounded up to this
)

// maxRequest is the largest size whose rounded and segment sizes fit in an
// int64. No device holds more; Malloc treats a larger request as one the
// device refuses.
const maxRequest = math.MaxInt64 &^ (RoundLarge - 1)

// Errors.
var (
	ErrOutOfMemory = errors.New("out of memory")
	ErrInvalid     = errors.New("invalid allocator call")
)

// OOMError reports an allocation the device could not satisfy even after
// the cache was released.
type OOMError struct {
	Requested   int64 // bytes asked for
	Rounded     int64 // after rounding to the allocator's size classes
	DeviceFree  int64
	DeviceTotal int64
	Allocated   int64 // bytes in live allocations
	Reserved    int64 // bytes held in segments
	Tag         Tag
}

func (e *OOMError) Error() string {
	s := fmt.Sprintf("%v: tried to allocate %s; device has %s free of %s; %s allocated, %s reserved",
		ErrOutOfMemory, FormatBytes(e.Requested), FormatBytes(e.DeviceFree), FormatBytes(e.DeviceTotal),
		FormatBytes(e.Allocated), FormatBytes(e.Reserved))
	if e.Tag.Op != "" {
		s += " (for " + e.Tag.String() + ")"
	}
	return s
}

func (e *OOMError) Unwrap() error { return ErrOutOfMemory }

// FormatBytes renders a byte count with a binary unit: "20.00 MiB".
func FormatBytes(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v, i := float64(n), 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.2f %s", v, units[i])
}

// Tag names what an allocation is for, batchfit's stack frame: the graph
// node, its op and the module path that made it.
type Tag struct {
	Node  int // −1 when not a graph node
	Op    string
	Scope string
}

func (t Tag) String() string {
	s := t.Op
	if t.Scope != "" {
		s = t.Scope + "/" + s
	}
	if t.Node >= 0 && t.Op != "" {
		s += fmt.Sprintf(" (node %d)", t.Node)
	}
	return s
}

// RoundSize is the size an allocation of n bytes occupies, for n up to
// math.MaxInt64 rounded down to a multiple of RoundLarge.
func RoundSize(n int64) int64 {
	if n < MinBlockSize {
		return MinBlockSize
	}
	return (n + MinBlockSize - 1) / MinBlockSize * MinBlockSize
}

// SegmentSize is the size of the segment a new allocation of rounded size
// n reserves from the device, for n up to math.MaxInt64 rounded down to a
// multiple of RoundLarge.
func SegmentSize(n int64) int64 {
	switch {
	case n <= SmallSize:
		return SmallBuffer
	case n < MinLargeAlloc:
		return LargeBuffer
	}
	return (n + RoundLarge - 1) / RoundLarge * RoundLarge
}

func poolOf(rounded int64) Pool {
	if rounded <= SmallSize {
		return SmallPool
	}
	return LargePool
}

// segment is one device allocation, split into blocks.
type segment struct {
	base Ptr
	size int64
	pool Pool
	head *Block // lowest-address block
	seq  uint64 // creation order among the allocator's segments
}

// Block is a piece of a segment: an allocation while allocated, cached
// memory otherwise.
type Block struct {
	ptr        Ptr
	size       int64
	requested  int64
	allocated  bool
	prev, next *Block // neighbours in the segment
	seg        *segment
	tag        Tag
}

// Ptr is the block's device address.
func (b *Block) Ptr() Ptr { return b.ptr }

// Size is the block's rounded size.
func (b *Block) Size() int64 { return b.size }

// Requested is the size asked for.
func (b *Block) Requested() int64 { return b.requested }

func (b *Block) isSplit() bool { return b.prev != nil || b.next != nil }

// freeList holds a pool's free blocks ordered by size, then by their
// segment's age, then by address within the segment: the first block at
// least as large as a request is its best fit. PyTorch breaks ties by
// address alone; here the segment's creation order comes first, so that a
// simulated device and a real one, whose driver places segments at
// addresses of its choosing, pick the same block among equal sizes and lay
// out every later allocation alike. On a device that hands out increasing
// addresses, as the simulated one does, the two orders are the same.
type freeList []*Block

func less(a, b *Block) int {
	if a.size != b.size {
		return cmp.Compare(a.size, b.size)
	}
	if a.seg != b.seg {
		return cmp.Compare(a.seg.seq, b.seg.seq)
	}
	return cmp.Compare(a.ptr, b.ptr)
}

func (l *freeList) insert(b *Block) {
	i, _ := slices.BinarySearchFunc(*l, b, less)
	*l = slices.Insert(*l, i, b)
}

func (l *freeList) remove(b *Block) {
	if i, ok := slices.BinarySearchFunc(*l, b, less); ok {
		*l = slices.Delete(*l, i, i+1)
	}
}

// bestFit returns the smallest free block of at least size bytes.
func (l freeList) bestFit(size int64) *Block {
	i, _ := slices.BinarySearchFunc(l, size, func(b *Block, s int64) int { return cmp.Compare(b.size, s) })
	if i < len(l) {
		return l[i]
	}
	return nil
}

// Options configures an Allocator.
type Options struct {
	// TraceEntries keeps the last TraceEntries events, at most
	// MaxTraceEntries; 0 disables tracing.
	TraceEntries int
}

// MaxTraceEntries bounds Options.TraceEntries: 2²⁴ events, about 1.5 GiB
// of trace once that many have happened.
const MaxTraceEntries = 1 << 24

// Validate reports options New cannot honour as given: TraceEntries below
// 0 or above MaxTraceEntries. The error wraps ErrInvalid.
func (o Options) Validate() error {
	if o.TraceEntries < 0 || o.TraceEntries > MaxTraceEntries {
		return fmt.Errorf("%w: TraceEntries %d, want 0 to %d", ErrInvalid, o.TraceEntries, MaxTraceEntries)
	}
	return nil
}

// Allocator is a caching allocator over a Backend.
type Allocator struct {
	mu       sync.Mutex
	be       Backend
	free     [numPools]freeList // indexed by SmallPool, LargePool
	segments map[Ptr]*segment
	segSeq   uint64 // segments made so far, for their seq
	limit    int64  // SetLimit's cap on reserved bytes; 0: none
	stats    Stats
	trace    *ring
}

// New returns an allocator drawing segments from be. Options that fail
// Validate are clamped: a negative TraceEntries traces nothing, one above
// MaxTraceEntries keeps MaxTraceEntries.
func New(be Backend, o Options) *Allocator {
	a := &Allocator{be: be, segments: map[Ptr]*segment{}}
	if o.TraceEntries > 0 {
		a.trace = newRing(min(o.TraceEntries, MaxTraceEntries))
	}
	return a
}

// Backend is the device the allocator draws from.
func (a *Allocator) Backend() Backend { return a.be }

// Malloc returns a block of at least size bytes. A size of 0 gets an empty
// block that occupies nothing.
func (a *Allocator) Malloc(size int64, tag Tag) (*Block, error) {
	if size < 0 {
		return nil, fmt.Errorf("%w: malloc of %d bytes for %s", ErrInvalid, size, tag)
	}
	if size == 0 {
		return &Block{tag: tag}, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	rounded := size // past maxRequest: no cached block fits, the device refuses
	if size <= maxRequest {
		rounded = RoundSize(size)
	}
	pool := poolOf(rounded)
	b := a.free[pool].bestFit(rounded)
	if b != nil {
		a.free[pool].remove(b)
	} else {
		var err error
		if b, err = a.newSegment(size, rounded, pool, tag); err != nil {
			return nil, err
		}
	}
	alreadySplit := b.isSplit()
	remainder := b.size - rounded
	if (pool == SmallPool && remainder >= MinBlockSize) || (pool == LargePool && remainder > SmallSize) {
		rest := &Block{ptr: b.ptr + Ptr(rounded), size: remainder, prev: b, next: b.next, seg: b.seg, tag: Tag{Node: -1}}
		if b.next != nil {
			b.next.prev = rest
		}
		b.next = rest
		b.size = rounded
		a.free[pool].insert(rest)
		if alreadySplit { // a free split block shrank by what we took
			a.stats.InactiveSplitBytes.update(pool, -rounded)
		} else { // an unsplit block now leaves a split remainder
			a.stats.InactiveSplitBytes.update(pool, remainder)
			a.stats.InactiveSplit.update(pool, 1)
		}
	} else if alreadySplit { // a free split block becomes active whole
		a.stats.InactiveSplitBytes.update(pool, -b.size)
		a.stats.InactiveSplit.update(pool, -1)
	}
	b.allocated, b.requested, b.tag = true, size, tag
	a.stats.Allocation.update(pool, 1)
	a.stats.AllocatedBytes.update(pool, b.size)
	a.stats.Active.update(pool, 1)
	a.stats.ActiveBytes.update(pool, b.size)
	a.stats.RequestedBytes.update(pool, size)
	a.record(EventAlloc, b.ptr, b.size, tag)
	return b, nil
}

// newSegment reserves a segment for a request of rounded bytes, releasing
// cached segments and retrying once when the device is full.
func (a *Allocator) newSegment(size, rounded int64, pool Pool, tag Tag) (*Block, error) {
	segSize := SegmentSize(rounded)
	p, err := a.deviceMalloc(rounded, segSize)
	if errors.Is(err, ErrDeviceOOM) {
		if rerr := a.releaseCached(); rerr != nil {
			return nil, rerr
		}
		a.stats.NumAllocRetries++
		p, err = a.deviceMalloc(rounded, segSize)
	}
	if errors.Is(err, ErrDeviceOOM) {
		a.stats.NumOOMs++
		a.record(EventOOM, 0, size, tag)
		e := &OOMError{Requested: size, Rounded: rounded, Allocated: a.stats.AllocatedBytes[All].Current,
			Reserved: a.stats.ReservedBytes[All].Current, Tag: tag}
		e.DeviceFree, e.DeviceTotal, _ = a.be.MemInfo()
		return nil, e
	}
	if err != nil {
		return nil, fmt.Errorf("alloc: device malloc of %d bytes: %w", segSize, err)
	}
	a.segSeq++
	seg := &segment{base: p, size: segSize, pool: pool, seq: a.segSeq}
	b := &Block{ptr: p, size: segSize, seg: seg}
	seg.head = b
	a.segments[p] = seg
	a.stats.Segment.update(pool, 1)
	a.stats.ReservedBytes.update(pool, segSize)
	a.stats.NumDeviceAlloc++
	a.record(EventSegmentAlloc, p, segSize, tag)
	return b, nil
}

// deviceMalloc reserves a segment of segSize bytes for a request of rounded
// bytes. A request past maxRequest, whose segSize overflowed, is refused
// without asking the device, as the device would refuse it.
func (a *Allocator) deviceMalloc(rounded, segSize int64) (Ptr, error) {
	if rounded > maxRequest {
		return 0, fmt.Errorf("%w: %d bytes is more than any device holds", ErrDeviceOOM, rounded)
	}
	if reserved := a.stats.ReservedBytes[All].Current; a.limit > 0 && segSize > a.limit-reserved {
		return 0, fmt.Errorf("%w: a %s segment on %s reserved passes the allocator's limit of %s",
			ErrDeviceOOM, FormatBytes(segSize), FormatBytes(reserved), FormatBytes(a.limit))
	}
	return a.be.Malloc(segSize)
}

// SetLimit caps the bytes the allocator reserves, as PyTorch's
// set_per_process_memory_fraction does: a segment that would take reserved
// memory past limit is refused as if the device were full, so cached
// segments are released and the request retried once, and then it fails
// with an *OOMError. A plan made on a simulated device of the budget's
// size therefore runs the same way on a larger real one. 0 removes the
// cap; a limit below what is reserved already refuses every new segment.
func (a *Allocator) SetLimit(limit int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.limit = max(limit, 0)
}

// Limit is SetLimit's cap, 0 when there is none.
func (a *Allocator) Limit() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.limit
}

// Free returns b to the cache, merging it with free neighbours.
func (a *Allocator) Free(b *Block) error {
	if b == nil {
		return fmt.Errorf("%w: free of a nil block", ErrInvalid)
	}
	if b.seg == nil && b.size == 0 {
		return nil // the empty block of a zero-size request
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if !b.allocated {
		return fmt.Errorf("%w: double free of %s at %#x (%s)", ErrInvalid, FormatBytes(b.size), b.ptr, b.tag)
	}
	if a.segments[b.seg.base] != b.seg {
		return fmt.Errorf("%w: free of a block at %#x this allocator did not hand out", ErrInvalid, b.ptr)
	}
	pool := b.seg.pool
	b.allocated = false
	a.stats.Allocation.update(pool, -1)
	a.stats.AllocatedBytes.update(pool, -b.size)
	a.stats.Active.update(pool, -1)
	a.stats.ActiveBytes.update(pool, -b.size)
	a.stats.RequestedBytes.update(pool, -b.requested)
	a.record(EventFree, b.ptr, b.size, b.tag)
	var splitBlocks, splitBytes int64
	for _, nb := range [2]*Block{b.prev, b.next} {
		if nb == nil || nb.allocated {
			continue
		}
		a.free[pool].remove(nb)
		splitBlocks--
		splitBytes -= nb.size
		if nb == b.prev {
			b.ptr = nb.ptr
			b.prev = nb.prev
			if b.prev != nil {
				b.prev.next = b
			} else {
				b.seg.head = b
			}
		} else {
			b.next = nb.next
			if b.next != nil {
				b.next.prev = b
			}
		}
		b.size += nb.size
	}
	b.requested, b.tag = 0, Tag{Node: -1}
	a.free[pool].insert(b)
	if b.isSplit() {
		splitBlocks++
		splitBytes += b.size
	}
	a.stats.InactiveSplit.update(pool, splitBlocks)
	a.stats.InactiveSplitBytes.update(pool, splitBytes)
	return nil
}

// releaseCached returns every whole cached segment to the device, the
// large pool first as in PyTorch's release_cached_blocks.
func (a *Allocator) releaseCached() error {
	for _, pool := range [...]Pool{LargePool, SmallPool} {
		var keep freeList
		for i, b := range a.free[pool] {
			if b.isSplit() {
				keep = append(keep, b)
				continue
			}
			if err := a.be.Free(b.ptr); err != nil {
				// Segments released so far are gone; b and the rest stay cached.
				a.free[pool] = append(keep, a.free[pool][i:]...)
				return fmt.Errorf("alloc: device free of %#x: %w", b.ptr, err)
			}
			delete(a.segments, b.ptr)
			a.stats.Segment.update(pool, -1)
			a.stats.ReservedBytes.update(pool, -b.size)
			a.stats.NumDeviceFree++
			a.record(EventSegmentFree, b.ptr, b.size, Tag{Node: -1})
		}
		a.free[pool] = keep
	}
	return nil
}

// EmptyCache returns every whole cached segment to the device, as
// torch.cuda.empty_cache does.
func (a *Allocator) EmptyCache() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.releaseCached()
}

// Stats returns a copy of the counters.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats
}

// ResetPeak sets every peak to its current value.
func (a *Allocator) ResetPeak() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stats.resetPeak()
}

// Cached is the bytes held in segments but not allocated: what a planner
// may count as available on top of the device's free memory.
func (a *Allocator) Cached() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats.ReservedBytes[All].Current - a.stats.AllocatedBytes[All].Current
}
