package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
)

// bytesFlag is a flag of a byte count written as alloc.ParseBytes reads
// it: 8GiB, 512MiB, 8GB or plain bytes.
type bytesFlag struct{ n *int64 }

func (f bytesFlag) String() string {
	if f.n == nil {
		return "0"
	}
	return fmt.Sprint(*f.n)
}

func (f bytesFlag) Set(s string) error {
	n, err := alloc.ParseBytes(s)
	if err != nil {
		return err
	}
	*f.n = n
	return nil
}

// unlimitedCapacity is a simulated device no plan fills (1 EiB), for
// measuring what a chunk list needs.
const unlimitedCapacity = 1 << 60

// keepResident is the planner's own simulation's hooks: parameters and
// optimizer state stay allocated from one replay to the next, as the
// executor keeps them resident, and nothing runs.
type keepResident struct{ blocks map[residentKey]*alloc.Block }

type residentKey struct {
	kind       planner.BufferKind
	node, slot int
}

func keyOf(b planner.Buffer) residentKey { return residentKey{b.Kind, b.Node, b.Slot} }

func (k *keepResident) Resident(b planner.Buffer) *alloc.Block { return k.blocks[keyOf(b)] }
func (k *keepResident) Fill(b planner.Buffer, blk *alloc.Block) error {
	if b.Kind == planner.BufParam || b.Kind == planner.BufState {
		k.blocks[keyOf(b)] = blk
	}
	return nil
}
func (*keepResident) Run(*graph.Node, planner.Chunk, *alloc.Block, []*alloc.Block, *alloc.Block) error {
	return nil
}
func (*keepResident) Freed(planner.Buffer, *alloc.Block)                            {}
func (*keepResident) ChunkDone(planner.Chunk, []*alloc.Block, []*alloc.Block) error { return nil }
func (*keepResident) Finish([]*alloc.Block, *alloc.Block) error                     { return nil }
func (*keepResident) EveryChunk() bool                                              { return true }

// simulateSteps replays two training steps of p in chunks on a fresh
// simulated device of capacity bytes, through the caching allocator, as
// planner.Make judges a chunk list: the second step finds parameters and
// optimizer state resident and the first step's segments cached. The usage
// is the larger of the two steps'; fits is false when either ran out of
// memory.
func simulateSteps(p *planner.Program, chunks []planner.Chunk, capacity int64) (u planner.Usage, fits bool, err error) {
	return replaySteps(p, chunks, alloc.New(alloc.NewSimBackend(capacity), alloc.Options{}))
}

// replaySteps is simulateSteps on allocator a.
func replaySteps(p *planner.Program, chunks []planner.Chunk, a *alloc.Allocator) (u planner.Usage, fits bool, err error) {
	h := &keepResident{blocks: map[residentKey]*alloc.Block{}}
	for range 2 {
		s, err := planner.Replay(p, chunks, a, h, false)
		if errors.Is(err, alloc.ErrOutOfMemory) {
			return u, false, nil
		}
		if err != nil {
			return u, false, err
		}
		u.PeakReserved = max(u.PeakReserved, s.PeakReserved)
		u.PeakAllocated = max(u.PeakAllocated, s.PeakAllocated)
	}
	return u, true, nil
}

// tightPlan is planner.Make's plan of a step within a budget and the plan
// one size up: the fewest chunks a larger chunk size gives.
type tightPlan struct {
	plan *planner.Plan
	// next is the chunk list of the smallest chunk size above the plan's
	// chunk count (nil when the whole batch runs at once): ChunksOf(N,
	// ⌈N/(k−1)⌉), k−1 balanced chunks for all but tiny chunks.
	next      []planner.Chunk
	nextUsage planner.Usage // next's two-step peaks on an unlimited device
	nextFits  bool          // whether next's two steps fit a device of the budget
}

// planTight plans p within budget bytes (the plan's budget: what the
// executor may reserve, less its Overhead) and simulates the next larger
// chunk size against the same budget.
func planTight(p *planner.Program, budget int64) (*tightPlan, error) {
	pl, err := planner.Make(p, planner.Options{Budget: budget})
	if err != nil {
		return nil, err
	}
	t := &tightPlan{plan: pl}
	k, n := len(pl.Chunks), pl.Batch
	if k == 1 {
		return t, nil
	}
	t.next = planner.ChunksOf(n, (n+k-2)/(k-1))
	if t.nextUsage, _, err = simulateSteps(p, t.next, unlimitedCapacity); err != nil {
		return nil, err
	}
	if _, t.nextFits, err = simulateSteps(p, t.next, budget); err != nil {
		return nil, err
	}
	return t, nil
}

// tightness plans the model's step at its tightness batch within
// c.budget, as the executor will run it (the plan's budget is c.budget
// less Overhead, the cuBLAS workspace outside every plan), runs two real
// steps in the planned chunks, and simulates the next larger chunk size,
// which must need more than the budget.
func tightness(d *cuda.Device, c config, m benchModel) (Record, error) {
	r := Record{Kind: "tightness", Model: m.name, About: m.about, Batch: m.tight, Seq: m.seq, Optimizer: m.optName,
		Budget: c.budget}
	mod := m.module(nn.Seed(1))
	if err := nn.Check(mod); err != nil {
		return r, err
	}
	r.Params = int64(nn.NumParams(mod))
	loss, _ := m.build(mod, m.tight, rand.New(rand.NewPCG(6, 7)))
	e, err := cuda.NewExecutor(d, c.executorOptions())
	if err != nil {
		return r, err
	}
	defer e.Close()
	r.Overhead = e.Overhead()
	if c.budget <= r.Overhead {
		return r, fmt.Errorf("%s: budget %s is no more than the executor's overhead %s", m.name,
			alloc.FormatBytes(c.budget), alloc.FormatBytes(r.Overhead))
	}

	start := time.Now()
	p, _, err := compileStep(e.Workspace(), c.policy(), c.train(), loss, nn.Trainable(mod), 2)
	if err != nil {
		return r, err
	}
	tp, err := planTight(p, c.budget-r.Overhead)
	if err != nil {
		return r, err
	}
	r.PlanSeconds = time.Since(start).Seconds()
	pl := tp.plan
	r.Chunks, r.ChunkSizes = len(pl.Chunks), planner.Sizes(pl.Chunks)
	r.PredictedPeakReserved, r.PredictedPeakAllocated = pl.PeakReserved, pl.PeakAllocated
	if tp.next != nil {
		r.NextChunks, r.NextChunkSizes = len(tp.next), planner.Sizes(tp.next)
		r.NextPeakReserved = tp.nextUsage.PeakReserved
		r.NextOutOfMemory = !tp.nextFits
	}
	fmt.Fprintf(os.Stderr, "gobench: %s tightness: batch %d within %s runs as %s (predicted peak %s + overhead %s)",
		m.name, m.tight, alloc.FormatBytes(c.budget), planner.DescribeSizes(r.ChunkSizes),
		alloc.FormatBytes(pl.PeakReserved), alloc.FormatBytes(r.Overhead))
	if tp.next != nil {
		fmt.Fprintf(os.Stderr, "; %s would need %s", planner.DescribeSizes(r.NextChunkSizes), alloc.FormatBytes(r.NextPeakReserved))
	}
	fmt.Fprintln(os.Stderr)

	// Two steps on the card in the planned chunks, as a training loop runs
	// them (parameters and optimizer state resident, gradients on the
	// device), since the plan covers the steady state of a second step.
	before, _, err := used(d)
	if err != nil {
		return r, err
	}
	r.DeviceUsedBefore = before
	// The plan was judged on a simulated device of the budget: the
	// executor's allocator is capped there too (Overhead included), so it
	// releases its cache where the simulation did.
	e.Allocator().SetLimit(c.budget)
	opt := m.optimizer()
	var res *cuda.Result
	for step := range 2 {
		start = time.Now()
		res, err = e.Execute(context.Background(), p, pl.Chunks,
			cuda.ExecOptions{Resident: true, Optimizer: opt, KeptOnDevice: true})
		r.VerifySeconds = time.Since(start).Seconds()
		if err != nil {
			return r, fmt.Errorf("%s step %d at batch %d in %d chunks: %w", m.name, step, m.tight, len(pl.Chunks), err)
		}
		if step == 0 {
			r.FirstLoss = scalar(res.Outputs[0])
		}
		r.MeasuredPeakReserved = max(r.MeasuredPeakReserved, res.Usage.PeakReserved)
		r.MeasuredPeakAllocated = max(r.MeasuredPeakAllocated, res.Usage.PeakAllocated)
	}
	r.Verified = true
	r.LastLoss = scalar(res.Outputs[0])
	if r.DeviceUsedPeak, _, err = used(d); err != nil {
		return r, err
	}
	return r, nil
}
