package memviz

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/planner"
)

// OpMemory is the allocator's state around one profile row, from a
// timeline. Active bytes are the allocated bytes (batchfit's allocator has
// one stream, so every allocated block is active).
type OpMemory struct {
	LiveAfter     int64 `json:"live_after"`     // allocated bytes after the row's last step
	ReservedAfter int64 `json:"reserved_after"` // reserved bytes after it
	PeakActive    int64 `json:"peak_active"`    // most allocated bytes during its steps
	PeakReserved  int64 `json:"peak_reserved"`  // most reserved bytes during its steps
}

// ProfileRow is one node of one chunk (or one persistent buffer, or the
// read-back of a chunk's outputs) in program order.
type ProfileRow struct {
	Chunk int    `json:"chunk"` // −1 for persistent buffers allocated before the chunks
	Step  int    `json:"step"`  // first program step of the row, −1 outside the chunk program
	Node  int    `json:"node"`  // −1 for a chunk's output read-back
	Scope string `json:"scope"` // module path
	Op    string `json:"op"`
	Name  string `json:"name"` // what memviz calls the node's buffer
	// Requested and Allocated are the bytes the row's steps asked for and
	// took after rounding (its output and workspace); Freed the rounded
	// bytes they gave back (workspace, inputs at their last use).
	Requested int64     `json:"requested"`
	Allocated int64     `json:"allocated"`
	Freed     int64     `json:"freed"`
	Predicted OpMemory  `json:"predicted"`
	Measured  *OpMemory `json:"measured,omitempty"` // nil when not measured
}

// Profile is a per-op memory profile of one step.
type Profile struct {
	Rows []ProfileRow `json:"rows"`
	// Peaks over the whole step, and the rows where they happen first.
	PredictedPeakActive   int64 `json:"predicted_peak_active"`
	PredictedPeakReserved int64 `json:"predicted_peak_reserved"`
	PredictedPeakRow      int   `json:"predicted_peak_row"`
	MeasuredPeakActive    int64 `json:"measured_peak_active,omitempty"`
	MeasuredPeakReserved  int64 `json:"measured_peak_reserved,omitempty"`
	MeasuredPeakRow       int   `json:"measured_peak_row"` // −1 when not measured
}

// rowKey identifies a profile row across two timelines of one program:
// step is −1 outside the chunk program (persistent buffers, a chunk's
// output read-back) and −2 for a node's steps; nth tells apart the
// persistent buffers of one node (its optimizer state slots).
type rowKey struct {
	chunk, step, node, nth int
}

// NewProfile builds the per-op profile of p run for chunks from a predicted
// timeline (planner.Replay with record on a simulated device, or a Plan's
// Timeline) and, when not nil, a measured one (cpu.ExecOptions.Timeline, or
// a replay through the executor's allocator). Persistent buffers an
// executor already held are absent from its timeline and have no
// measurement.
func NewProfile(p *planner.Program, chunks []planner.Chunk, predicted, measured []planner.Point, o Options) (*Profile, error) {
	if p == nil {
		return nil, fmt.Errorf("%w: no program", ErrTimeline)
	}
	if len(predicted) == 0 {
		return nil, fmt.Errorf("%w: empty predicted timeline", ErrTimeline)
	}
	n := NewNames(p, o)
	pr := &Profile{MeasuredPeakRow: -1}
	keys, err := n.rows(chunks, predicted, pr, true)
	if err != nil {
		return nil, err
	}
	for i, r := range pr.Rows {
		if r.Predicted.PeakActive > pr.PredictedPeakActive {
			pr.PredictedPeakActive, pr.PredictedPeakRow = r.Predicted.PeakActive, i
		}
		pr.PredictedPeakReserved = max(pr.PredictedPeakReserved, r.Predicted.PeakReserved)
	}
	if measured == nil {
		return pr, nil
	}
	var m Profile
	mkeys, err := n.rows(chunks, measured, &m, false)
	if err != nil {
		return nil, err
	}
	at := make(map[rowKey]int, len(keys))
	for i, k := range keys {
		at[k] = i
	}
	for j, k := range mkeys {
		i, ok := at[k]
		if !ok {
			return nil, fmt.Errorf("%w: measured row %+v has no predicted counterpart", ErrTimeline, k)
		}
		mm := m.Rows[j].Predicted
		pr.Rows[i].Measured = &mm
		if mm.PeakActive > pr.MeasuredPeakActive || pr.MeasuredPeakRow < 0 {
			pr.MeasuredPeakActive, pr.MeasuredPeakRow = mm.PeakActive, i
		}
		pr.MeasuredPeakReserved = max(pr.MeasuredPeakReserved, mm.PeakReserved)
	}
	return pr, nil
}

// rows groups timeline points into rows (stored as Predicted) and returns
// their keys. A node's row spans its output and workspace allocations, its
// run, and the frees that follow it.
func (n *Names) rows(chunks []planner.Chunk, tl []planner.Point, pr *Profile, full bool) ([]rowKey, error) {
	p := n.p
	var keys []rowKey
	err := n.walk(chunks, tl, func(_ int, pt planner.Point, k rowKey, bufs []int) {
		if len(keys) == 0 || keys[len(keys)-1] != k {
			keys = append(keys, k)
			row := ProfileRow{Chunk: k.chunk, Step: pt.Step, Node: k.node,
				Predicted: OpMemory{PeakActive: pt.Allocated, PeakReserved: pt.Reserved}}
			if full {
				n.describe(&row, bufs)
			}
			pr.Rows = append(pr.Rows, row)
		}
		r := &pr.Rows[len(pr.Rows)-1]
		r.Predicted.LiveAfter, r.Predicted.ReservedAfter = pt.Allocated, pt.Reserved
		r.Predicted.PeakActive = max(r.Predicted.PeakActive, pt.Allocated)
		r.Predicted.PeakReserved = max(r.Predicted.PeakReserved, pt.Reserved)
		size := 0
		if pt.Chunk >= 0 {
			size = chunks[pt.Chunk].Size
		}
		for _, b := range bufs {
			if b >= 0 {
				req := p.Buffers[b].Bytes(size)
				r.Requested += req
				r.Allocated += roundSize(req)
			} else {
				r.Freed += roundSize(p.Buffers[-1-b].Bytes(size))
			}
		}
	})
	return keys, err
}

// walk calls fn for each point i of timeline tl of p run for chunks, with
// the profile row the point belongs to and the buffers it allocated (≥ 0)
// or freed (encoded −1−b); it checks that the timeline fits the program.
func (n *Names) walk(chunks []planner.Chunk, tl []planner.Point, fn func(i int, pt planner.Point, k rowKey, bufs []int)) error {
	p := n.p
	// owner is the node whose row a step belongs to: an allocation the next
	// run's (a node's output and workspace, and a companion output
	// allocated with it: planner.Program.Companion), a run and the frees
	// after it that run's.
	owner := make([]int, len(p.Steps))
	cur := -1
	for si, st := range p.Steps {
		if st.Kind == planner.StepRun {
			cur = st.Node
		}
		owner[si] = cur
	}
	cur = -1
	for si := len(p.Steps) - 1; si >= 0; si-- {
		switch p.Steps[si].Kind {
		case planner.StepRun:
			cur = p.Steps[si].Node
		case planner.StepAlloc:
			owner[si] = cur
		}
	}
	persistent := p.Persistent
	if len(chunks) > 1 {
		persistent = append(append([]int(nil), persistent...), p.Accumulators...)
	}
	pi := 0                 // next expected persistent buffer
	nth := map[[2]int]int{} // (chunk, node) → rows so far, for persistent buffers of one node
	for i, pt := range tl {
		var k rowKey
		var bufs []int // buffers allocated (≥ 0) or freed (encoded −1−b) at this point
		switch {
		case pt.Chunk < 0: // persistent allocation
			for pi < len(persistent) && p.Buffers[persistent[pi]].Node != pt.Node {
				pi++ // resident: the executor already held it
			}
			if pi == len(persistent) {
				return fmt.Errorf("%w: persistent allocation for node %d is not in the program", ErrTimeline, pt.Node)
			}
			k = rowKey{chunk: -1, step: -1, node: pt.Node, nth: nth[[2]int{-1, pt.Node}]}
			nth[[2]int{-1, pt.Node}]++
			bufs = []int{persistent[pi]}
			pi++
		case pt.Chunk >= len(chunks):
			return fmt.Errorf("%w: point of chunk %d, but %d chunks", ErrTimeline, pt.Chunk, len(chunks))
		case pt.Step < 0: // a chunk's outputs read back and freed
			k = rowKey{chunk: pt.Chunk, step: -1, node: -1}
			if pt.Node < 0 || pt.Node >= len(p.OutputBuf) || p.OutputBuf[pt.Node] < 0 {
				return fmt.Errorf("%w: chunk %d frees output node %d, which has no buffer", ErrTimeline, pt.Chunk, pt.Node)
			}
			bufs = []int{-1 - p.OutputBuf[pt.Node]}
		case pt.Step >= len(p.Steps):
			return fmt.Errorf("%w: step %d of a %d-step program", ErrTimeline, pt.Step, len(p.Steps))
		default:
			st := p.Steps[pt.Step]
			if st.Node != pt.Node || st.Kind != pt.Kind {
				return fmt.Errorf("%w: step %d is %s of node %d, the timeline says %s of node %d",
					ErrTimeline, pt.Step, st.Kind, st.Node, pt.Kind, pt.Node)
			}
			k = rowKey{chunk: pt.Chunk, step: -2, node: owner[pt.Step]}
			switch st.Kind {
			case planner.StepAlloc:
				bufs = []int{st.Buf}
			case planner.StepFree:
				bufs = []int{-1 - st.Buf}
			}
		}
		fn(i, pt, k, bufs)
	}
	return nil
}

// roundSize is what a request of n bytes occupies; an empty request
// occupies nothing.
func roundSize(n int64) int64 {
	if n == 0 {
		return 0
	}
	return alloc.RoundSize(n)
}

// describe fills a row's module path, op and name.
func (n *Names) describe(r *ProfileRow, bufs []int) {
	switch {
	case r.Node < 0:
		r.Op, r.Name = "(outputs)", "chunk outputs read back"
	case r.Chunk < 0 && len(bufs) == 1:
		l := n.ofBuffer(bufs[0])
		nd := n.p.Graph.Node(r.Node)
		r.Scope, r.Op, r.Name = nd.Scope, l.Stack[len(l.Stack)-1], l.Name
	default:
		nd := n.p.Graph.Node(r.Node)
		r.Scope, r.Op = nd.Scope, nd.Op.String()
		if bi := n.p.OutputBuf[r.Node]; bi >= 0 {
			r.Name = n.ofBuffer(bi).Name
		}
	}
}

var profileHeader = []string{"chunk", "step", "node", "module", "op", "name", "requested", "allocated", "freed",
	"live_after", "peak_active", "peak_reserved", "measured_live_after", "measured_peak_active", "measured_peak_reserved"}

func (r *ProfileRow) fields(format func(int64) string) []string {
	f := []string{strconv.Itoa(r.Chunk), strconv.Itoa(r.Step), strconv.Itoa(r.Node), r.Scope, r.Op, r.Name,
		format(r.Requested), format(r.Allocated), format(r.Freed),
		format(r.Predicted.LiveAfter), format(r.Predicted.PeakActive), format(r.Predicted.PeakReserved)}
	if r.Measured == nil {
		return append(f, "", "", "")
	}
	return append(f, format(r.Measured.LiveAfter), format(r.Measured.PeakActive), format(r.Measured.PeakReserved))
}

// WriteText writes the profile as an aligned table with human-readable
// sizes, then the peaks.
func (p *Profile) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	for i, h := range profileHeader {
		if i > 0 {
			fmt.Fprint(tw, "\t")
		}
		fmt.Fprint(tw, h)
	}
	fmt.Fprintln(tw, "\t")
	for i := range p.Rows {
		for j, f := range p.Rows[i].fields(alloc.FormatBytes) {
			if j > 0 {
				fmt.Fprint(tw, "\t")
			}
			fmt.Fprint(tw, f)
		}
		fmt.Fprintln(tw, "\t")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "predicted peak: %s active, %s reserved, first at %s\n",
		alloc.FormatBytes(p.PredictedPeakActive), alloc.FormatBytes(p.PredictedPeakReserved), p.where(p.PredictedPeakRow))
	if err == nil && p.MeasuredPeakRow >= 0 {
		_, err = fmt.Fprintf(w, "measured peak:  %s active, %s reserved, first at %s\n",
			alloc.FormatBytes(p.MeasuredPeakActive), alloc.FormatBytes(p.MeasuredPeakReserved), p.where(p.MeasuredPeakRow))
	}
	return err
}

// where describes row i for the peak lines.
func (p *Profile) where(i int) string {
	if i < 0 || i >= len(p.Rows) {
		return "no row"
	}
	r := p.Rows[i]
	if r.Chunk < 0 {
		return "persistent " + r.Name
	}
	return fmt.Sprintf("chunk %d node %d %s (%s)", r.Chunk, r.Node, r.Op, r.Name)
}

// WriteCSV writes one header line and one line per row, sizes in bytes;
// measured columns are empty when not measured.
func (p *Profile) WriteCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(profileHeader); err != nil {
		return err
	}
	for i := range p.Rows {
		if err := cw.Write(p.Rows[i].fields(func(n int64) string { return strconv.FormatInt(n, 10) })); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteJSON writes the profile as indented JSON.
func (p *Profile) WriteJSON(w io.Writer) error {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(p)
}
