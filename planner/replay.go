package planner

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Chunk is a contiguous range of the batch run at once.
type Chunk struct {
	Index, Start, Size int
}

// Split is a batch of N samples cut into K balanced chunks: sizes differ by
// at most one, larger ones first (100 in 4 → 25, 25, 25, 25; 10 in 3 → 4,
// 3, 3). It describes its chunks without listing them, so its memory does
// not grow with the batch: a batch of 10⁹ in chunks of one is two ints.
type Split struct{ N, K int }

// SplitOf cuts n samples into the fewest balanced chunks of at most b
// (b ≥ 1).
func SplitOf(n, b int) Split { return Split{N: n, K: n/b + min(n%b, 1)} }

// Len is the number of chunks, K.
func (s Split) Len() int { return s.K }

// At is chunk i, 0 ≤ i < K.
func (s Split) At(i int) Chunk {
	q, r := s.N/s.K, s.N%s.K
	c := Chunk{Index: i, Start: i*q + min(i, r), Size: q}
	if i < r {
		c.Size++
	}
	return c
}

// Largest is the size of the first, largest chunk.
func (s Split) Largest() int { return s.At(0).Size }

// List lists the chunks; its length is K.
func (s Split) List() []Chunk {
	cs := make([]Chunk, s.K)
	for i := range cs {
		cs[i] = s.At(i)
	}
	return cs
}

// Run is Count chunks of Size samples in a row.
type Run struct{ Count, Size int }

// Runs lists the split's chunks as at most two runs, larger size first.
func (s Split) Runs() []Run {
	if s.K <= 0 {
		return nil
	}
	q, r := s.N/s.K, s.N%s.K
	var runs []Run
	if r > 0 {
		runs = append(runs, Run{Count: r, Size: q + 1})
	}
	if q > 0 {
		runs = append(runs, Run{Count: s.K - r, Size: q})
	}
	return runs
}

// String describes the chunks as DescribeSizes does: "2 × 11 + 1 × 10".
func (s Split) String() string { return describeRuns(s.Runs()) }

// after is the index of the first chunk after i of another size than chunk
// i's, or K.
func (s Split) after(i int) int {
	if r := s.N % s.K; i < r {
		return r
	}
	return s.K
}

// Chunks splits n samples into k balanced chunks, listed: Split{n, k}.List().
func Chunks(n, k int) []Chunk { return Split{N: n, K: k}.List() }

// ChunksOf splits n samples into the fewest balanced chunks of at most b,
// listed: SplitOf(n, b).List().
func ChunksOf(n, b int) []Chunk { return SplitOf(n, b).List() }

// Sizes lists the chunks' sizes.
func Sizes(cs []Chunk) []int {
	s := make([]int, len(cs))
	for i, c := range cs {
		s[i] = c.Size
	}
	return s
}

// DescribeSizes writes chunk sizes as counts of equal runs: [8 8 8 8] →
// "4 × 8", [4 3 3] → "1 × 4 + 2 × 3"; "" for none.
func DescribeSizes(sizes []int) string {
	var runs []Run
	for i := 0; i < len(sizes); {
		j := i
		for j < len(sizes) && sizes[j] == sizes[i] {
			j++
		}
		runs = append(runs, Run{Count: j - i, Size: sizes[i]})
		i = j
	}
	return describeRuns(runs)
}

func describeRuns(runs []Run) string {
	parts := make([]string, len(runs))
	for i, r := range runs {
		parts[i] = fmt.Sprintf("%d × %d", r.Count, r.Size)
	}
	return strings.Join(parts, " + ")
}

// chunkSeq is the chunks a replay walks: a listed []Chunk, or a Split.
type chunkSeq interface {
	Len() int
	At(i int) Chunk
	// after is the index of the first chunk after i of another size than
	// chunk i's, or Len().
	after(i int) int
}

// chunkList is a listed chunk sequence, of any sizes.
type chunkList []Chunk

func (l chunkList) Len() int       { return len(l) }
func (l chunkList) At(i int) Chunk { return l[i] }
func (l chunkList) after(i int) int {
	j := i + 1
	for j < len(l) && l[j].Size == l[i].Size {
		j++
	}
	return j
}

// Hooks let an executor act during a replay. Plan replays with nil hooks.
type Hooks interface {
	// Resident returns the block already holding a persistent buffer (a
	// parameter uploaded by an earlier step, optimizer state), or nil.
	Resident(buf Buffer) *alloc.Block
	// Fill initialises a persistent buffer just allocated: parameters and
	// constants are uploaded, state and accumulators zeroed.
	Fill(buf Buffer, blk *alloc.Block) error
	// Run computes node nd for chunk c into out from ins (ws is its
	// workspace, or nil). For an input node it loads the chunk's samples.
	Run(nd *graph.Node, c Chunk, out *alloc.Block, ins []*alloc.Block, ws *alloc.Block) error
	// Freed reports that a chunk buffer went back to the allocator.
	Freed(buf Buffer, blk *alloc.Block)
	// ChunkDone receives the blocks of the program's outputs after chunk c;
	// with several chunks, acc holds the accumulators of the kept outputs
	// (nil otherwise), into which the chunk's kept outputs are to be added.
	ChunkDone(c Chunk, outs []*alloc.Block, acc []*alloc.Block) error
	// Finish receives the final kept outputs (accumulators, or the single
	// chunk's blocks) before they are freed: the optimizer step goes here.
	// ws is the program's finish workspace (Program.FinishWorkspace), nil
	// when it has none.
	Finish(kept []*alloc.Block, ws *alloc.Block) error
	// EveryChunk reports whether the hooks must see every chunk. Hooks
	// that compute or observe say true; a simulation that only keeps
	// buffers resident says false, and a replay without a timeline then
	// skips chunks known to repeat, as it does with nil hooks.
	EveryChunk() bool
}

// CompanionHooks is implemented by hooks whose kernel for a node can also
// compute its companions' outputs (Program.Companion) in the same pass.
type CompanionHooks interface {
	// Companion hands over the block of node nd's companion (node id m),
	// allocated already, just before Run(nd, …): once for each of nd's
	// companions, in order (Program.Companions). The hook may fill it
	// during that run, and then need not compute it again when m's own run
	// step comes. ins are the blocks of m's inputs, one of which may be
	// nd's own output (add + layer_norm: the layer norm's x is the add's
	// result, its weight and bias are read from ins).
	Companion(nd *graph.Node, m int, blk *alloc.Block, ins []*alloc.Block)
}

// Point is the allocator's state after one step of a replay.
type Point struct {
	Chunk     int
	Step      int // index into Program.Steps, −1 for persistent allocations
	Node      int
	Kind      StepKind
	Allocated int64
	Reserved  int64
}

// Usage is what a replay measured.
type Usage struct {
	PeakReserved  int64
	PeakAllocated int64
	Timeline      []Point // when requested
	// HostPinned is the host memory an executor holds for an offloaded
	// optimizer after the step (exec.Options.Offload): what a plan's
	// HostPinned predicts. 0 for replays and steps without offload.
	HostPinned int64
}

// Replay walks p for the given chunks through a, calling h (when not nil)
// at each step. Persistent buffers are allocated first, unless h says they
// are resident; chunk buffers are freed as the program says, and outputs at
// the end of each chunk. Peaks are measured from the allocator's stats,
// reset at the start.
func Replay(p *Program, chunks []Chunk, a *alloc.Allocator, h Hooks, record bool) (Usage, error) {
	recorded := 0
	if record {
		recorded = math.MaxInt
	}
	return replay(p, chunkList(chunks), a, h, recorded)
}

// replay is Replay over any chunk sequence. It records the timeline of the
// persistent allocations and of the chunks whose Index is below recorded
// (none when 0).
func replay(p *Program, chunks chunkSeq, a *alloc.Allocator, h Hooks, recorded int) (Usage, error) {
	a.ResetPeak()
	var u Usage
	mark := func(c, step, node int, k StepKind) {
		if c < recorded { // persistent allocations are chunk −1
			s := a.Stats()
			u.Timeline = append(u.Timeline, Point{Chunk: c, Step: step, Node: node, Kind: k,
				Allocated: s.AllocatedBytes[alloc.All].Current, Reserved: s.ReservedBytes[alloc.All].Current})
		}
	}
	blocks := make([]*alloc.Block, len(p.Buffers))
	var owned []int // blocks this replay allocated and must free at the end
	fail := func(err error) (Usage, error) {
		for i, b := range blocks {
			if b != nil && p.Buffers[i].Kind != BufParam && p.Buffers[i].Kind != BufState {
				_ = a.Free(b) // release what the failed replay held; it is already failing
			}
		}
		return u, err
	}
	persistent := p.Persistent
	if chunks.Len() > 1 {
		persistent = append(append([]int(nil), persistent...), p.Accumulators...)
	}
	for _, bi := range persistent {
		buf := p.Buffers[bi]
		if h != nil {
			blocks[bi] = h.Resident(buf)
		}
		if blocks[bi] != nil {
			continue
		}
		blk, err := a.Malloc(buf.Bytes(0), buf.Tag)
		if err != nil {
			return fail(err)
		}
		blocks[bi] = blk
		if buf.Kind == BufAccumulator {
			owned = append(owned, bi)
		}
		if h != nil {
			if err := h.Fill(buf, blk); err != nil {
				return fail(err)
			}
		}
		mark(-1, -1, buf.Node, StepAlloc)
	}
	g := p.Graph
	outBlocks := make([]*alloc.Block, len(p.Outputs))
	var acc []*alloc.Block
	if chunks.Len() > 1 {
		for _, bi := range p.Accumulators {
			acc = append(acc, blocks[bi])
		}
	}
	// A chunk that made no device call and freed all it allocated left the
	// allocator as it found it (free blocks coalesce around the persistent
	// ones), so every later chunk of its size would repeat it step for step.
	// A bare replay (no hooks, or hooks that run nothing) skips those, past
	// the recorded chunks, a run of equal sizes at a time: planning a batch
	// of 10⁹ in chunks of one then costs a few chunks, not 10⁹.
	bare := h == nil || !h.EveryChunk()
	repeats := -1 // size of the chunks known to repeat
	var before alloc.Stats
	n := chunks.Len()
	for ci := 0; ci < n; ci++ {
		c := chunks.At(ci)
		if bare {
			if c.Size == repeats && c.Index >= recorded {
				ci = chunks.after(ci) - 1
				continue
			}
			before = a.Stats()
		}
		for si, st := range p.Steps {
			buf := p.Buffers[max(st.Buf, 0)]
			switch st.Kind {
			case StepAlloc:
				blk, err := a.Malloc(buf.Bytes(c.Size), buf.Tag)
				if err != nil {
					return fail(err)
				}
				blocks[st.Buf] = blk
			case StepRun:
				if h != nil {
					nd := g.Node(st.Node)
					ins := make([]*alloc.Block, len(nd.Inputs))
					for i, in := range nd.Inputs {
						ins[i] = blocks[p.OutputBuf[in]]
					}
					var ws *alloc.Block
					if si > 0 && p.Steps[si-1].Kind == StepAlloc && p.Buffers[p.Steps[si-1].Buf].Kind == BufWorkspace {
						ws = blocks[p.Steps[si-1].Buf]
					}
					if ch, ok := h.(CompanionHooks); ok {
						for m := p.Companion[st.Node]; m >= 0; m = p.NextCompanion[m] {
							mi := g.Node(m).Inputs
							coIns := make([]*alloc.Block, len(mi))
							for i, in := range mi {
								coIns[i] = blocks[p.OutputBuf[in]]
							}
							ch.Companion(nd, m, blocks[p.OutputBuf[m]], coIns)
						}
					}
					if err := h.Run(nd, c, blocks[p.OutputBuf[st.Node]], ins, ws); err != nil {
						return fail(err)
					}
				}
			case StepFree:
				if err := a.Free(blocks[st.Buf]); err != nil {
					return fail(err)
				}
				if h != nil {
					h.Freed(buf, blocks[st.Buf])
				}
				blocks[st.Buf] = nil
			}
			mark(c.Index, si, st.Node, st.Kind)
		}
		for i, o := range p.Outputs {
			outBlocks[i] = blocks[p.OutputBuf[o]]
		}
		if h != nil {
			if err := h.ChunkDone(c, outBlocks, acc); err != nil {
				return fail(err)
			}
		}
		for i, o := range p.Outputs {
			bi := p.OutputBuf[o]
			if p.Buffers[bi].Kind != BufOutput || blocks[bi] == nil || (n == 1 && slices.Contains(p.Kept, o)) {
				continue // persistent, listed twice, or the single chunk's kept output (freed after Finish)
			}
			if err := a.Free(outBlocks[i]); err != nil {
				return fail(err)
			}
			if h != nil {
				h.Freed(p.Buffers[bi], outBlocks[i])
			}
			blocks[bi] = nil
			mark(c.Index, -1, o, StepFree)
		}
		if bare {
			s := a.Stats()
			if s.NumDeviceAlloc == before.NumDeviceAlloc && s.NumDeviceFree == before.NumDeviceFree &&
				s.Allocation[alloc.All].Current == before.Allocation[alloc.All].Current {
				repeats = c.Size
			}
		}
	}
	kept := acc
	if n == 1 {
		for _, k := range p.Kept {
			bi := p.OutputBuf[k]
			kept = append(kept, blocks[bi])
			if p.Buffers[bi].Kind == BufOutput { // not a view of a parameter
				owned = append(owned, bi)
			}
		}
	}
	var ws *alloc.Block
	if fw := p.FinishWorkspace; fw.Fixed > 0 && len(kept) > 0 {
		blk, err := a.Malloc(fw.Fixed, fw.Tag)
		if err != nil {
			return fail(err)
		}
		ws = blk
	}
	if h != nil {
		if err := h.Finish(kept, ws); err != nil {
			if ws != nil {
				_ = a.Free(ws) // the replay is failing already
			}
			return fail(err)
		}
	}
	if ws != nil {
		if err := a.Free(ws); err != nil {
			return fail(err)
		}
		if h != nil {
			h.Freed(p.FinishWorkspace, ws)
		}
	}
	for _, bi := range owned {
		if blocks[bi] == nil {
			continue // a kept output listed twice (two parameters sharing one gradient node)
		}
		if err := a.Free(blocks[bi]); err != nil {
			return fail(err)
		}
		if h != nil {
			h.Freed(p.Buffers[bi], blocks[bi])
		}
		blocks[bi] = nil
	}
	s := a.Stats()
	u.PeakReserved = s.ReservedBytes[alloc.All].Peak
	u.PeakAllocated = s.AllocatedBytes[alloc.All].Peak
	return u, nil
}
