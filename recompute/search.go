package recompute

import (
	"errors"
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Mode says whether a Session recomputes.
type Mode string

const (
	Off  Mode = ""     // chunks only (the default): no recomputation
	Auto Mode = "auto" // Search picks chunks and a recompute set
	// SelectiveOnly and FullCheckpoint force a candidate whatever the budget (the
	// planner still picks the chunks): "selective", or full checkpointing
	// (every block, plus selective), the last of Candidates.
	SelectiveOnly  Mode = "selective"
	FullCheckpoint Mode = "full"
)

// ParseMode reads "off" (or ""), "auto", "selective" or "full".
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case Off, "off":
		return Off, nil
	case Auto, SelectiveOnly, FullCheckpoint:
		return Mode(s), nil
	}
	return Off, fmt.Errorf("%w: recompute mode %q (want off, auto, selective or full)", ErrInvalid, s)
}

// Forced is the candidate a SelectiveOnly or FullCheckpoint mode runs (ok false for
// other modes, or when the graph has no such candidate).
func Forced(m Mode, g *graph.Graph, boundary int) (c Candidate, ok bool) {
	cs := Candidates(g, boundary)
	switch m {
	case SelectiveOnly:
		for _, c := range cs {
			if c.Name == "selective" {
				return c, true
			}
		}
	case FullCheckpoint:
		if len(cs) > 1 {
			return cs[len(cs)-1], true
		}
	}
	return Candidate{}, false
}

// ErrInvalid marks a bad option or profile.
var ErrInvalid = errors.New("recompute: invalid")

// Step is a training step to plan: its graph with forward nodes below
// Boundary (the loss is the last of them) and backward nodes from there
// on, and what Compile takes.
type Step struct {
	Graph    *graph.Graph
	Boundary int
	Outputs  []int
	Compile  planner.CompileOptions // Kept and Trained in Graph's ids
}

// Options configures Search.
type Options struct {
	Planner planner.Options
	Profile Profile // DefaultProfile when zero
	TF32    bool
	// PlanAll plans every candidate, pruning none: reports show the
	// alternatives' plans; the choice is the same.
	PlanAll bool
	// Resident, when set, gives each candidate program's
	// planner.Options.Resident (buffer indices differ between programs).
	Resident func(*planner.Program) []planner.Held
}

// Choice is one candidate: a recompute set, its program and its plan
// within the budget (Err when it does not fit).
type Choice struct {
	Name      string // "none", "selective", "blocks 6/12", "blocks 12/12+selective"
	Recompute []int  // forward node ids of Step.Graph recomputed (sorted)
	Copies    int    // nodes appended
	Program   *planner.Program
	Remap     []int // Step.Graph id → Program.Graph id
	Plan      *planner.Plan
	Cost      *Cost
	Time      float64 // predicted seconds per step; +Inf when it does not fit
	Err       error
}

// SamplesPerSec is the predicted throughput, 0 when it does not fit.
func (c *Choice) SamplesPerSec() float64 {
	if c.Plan == nil || c.Time <= 0 {
		return 0
	}
	return float64(c.Plan.Batch) / c.Time
}

// ExtraFLOPs is the recomputation's flops per step over plain's.
func (c *Choice) ExtraFLOPs(plain *Choice) float64 {
	if c.Cost == nil || plain == nil || plain.Cost == nil {
		return 0
	}
	return c.Cost.FLOPs - plain.Cost.FLOPs
}

// Result is Search's answer: the chosen candidate and every candidate
// priced (Plain and Full are the chunks-only and full-checkpointing
// alternatives, also in All).
type Result struct {
	Best        *Choice // nil when nothing fits
	Plain, Full *Choice
	All         []*Choice
}

// Candidate is a named recompute set.
type Candidate struct {
	Name string
	Set  []int // forward node ids, sorted
}

// Candidates lists the recompute sets Search tries, cheapest first: none,
// selective (cheap ops everywhere), the first k of K blocks for k = K/2,
// 3K/4 and K (whole-block checkpoints), and every block plus
// selective.
func Candidates(g *graph.Graph, boundary int) []Candidate {
	cs := []Candidate{{Name: "none"}}
	sel := Selective(g, boundary, nil)
	if len(sel) > 0 {
		cs = append(cs, Candidate{Name: "selective", Set: sel})
	}
	blocks := Blocks(g, boundary)
	k := len(blocks)
	var ks []int
	for _, q := range []int{k / 2, 3 * k / 4, k} {
		if q > 0 && !slices.Contains(ks, q) {
			ks = append(ks, q)
		}
	}
	for _, q := range ks {
		var set []int
		for _, b := range blocks[:q] {
			set = append(set, b.Nodes...)
		}
		slices.Sort(set)
		cs = append(cs, Candidate{Name: fmt.Sprintf("blocks %d/%d", q, k), Set: set})
	}
	if k > 0 {
		set := slices.Clone(cs[len(cs)-1].Set)
		skip := make([]bool, boundary)
		for _, id := range set {
			skip[id] = true
		}
		if more := Selective(g, boundary, skip); len(more) > 0 {
			set = append(set, more...)
			slices.Sort(set)
			cs = append(cs, Candidate{Name: fmt.Sprintf("blocks %d/%d+selective", k, k), Set: set})
		}
	}
	return cs
}

// Build transforms st for a recompute set and compiles it.
func Build(st Step, name string, set []int) (*Choice, error) {
	c := &Choice{Name: name, Recompute: set}
	g, remap := st.Graph, identity(st.Graph.Len())
	if len(set) > 0 {
		mark := make([]bool, st.Boundary)
		for _, id := range set {
			if id >= 0 && id < st.Boundary {
				mark[id] = true
			}
		}
		var err error
		if g, remap, c.Copies, err = Apply(st.Graph, st.Boundary, mark); err != nil {
			return nil, err
		}
	}
	c.Remap = remap
	outs := mapIDs(remap, st.Outputs)
	o := st.Compile
	o.Kept, o.Trained = mapIDs(remap, o.Kept), mapIDs(remap, o.Trained)
	info, err := shapeinfer.Analyze(g, outs...)
	if err != nil {
		return nil, err
	}
	if c.Program, err = planner.Compile(g, info, outs, o); err != nil {
		return nil, err
	}
	return c, nil
}

func identity(n int) []int {
	r := make([]int, n)
	for i := range r {
		r[i] = i
	}
	return r
}

func mapIDs(remap, ids []int) []int {
	if ids == nil {
		return nil
	}
	out := make([]int, len(ids))
	for i, id := range ids {
		out[i] = remap[id]
	}
	return out
}

// Search prices every candidate (Candidates) and returns the one with the
// highest predicted samples/s whose replayed peak fits o.Planner's budget,
// ties going to the lower peak. Each candidate's plan is planner.Make's
// largest chunk that fits, which is its fastest (a step's predicted time
// never grows when balanced chunks merge: every node's cost is convex in
// the chunk size with a non-negative cost at zero). A candidate whose
// whole-batch time cannot beat the best so far is priced but not planned,
// and when plain runs the whole batch in one chunk nothing else is planned:
// recomputation only adds work. So a larger budget never yields a slower
// plan, and no plan's peak exceeds its budget.
func Search(st Step, o Options) (*Result, error) {
	if o.Profile.Bandwidth <= 0 {
		o.Profile = DefaultProfile()
	}
	if err := o.Profile.Validate(); err != nil {
		return nil, err
	}
	res := &Result{}
	cands := Candidates(st.Graph, st.Boundary)
	var plainCost *Cost
	for i, cd := range cands {
		var c *Choice
		if i == 0 {
			var err error
			if c, err = Build(st, cd.Name, nil); err != nil {
				return nil, err
			}
			plainCost = NewCost(c.Program, o.Profile, o.TF32)
			c.Cost = plainCost
			res.Plain = c
		} else {
			mark := make([]bool, st.Boundary)
			for _, id := range cd.Set {
				mark[id] = true
			}
			copied := Copied(st.Graph, st.Boundary, mark)
			c = &Choice{Name: cd.Name, Recompute: cd.Set, Copies: len(copied), Cost: plainCost.Plus(st.Graph, copied)}
		}
		res.All = append(res.All, c)
		if i > 0 && i == len(cands)-1 {
			res.Full = c
		}
		n := st.Graph.Batch()
		// The candidate can beat the best so far only at chunks of at
		// least need samples (a step's time falls as chunks grow).
		need := 1
		if !o.PlanAll && res.Best != nil {
			if need = minChunk(c.Cost, n, res.Best.Time); need == 0 {
				c.Time, c.Err = inf, errPruned
				continue
			}
		}
		if c.Program == nil {
			built, err := Build(st, cd.Name, cd.Set)
			if err != nil {
				return nil, err
			}
			c.Program, c.Remap = built.Program, built.Remap
			// The built program's own price: the estimate above (plain's
			// nodes plus the copies') served the pruning.
			c.Cost = NewCost(c.Program, o.Profile, o.TF32)
		}
		po := o.Planner
		po.NoChunkList = true
		if o.Resident != nil {
			po.Resident = o.Resident(c.Program)
		}
		if !o.PlanAll && len(po.Resident) == 0 && !prefixFits(c.Program, po, planner.SplitOf(n, need)) {
			if need > 1 {
				c.Time, c.Err = inf, errPruned
			} else {
				c.Time, c.Err = inf, fmt.Errorf("%w: chunks of one sample do not fit", planner.ErrDoesNotFit)
			}
			continue
		}
		c.Plan, c.Err = planner.Make(c.Program, po)
		if c.Err != nil {
			if !errors.Is(c.Err, planner.ErrDoesNotFit) {
				return nil, c.Err
			}
			c.Plan, c.Time = nil, inf
			continue
		}
		c.Time = c.Cost.Step(c.Plan.Split)
		if res.Best == nil || c.Time < res.Best.Time || (c.Time == res.Best.Time && c.Plan.PeakReserved < res.Best.Plan.PeakReserved) {
			res.Best = c
		}
		if i == 0 && c.Plan.Split.K == 1 && !o.PlanAll {
			break // nothing beats the plain whole batch
		}
	}
	return res, nil
}

// minChunk is the smallest chunk size at which c's step beats best
// seconds, or 0 when even the whole batch does not.
func minChunk(c *Cost, n int, best float64) int {
	if c.Step(planner.SplitOf(n, n)) >= best {
		return 0
	}
	lo, hi := 0, n // Step at hi beats best; at lo (0: none) it does not
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if c.Step(planner.SplitOf(n, mid)) < best {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

// prefixFits is a necessary condition for planner.Make to choose chunks
// of at least s's on a device holding nothing: one replay of s's first two
// chunks (which allocate what later chunks reuse) within the budget. A
// replay of a prefix of s is the prefix of s's replay, so it peaks no
// higher.
func prefixFits(p *planner.Program, o planner.Options, s planner.Split) bool {
	avail := o.Budget - o.Headroom
	if o.Headroom == 0 && !o.NoHeadroom {
		avail = o.Budget - planner.DefaultHeadroom
	}
	if avail <= 0 {
		return false
	}
	chunks := []planner.Chunk{s.At(0)}
	if s.K > 1 {
		chunks = append(chunks, s.At(1))
	}
	a := alloc.New(alloc.NewSimBackend(avail), alloc.Options{})
	_, err := planner.Replay(p, chunks, a, nil, false)
	return err == nil
}

var inf = func() float64 { x := 1e308; return x * 10 }()

// errPruned marks a candidate that could not beat the best one found
// before it even in one chunk, so it was not planned.
var errPruned = errors.New("pruned: slower than the chosen plan even in one chunk")

// IsPruned reports whether the candidate was skipped by the search.
func (c *Choice) IsPruned() bool { return errors.Is(c.Err, errPruned) }
