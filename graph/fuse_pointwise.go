package graph

import (
	"math"
	"slices"
)

// FusePointwise is a graph pass over a graph whose nodes are all typed (a
// forward graph, or a training graph after autodiff and the pattern
// fusions): it finds connected groups of pointwise ops (unary, scalar and
// binary elementwise ops with broadcasting, casts, expand, the elementwise
// gradients silu_grad, gelu_grad and relu_grad, sum, mean or max over the
// last axis with KeepDim, and a column sum: sum with KeepDim over every
// axis but the last, rows of at least minColSumCols) and puts
// fused_pointwise nodes in place of each group: one node for each value
// the group gives to the rest of the graph (or to outputs), each
// computing it from the group's inputs.
//
// A group's members are batched float values of one iteration shape S
// (per element, shape S) or rows of it (per row: S with its last dimension
// 1, after a reduction over the last axis); a reduction never runs along
// the batch axis, so every row lies in one sample and the graph stays
// chunkable. No group reads, through nodes outside it or through another
// group, a value it makes (that would be a cycle; such groups stay plain
// nodes). Nodes that an executor pairs as companions (CompanionProducer:
// an add and the rms_norm it feeds, a cast of a norm's gradient, …) stay
// as they are, so the hand-fused kernels keep their pairs. Groups of one
// shape that read one value made outside any group merge into one
// (siblings: a backward's two gradients from one output gradient) when
// that holds nothing longer and makes no cycle. A column sum joins the
// group of the value it sums (a written RMSNorm's weight gradient, summed
// in the kernel that computes its terms rather than stored and read back),
// and no member reads it: it is complete only when the kernel ends. A
// group of one node that recomputes nothing is left alone. The nodes a
// group gives follow one another, the first giving its expression's
// output 0, so an executor computes them all in one pass
// (FusedPointwiseProducer).
//
// Preconditions: every node typed (as Append leaves them), outputs naming
// nodes of g (others are ignored). The pass reads g and returns a new
// graph; g is left as it is.
//
// Save or recompute: a value v of group A read by other groups (a
// backward chain reading a forward intermediate) is recomputed inside
// each of them from A's inputs, rather than kept from A until they run,
// when every reader of v outside A is in a group over A's shape (else v
// is kept anyway and recomputing saves nothing), v's cone in A holds at
// most maxRecompute ops, and the inputs of the cone that nothing else
// keeps alive until the last of those groups total no more bytes than v
// (v's bytes are freed; theirs are held longer). A value no reader
// outside its group still needs is not given at all, so the planner sees
// exactly what is kept.
//
// Intermediates are computed in float32 and not rounded to their 16-bit
// dtypes; explicit narrowing casts round. Values a group gives are stored
// in their own dtypes. Nodes move only as far as the fused nodes need
// (a reader of a group's value comes after the group's node). ids[i] is
// old node i's id in the new graph, −1 for a member no one reads.
func FusePointwise(g *Graph, outputs []int) (*Graph, []int, error) {
	f := newPWFuser(g, outputs)
	f.group()
	f.siblings()
	f.acyclic()
	f.recompute()
	return f.build()
}

// maxRecompute bounds the ops of a cone that a group recomputes.
const maxRecompute = 24

// minColSumCols is the shortest row a column sum fuses over: a kernel
// with a column sum runs a fixed grid of blocks over the rows, each
// thread accumulating its own columns, which short rows leave mostly idle.
const minColSumCols = 128

type pwGroup struct {
	members []int // node ids, ascending
	s       []int // iteration shape
	last    int   // largest member id
	absorb  []int // members of other groups this one recomputes, ascending
	outs    []int // members given to the rest of the graph, ascending
	state   pwState
	dag     *Pointwise
	inputs  []int // old ids of the fused nodes' inputs, in input order
	emitted bool
}

// pwState is what becomes of a group.
type pwState uint8

const (
	pwLive    pwState = iota // fused: its nodes give outs
	pwSmall                  // one node, or merged into another group: left alone
	pwGivenUp                // its fused nodes would not type: left alone
	pwGone                   // every value recomputed by its readers: dropped
)

type pwFuser struct {
	g        *Graph
	outputs  []int
	isOut    []bool
	readers  [][]int // reader node ids of each node
	lastUse  []int   // largest reader id (MaxInt for outputs)
	excluded []bool
	colSum   []bool // a column sum (pointwiseOp's third kind of member)
	grp      []int  // group of each node, −1 for none
	groups   []*pwGroup
	mark     []int // stamp array for searches
	stamp    int
}

func newPWFuser(g *Graph, outputs []int) *pwFuser {
	n := g.Len()
	f := &pwFuser{g: g, outputs: outputs, isOut: make([]bool, n), readers: make([][]int, n), lastUse: make([]int, n),
		excluded: make([]bool, n), colSum: make([]bool, n), grp: make([]int, n), mark: make([]int, n)}
	for i := range n {
		f.grp[i] = -1
		f.lastUse[i] = -1
		for _, in := range g.Node(i).Inputs {
			f.readers[in] = append(f.readers[in], i)
			f.lastUse[in] = max(f.lastUse[in], i)
		}
		if p := CompanionProducer(g, i); p >= 0 {
			f.excluded[i], f.excluded[p] = true, true
		}
	}
	for _, o := range outputs {
		if o >= 0 && o < n {
			f.isOut[o] = true
			f.lastUse[o] = math.MaxInt
		}
	}
	return f
}

// pointwiseOp reports whether node n may join a group, and its iteration
// shape and whether it is per row there: a reduction's is its input's. A
// column sum (sets f.colSum) is per element: it sums a per-element value.
func (f *pwFuser) pointwiseOp(i int) (s []int, row, ok bool) {
	n := f.g.Node(i)
	if n.Op == OpSum && !f.excluded[i] && n.Type.DType.IsFloat() && len(n.Inputs) == 1 {
		if x := f.g.Node(n.Inputs[0]).Type; x.DType.IsFloat() && isColSum(n.Attrs, x) {
			f.colSum[i] = true // a cross-batch value: not Batched
			return x.Shape, false, true
		}
	}
	if f.excluded[i] || !n.Type.DType.IsFloat() || !n.Type.Batched() {
		return nil, false, false
	}
	for _, in := range n.Inputs {
		if !f.g.Node(in).Type.DType.IsFloat() {
			return nil, false, false
		}
	}
	switch n.Op {
	case OpNeg, OpExp, OpLog, OpSqrt, OpAbs, OpTanh, OpSigmoid, OpRelu, OpGelu, OpSign, OpSilu, OpCast,
		OpAddScalar, OpSubScalar, OpRSubScalar, OpMulScalar, OpDivScalar, OpRDivScalar, OpPowScalar, OpMaximumScalar,
		OpAdd, OpSub, OpMul, OpDiv, OpPow, OpMaximum, OpSiluGrad, OpGeluGrad, OpReluGrad:
		return n.Type.Shape, false, true
	case OpExpand:
		x := f.g.Node(n.Inputs[0]).Type.Shape
		if len(x) != len(n.Type.Shape) || len(x) == 0 || x[len(x)-1] != 1 || n.Type.Shape[len(x)-1] == 1 ||
			!slices.Equal(x[:len(x)-1], n.Type.Shape[:len(x)-1]) {
			return nil, false, false
		}
		return n.Type.Shape, false, true
	case OpSum, OpMean, OpMax:
		x := f.g.Node(n.Inputs[0]).Type
		r := len(x.Shape)
		if !n.Attrs.KeepDim || r == 0 || !slices.Equal(n.Attrs.Axes, []int{r - 1}) || x.Shape[r-1] <= 1 ||
			x.BatchAxis == r-1 || !x.Batched() {
			return nil, false, false
		}
		return x.Shape, true, true
	}
	return nil, false, false
}

// isColSum reports whether a sum with attrs over x is a column sum a
// group can give: KeepDim, over every axis but the last, which is not the
// batch axis and holds at least minColSumCols.
func isColSum(a Attrs, x Type) bool {
	r := len(x.Shape)
	if !a.KeepDim || r < 2 || x.BatchAxis < 0 || x.BatchAxis == r-1 || x.Shape[r-1] < minColSumCols || len(a.Axes) != r-1 {
		return false
	}
	for d, ax := range a.Axes {
		if ax != d {
			return false
		}
	}
	return true
}

// levelIn is whether node i, of iteration shape si and per row or not
// there, fits a group of shape s, and whether it is per row in it.
func levelIn(si []int, row bool, s []int) (bool, bool) {
	if slices.Equal(si, s) {
		return true, row
	}
	r := len(s)
	if !row && len(si) == r && r > 0 && si[r-1] == 1 && s[r-1] != 1 && slices.Equal(si[:r-1], s[:r-1]) {
		return true, true
	}
	return false, false
}

// group forms the groups in node order: each pointwise node joins the
// groups of its inputs it fits (merging them) when that makes no cycle,
// or the largest one it can, or starts its own.
func (f *pwFuser) group() {
	g := f.g
	rowOf := map[int]bool{} // per-row members
	for i := range g.Len() {
		si, row, ok := f.pointwiseOp(i)
		if !ok {
			continue
		}
		n := g.Node(i)
		var cands []int
		for _, in := range n.Inputs {
			gi := f.grp[in]
			if gi < 0 || slices.Contains(cands, gi) {
				continue
			}
			fits, r := levelIn(si, row, f.groups[gi].s)
			if !fits {
				continue
			}
			if (n.Op == OpSum || n.Op == OpMean || n.Op == OpMax) && (rowOf[in] || r != row) {
				continue // a reduction of a per-row value
			}
			if f.colSum[i] && r {
				continue // the column sum of a per-row value
			}
			cands = append(cands, gi)
		}
		joined := -1
		if len(cands) > 0 && !f.cycle(i, cands) {
			joined = f.merge(cands)
		} else if len(cands) > 1 {
			slices.SortFunc(cands, func(a, b int) int { return len(f.groups[b].members) - len(f.groups[a].members) })
			for _, c := range cands {
				if !f.cycle(i, []int{c}) {
					joined = c
					break
				}
			}
		}
		if joined < 0 {
			joined = len(f.groups)
			f.groups = append(f.groups, &pwGroup{s: slices.Clone(si)})
		}
		gr := f.groups[joined]
		_, r := levelIn(si, row, gr.s)
		rowOf[i] = r
		gr.members = append(gr.members, i)
		gr.last = i
		f.grp[i] = joined
	}
}

// siblings merges groups that read one value of their iteration shape
// from outside any group, so that one kernel reads it once and writes what
// both gave: the backward of silu(a)·b reads its output gradient g in
// g·silu(a) (b's gradient) and in silu_grad(g·b, a) (a's), and a written
// RMSNorm's backward reads x and g in its input's gradient and in its
// weight's g·x·r (a flat group joining the row group of the norm's
// backward: its kernel stores one more per-element value). Two groups
// merge when they have one iteration shape, the union makes no cycle, and
// the merged kernel, which runs when the later of the two could, holds no
// input of the earlier one longer: each is read by the later one too, is
// needed until then anyway, or is a value of another group made from such
// inputs (a forward intermediate, which recompute then usually recomputes
// from them rather than keeps).
func (f *pwFuser) siblings() {
	g := f.g
	ins := func(gi int) (ext []int, last int) {
		last = -1
		for _, m := range f.groups[gi].members {
			for _, x := range g.Node(m).Inputs {
				if f.grp[x] != gi && !slices.Contains(ext, x) {
					ext = append(ext, x)
					last = max(last, x)
				}
			}
		}
		return ext, last
	}
	// reads is what a group's kernel with inputs ext will read: those,
	// and for an input that is another group's value, the inputs that value is made
	// from (recompute may read those instead).
	reads := func(ext []int) map[int]bool {
		r := map[int]bool{}
		for _, x := range ext {
			r[x] = true
			if c := f.grp[x]; c >= 0 {
				_, leaves := f.cone(c, x)
				for _, l := range leaves {
					r[l] = true
				}
			}
		}
		return r
	}
	// mergeable: no input of the earlier group is held longer.
	mergeable := func(a, b int) bool {
		ea, la := ins(a)
		eb, lb := ins(b)
		if la > lb {
			a, b, ea, eb, lb = b, a, eb, ea, la
		}
		rb := reads(eb)
		held := func(x int) bool { return rb[x] || f.lastUse[x] >= lb }
		for _, x := range ea {
			if held(x) {
				continue
			}
			c := f.grp[x]
			if c < 0 {
				return false
			}
			_, leaves := f.cone(c, x)
			for _, l := range leaves {
				if !held(l) {
					return false
				}
			}
		}
		return !f.cycle(f.groups[a].members[0], []int{a, b})
	}
	for x := range g.Len() {
		if f.grp[x] >= 0 {
			continue
		}
		var gs []int
		for _, r := range f.readers[x] {
			gi := f.grp[r]
			if gi < 0 || slices.Contains(gs, gi) || !slices.Equal(f.groups[gi].s, g.Node(x).Type.Shape) {
				continue
			}
			gs = append(gs, gi)
		}
		for i := 1; i < len(gs); i++ {
			if mergeable(gs[0], gs[i]) {
				f.merge([]int{gs[0], gs[i]})
			}
		}
	}
}

// small sets aside the groups of one node that recompute nothing: one
// op is one kernel already.
func (f *pwFuser) small() {
	for _, gr := range f.groups {
		if gr.state == pwLive && len(gr.members) < 2 && len(gr.absorb) == 0 {
			gr.state = pwSmall
			for _, m := range gr.members {
				f.grp[m] = -1
			}
		}
	}
}

// acyclic dissolves groups until the graph with each group as one node
// has no cycle. group's check sees paths through plain nodes; a cycle
// through two groups (A reads B's member, B another member reading A's)
// is found here, by a topological sort of the contracted graph, and every
// group left on a cycle goes back to plain nodes. Splitting a group never
// makes a cycle.
func (f *pwFuser) acyclic() {
	g := f.g
	n := g.Len()
	for {
		rep := func(i int) int {
			if gi := f.grp[i]; gi >= 0 {
				return n + gi
			}
			return i
		}
		m := n + len(f.groups)
		indeg := make([]int, m)
		succ := make([][]int, m)
		seen := map[[2]int]bool{}
		for i := range n {
			ri := rep(i)
			for _, x := range g.Node(i).Inputs {
				rx := rep(x)
				if rx == ri || seen[[2]int{rx, ri}] {
					continue
				}
				seen[[2]int{rx, ri}] = true
				succ[rx] = append(succ[rx], ri)
				indeg[ri]++
			}
		}
		var queue []int
		present := make([]bool, m)
		for i := range n {
			present[rep(i)] = true
		}
		for r := range m {
			if present[r] && indeg[r] == 0 {
				queue = append(queue, r)
			}
		}
		for len(queue) > 0 {
			r := queue[len(queue)-1]
			queue = queue[:len(queue)-1]
			for _, s := range succ[r] {
				if indeg[s]--; indeg[s] == 0 {
					queue = append(queue, s)
				}
			}
		}
		dissolved := false
		for gi, gr := range f.groups {
			if r := n + gi; present[r] && indeg[r] > 0 {
				gr.state, dissolved = pwSmall, true
				for _, mb := range gr.members {
					f.grp[mb] = -1
				}
			}
		}
		if !dissolved {
			return
		}
	}
}

// merge unites groups cands into the first and returns it.
func (f *pwFuser) merge(cands []int) int {
	to := f.groups[cands[0]]
	for _, c := range cands[1:] {
		from := f.groups[c]
		for _, m := range from.members {
			f.grp[m] = cands[0]
		}
		to.members = append(to.members, from.members...)
		to.last = max(to.last, from.last)
		from.members, from.state = nil, pwSmall
	}
	slices.Sort(to.members)
	return cands[0]
}

// cycle reports whether node i joining the union of groups cands would
// make a group that reads, through nodes outside it, a value of its own,
// or one whose member reads a column sum of it (complete only once the
// group's kernel ends).
func (f *pwFuser) cycle(i int, cands []int) bool {
	in := func(id int) bool { return id == i || slices.Contains(cands, f.grp[id]) }
	readsColSum := func(m int) bool {
		for _, x := range f.g.Node(m).Inputs {
			if f.colSum[x] && in(x) {
				return true
			}
		}
		return false
	}
	if readsColSum(i) {
		return true
	}
	if len(cands) > 1 {
		for _, c := range cands {
			for _, m := range f.groups[c].members {
				if readsColSum(m) {
					return true
				}
			}
		}
	}
	lo := i
	var ext []int
	addExt := func(m int) {
		for _, x := range f.g.Node(m).Inputs {
			if !in(x) {
				ext = append(ext, x)
			}
		}
	}
	addExt(i)
	for _, c := range cands {
		gr := f.groups[c]
		lo = min(lo, gr.members[0])
		if len(cands) > 1 {
			for _, m := range gr.members {
				addExt(m)
			}
		}
	}
	f.stamp++
	stack := ext
	for len(stack) > 0 {
		x := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if x < lo || f.mark[x] == f.stamp {
			continue
		}
		f.mark[x] = f.stamp
		if in(x) {
			return true
		}
		stack = append(stack, f.g.Node(x).Inputs...)
	}
	return false
}

// cone is the members of group gi that node v of it depends on, ascending,
// and the inputs from outside the group those read.
func (f *pwFuser) cone(gi, v int) (nodes, leaves []int) {
	f.stamp++
	stack := []int{v}
	for len(stack) > 0 {
		x := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if f.mark[x] == f.stamp {
			continue
		}
		f.mark[x] = f.stamp
		if f.grp[x] != gi {
			leaves = append(leaves, x)
			continue
		}
		nodes = append(nodes, x)
		stack = append(stack, f.g.Node(x).Inputs...)
	}
	slices.Sort(nodes)
	slices.Sort(leaves)
	return nodes, leaves
}

// recompute decides, for each value one group reads from another, whether
// the reader recomputes it (FusePointwise's rule), then which values each
// group gives.
func (f *pwFuser) recompute() {
	g := f.g
	absorbed := map[[2]int]bool{} // {group, node}: the group recomputes the node
	// leafOf[x]: the groups that read x because they recompute a cone
	// that reads it (x may be another group's member).
	leafOf := map[int][]int{}
	for ai, a := range f.groups {
		if a.state != pwLive || len(a.members) < 2 {
			continue // a node of its own stays as it is: nothing to drop
		}
		for _, v := range a.members {
			if f.isOut[v] {
				continue
			}
			// Every reader outside A must be in a group over A's shape
			// that can recompute v; else v is kept and nothing is saved.
			var by []int
			last, ok := -1, true
			for _, r := range f.readers[v] {
				rg := f.grp[r]
				if rg == ai {
					continue
				}
				if rg < 0 || f.groups[rg].state != pwLive || !slices.Equal(f.groups[rg].s, a.s) {
					ok = false
					break
				}
				if !slices.Contains(by, rg) {
					by = append(by, rg)
					last = max(last, f.groups[rg].last)
				}
			}
			if !ok || len(by) == 0 {
				continue
			}
			nodes, leaves := f.cone(ai, v)
			if len(nodes) > maxRecompute {
				continue
			}
			var extra int64
			for _, l := range leaves {
				if f.lastUse[l] < last {
					extra += g.Node(l).Type.Bytes()
				}
			}
			if extra > g.Node(v).Type.Bytes() {
				continue
			}
			for _, bi := range by {
				b := f.groups[bi]
				absorbed[[2]int{bi, v}] = true
				for _, l := range leaves {
					leafOf[l] = append(leafOf[l], bi)
				}
				for _, c := range nodes {
					if !slices.Contains(b.absorb, c) {
						b.absorb = append(b.absorb, c)
					}
				}
			}
		}
	}
	for _, b := range f.groups {
		slices.Sort(b.absorb)
	}
	f.small()
	// Which values each group gives, given who recomputes what; a group
	// given up (express) recomputes nothing, so the outputs are found
	// again until every group left types.
	for {
		for _, a := range f.groups {
			if a.state == pwLive || a.state == pwGone {
				a.state, a.outs, a.dag, a.inputs = pwLive, nil, nil, nil
			}
		}
		for ai, a := range f.groups {
			if a.state != pwLive {
				continue
			}
			for _, m := range a.members {
				need := f.isOut[m]
				for _, r := range f.readers[m] {
					rg := f.grp[r]
					if rg == ai {
						continue
					}
					if rg < 0 || !absorbed[[2]int{rg, m}] || f.groups[rg].state == pwGivenUp {
						need = true
					}
				}
				for _, rg := range leafOf[m] {
					if rg != ai && f.groups[rg].state != pwGivenUp {
						need = true
					}
				}
				if need {
					a.outs = append(a.outs, m)
				}
			}
			if len(a.outs) == 0 {
				a.state = pwGone
			}
		}
		again := false
		for _, gr := range f.groups {
			if gr.state == pwLive && !f.express(gr) {
				gr.state, gr.absorb, again = pwGivenUp, nil, true
			}
		}
		if !again {
			return
		}
	}
}

// express builds group gr's expression and input list, and reports
// false for a group whose fused nodes would not type as its members do
// (its inputs broadcast to another shape): that group is given up.
func (f *pwFuser) express(gr *pwGroup) bool {
	g := f.g
	all := slices.Concat(gr.absorb, gr.members)
	slices.Sort(all)
	all = slices.Compact(all)
	inSet := map[int]bool{}
	for _, m := range all {
		inSet[m] = true
	}
	var nodes []PWNode
	val := map[int]int{}   // old id → expression node
	input := map[int]int{} // old id → input's expression node
	consts := map[uint64]int{}
	cnst := func(s float64) int {
		k := math.Float64bits(s)
		if v, ok := consts[k]; ok {
			return v
		}
		nodes = append(nodes, PWNode{Op: PWConst, Scalar: s})
		consts[k] = len(nodes) - 1
		return len(nodes) - 1
	}
	arg := func(x int) int {
		if inSet[x] {
			return val[x]
		}
		if v, ok := input[x]; ok {
			return v
		}
		nodes = append(nodes, PWNode{Op: PWInput, In: len(gr.inputs)})
		gr.inputs = append(gr.inputs, x)
		input[x] = len(nodes) - 1
		return len(nodes) - 1
	}
	add := func(n PWNode) int { nodes = append(nodes, n); return len(nodes) - 1 }
	for _, m := range all {
		n := g.Node(m)
		for _, x := range n.Inputs {
			if f.colSum[x] && inSet[x] {
				return false // reads a column sum of its own group
			}
		}
		a := arg(n.Inputs[0])
		b := -1
		if len(n.Inputs) > 1 {
			b = arg(n.Inputs[1])
		}
		s := n.Attrs.Scalar
		var v int
		switch n.Op {
		case OpNeg, OpExp, OpLog, OpSqrt, OpAbs, OpTanh, OpSigmoid, OpRelu, OpSign, OpSilu:
			v = add(PWNode{Op: unaryPW[n.Op], A: a})
		case OpGelu:
			v = add(PWNode{Op: map[bool]PWOp{false: PWGelu, true: PWGeluTanh}[n.Attrs.Approx], A: a})
		case OpCast:
			v = a
			if n.Type.DType.IsHalf() {
				v = add(PWNode{Op: PWCast, A: a, DType: n.Type.DType})
			}
		case OpExpand:
			v = add(PWNode{Op: PWExpand, A: a})
		case OpAddScalar:
			v = add(PWNode{Op: PWAdd, A: a, B: cnst(s)})
		case OpSubScalar:
			v = add(PWNode{Op: PWSub, A: a, B: cnst(s)})
		case OpRSubScalar:
			v = add(PWNode{Op: PWSub, A: cnst(s), B: a})
		case OpMulScalar:
			v = add(PWNode{Op: PWMul, A: a, B: cnst(s)})
		case OpDivScalar:
			v = add(PWNode{Op: PWDiv, A: a, B: cnst(s)})
		case OpRDivScalar:
			v = add(PWNode{Op: PWDiv, A: cnst(s), B: a})
		case OpMaximumScalar:
			v = add(PWNode{Op: PWMax, A: a, B: cnst(s)})
		case OpPowScalar:
			switch s {
			case 1:
				v = a
			case 2:
				v = add(PWNode{Op: PWMul, A: a, B: a})
			case 0.5:
				v = add(PWNode{Op: PWSqrt, A: a})
			case -0.5:
				v = add(PWNode{Op: PWRsqrt, A: a})
			case -1:
				v = add(PWNode{Op: PWDiv, A: cnst(1), B: a})
			default:
				v = add(PWNode{Op: PWPow, A: a, B: cnst(s)})
			}
		case OpAdd, OpSub, OpMul, OpDiv, OpPow, OpMaximum, OpSiluGrad, OpReluGrad:
			v = add(PWNode{Op: binaryPW[n.Op], A: a, B: b})
		case OpGeluGrad:
			v = add(PWNode{Op: map[bool]PWOp{false: PWGeluGrad, true: PWGeluTanhGrad}[n.Attrs.Approx], A: a, B: b})
		case OpSum, OpMean:
			if f.colSum[m] {
				v = a // given as a ColSum output; nothing reads it
				break
			}
			v = add(PWNode{Op: PWRowSum, A: a, Scalar: map[bool]float64{false: 1, true: s}[n.Op == OpMean]})
		case OpMax:
			v = add(PWNode{Op: PWRowMax, A: a})
		}
		val[m] = v
	}
	outs := make([]PWOut, len(gr.outs))
	for i, o := range gr.outs {
		outs[i] = PWOut{Node: val[o], DType: g.Node(o).Type.DType, ColSum: f.colSum[o]}
	}
	nodes, outs = prunePW(nodes, outs)
	var used []int // the inputs still read, renumbered in order
	renum := map[int]int{}
	for i, n := range nodes {
		if n.Op == PWInput {
			if _, ok := renum[n.In]; !ok {
				renum[n.In] = len(used)
				used = append(used, gr.inputs[n.In])
			}
			nodes[i].In = renum[n.In]
		}
	}
	gr.inputs = used
	p, err := NewPointwise(nodes, outs)
	if err != nil {
		return false
	}
	in := make([]Type, len(gr.inputs))
	for i, x := range gr.inputs {
		in[i] = g.Node(x).Type
	}
	for i, o := range gr.outs {
		at := Attrs{Pointwise: p, Axis: i}
		t, err := fusedPointwiseRule(OpFusedPointwise, &at, in, g.Batch())
		if err != nil || !sameType(t, g.Node(o).Type) {
			return false
		}
	}
	gr.dag = p
	return true
}

var unaryPW = map[Op]PWOp{OpNeg: PWNeg, OpExp: PWExp, OpLog: PWLog, OpSqrt: PWSqrt, OpAbs: PWAbs, OpTanh: PWTanh,
	OpSigmoid: PWSigmoid, OpRelu: PWRelu, OpSign: PWSign, OpSilu: PWSilu}

var binaryPW = map[Op]PWOp{OpAdd: PWAdd, OpSub: PWSub, OpMul: PWMul, OpDiv: PWDiv, OpPow: PWPow, OpMaximum: PWMax,
	OpSiluGrad: PWSiluGrad, OpReluGrad: PWReluGrad}

// build copies g with each live group's fused nodes in place of its
// members, in node order but for what the fused nodes need moved.
func (f *pwFuser) build() (*Graph, []int, error) {
	g := f.g
	// A group given up leaves its members as plain nodes; one that is
	// gone (all its values recomputed elsewhere) drops them.
	member := make([]int, g.Len())
	for i := range member {
		member[i] = -1
	}
	for gi, gr := range f.groups {
		if gr.state == pwLive || gr.state == pwGone {
			for _, m := range gr.members {
				member[m] = gi
			}
		}
	}
	out := New()
	if g.Batch() != 0 {
		if err := out.SetBatch(g.Batch()); err != nil {
			return nil, nil, err
		}
	}
	ids := make([]int, g.Len())
	done := make([]bool, g.Len())
	for i := range ids {
		ids[i] = -1
	}
	var emit func(i int) error
	emitGroup := func(gi int) error {
		gr := f.groups[gi]
		if gr.emitted {
			return nil
		}
		gr.emitted = true
		if gr.dag == nil {
			return nil // gone: every value recomputed elsewhere
		}
		in := make([]int, len(gr.inputs))
		for k, x := range gr.inputs {
			if err := emit(x); err != nil {
				return err
			}
			in[k] = ids[x]
		}
		last := g.Node(gr.last)
		for k, o := range gr.outs {
			id, err := out.Append(Node{Op: OpFusedPointwise, Inputs: slices.Clone(in), Attrs: Attrs{Pointwise: gr.dag, Axis: k},
				Scope: g.Node(o).Scope, Site: last.Site})
			if err != nil {
				return &OpError{Op: "fuse " + OpFusedPointwise.String(), Site: last.Site, Err: err}
			}
			ids[o] = id
			done[o] = true
		}
		return nil
	}
	emit = func(i int) error {
		if done[i] {
			return nil
		}
		if gi := member[i]; gi >= 0 {
			return emitGroup(gi)
		}
		done[i] = true
		nd := g.Node(i)
		for _, in := range nd.Inputs {
			if err := emit(in); err != nil {
				return err
			}
		}
		n := Node{Op: nd.Op, Attrs: nd.Attrs.Clone(), Name: nd.Name, Scope: nd.Scope, Site: nd.Site, Value: nd.Value,
			Inputs: make([]int, len(nd.Inputs))}
		if nd.Op.Category() == CatSource {
			n.Type = nd.Type
		}
		for k, in := range nd.Inputs {
			n.Inputs[k] = ids[in]
		}
		id, err := out.Append(n)
		if err != nil {
			return &OpError{Op: "fuse " + n.Op.String(), Site: nd.Site, Err: err}
		}
		ids[i] = id
		return nil
	}
	for i := range g.Len() {
		if gi := member[i]; gi >= 0 {
			if f.groups[gi].last == i {
				if err := emitGroup(gi); err != nil {
					return nil, nil, err
				}
			}
			continue
		}
		if err := emit(i); err != nil {
			return nil, nil, err
		}
	}
	return out, ids, nil
}

// prunePW drops the nodes no output needs (a member whose value another
// group recomputes and no one else reads), renumbering the rest.
func prunePW(nodes []PWNode, outs []PWOut) ([]PWNode, []PWOut) {
	need := make([]bool, len(nodes))
	for _, o := range outs {
		need[o.Node] = true
	}
	for i := len(nodes) - 1; i >= 0; i-- {
		if !need[i] {
			continue
		}
		if k := nodes[i].Op.Args(); k >= 1 {
			need[nodes[i].A] = true
			if k == 2 {
				need[nodes[i].B] = true
			}
		}
	}
	at := make([]int, len(nodes))
	var kept []PWNode
	for i, n := range nodes {
		if !need[i] {
			continue
		}
		at[i] = len(kept)
		if k := n.Op.Args(); k >= 1 {
			n.A = at[n.A]
			if k == 2 {
				n.B = at[n.B]
			}
		}
		kept = append(kept, n)
	}
	out := make([]PWOut, len(outs))
	for i, o := range outs {
		out[i] = PWOut{Node: at[o.Node], DType: o.DType, ColSum: o.ColSum}
	}
	return kept, out
}
