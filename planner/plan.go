package planner

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/lru"
)

// Errors.
var (
	ErrDoesNotFit = errors.New("does not fit the memory budget")
	ErrBudget     = errors.New("invalid memory budget")
	ErrNoBatch    = errors.New("graph has no batch to plan")
)

// BufferUse names one buffer and its size at some chunk size, for errors
// and reports.
type BufferUse struct {
	Tag   alloc.Tag
	Kind  BufferKind
	Bytes int64
}

// DoesNotFitError says how much memory the smallest possible run needs and
// which buffers are largest. When the graph is not chunkable it also wraps
// the reason (errors.Is(err, graph.ErrNotChunkable)).
type DoesNotFitError struct {
	Chunk     int   // the smallest chunk tried: 1 (or the graph's MinChunk), or the whole batch
	Needed    int64 // peak reserved bytes of that run, −1 when more than Unlimited
	Whole     int64 // peak reserved bytes of the whole batch in one chunk, −1 when more than Unlimited
	Available int64 // the budget after headroom
	Fixed     int64 // persistent bytes: parameters and optimizer state
	Largest   []BufferUse
	Reason    error // why smaller chunks were not tried, if they were not
	batch     int
}

func (e *DoesNotFitError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: %s available; the whole batch in one chunk needs %s", ErrDoesNotFit,
		alloc.FormatBytes(e.Available), FormatPeak(e.Whole))
	if e.Chunk != e.batch {
		fmt.Fprintf(&b, ", chunks of %d need %s (gradient accumulators included)", e.Chunk, FormatPeak(e.Needed))
	}
	fmt.Fprintf(&b, ": %s persistent (parameters, optimizer state)", alloc.FormatBytes(e.Fixed))
	if e.Fixed > e.Available {
		b.WriteString(", more than the budget by itself")
	}
	if e.Needed >= e.Fixed {
		if e.Fixed > e.Available {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, " and %s for the step's work at %s a chunk (activations, gradients, workspaces)",
			alloc.FormatBytes(e.Needed-e.Fixed), samples(e.Chunk))
	}
	if e.Reason != nil {
		fmt.Fprintf(&b, "; the whole batch must run at once: %v", e.Reason)
	}
	if len(e.Largest) > 0 {
		b.WriteString("; largest buffers:")
		for _, l := range e.Largest {
			fmt.Fprintf(&b, " %s %s (%s),", l.Tag, l.Kind, alloc.FormatBytes(l.Bytes))
		}
	}
	return strings.TrimSuffix(b.String(), ",")
}

// samples is "1 sample" or "n samples".
func samples(n int) string {
	if n == 1 {
		return "1 sample"
	}
	return fmt.Sprintf("%d samples", n)
}

func (e *DoesNotFitError) Unwrap() []error {
	if e.Reason != nil {
		return []error{ErrDoesNotFit, e.Reason}
	}
	return []error{ErrDoesNotFit}
}

// Options configures Plan.
type Options struct {
	// Budget is the memory the run may reserve: device free memory plus
	// what the allocator already holds cached.
	Budget int64
	// Headroom is kept back from Budget (for memory outside batchfit's
	// allocator); DefaultHeadroom when zero and not NoHeadroom.
	Headroom   int64
	NoHeadroom bool
	// Timeline records the allocator state after every step of the chosen
	// plan's replay: the persistent allocations and every chunk, or only
	// the first TimelineChunks chunks when that is positive.
	Timeline       bool
	TimelineChunks int
	// NoChunkList leaves Plan.Chunks nil, for callers that run nothing (dry
	// runs): Plan.Split describes the chunks either way, in memory that does
	// not grow with the batch, where the list holds one Chunk per chunk.
	NoChunkList bool
	// MaxChunk caps the chunk size (0: the whole batch may run at once): a
	// fixed micro-batch, as gradient accumulation over micro-batches of at
	// most MaxChunk samples gives, where memory would allow more. The plan
	// still picks smaller chunks when MaxChunk samples do not fit. Below
	// the graph's least chunk (per-chunk batch statistics' MinChunk) it is
	// an ErrBudget error.
	MaxChunk int
	// Resident lists the buffers the device already holds when the run
	// starts, in the order they were allocated (an executor's resident
	// parameters, constants and optimizer state, whichever program made
	// them). The simulated device allocates them first; those that stand
	// for a persistent buffer of the program are found resident there.
	Resident []Held
}

// Unlimited is the capacity of the simulated device on which the planner
// measures runs without a budget: 1 EiB. A run that needs more is reported
// as needing more than Unlimited (a peak of −1).
const Unlimited = 1 << 60

// FormatPeak prints a peak in bytes as alloc.FormatBytes does, and −1 as
// "more than 1 EiB" (Unlimited).
func FormatPeak(n int64) string {
	if n < 0 {
		return "more than 1 EiB"
	}
	return alloc.FormatBytes(n)
}

// Held is a buffer the device holds before a run: its requested bytes,
// its tag and the index in Program.Buffers of the persistent buffer it
// holds, or −1 when the program does not read it.
type Held struct {
	Bytes  int64
	Tag    alloc.Tag
	Buffer int
}

// fresh reports whether held is what the program's own first replay
// allocates first (its persistent buffers, in order): a device holding
// them is, to the allocator, a fresh device that has run the program once.
func (p *Program) fresh(held []Held) bool {
	if len(held) > len(p.Persistent) {
		return false
	}
	for i, h := range held {
		if h.Buffer != p.Persistent[i] {
			return false
		}
	}
	return true
}

// DefaultHeadroom is kept back from the budget unless told otherwise: every
// byte batchfit uses goes through its allocator, so only memory allocated
// behind its back (other processes, libraries' private buffers) needs it.
const DefaultHeadroom = 0

// Plan is the planner's answer.
type Plan struct {
	Batch int   // N
	Chunk int   // samples per chunk (the largest chunk of Split)
	Split Split // the balanced chunks the batch runs in
	// Chunks lists Split's chunks for executors (Split.List()); nil with
	// Options.NoChunkList.
	Chunks        []Chunk
	PeakReserved  int64 // predicted peak reserved bytes of the whole step
	PeakAllocated int64
	// Fixed and PerSample fit a chunked run's peak reserved bytes as
	// Fixed + PerSample·chunk (from replays at chunk sizes N/4 and N/2; zero
	// for batches below 3). Fixed includes the persistent buffers.
	Fixed, PerSample int64
	Persistent       int64 // bytes of parameters and optimizer state (accumulators not included)
	// HostPinned is the pinned host memory the step holds besides the
	// device's: the program's HostPinned (an offloaded optimizer's
	// masters, state and staging), 0 otherwise.
	HostPinned int64
	Budget     int64 // as given
	Headroom   int64
	Replays    int // simulated replays it took
	Timeline   []Point
	// BatchStats is which statistics the step's training-mode batch_norm
	// nodes normalise with under this plan: "" when it has none,
	// WholeBatchStats or PerChunkStats; BatchNormNodes counts them.
	// StatsNote says it in a sentence.
	BatchStats     string
	BatchNormNodes int
	// LossChunk is the tokens per logits chunk of the step's fused loss
	// (graph.OpLinearCrossEntropy's Attrs.LossChunk: in a Session, its
	// choice), 0 when it has none.
	LossChunk int
}

// Plan.BatchStats values.
const (
	// WholeBatchStats: every training-mode batch_norm normalises with the
	// whole batch's statistics, the batch running in one chunk (the
	// default; a graph with such a node is not chunkable, or the batch
	// fits in one chunk).
	WholeBatchStats = "whole-batch"
	// PerChunkStats: the batch runs in several chunks and each per-chunk
	// batch_norm (graph.Attrs.PerChunk) normalises each with its own
	// statistics, as gradient accumulation normalises its micro-batches.
	PerChunkStats = "per-chunk"
)

// StatsNote describes BatchStats for reports; "" when the step has no
// training-mode batch_norm.
func (p *Plan) StatsNote() string {
	nodes := fmt.Sprintf("%d batch_norm nodes normalise", p.BatchNormNodes)
	if p.BatchNormNodes == 1 {
		nodes = "1 batch_norm node normalises"
	}
	switch p.BatchStats {
	case PerChunkStats:
		return fmt.Sprintf("per-chunk statistics: %s each of the %d chunks (%s) with its own mean and variance, as gradient accumulation does",
			nodes, p.Split.Len(), p.Split)
	case WholeBatchStats:
		return fmt.Sprintf("whole-batch statistics: %s with the mean and variance of all %d samples, run in one chunk", nodes, p.Batch)
	}
	return ""
}

// Available is the budget after headroom.
func (p *Plan) Available() int64 { return p.Budget - p.Headroom }

// simulate replays chunks on a simulated device of the given capacity that
// first holds held, allocated in order, recording the timeline of the
// chunks with an Index below recorded; ok is false when it ran out of
// memory.
//
// It replays two steps, as a training loop runs them: the second starts
// with the persistent buffers resident and the cache holding the first
// step's segments, and may need a segment the first did not. The usage is
// the larger of the two; the timeline, when recorded, is the first step's.
func simulate(p *Program, chunks Split, capacity int64, recorded int, held []Held) (u Usage, ok bool, err error) {
	a := alloc.New(alloc.NewSimBackend(capacity), alloc.Options{})
	h := &residentSim{blocks: map[residentKey]*alloc.Block{}}
	for _, r := range held {
		blk, err := a.Malloc(r.Bytes, r.Tag)
		if errors.Is(err, alloc.ErrOutOfMemory) {
			return u, false, nil
		}
		if err != nil {
			return u, false, err
		}
		if r.Buffer >= 0 {
			h.blocks[key(p.Buffers[r.Buffer])] = blk
		}
	}
	for step := range 2 {
		if step == 1 {
			recorded = 0
		}
		s, err := replay(p, chunks, a, h, recorded)
		if errors.Is(err, alloc.ErrOutOfMemory) {
			return u, false, nil
		}
		if err != nil {
			return u, false, err
		}
		if step == 0 {
			u = s
		}
		u.PeakReserved = max(u.PeakReserved, s.PeakReserved)
		u.PeakAllocated = max(u.PeakAllocated, s.PeakAllocated)
	}
	return u, true, nil
}

// residentSim keeps persistent buffers allocated across simulated steps,
// as executors keep parameters and optimizer state resident; it runs
// nothing.
type residentSim struct{ blocks map[residentKey]*alloc.Block }

type residentKey struct {
	kind       BufferKind
	node, slot int
}

func key(b Buffer) residentKey { return residentKey{b.Kind, b.Node, b.Slot} }

func (r *residentSim) Resident(b Buffer) *alloc.Block { return r.blocks[key(b)] }
func (r *residentSim) Fill(b Buffer, blk *alloc.Block) error {
	if b.Kind != BufAccumulator { // parameters, state, a sharded program's shards and bucket
		r.blocks[key(b)] = blk
	}
	return nil
}
func (*residentSim) Run(*graph.Node, Chunk, *alloc.Block, []*alloc.Block, *alloc.Block) error {
	return nil
}
func (*residentSim) Freed(Buffer, *alloc.Block)                            {}
func (*residentSim) ChunkDone(Chunk, []*alloc.Block, []*alloc.Block) error { return nil }
func (*residentSim) Finish([]*alloc.Block, *alloc.Block) error             { return nil }
func (*residentSim) EveryChunk() bool                                      { return false }

// Make picks the largest chunk whose replay of p keeps the peak reserved
// within the budget and returns the plan.
func Make(p *Program, o Options) (*Plan, error) {
	head := o.Headroom
	if head == 0 && !o.NoHeadroom {
		head = DefaultHeadroom
	}
	if o.Budget < 0 || head < 0 || head > o.Budget {
		return nil, fmt.Errorf("%w: budget %d bytes with headroom %d", ErrBudget, o.Budget, head)
	}
	if o.MaxChunk < 0 {
		return nil, fmt.Errorf("%w: MaxChunk %d is negative", ErrBudget, o.MaxChunk)
	}
	n := p.Batch
	if n <= 0 {
		return nil, fmt.Errorf("%w: the graph has no batched input", ErrNoBatch)
	}
	least := p.leastChunk()
	top := n // the largest chunk allowed
	if o.MaxChunk > 0 && o.MaxChunk < n {
		if p.Info.NotChunkable != nil {
			return nil, fmt.Errorf("%w: MaxChunk %d asks for chunks of a batch of %d that cannot be chunked: %w", ErrBudget, o.MaxChunk, n, p.Info.NotChunkable)
		}
		if top = o.MaxChunk; top < least {
			return nil, fmt.Errorf("%w: MaxChunk %d is below the least chunk %d that a batch of %d allows (per-chunk batch statistics need chunks of at least %d)",
				ErrBudget, o.MaxChunk, least, n, p.Info.MinChunk)
		}
	}
	avail := o.Budget - head
	held := o.Resident
	if p.fresh(held) {
		held = nil
	}
	pl := &Plan{Batch: n, Budget: o.Budget, Headroom: head, HostPinned: p.HostPinned}
	if p.Graph != nil {
		if t, _, _, _, ok := graph.LossChunkOf(p.Graph); ok {
			pl.LossChunk = t
		}
	}
	for _, bi := range p.Persistent {
		pl.Persistent += p.Buffers[bi].Bytes(0)
	}
	fits := func(b int) (Usage, bool, error) {
		pl.Replays++
		return simulate(p, SplitOf(n, b), avail, 0, held)
	}
	// One chunk needs no gradient accumulators, so it can fit where a
	// chunked run of the same batch does not: try it first (or the largest
	// chunk MaxChunk allows).
	var chosen int
	if _, ok, err := fits(top); err != nil {
		return nil, err
	} else if ok {
		chosen = top
	} else if top < n {
		// MaxChunk samples do not fit: search below it.
	} else if p.Info.NotChunkable != nil {
		return nil, p.doesNotFit(n, avail, held, p.Info.NotChunkable)
	} else if least == n {
		// No smaller chunk exists: a batch of one sample, or one that
		// per-chunk batch statistics cannot split.
		var why error
		if p.Info.MinChunk > 1 {
			why = graph.Errorf(graph.ErrNotChunkable,
				"a batch of %d cannot be split into chunks of at least %d samples, which per-chunk batch statistics need", n, p.Info.MinChunk)
		}
		return nil, p.doesNotFit(n, avail, held, why)
	}
	// The affine fit of a chunked run's peak, from unconstrained replays at
	// two chunk sizes that both need several chunks (none when they need
	// more than Unlimited).
	if n >= 3 {
		c1 := max(1, n/4)
		c2 := max(c1+1, n/2)
		u1, ok1, err := simulate(p, SplitOf(n, c1), Unlimited, 0, held)
		if err != nil {
			return nil, err
		}
		u2, ok2, err := simulate(p, SplitOf(n, c2), Unlimited, 0, held)
		if err != nil {
			return nil, err
		}
		pl.Replays += 2
		if ok1 && ok2 {
			pl.PerSample = max((u2.PeakReserved-u1.PeakReserved)/int64(c2-c1), 0)
			pl.Fixed = u1.PeakReserved - pl.PerSample*int64(c1)
		}
	}
	if chosen == 0 {
		if _, ok, err := fits(least); err != nil {
			return nil, err
		} else if !ok {
			return nil, p.doesNotFit(least, avail, held, nil)
		}
		lo, hi := least, top  // lo fits, hi does not
		if pl.PerSample > 0 { // first guess from the affine fit
			if g := int((avail - pl.Fixed) / pl.PerSample); g > lo && g < hi {
				if _, ok, err := fits(g); err != nil {
					return nil, err
				} else if ok {
					lo = g
				} else {
					hi = g
				}
			}
		}
		for hi-lo > 1 { // then bisection with full replays
			mid := lo + (hi-lo)/2
			if _, ok, err := fits(mid); err != nil {
				return nil, err
			} else if ok {
				lo = mid
			} else {
				hi = mid
			}
		}
		chosen = lo
	}
	pl.Split = SplitOf(n, chosen)
	pl.Chunk = pl.Split.Largest()
	if !o.NoChunkList {
		pl.Chunks = pl.Split.List()
	}
	recorded := 0
	if o.Timeline {
		recorded = math.MaxInt
		if o.TimelineChunks > 0 {
			recorded = o.TimelineChunks
		}
	}
	u, ok, err := simulate(p, pl.Split, avail, recorded, held)
	pl.Replays++
	if err != nil {
		return nil, err
	}
	if !ok { // cannot happen: chosen was checked with the same chunks
		return nil, p.doesNotFit(pl.Chunk, avail, held, nil)
	}
	pl.PeakReserved, pl.PeakAllocated, pl.Timeline = u.PeakReserved, u.PeakAllocated, u.Timeline
	if pl.BatchNormNodes = len(p.Info.WholeStats) + len(p.Info.ChunkStats); pl.BatchNormNodes > 0 {
		pl.BatchStats = WholeBatchStats
		if pl.Split.Len() > 1 {
			pl.BatchStats = PerChunkStats
		}
	}
	return pl, nil
}

// leastChunk is the smallest chunk size b whose balanced split of the
// batch (SplitOf) has no chunk below the graph's MinChunk: 1 for most
// graphs, the whole batch when it cannot be split so.
func (p *Program) leastChunk() int {
	n, m := p.Batch, p.Info.MinChunk
	if m <= 1 {
		return 1
	}
	k := n / m // the most chunks of at least m samples
	if k <= 1 {
		return n
	}
	return (n + k - 1) / k
}

// doesNotFit measures what a run at chunk size b needs and lists the
// largest buffers.
func (p *Program) doesNotFit(b int, avail int64, held []Held, reason error) error {
	peak := func(b int) int64 {
		u, ok, _ := simulate(p, SplitOf(p.Batch, b), Unlimited, 0, held)
		if !ok {
			return -1
		}
		return u.PeakReserved
	}
	e := &DoesNotFitError{Chunk: b, Needed: peak(b), Whole: peak(p.Batch), Available: avail, batch: p.Batch}
	if reason != nil {
		e.Reason = reason
	}
	uses := make([]BufferUse, 0, len(p.Buffers))
	for _, bi := range p.Persistent {
		e.Fixed += p.Buffers[bi].Bytes(0)
	}
	for _, h := range held {
		if h.Buffer < 0 {
			e.Fixed += h.Bytes
		}
	}
	for _, buf := range p.Buffers {
		uses = append(uses, BufferUse{Tag: buf.Tag, Kind: buf.Kind, Bytes: buf.Bytes(b)})
	}
	sort.SliceStable(uses, func(i, j int) bool { return uses[i].Bytes > uses[j].Bytes })
	e.Largest = uses[:min(5, len(uses))]
	return e
}

// CacheSize bounds a Cache: it keeps the CacheSize plans most recently
// made or found, evicting the least recently used.
const CacheSize = 64

// Cache keeps plans by program signature and options, so a steady training
// loop plans once. It holds at most CacheSize plans; a plan holds no
// graph and no data. A plan found by signature is served only to a program
// with the schedule it was made for (sameSchedule), so a signature
// collision plans anew.
type Cache struct {
	mu    sync.Mutex
	plans lru.Cache[cacheKey, cached]
	hits  int
}

// cached is a plan and the program it was made for, without its graph.
type cached struct {
	pl *Plan
	p  *Program
}

// sameSchedule reports whether p and q replay alike: the same compiled
// program (a Rebind of it shares its slices), or programs equal in
// everything Make reads. Their graphs' data may differ.
func (p *Program) sameSchedule(q *Program) bool {
	if p.Batch != q.Batch || len(p.Steps) != len(q.Steps) || len(p.Buffers) != len(q.Buffers) || len(p.Outputs) != len(q.Outputs) {
		return false
	}
	if len(p.Steps) > 0 && len(p.Buffers) > 0 && len(p.Outputs) > 0 &&
		&p.Steps[0] == &q.Steps[0] && &p.Buffers[0] == &q.Buffers[0] && &p.Outputs[0] == &q.Outputs[0] {
		return true // Compile makes every slice anew
	}
	a, b := p.Info, q.Info
	if a == nil || b == nil {
		return false
	}
	return slices.Equal(p.Steps, q.Steps) && slices.Equal(p.Buffers, q.Buffers) && slices.Equal(p.Outputs, q.Outputs) &&
		slices.Equal(p.Persistent, q.Persistent) && slices.Equal(p.Accumulators, q.Accumulators) &&
		slices.Equal(p.Kept, q.Kept) && slices.Equal(p.Trained, q.Trained) && slices.Equal(p.OutputBuf, q.OutputBuf) &&
		slices.Equal(p.Companion, q.Companion) && p.FinishWorkspace == q.FinishWorkspace &&
		a.MinChunk == b.MinChunk && (a.NotChunkable == nil) == (b.NotChunkable == nil) &&
		slices.Equal(a.WholeStats, b.WholeStats) && slices.Equal(a.ChunkStats, b.ChunkStats)
}

type cacheKey struct {
	sig              uint64
	kept             string
	trained          int
	budget, headroom int64
	noHeadroom       bool
	noChunkList      bool
	maxChunk         int
	held             string
}

// Signature identifies what a program's memory depends on: its graph, its
// buffers and its schedule, which the outputs shape (an output lives to the
// end of each chunk; the same node not asked for is freed early).
// Compile computes it once, and Rebind carries it to the rebuilt graph, so a
// training loop does not hash its graph twice per step.
func (p *Program) Signature() uint64 {
	if p.sig != 0 {
		return p.sig
	}
	return p.signature()
}

func (p *Program) signature() uint64 {
	h := p.Graph.Signature()
	for _, b := range p.Buffers { // persistent kinds and workspace sizes
		h = h*1099511628211 ^ uint64(b.Kind)<<56 ^ uint64(b.Fixed) ^ uint64(b.PerSample)<<17
	}
	h = h*1099511628211 ^ uint64(p.FinishWorkspace.Fixed)
	h = h*1099511628211 ^ uint64(p.HostPinned) // an offloaded optimizer's host bytes are the plan's too
	for _, o := range p.Outputs {
		h = h*1099511628211 ^ uint64(o)
	}
	for _, st := range p.Steps {
		h = h*1099511628211 ^ uint64(st.Kind)<<56 ^ uint64(st.Node)<<24 ^ uint64(st.Buf)
	}
	return h
}

// Plan returns the cached plan for p and o, making it on a miss.
func (c *Cache) Plan(p *Program, o Options) (*Plan, error) {
	key := cacheKey{sig: p.Signature(), kept: p.keptKey, trained: len(p.Persistent),
		budget: o.Budget, headroom: o.Headroom, noHeadroom: o.NoHeadroom, noChunkList: o.NoChunkList, maxChunk: o.MaxChunk}
	if !p.fresh(o.Resident) {
		key.held = heldKey(o.Resident)
	}
	c.mu.Lock()
	if e, ok := c.plans.Get(key); ok && e.p.sameSchedule(p) {
		c.hits++
		c.mu.Unlock()
		return e.pl, nil
	}
	c.mu.Unlock()
	pl, err := Make(p, o)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.plans.Max = CacheSize
	c.plans.Put(key, cached{pl: pl, p: p.Rebind(nil)})
	return pl, nil
}

// Len is the number of plans cached.
func (c *Cache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.plans.Len()
}

// Hits counts plans served from the cache.
func (c *Cache) Hits() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.hits
}

// heldKey identifies what a device holding held means to a replay: the
// sizes, in order, and which program buffer each stands for.
func heldKey(held []Held) string {
	b := make([]byte, 0, 16*len(held))
	for _, h := range held {
		b = strconv.AppendInt(b, h.Bytes, 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(h.Buffer), 10)
		b = append(b, ',')
	}
	return string(b)
}
