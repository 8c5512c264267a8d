package memviz

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// HTMLOptions configures WriteHTML.
type HTMLOptions struct {
	// Title heads the page (user data: it is escaped like every name).
	Title string
	// Subtitle says what step this is, under the title (user data too).
	Subtitle string
	// Plan, when given, fills the plan panel: budget, headroom, chunks,
	// the affine fit and the predicted peaks.
	Plan *planner.Plan
	// Measured is a measured timeline of the same program and chunks
	// (cpu.ExecOptions.Timeline, Session.LastUsage), drawn over the
	// predicted one; nil when not measured. MeasuredLabel says where it
	// was measured ("CPU executor").
	Measured      []planner.Point
	MeasuredLabel string
	// Alternatives are other ways to run the step (a recompute planner's
	// candidates); the page lists them when there are any and says
	// nothing of them otherwise.
	Alternatives []Alternative
	// Names configures tensor names, as for NewReport.
	Names Options
	// MaxPoints bounds the timeline points the page carries; 0 means
	// DefaultMaxPoints. Past it consecutive points are merged, each merged
	// point showing the largest allocated and reserved bytes of those it
	// stands for, so no peak is lost.
	MaxPoints int
}

// Alternative is one other way to run the step, for the plan panel.
type Alternative struct {
	Name          string `json:"name"`
	Description   string `json:"description,omitempty"`
	Chunk         int    `json:"chunk,omitempty"`
	PeakReserved  int64  `json:"peak_reserved"`
	PeakAllocated int64  `json:"peak_allocated,omitempty"`
}

// DefaultMaxPoints is how many timeline points a page carries at most by
// default: GPT-2 small's step (about 2,000 program steps a chunk) fits
// whole in a few chunks.
const DefaultMaxPoints = 8000

// maxSegmentRows bounds the segments the segment map draws one by one.
const maxSegmentRows = 400

// maxLargest is how many of the largest buffers the plan panel lists.
const maxLargest = 12

// page is the data a report page is drawn from, embedded as JSON.
// Byte counts of the timeline, intervals and blocks are in units of Unit
// bytes (512 when every count is a multiple of it), so the page stays
// small; JavaScript multiplies back, exactly (counts stay below 2^53).
type page struct {
	Title    string `json:"title"`
	Subtitle string `json:"subtitle,omitempty"`
	Unit     int64  `json:"unit"`
	// Points is how many timeline points the step has; Index the point
	// each carried point stands for (all of them unless merged).
	Points int   `json:"points"`
	Index  []int `json:"index"`
	// Allocated and Reserved per carried point, predicted; Measured* the
	// same measured (−1 where the measured timeline has no such point), or
	// nil.
	Allocated         []int64 `json:"allocated"`
	Reserved          []int64 `json:"reserved"`
	MeasuredAllocated []int64 `json:"measured_allocated,omitempty"`
	MeasuredReserved  []int64 `json:"measured_reserved,omitempty"`
	MeasuredLabel     string  `json:"measured_label,omitempty"`
	// Chunks are the carried-point ranges of each chunk, after the
	// persistent allocations.
	Chunks []pageChunk `json:"chunks"`
	// What says what happened at each carried point: 3t for the
	// allocation of tensor t, 3t+1 for its free, 3r+2 for running node
	// Runs[r]; Step is the point's program step (−1 outside the chunk
	// program).
	What []int    `json:"what"`
	Step []int    `json:"step"`
	Runs []string `json:"runs"`
	// Kinds names the tensor kinds, in stacking order.
	Kinds []Kind `json:"kinds"`
	// Tensors are the distinct tensors; Live their lifetimes: carried
	// points [Start, End) (End = len(Index) when alive at the end).
	Tensors tensorTable `json:"tensors"`
	Live    liveColumns `json:"live"`
	// Peak is the carried point of the predicted peak of allocated bytes,
	// and Segments the allocator's segments while it runs.
	Peak int `json:"peak"`
	// Source is "plan" (a program's predicted step) or "snapshot" (a
	// snapshot's trace); SegmentsAt says when the segments were taken.
	Source     string        `json:"source"`
	SegmentsAt string        `json:"segments_at"`
	Segments   []pageSegment `json:"segments"`
	// SegmentsLeftOut counts segments past maxSegmentRows, not drawn.
	SegmentsLeftOut int            `json:"segments_left_out,omitempty"`
	Plan            *pagePlan      `json:"plan,omitempty"`
	Largest         []pageBuffer   `json:"largest"`
	Alternatives    []Alternative  `json:"alternatives,omitempty"`
	Stats           map[string]int `json:"stats"`
}

type pageChunk struct {
	Label string `json:"label,omitempty"` // what the range is, when not a chunk
	Index int    `json:"index"`           // −1 for the persistent allocations
	Size  int    `json:"size"`
	Start int    `json:"start"`
	End   int    `json:"end"`
}

type pageTensor struct {
	Name  string `json:"n"`
	Kind  int    `json:"k"` // index into Kinds
	Path  string `json:"p"` // module path, dotted ("" at the top)
	Op    string `json:"o"`
	Shape string `json:"s,omitempty"`
	DType string `json:"d,omitempty"`
	Req   int64  `json:"r"` // requested bytes
	buf   int    // program buffer, −1 when none
}

// tensorTable is written as {"strings": [...], "rows": [[name, kind,
// path, op, shape, dtype, requested], ...]} with path, op, shape and dtype
// indices into strings: they repeat across layers and chunks.
type tensorTable []pageTensor

func (tt tensorTable) MarshalJSON() ([]byte, error) {
	strs := []string{}
	at := map[string]int{}
	in := func(s string) int {
		i, ok := at[s]
		if !ok {
			i = len(strs)
			at[s] = i
			strs = append(strs, s)
		}
		return i
	}
	rows := make([][]any, len(tt))
	for i, t := range tt {
		rows[i] = []any{t.Name, t.Kind, in(t.Path), in(t.Op), in(t.Shape), in(t.DType), t.Req}
	}
	return json.Marshal(struct {
		Strings []string `json:"strings"`
		Rows    [][]any  `json:"rows"`
	}{strs, rows})
}

// liveColumns holds tensor lifetimes column-wise, to keep the page small.
type liveColumns struct {
	Tensor []int   `json:"t"`
	Start  []int   `json:"s"`
	End    []int   `json:"e"`
	Size   []int64 `json:"b"` // block bytes, in units
}

type pageSegment struct {
	Addr   string     `json:"addr"`
	Size   int64      `json:"size"` // in units
	Pool   string     `json:"pool"`
	Blocks [][4]int64 `json:"blocks"` // offset, size (units), tensor index or −1 when free, requested bytes
	Free   int64      `json:"free"`   // inactive bytes, in units
}

type pagePlan struct {
	Batch         int    `json:"batch"`
	Chunks        string `json:"chunks"`
	NumChunks     int    `json:"num_chunks"`
	Budget        int64  `json:"budget"`
	Headroom      int64  `json:"headroom"`
	Available     int64  `json:"available"`
	PeakReserved  int64  `json:"peak_reserved"`
	PeakAllocated int64  `json:"peak_allocated"`
	Persistent    int64  `json:"persistent"`
	HostPinned    int64  `json:"host_pinned"` // an offloaded optimizer's host memory (planner.Plan.HostPinned)
	Fixed         int64  `json:"fixed"`
	PerSample     int64  `json:"per_sample"`
	Replays       int    `json:"replays"`
}

type pageBuffer struct {
	Name  string `json:"name"`
	Kind  Kind   `json:"kind"`
	Shape string `json:"shape,omitempty"`
	Bytes int64  `json:"bytes"`
	Count int    `json:"count"` // buffers of this name and size (one per chunk size)
}

//go:embed report.html
var pageTemplate string

// dataMarker is replaced by the page's JSON in pageTemplate.
const dataMarker = "/*BATCHFIT-DATA*/"

// WriteHTML writes one self-contained HTML page showing p's step run for
// chunks as sim predicted it (Simulate): the allocated and reserved
// timeline per chunk with the peak marked (and o.Measured overlaid), the
// live tensors at any point by kind and module path, the segment map at
// the peak and the plan. The page makes no network request: styles,
// script and data are inline, drawn as SVG by a little JavaScript.
func WriteHTML(w io.Writer, p *planner.Program, chunks []planner.Chunk, sim *Simulation, o HTMLOptions) error {
	pg, err := newPage(p, chunks, sim, o)
	if err != nil {
		return err
	}
	return pg.write(w)
}

// write writes the page: the template with pg as its data.
func (pg *page) write(w io.Writer) error {
	data, err := json.Marshal(pg) // escapes <, >, & and U+2028/9: no name can end the script element
	if err != nil {
		return err
	}
	// A name that is a URL stays one only as text: "//" is written
	// "\/\/", so not even a string in the data reads as an address.
	data = bytes.ReplaceAll(data, []byte("//"), []byte(`\/\/`))
	before, after, ok := strings.Cut(pageTemplate, dataMarker)
	if !ok {
		return fmt.Errorf("memviz: page template has no data marker")
	}
	var b bytes.Buffer
	b.Grow(len(pageTemplate) + len(data))
	b.WriteString(before)
	b.Write(data)
	b.WriteString(after)
	_, err = w.Write(b.Bytes())
	return err
}

// pageKinds is the stacking order of the live tensors, bottom first.
var pageKinds = []Kind{KindParam, KindGrad, KindState, KindActivation, KindWorkspace, KindUnknown}

func kindIndex(k Kind) int {
	if i := slices.Index(pageKinds, k); i >= 0 {
		return i
	}
	return len(pageKinds) - 1
}

func newPage(p *planner.Program, chunks []planner.Chunk, sim *Simulation, o HTMLOptions) (*page, error) {
	if p == nil || sim == nil {
		return nil, fmt.Errorf("%w: no program or simulation", ErrTimeline)
	}
	tl := sim.Usage.Timeline
	if len(tl) == 0 {
		return nil, fmt.Errorf("%w: empty predicted timeline", ErrTimeline)
	}
	n := NewNames(p, o.Names)
	pg := newPageOf(o)
	pg.Points = len(tl)

	carried := pg.carry(len(tl), func(i int) (int64, int64) { return tl[i].Allocated, tl[i].Reserved }, o.MaxPoints)
	lt := newLifetimes(pg, carried)

	// Tensor lifetimes from the buffers each point allocates and frees;
	// a block's bytes are what the point added to the allocated bytes.
	tensorOf := map[[2]int]int{}  // (buffer, chunk size) → tensor
	accumulated := map[int]bool{} // nodes whose chunks add up into an accumulator
	for _, bi := range p.Accumulators {
		accumulated[p.Buffers[bi].Node] = true
	}
	runs := map[int]int{} // node → index in Runs
	var prev int64
	err := n.walk(chunks, tl, func(i int, pt planner.Point, _ rowKey, bufs []int) {
		delta := pt.Allocated - prev
		prev = pt.Allocated
		shown := pg.Index[carried[i]] == i
		if shown {
			pg.Step[carried[i]] = pt.Step
			if pt.Kind == planner.StepRun {
				r, ok := runs[pt.Node]
				if !ok {
					r = len(pg.Runs)
					runs[pt.Node] = r
					nd := p.Graph.Node(pt.Node)
					pg.Runs = append(pg.Runs, fmt.Sprintf("%s (node %d)", scoped(nd.Scope, nd.Op.String()), nd.ID))
				}
				pg.What[carried[i]] = 3*r + 2
			}
		}
		for _, b := range bufs {
			if b < 0 {
				if ti, ok := lt.end(int64(-1-b), i); ok && shown {
					pg.What[carried[i]] = 3*ti + 1
				}
				continue
			}
			size := 0
			if pt.Chunk >= 0 {
				size = chunks[pt.Chunk].Size
			}
			key := [2]int{b, size}
			ti, ok := tensorOf[key]
			if !ok {
				ti = len(pg.Tensors)
				tensorOf[key] = ti
				t := n.pageTensor(b, p.Buffers[b].Bytes(size))
				if len(chunks) > 1 && accumulated[p.Buffers[b].Node] && p.Buffers[b].Kind == planner.BufOutput {
					t.Name += ".chunk" // the running chunk's part, beside the sum (as NewReport names it)
				}
				pg.Tensors = append(pg.Tensors, t)
			}
			lt.start(int64(b), i, ti, delta)
			if shown {
				pg.What[carried[i]] = 3 * ti
			}
		}
	})
	if err != nil {
		return nil, err
	}
	lt.endAll(len(tl))

	// Chunks as carried-point ranges.
	for i, pt := range tl {
		c := pt.Chunk
		if k := len(pg.Chunks); k == 0 || pg.Chunks[k-1].Index != c {
			pc := pageChunk{Index: c, Start: carried[i]}
			if c >= 0 && c < len(chunks) {
				pc.Size = chunks[c].Size
			}
			pg.Chunks = append(pg.Chunks, pc)
		}
		pg.Chunks[len(pg.Chunks)-1].End = carried[i] + 1
	}

	if o.Measured != nil {
		if err := pg.measured(n, chunks, tl, o.Measured, carried); err != nil {
			return nil, err
		}
	}

	if o.Plan != nil {
		pl := o.Plan
		pg.Plan = &pagePlan{Batch: pl.Batch, Chunks: planner.DescribeSizes(planner.Sizes(pl.Chunks)), NumChunks: len(pl.Chunks),
			Budget: pl.Budget, Headroom: pl.Headroom, Available: pl.Available(), PeakReserved: pl.PeakReserved,
			PeakAllocated: pl.PeakAllocated, Persistent: pl.Persistent, HostPinned: pl.HostPinned, Fixed: pl.Fixed, PerSample: pl.PerSample, Replays: pl.Replays}
	}
	pg.finish(n, sim.Snapshot, chunks)
	return pg, nil
}

// newPageOf starts a page with o's title, subtitle and alternatives.
func newPageOf(o HTMLOptions) *page {
	pg := &page{Title: o.Title, Subtitle: o.Subtitle, Kinds: pageKinds, Peak: -1, Alternatives: o.Alternatives,
		MeasuredLabel: o.MeasuredLabel, Source: "plan", SegmentsAt: "at the peak", Stats: map[string]int{},
		Live:     liveColumns{Tensor: []int{}, Start: []int{}, End: []int{}, Size: []int64{}},
		Segments: []pageSegment{}, Largest: []pageBuffer{}}
	if pg.Title == "" {
		pg.Title = "batchfit memory report"
	}
	return pg
}

// finish marks the peak, lays out the segments of s, lists a program's
// largest buffers (at chunks' first size) and scales the byte counts.
func (pg *page) finish(n *Names, s alloc.Snapshot, chunks []planner.Chunk) {
	for j, a := range pg.Allocated {
		if pg.Peak < 0 || a > pg.Allocated[pg.Peak] {
			pg.Peak = j
		}
	}
	pg.segments(n, s)
	if n.p != nil {
		pg.largest(n, chunks)
	}
	pg.scale()
	pg.Stats["tensors"] = len(pg.Tensors)
	pg.Stats["lifetimes"] = len(pg.Live.Tensor)
	pg.Stats["carried_points"] = len(pg.Index)
}

// carry picks the points the page carries out of n, point i having
// allocated and reserved bytes at(i): all of them, or past limit (0:
// DefaultMaxPoints) the point of most allocated bytes of each run of
// merged points, with the run's most reserved bytes. It fills Index,
// Allocated and Reserved and returns each point's carried point.
func (pg *page) carry(n int, at func(i int) (allocated, reserved int64), limit int) []int {
	if limit <= 0 {
		limit = DefaultMaxPoints
	}
	group := (n + limit - 1) / limit
	carried := make([]int, n)
	for lo := 0; lo < n; lo += group {
		hi := min(lo+group, n)
		best, bestA := lo, int64(0)
		var res int64
		for i := lo; i < hi; i++ {
			carried[i] = len(pg.Index)
			a, r := at(i)
			if i == lo || a > bestA {
				best, bestA = i, a
			}
			res = max(res, r)
		}
		pg.Index = append(pg.Index, best)
		pg.Allocated = append(pg.Allocated, bestA)
		pg.Reserved = append(pg.Reserved, res)
	}
	pg.What = make([]int, len(pg.Index))
	pg.Step = make([]int, len(pg.Index))
	return carried
}

// lifetimes collects the page's tensor lifetimes from points where blocks
// start and end, keyed by what identifies a block while it lives (a
// program buffer, an address).
type lifetimes struct {
	pg      *page
	carried []int
	open    map[int64]lifetime
}

type lifetime struct {
	start, tensor int
	size          int64
}

func newLifetimes(pg *page, carried []int) *lifetimes {
	return &lifetimes{pg: pg, carried: carried, open: map[int64]lifetime{}}
}

// from is the first carried point at or after point i (len(Index) past
// the end): a lifetime [s, e) of points is alive at carried point j
// exactly when s ≤ Index[j] < e.
func (l *lifetimes) from(i int) int {
	if i >= len(l.carried) {
		return len(l.pg.Index)
	}
	j := l.carried[i]
	if l.pg.Index[j] < i {
		j++
	}
	return j
}

// start opens a lifetime of tensor at point i holding size bytes (one
// still open under key ends there: it cannot happen in a valid program
// or trace, and keeps lifetimes disjoint).
func (l *lifetimes) start(key int64, i, tensor int, size int64) {
	l.end(key, i)
	l.open[key] = lifetime{start: i, tensor: tensor, size: size}
}

// end closes key's lifetime at point i and says whose it was.
func (l *lifetimes) end(key int64, i int) (tensor int, ok bool) {
	o, ok := l.open[key]
	if !ok {
		return -1, false
	}
	delete(l.open, key)
	s, e := l.from(o.start), l.from(i)
	if s < e && o.size > 0 {
		lv := &l.pg.Live
		lv.Tensor = append(lv.Tensor, o.tensor)
		lv.Start = append(lv.Start, s)
		lv.End = append(lv.End, e)
		lv.Size = append(lv.Size, o.size)
	}
	return o.tensor, true
}

// endAll closes what is still open at point i, in key order.
func (l *lifetimes) endAll(i int) {
	for _, k := range slices.Sorted(maps.Keys(l.open)) {
		l.end(k, i)
	}
}

// pageTensor describes buffer bi holding requested bytes.
func (n *Names) pageTensor(bi int, requested int64) pageTensor {
	l := n.ofBuffer(bi)
	nd := n.p.Graph.Node(n.p.Buffers[bi].Node)
	t := pageTensor{Name: l.Name, Kind: kindIndex(l.Kind), Op: nd.Op.String(), Req: requested,
		Path: joinPath(l.Stack), buf: bi}
	if shape, dtype := n.shape(bi, requested); shape != nil {
		t.Shape, t.DType = graph.FormatShape(shape), dtype
	}
	return t
}

// joinPath is the dotted module path of a label's stack: all but its leaf.
func joinPath(stack []string) string {
	if len(stack) == 0 {
		return ""
	}
	return strings.Join(stack[:len(stack)-1], ".")
}

// measured aligns a measured timeline with the predicted one point by
// point: persistent allocations by node (an executor's resident buffers
// have none), chunk steps by chunk and step.
func (pg *page) measured(n *Names, chunks []planner.Chunk, tl, m []planner.Point, carried []int) error {
	type key struct{ chunk, step, node, nth int }
	keyOf := func(pts []planner.Point) ([]key, error) {
		ks := make([]key, len(pts))
		err := n.walk(chunks, pts, func(i int, pt planner.Point, k rowKey, _ []int) {
			ks[i] = key{pt.Chunk, pt.Step, pt.Node, k.nth}
		})
		return ks, err
	}
	pk, err := keyOf(tl)
	if err != nil {
		return err
	}
	mk, err := keyOf(m)
	if err != nil {
		return err
	}
	at := make(map[key]int, len(pk))
	for i, k := range pk {
		at[k] = i
	}
	pg.MeasuredAllocated = make([]int64, len(pg.Index))
	pg.MeasuredReserved = make([]int64, len(pg.Index))
	for j := range pg.Index {
		pg.MeasuredAllocated[j], pg.MeasuredReserved[j] = -1, -1
	}
	for i, k := range mk {
		pi, ok := at[k]
		if !ok {
			return fmt.Errorf("%w: measured point %+v has no predicted counterpart", ErrTimeline, k)
		}
		j := carried[pi]
		pg.MeasuredAllocated[j] = max(pg.MeasuredAllocated[j], m[i].Allocated)
		pg.MeasuredReserved[j] = max(pg.MeasuredReserved[j], m[i].Reserved)
	}
	return nil
}

// segments lays out the snapshot's segments, each block labelled by the
// page tensor it holds.
func (pg *page) segments(n *Names, s alloc.Snapshot) {
	type bufSize struct {
		buf  int
		name string // for blocks of no program buffer
		req  int64
	}
	byKey := map[bufSize]int{} // → tensor
	for i, t := range pg.Tensors {
		k := bufSize{t.buf, "", t.Req}
		if t.buf < 0 {
			k.name = t.Name
		}
		byKey[k] = i
	}
	segs := slices.Clone(s.Segments)
	if len(segs) > maxSegmentRows { // the largest ones
		slices.SortStableFunc(segs, func(a, b alloc.SegmentInfo) int { return int((b.Size - a.Size) >> 9) })
		pg.SegmentsLeftOut = len(segs) - maxSegmentRows
		segs = segs[:maxSegmentRows]
		slices.SortFunc(segs, func(a, b alloc.SegmentInfo) int { return cmpPtr(a.Addr, b.Addr) })
	}
	for _, seg := range segs {
		ps := pageSegment{Addr: fmt.Sprintf("%#x", uint64(seg.Addr)), Size: seg.Size, Pool: seg.Pool.String()}
		for _, b := range seg.Blocks {
			ti := int64(-1)
			if active(b.State) {
				l := n.Of(b.Tag)
				key := bufSize{l.Buffer, "", b.Requested}
				if l.Buffer < 0 { // named from its tag, as a snapshot's trace names it: by block size
					key.name, key.req = l.Name, b.Size
				}
				t, ok := byKey[key]
				if !ok { // a block the timeline does not name: describe it from its tag
					t = len(pg.Tensors)
					pt := tagTensor(l, b.Tag, b.Requested)
					if l.Buffer >= 0 {
						pt = n.pageTensor(l.Buffer, b.Requested)
					}
					byKey[key] = t
					pg.Tensors = append(pg.Tensors, pt)
				}
				ti = int64(t)
			} else {
				ps.Free += b.Size
			}
			ps.Blocks = append(ps.Blocks, [4]int64{int64(b.Addr - seg.Addr), b.Size, ti, b.Requested})
		}
		pg.Segments = append(pg.Segments, ps)
	}
}

// largest lists the program's largest buffers at the first chunk's size,
// one row per name.
func (pg *page) largest(n *Names, chunks []planner.Chunk) {
	size := 0
	if len(chunks) > 0 {
		size = chunks[0].Size
	}
	idx := make([]int, len(n.p.Buffers))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int {
		x, y := n.p.Buffers[a].Bytes(size), n.p.Buffers[b].Bytes(size)
		switch {
		case x > y:
			return -1
		case x < y:
			return 1
		}
		return 0
	})
	for _, bi := range idx {
		t := n.pageTensor(bi, n.p.Buffers[bi].Bytes(size))
		if k := len(pg.Largest); k > 0 && pg.Largest[k-1].Name == t.Name && pg.Largest[k-1].Bytes == t.Req {
			pg.Largest[k-1].Count++
			continue
		}
		if len(pg.Largest) == maxLargest {
			break
		}
		pg.Largest = append(pg.Largest, pageBuffer{Name: t.Name, Kind: pageKinds[t.Kind], Shape: t.Shape, Bytes: t.Req, Count: 1})
	}
}

// scale picks the unit of the page's block byte counts: 512 when all are
// multiples of it, else 1.
func (pg *page) scale() {
	const u = 512
	ok := true
	check := func(xs []int64) {
		for _, x := range xs {
			if x > 0 && x%u != 0 {
				ok = false
			}
		}
	}
	check(pg.Allocated)
	check(pg.Reserved)
	check(pg.MeasuredAllocated)
	check(pg.MeasuredReserved)
	check(pg.Live.Size)
	for _, s := range pg.Segments {
		check([]int64{s.Size, s.Free})
		for _, b := range s.Blocks {
			check(b[:2])
		}
	}
	pg.Unit = 1
	if !ok {
		return
	}
	pg.Unit = u
	div := func(xs []int64) {
		for i, x := range xs {
			if x > 0 {
				xs[i] = x / u
			}
		}
	}
	div(pg.Allocated)
	div(pg.Reserved)
	div(pg.MeasuredAllocated)
	div(pg.MeasuredReserved)
	div(pg.Live.Size)
	for i := range pg.Segments {
		s := &pg.Segments[i]
		s.Size /= u
		s.Free /= u
		for k := range s.Blocks {
			s.Blocks[k][0] /= u
			s.Blocks[k][1] /= u
		}
	}
}
