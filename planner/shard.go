package planner

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// ShardOptions says how one rank of sharded data parallel (ZeRO) holds
// its training state, for Shard.
type ShardOptions struct {
	// Stage is ZeRO's: 1 shards the optimizer state, 2 the gradients too,
	// 3 the parameters too.
	Stage int
	// Ranks is the world size.
	Ranks int
	// BucketBytes is the flat bucket gradients are copied into and
	// reduce-scattered from (stages 2 and 3); 25 MiB if 0.
	BucketBytes int64
	// Prefetch is how many parameters' gathers (stage 3) are allocated
	// ahead of the one in use, in the order the step reads them: the
	// next ones' all-gathers overlap this one's compute. 1 if 0; −1 for
	// none.
	Prefetch int
}

// ShardBytes is what one rank holds under a sharded program, per kind.
// Every rank holds the same: the flat parameter space is padded to Ranks
// equal shards.
type ShardBytes struct {
	Stage, Ranks int
	// Total is the trained parameters' elements, ShardLen ⌈Total/Ranks⌉,
	// the elements of each rank's shard.
	Total, ShardLen int64
	// Params are the persistent parameter bytes: the whole parameters
	// (stages 1, 2) or the rank's shard (stage 3), constants excluded.
	Params int64
	// Grads is the rank's persistent gradient shard (stages 2, 3); 0 for
	// stage 1, whose whole gradients live in the step as without ZeRO.
	Grads int64
	// State is the rank's optimizer state: StateSlots shards.
	State int64
	// Bucket is the flat gradient bucket (stages 2, 3).
	Bucket int64
	// Constants are the program's constants, held as without sharding.
	Constants int64
	// Gather is the largest sum of gathered parameters held at once
	// (stage 3), from the schedule.
	Gather int64
}

// Persistent is the bytes a rank holds across steps: parameters (or
// their shard), gradient shard, state shards, bucket and constants
// (Plan.Persistent of the sharded program).
func (b ShardBytes) Persistent() int64 { return b.Params + b.Grads + b.State + b.Bucket + b.Constants }

// ShardScope is the tag scope of a sharded program's flat buffers (the
// state and gradient shards, the parameter shard, the bucket), which
// belong to no module.
const ShardScope = "zero"

// Shard returns the program one rank of sharded data parallel (ZeRO)
// runs in place of p, a training program (Trained and Kept paired), and
// what the rank holds. The schedule is p's; what changes is what is held:
//
//   - Stage ≥ 1: the optimizer state is StateSlots flat shards of
//     ShardLen elements, in place of a state buffer per parameter.
//   - Stage ≥ 2: each gradient is freed once its last reader has run
//     (its values copied into the bucket, reduce-scattered into the
//     rank's flat gradient shard, persistent); there are no chunk
//     accumulators, the shard accumulating the chunks' sums.
//   - Stage 3: each trained parameter's persistent buffer is replaced by
//     the rank's flat parameter shard; the whole parameter is gathered
//     into a buffer allocated before its first read in the forward
//     (Prefetch reads ahead) and freed after its last read there, and
//     again for the backward.
//
// Planned like any program (Make), it gives the rank's peak through the
// same allocator replay. The parameters must share one element type.
func Shard(p *Program, o ShardOptions) (*Program, ShardBytes, error) {
	var sb ShardBytes
	if o.Stage < 1 || o.Stage > 3 || o.Ranks < 1 {
		return nil, sb, graph.Errorf(graph.ErrAttr, "planner: shard: ZeRO stage %d over %d ranks (want stage 1, 2 or 3 over at least one rank)", o.Stage, o.Ranks)
	}
	if len(p.Trained) == 0 || len(p.Kept) != len(p.Trained) {
		return nil, sb, graph.Errorf(graph.ErrAttr, "planner: shard: a training program's trained parameters and their gradients are needed (%d trained, %d kept)", len(p.Trained), len(p.Kept))
	}
	if o.BucketBytes <= 0 {
		o.BucketBytes = 25 << 20
	}
	if o.Prefetch == 0 {
		o.Prefetch = 1
	}
	g := p.Graph
	var esz int64
	trained := map[int]bool{}
	for _, id := range p.Trained {
		t := g.Node(id).Type
		n := int64(graph.Numel(t.Shape))
		if n == 0 {
			continue
		}
		e := t.Bytes() / n
		if esz != 0 && e != esz {
			return nil, sb, graph.Errorf(graph.ErrDType, "planner: shard: parameter %q has %d-byte elements, another %d: the flat shard needs one type", g.Node(id).Name, e, esz)
		}
		esz = e
		sb.Total += n
		trained[id] = true
	}
	sb.Stage, sb.Ranks = o.Stage, o.Ranks
	sb.ShardLen = (sb.Total + int64(o.Ranks) - 1) / int64(o.Ranks)
	shardBytes := sb.ShardLen * esz

	q := *p
	q.Buffers = slices.Clone(p.Buffers)
	add := func(b Buffer) int {
		q.Buffers = append(q.Buffers, b)
		return len(q.Buffers) - 1
	}
	zeroTag := func(op string) alloc.Tag { return alloc.Tag{Node: p.Trained[0], Op: op, Scope: ShardScope} }
	slots := 0
	var persistent []int
	for _, bi := range p.Persistent {
		b := p.Buffers[bi]
		switch {
		case b.Kind == BufState:
			slots = max(slots, b.Slot+1)
			continue
		case o.Stage == 3 && b.Kind == BufParam && trained[b.Node]:
			continue
		case b.Kind == BufParam && g.Node(b.Node).Op == graph.OpParam:
			sb.Params += b.Fixed
		default:
			sb.Constants += b.Fixed
		}
		persistent = append(persistent, bi)
	}
	if o.Stage == 3 {
		sb.Params = shardBytes
		persistent = append(persistent, add(Buffer{Kind: BufShard, Node: p.Trained[0], Slot: 0, Fixed: shardBytes, Tag: zeroTag("param_shard")}))
	}
	for s := range slots {
		persistent = append(persistent, add(Buffer{Kind: BufState, Node: p.Trained[0], Slot: s, Fixed: shardBytes, Tag: zeroTag(StateOp(s) + "_shard")}))
		sb.State += shardBytes
	}
	if o.Stage >= 2 {
		persistent = append(persistent, add(Buffer{Kind: BufShard, Node: p.Trained[0], Slot: 1, Fixed: shardBytes, Tag: zeroTag("grad_shard")}))
		persistent = append(persistent, add(Buffer{Kind: BufGather, Node: p.Trained[0], Slot: 0, Fixed: o.BucketBytes, Tag: zeroTag("grad_bucket")}))
		sb.Grads, sb.Bucket = shardBytes, o.BucketBytes
		q.Accumulators = nil
	}
	q.Persistent = persistent

	// The steps that read each buffer (a run step whose node has it as an
	// input, views followed) and the step that writes it.
	readers := map[int][]int{}
	writer := map[int]int{}
	for si, st := range p.Steps {
		if st.Kind != StepRun {
			continue
		}
		nd := g.Node(st.Node)
		if bi := p.OutputBuf[st.Node]; bi >= 0 {
			writer[bi] = si
		}
		for _, in := range uniqueBuffers(p, nd.Inputs) {
			readers[in] = append(readers[in], si)
		}
	}
	before := map[int][]Step{} // inserted before step i (after what came before)
	after := map[int][]Step{}  // inserted after step i
	// start is where to insert an allocation ahead of run step si: before
	// the allocations of its node's output and workspace.
	start := func(si int) int {
		nd := p.Steps[si].Node
		for si > 0 && p.Steps[si-1].Kind == StepAlloc && p.Steps[si-1].Node == nd {
			si--
		}
		return si
	}
	// end is where to insert a free after run step si: after its
	// workspace's free.
	end := func(si int) int {
		nd := p.Steps[si].Node
		for si+1 < len(p.Steps) && p.Steps[si+1].Kind == StepFree && p.Steps[si+1].Node == nd && p.Buffers[p.Steps[si+1].Buf].Kind == BufWorkspace {
			si++
		}
		return si
	}
	if o.Stage >= 2 {
		seen := map[int]bool{}
		for _, k := range p.Kept {
			bi := p.OutputBuf[k]
			if bi < 0 || seen[bi] || p.Buffers[bi].Kind != BufOutput {
				continue // a view of a parameter, or listed twice
			}
			seen[bi] = true
			last, ok := writer[bi]
			if !ok {
				continue
			}
			for _, r := range readers[bi] {
				last = max(last, r)
			}
			last = end(last)
			after[last] = append(after[last], Step{Kind: StepFree, Node: p.Buffers[bi].Node, Buf: bi})
		}
	}
	if o.Stage == 3 {
		loss := p.Outputs[0]
		type use struct{ first, last, buf int }
		var fwd, bwd []use
		for _, id := range p.Trained {
			bi := p.OutputBuf[id]
			if !trained[id] || bi < 0 {
				continue
			}
			var f, b []int
			for _, si := range readers[bi] {
				if p.Steps[si].Node <= loss {
					f = append(f, si)
				} else {
					b = append(b, si)
				}
			}
			for i, us := range [][]int{f, b} {
				if len(us) == 0 {
					continue
				}
				tag := p.Buffers[bi].Tag
				tag.Op = [...]string{"all_gather", "all_gather_backward"}[i]
				u := use{first: slices.Min(us), last: slices.Max(us), buf: add(Buffer{Kind: BufGather, Node: id, Slot: 1 + i, Fixed: p.Buffers[bi].Fixed, Tag: tag})}
				if i == 0 {
					fwd = append(fwd, u)
				} else {
					bwd = append(bwd, u)
				}
			}
		}
		for _, phase := range [][]use{fwd, bwd} {
			slices.SortStableFunc(phase, func(a, b use) int { return a.first - b.first })
			for i, u := range phase {
				at := u.first
				if o.Prefetch > 0 { // allocated when the read Prefetch places ahead starts
					at = phase[max(i-o.Prefetch, 0)].first
				}
				at = start(at)
				before[at] = append(before[at], Step{Kind: StepAlloc, Node: u.buf, Buf: u.buf})
				e := end(u.last)
				after[e] = append(after[e], Step{Kind: StepFree, Node: u.buf, Buf: u.buf})
			}
		}
	}
	q.Steps = make([]Step, 0, len(p.Steps)+len(q.Buffers))
	for si, st := range p.Steps {
		q.Steps = append(q.Steps, before[si]...)
		q.Steps = append(q.Steps, st)
		q.Steps = append(q.Steps, after[si]...)
	}
	// A gather step names its buffer's parameter node.
	for i, st := range q.Steps {
		if st.Kind != StepRun && q.Buffers[st.Buf].Kind == BufGather {
			q.Steps[i].Node = q.Buffers[st.Buf].Node
		}
	}
	if o.Stage == 3 {
		var cur, peak int64
		for _, st := range q.Steps {
			if st.Kind == StepRun || q.Buffers[st.Buf].Kind != BufGather {
				continue
			}
			if st.Kind == StepAlloc {
				cur += q.Buffers[st.Buf].Fixed
			} else {
				cur -= q.Buffers[st.Buf].Fixed
			}
			peak = max(peak, cur)
		}
		sb.Gather = peak
	}
	q.sig = q.signature()
	if err := q.checkSteps(); err != nil {
		return nil, sb, fmt.Errorf("planner: shard: %w", err)
	}
	return &q, sb, nil
}

// checkSteps checks that every chunk buffer is allocated before it is
// freed and freed at most once.
func (p *Program) checkSteps() error {
	live := map[int]bool{}
	for i, st := range p.Steps {
		switch st.Kind {
		case StepAlloc:
			if live[st.Buf] {
				return fmt.Errorf("step %d allocates buffer %d twice", i, st.Buf)
			}
			live[st.Buf] = true
		case StepFree:
			if !live[st.Buf] {
				return fmt.Errorf("step %d frees buffer %d, which is not allocated", i, st.Buf)
			}
			delete(live, st.Buf)
		}
	}
	return nil
}
