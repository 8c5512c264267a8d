package memviz

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// SimOptions configures Simulate.
type SimOptions struct {
	// Capacity of the simulated device in bytes; 0 means unlimited.
	Capacity int64
	// TraceEntries keeps that many allocator events in the peak snapshot;
	// outside 0…alloc.MaxTraceEntries Simulate fails with alloc.ErrInvalid.
	TraceEntries int
}

// Simulation is what a replay on a simulated device predicts.
type Simulation struct {
	Usage planner.Usage // peaks and timeline
	// Peak is the timeline point where allocated bytes first reach their
	// peak inside the chunk program, and Snapshot the allocator's state
	// there: what memory_viz users look at first.
	Peak     planner.Point
	Snapshot alloc.Snapshot
	// End is the allocator's state after the step: parameters and
	// optimizer state held, everything else freed into cached segments;
	// what a training loop holds between steps.
	End alloc.Snapshot
}

// unlimited is a simulated capacity no program reaches: 1 EiB.
const unlimited = 1 << 60

// Simulate replays p for chunks on a fresh simulated device, as the planner
// does, and captures the allocator's snapshot while the node at the peak
// runs.
func Simulate(p *planner.Program, chunks []planner.Chunk, o SimOptions) (*Simulation, error) {
	trace := alloc.Options{TraceEntries: o.TraceEntries}
	if err := trace.Validate(); err != nil {
		return nil, err
	}
	capacity := o.Capacity
	if capacity == 0 {
		capacity = unlimited
	}
	u, err := planner.Replay(p, chunks, alloc.New(alloc.NewSimBackend(capacity), alloc.Options{}), nil, true)
	if err != nil {
		return nil, err
	}
	s := &Simulation{Usage: u, Peak: planner.Point{Chunk: -1, Step: -1, Node: -1}}
	for _, pt := range u.Timeline {
		if pt.Kind == planner.StepRun && (s.Peak.Node < 0 || pt.Allocated > s.Peak.Allocated) {
			s.Peak = pt
		}
	}
	a := alloc.New(alloc.NewSimBackend(capacity), trace)
	h := &snapAt{a: a, chunk: s.Peak.Chunk, node: s.Peak.Node}
	if _, err := planner.Replay(p, chunks, a, h, false); err != nil {
		return nil, err
	}
	s.End = a.Snapshot()
	if h.taken {
		s.Snapshot = h.snap
	} else { // no node ran: the persistent buffers are all there is
		s.Snapshot = s.End
	}
	return s, nil
}

// snapAt is a planner.Hooks that runs nothing and snapshots the allocator
// when node runs in chunk.
type snapAt struct {
	a           *alloc.Allocator
	chunk, node int
	snap        alloc.Snapshot
	taken       bool
}

func (h *snapAt) Resident(planner.Buffer) *alloc.Block                          { return nil }
func (h *snapAt) Fill(planner.Buffer, *alloc.Block) error                       { return nil }
func (h *snapAt) Freed(planner.Buffer, *alloc.Block)                            {}
func (h *snapAt) ChunkDone(planner.Chunk, []*alloc.Block, []*alloc.Block) error { return nil }
func (h *snapAt) Finish([]*alloc.Block, *alloc.Block) error                     { return nil }
func (h *snapAt) EveryChunk() bool                                              { return true }

func (h *snapAt) Run(nd *graph.Node, c planner.Chunk, _ *alloc.Block, _ []*alloc.Block, _ *alloc.Block) error {
	if !h.taken && c.Index == h.chunk && nd.ID == h.node {
		h.snap, h.taken = h.a.Snapshot(), true
	}
	return nil
}
