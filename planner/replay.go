package planner

import (
	"fmt"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Chunk is a contiguous range of the batch run at once.
type Chunk struct {
	Index, Start, Size int
}

// Chunks splits n samples into k balanced chunks: sizes differ by at most
// one, larger ones first (100 in 4 → 25, 25, 25, 25; 10 in 3 → 4, 3, 3).
func Chunks(n, k int) []Chunk {
	cs := make([]Chunk, k)
	start := 0
	for i := range cs {
		size := n / k
		if i < n%k {
			size++
		}
		cs[i] = Chunk{Index: i, Start: start, Size: size}
		start += size
	}
	return cs
}

// ChunksOf splits n samples into the fewest balanced chunks of at most b.
func ChunksOf(n, b int) []Chunk { return Chunks(n, (n+b-1)/b) }

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
	var parts []string
	for i := 0; i < len(sizes); {
		j := i
		for j < len(sizes) && sizes[j] == sizes[i] {
			j++
		}
		parts = append(parts, fmt.Sprintf("%d × %d", j-i, sizes[i]))
		i = j
	}
	return strings.Join(parts, " + ")
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
	Finish(kept []*alloc.Block) error
	// EveryChunk reports whether the hooks must see every chunk. Hooks
	// that compute or observe say true; a simulation that only keeps
	// buffers resident says false, and a replay without a timeline then
	// skips chunks known to repeat, as it does with nil hooks.
	EveryChunk() bool
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
}

// Replay walks p for the given chunks through a, calling h (when not nil)
// at each step. Persistent buffers are allocated first, unless h says they
// are resident; chunk buffers are freed as the program says, and outputs at
// the end of each chunk. Peaks are measured from the allocator's stats,
// reset at the start.
func Replay(p *Program, chunks []Chunk, a *alloc.Allocator, h Hooks, record bool) (Usage, error) {
	a.ResetPeak()
	var u Usage
	mark := func(c, step, node int, k StepKind) {
		if record {
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
	if len(chunks) > 1 {
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
	if len(chunks) > 1 {
		for _, bi := range p.Accumulators {
			acc = append(acc, blocks[bi])
		}
	}
	// A chunk that made no device call and freed all it allocated left the
	// allocator as it found it (free blocks coalesce around the persistent
	// ones), so every later chunk of its size would repeat it step for step.
	// A bare replay (no hooks, no timeline) skips those: planning a batch
	// of thousands in chunks of one then costs a few chunks, not thousands.
	bare := (h == nil || !h.EveryChunk()) && !record
	repeats := -1 // size of the chunks known to repeat
	var before alloc.Stats
	for _, c := range chunks {
		if bare {
			if c.Size == repeats {
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
		last := c.Index == len(chunks)-1
		for i, o := range p.Outputs {
			bi := p.OutputBuf[o]
			if p.Buffers[bi].Kind != BufOutput || blocks[bi] == nil || (last && len(chunks) == 1 && slices.Contains(p.Kept, o)) {
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
	if len(chunks) == 1 {
		for _, k := range p.Kept {
			bi := p.OutputBuf[k]
			kept = append(kept, blocks[bi])
			if p.Buffers[bi].Kind == BufOutput { // not a view of a parameter
				owned = append(owned, bi)
			}
		}
	}
	if h != nil {
		if err := h.Finish(kept); err != nil {
			return fail(err)
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
