package memviz

import (
	"cmp"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// Tensor is one live device tensor of a report.
type Tensor struct {
	Name  string `json:"name"`
	Kind  Kind   `json:"kind"`
	Node  int    `json:"node"` // −1 when unknown
	Op    string `json:"op"`
	Scope string `json:"scope"`
	Shape []int  `json:"shape"` // nil when unknown (workspaces, unowned blocks)
	DType string `json:"dtype"`
	// Requested is the bytes asked for; Size the block's bytes after the
	// allocator's 512-byte rounding. An alias has Size 0: its bytes are
	// counted once, in the tensor it points at.
	Requested int64     `json:"requested"`
	Size      int64     `json:"size"`
	Addr      alloc.Ptr `json:"addr"`
	// AliasOf names the tensor whose block this one shares (a resident
	// executor uploads a parameter's data once however many graph nodes
	// read it); Aliases lists the tensors sharing this one's block.
	AliasOf string   `json:"alias_of,omitempty"`
	Aliases []string `json:"aliases,omitempty"`
}

// Totals itemise a device's allocated bytes:
// Tensors + Rounding + Workspace + Unowned = Allocated.
type Totals struct {
	Allocated int64 `json:"allocated"` // bytes in active blocks: allocated_bytes.all.current
	Reserved  int64 `json:"reserved"`  // bytes in segments: reserved_bytes.all.current
	Tensors   int64 `json:"tensors"`   // requested bytes of parameters, gradients, optimizer state and activations
	Rounding  int64 `json:"rounding"`  // what rounding their blocks up to 512-byte multiples added
	Workspace int64 `json:"workspace"` // blocks of kernel workspaces
	Unowned   int64 `json:"unowned"`   // blocks with no known owner
	// ByKind sums block bytes (rounded) per kind.
	ByKind map[Kind]int64 `json:"by_kind"`
}

// DeviceReport lists one device's live tensors.
type DeviceReport struct {
	Device  int      `json:"device"`
	Tensors []Tensor `json:"tensors"` // by kind (parameters first), then size, largest first
	Totals  Totals   `json:"totals"`
}

// Report lists live device tensors grouped by device.
type Report struct {
	Devices []DeviceReport `json:"devices"`
}

// NewReport names every active block of s using program p (nil names
// blocks from their tags alone) and itemises each device's allocated bytes.
// Blocks map to program buffers through their tags (node, op, module path);
// parameters and optimizer state also by op and name, since a resident
// executor keeps the blocks of the program that first uploaded them.
func NewReport(p *planner.Program, s Snapshot, o Options) (*Report, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	n := NewNames(p, o)
	r := &Report{}
	for _, d := range s.Devices {
		r.Devices = append(r.Devices, n.device(d))
	}
	return r, nil
}

func (n *Names) device(d DeviceSnapshot) DeviceReport {
	dr := DeviceReport{Device: d.Device, Totals: Totals{Allocated: d.Allocated(), Reserved: d.Reserved(), ByKind: map[Kind]int64{}}}
	var bufs []int        // program buffer of each tensor, −1 if none
	held := map[int]int{} // buffer → index of its first tensor
	for _, seg := range d.Segments {
		for _, b := range seg.Blocks {
			if !active(b.State) {
				continue
			}
			l := n.Of(b.Tag)
			t := Tensor{Name: l.Name, Kind: l.Kind, Node: b.Tag.Node, Op: b.Tag.Op, Scope: b.Tag.Scope,
				Requested: b.Requested, Size: b.Size, Addr: b.Addr}
			if l.Buffer >= 0 {
				t.Node = n.p.Buffers[l.Buffer].Node
				t.Shape, t.DType = n.shape(l.Buffer, b.Requested)
				nd := n.p.Graph.Node(t.Node)
				t.Op, t.Scope = nd.Op.String(), nd.Scope
				if _, ok := held[l.Buffer]; !ok {
					held[l.Buffer] = len(dr.Tensors)
				}
			}
			dr.Tensors = append(dr.Tensors, t)
			bufs = append(bufs, l.Buffer)
			dr.Totals.ByKind[l.Kind] = addBytes(dr.Totals.ByKind[l.Kind], b.Size)
			switch l.Kind {
			case KindWorkspace:
				dr.Totals.Workspace = addBytes(dr.Totals.Workspace, b.Size)
			case KindUnknown:
				dr.Totals.Unowned = addBytes(dr.Totals.Unowned, b.Size)
			default:
				dr.Totals.Tensors = addBytes(dr.Totals.Tensors, b.Requested)
				dr.Totals.Rounding = addBytes(dr.Totals.Rounding, b.Size-b.Requested)
			}
		}
	}
	n.chunkGrads(&dr, bufs)
	n.aliases(&dr, held)
	slices.SortStableFunc(dr.Tensors, func(a, b Tensor) int {
		return cmp.Or(cmp.Compare(kindOrder[a.Kind], kindOrder[b.Kind]), cmp.Compare(b.Size, a.Size),
			cmp.Compare(a.Name, b.Name), cmp.Compare(a.Addr, b.Addr))
	})
	return dr
}

// shape is the shape and dtype of buffer bi when it holds requested bytes:
// the chunk size follows from bytes = Fixed + PerSample·chunk.
func (n *Names) shape(bi int, requested int64) ([]int, string) {
	b := n.p.Buffers[bi]
	if b.Kind == planner.BufWorkspace {
		return nil, ""
	}
	ty := n.p.Graph.Node(b.Node).Type
	if b.PerSample > 0 && ty.Batched() {
		return ty.AtBatch(int((requested - b.Fixed) / b.PerSample)), ty.DType.String()
	}
	return slices.Clone(ty.Shape), ty.DType.String()
}

// aliases adds the persistent buffers that share a held block: a resident
// executor uploads a parameter's data once for every node reading it.
func (n *Names) aliases(dr *DeviceReport, held map[int]int) {
	if n == nil || n.p == nil {
		return
	}
	owner := map[residentTensor]int{} // → index in dr.Tensors
	for bi, ti := range held {
		if id, ok := n.identity[bi]; ok {
			if prev, dup := owner[id]; !dup || ti < prev {
				owner[id] = ti
			}
		}
	}
	for _, bi := range n.p.Persistent {
		id, ok := n.identity[bi]
		if _, isHeld := held[bi]; !ok || isHeld {
			continue
		}
		ti, shared := owner[id]
		if !shared {
			continue
		}
		l := n.ofBuffer(bi)
		host := &dr.Tensors[ti]
		shape, dtype := n.shape(bi, host.Requested)
		nd := n.p.Graph.Node(n.p.Buffers[bi].Node)
		host.Aliases = append(host.Aliases, l.Name)
		dr.Tensors = append(dr.Tensors, Tensor{Name: l.Name, Kind: l.Kind, Node: nd.ID, Op: nd.Op.String(), Scope: nd.Scope,
			Shape: shape, DType: dtype, Requested: host.Requested, Addr: host.Addr, AliasOf: host.Name})
	}
}

// chunkGrads renames a chunk's gradient when its accumulator is live
// beside it, so both are told apart: "w.grad" sums the chunks,
// "w.grad.chunk" is the running chunk's part. bufs holds each tensor's
// program buffer.
func (n *Names) chunkGrads(dr *DeviceReport, bufs []int) {
	acc := map[int]bool{} // nodes whose accumulator is held
	for _, bi := range bufs {
		if bi >= 0 && n.p.Buffers[bi].Kind == planner.BufAccumulator {
			acc[n.p.Buffers[bi].Node] = true
		}
	}
	for i, bi := range bufs {
		if bi >= 0 && n.p.Buffers[bi].Kind == planner.BufOutput && acc[n.p.Buffers[bi].Node] {
			dr.Tensors[i].Name += ".chunk"
		}
	}
}

// WriteText writes the report as aligned tables, one per device, each
// followed by the itemised totals.
func (r *Report) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	for _, d := range r.Devices {
		t := d.Totals
		fmt.Fprintf(tw, "device %d: %d tensors, %s allocated, %s reserved\n", d.Device, len(d.Tensors),
			alloc.FormatBytes(t.Allocated), alloc.FormatBytes(t.Reserved))
		fmt.Fprintln(tw, "kind\tname\tshape\tdtype\trequested\tsize\tnode\taddress\t")
		for _, x := range d.Tensors {
			size, addr := alloc.FormatBytes(x.Size), fmt.Sprintf("%#x", uint64(x.Addr))
			if x.AliasOf != "" {
				size = "→ " + x.AliasOf
			}
			shape := ""
			if x.Shape != nil {
				shape = graph.FormatShape(x.Shape)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t\n", x.Kind, x.Name, shape, x.DType,
				alloc.FormatBytes(x.Requested), size, x.Node, addr)
		}
		fmt.Fprintf(tw, "\ttensors (requested)\t\t\t\t%s\t\t\t\n", alloc.FormatBytes(t.Tensors))
		fmt.Fprintf(tw, "\t+ rounding to 512 B\t\t\t\t%s\t\t\t\n", alloc.FormatBytes(t.Rounding))
		fmt.Fprintf(tw, "\t+ workspace\t\t\t\t%s\t\t\t\n", alloc.FormatBytes(t.Workspace))
		fmt.Fprintf(tw, "\t+ blocks with no known owner\t\t\t\t%s\t\t\t\n", alloc.FormatBytes(t.Unowned))
		fmt.Fprintf(tw, "\t= allocated\t\t\t\t%s\t\t\t\n", alloc.FormatBytes(t.Allocated))
		fmt.Fprintf(tw, "\treserved (cached %s)\t\t\t\t%s\t\t\t\n", alloc.FormatBytes(t.Reserved-t.Allocated), alloc.FormatBytes(t.Reserved))
	}
	return tw.Flush()
}

// WriteCSV writes the tensors of every device as one CSV table with a
// header row; byte counts are exact, an alias's size is 0 and alias_of
// names the tensor holding its bytes.
func (r *Report) WriteCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"device", "kind", "name", "shape", "dtype", "requested", "size", "node", "op", "scope", "address", "alias_of"})
	for _, d := range r.Devices {
		for _, x := range d.Tensors {
			shape := ""
			if x.Shape != nil {
				shape = graph.FormatShape(x.Shape)
			}
			_ = cw.Write([]string{strconv.Itoa(d.Device), string(x.Kind), x.Name, shape, x.DType,
				strconv.FormatInt(x.Requested, 10), strconv.FormatInt(x.Size, 10), strconv.Itoa(x.Node), x.Op, x.Scope,
				fmt.Sprintf("%#x", uint64(x.Addr)), x.AliasOf})
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(r)
}

// String renders the report as WriteText does.
func (r *Report) String() string {
	var b strings.Builder
	_ = r.WriteText(&b) // a strings.Builder does not fail
	return b.String()
}
