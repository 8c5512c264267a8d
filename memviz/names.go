package memviz

import (
	"reflect"
	"strconv"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// Kind says what a live block holds.
type Kind string

const (
	KindParam      Kind = "param"           // a parameter or constant
	KindGrad       Kind = "grad"            // a parameter's gradient (kept output or accumulator)
	KindState      Kind = "optimizer_state" // optimizer state of a parameter
	KindActivation Kind = "activation"      // a node's value inside a chunk, forward or backward
	KindWorkspace  Kind = "workspace"       // scratch memory of a kernel
	KindUnknown    Kind = "unknown"         // no program buffer and no tag accounts for it
)

// kindOrder sorts report rows: persistent memory first.
var kindOrder = map[Kind]int{KindParam: 0, KindGrad: 1, KindState: 2, KindActivation: 3, KindWorkspace: 4, KindUnknown: 5}

// Options configures how blocks are named.
type Options struct {
	// StateNames names the optimizer state slots. Nil picks PyTorch's
	// names from the slot count: two slots are Adam's exp_avg and
	// exp_avg_sq, one is SGD's momentum_buffer; others are state<k>.
	StateNames []string
}

// Label names one block.
type Label struct {
	Name   string   // "fc1.weight", "fc1.weight.grad", "fc1.weight.exp_avg", "fc1/matmul"
	Kind   Kind     //
	Buffer int      // index into the program's Buffers, −1 when none
	Stack  []string // for flame graphs, root first: module path components, then the leaf
}

// Names resolves allocator tags to tensor names using a compiled program:
// parameter names from the graph (nn modules name them), gradients and
// optimizer state by their parameter, activations by module path and op.
// A nil *Names, or one made without a program, names blocks from their tags
// alone.
type Names struct {
	p          *planner.Program
	o          Options
	exact      map[alloc.Tag][]int    // buffers by tag
	persistent map[[2]string][]int    // persistent buffers by (op, scope): a resident parameter keeps the tag of the program that uploaded it
	gradOf     map[int]int            // kept output node → parameter node
	slots      map[int]int            // parameter node → optimizer state slots
	identity   map[int]residentTensor // persistent buffer → what an executor keeps resident
}

// residentTensor is what a resident executor shares one block among: a
// parameter's data (and for state, the slot).
type residentTensor struct {
	data any
	kind planner.BufferKind
	slot int
}

// NewNames indexes p's buffers; p may be nil.
func NewNames(p *planner.Program, o Options) *Names {
	n := &Names{p: p, o: o, exact: map[alloc.Tag][]int{}, persistent: map[[2]string][]int{},
		gradOf: map[int]int{}, slots: map[int]int{}, identity: map[int]residentTensor{}}
	if p == nil {
		return n
	}
	for i, b := range p.Buffers {
		n.exact[b.Tag] = append(n.exact[b.Tag], i)
		switch b.Kind {
		case planner.BufParam, planner.BufState, planner.BufAccumulator:
			k := [2]string{b.Tag.Op, b.Tag.Scope}
			n.persistent[k] = append(n.persistent[k], i)
		}
		if b.Kind == planner.BufState {
			n.slots[b.Node]++
		}
		if b.Kind == planner.BufParam || b.Kind == planner.BufState {
			if v := p.Graph.Node(b.Node).Value; v != nil && reflect.TypeOf(v).Comparable() {
				n.identity[i] = residentTensor{data: v, kind: b.Kind, slot: b.Slot}
			}
		}
	}
	if len(p.Kept) == len(p.Trained) {
		for i, k := range p.Kept {
			n.gradOf[k] = p.Trained[i]
		}
	}
	return n
}

// buffer finds the program buffer a block with tag t belongs to, or −1.
func (n *Names) buffer(t alloc.Tag) int {
	if n == nil || n.p == nil {
		return -1
	}
	if bs := n.exact[t]; len(bs) > 0 {
		return bs[0]
	}
	if bs := n.persistent[[2]string{t.Op, t.Scope}]; len(bs) > 0 {
		return bs[0]
	}
	return -1
}

// Of labels a block with tag t.
func (n *Names) Of(t alloc.Tag) Label {
	if bi := n.buffer(t); bi >= 0 {
		return n.ofBuffer(bi)
	}
	return labelFromTag(t)
}

// ofBuffer labels program buffer bi.
func (n *Names) ofBuffer(bi int) Label {
	b := n.p.Buffers[bi]
	nd := n.p.Graph.Node(b.Node)
	l := Label{Buffer: bi}
	switch b.Kind {
	case planner.BufParam:
		name := paramName(nd)
		l.Name, l.Kind, l.Stack = name, KindParam, path(name, nd.Op.String())
	case planner.BufState:
		name := paramName(nd)
		s := n.stateName(b.Slot, n.slots[b.Node])
		l.Name, l.Kind, l.Stack = name+"."+s, KindState, path(name, s)
	case planner.BufAccumulator, planner.BufOutput:
		if pn, ok := n.gradOf[b.Node]; ok {
			name := paramName(n.p.Graph.Node(pn))
			l.Name, l.Kind, l.Stack = name+".grad", KindGrad, path(name, "grad")
			break
		}
		op := nd.Op.String()
		if nd.Name != "" { // a named input
			l.Name, l.Kind, l.Stack = nd.Name, KindActivation, path(nd.Name, op)
		} else {
			l.Name, l.Kind, l.Stack = scoped(nd.Scope, op), KindActivation, path(nd.Scope, op)
		}
		if b.Kind == planner.BufAccumulator {
			l.Name += ".sum"
			l.Stack = append(l.Stack, "sum")
		}
	case planner.BufWorkspace:
		op := nd.Op.String() + ".workspace"
		l.Name, l.Kind, l.Stack = scoped(nd.Scope, op), KindWorkspace, path(nd.Scope, op)
	}
	return l
}

func (n *Names) stateName(slot, slots int) string {
	if slot < len(n.o.StateNames) && n.o.StateNames[slot] != "" {
		return n.o.StateNames[slot]
	}
	switch {
	case slots == 2:
		return [...]string{"exp_avg", "exp_avg_sq"}[slot]
	case slots == 1:
		return "momentum_buffer"
	}
	return "state" + strconv.Itoa(slot)
}

// labelFromTag labels a block no program buffer accounts for from its
// tag: the op says the kind, the scope the module path.
func labelFromTag(t alloc.Tag) Label {
	l := Label{Buffer: -1, Name: scoped(t.Scope, t.Op), Stack: path(t.Scope, t.Op)}
	switch {
	case t.Op == "":
		l.Kind, l.Name, l.Stack = KindUnknown, "<unknown>", []string{"<unknown>"}
	case t.Op == "param" || t.Op == "const":
		l.Kind, l.Name = KindParam, t.Scope
	case strings.HasPrefix(t.Op, "optimizer_state"):
		l.Kind = KindState
	case t.Op == "grad_accumulator":
		l.Kind = KindGrad
	case strings.HasSuffix(t.Op, ".workspace"):
		l.Kind = KindWorkspace
	default:
		l.Kind = KindActivation
	}
	if l.Name == "" {
		l.Name = t.Op
	}
	return l
}

func paramName(nd *graph.Node) string {
	if nd.Name != "" {
		return nd.Name
	}
	return scoped(nd.Scope, nd.Op.String()+"#"+strconv.Itoa(nd.ID))
}

// scoped joins a module path and an op: "fc1/matmul".
func scoped(scope, op string) string {
	if scope == "" {
		return op
	}
	return scope + "/" + op
}

// path is a flame-graph stack: the dotted name split into components,
// then leaf.
func path(dotted, leaf string) []string {
	var s []string
	if dotted != "" {
		s = strings.Split(dotted, ".")
	}
	if leaf == "" {
		leaf = "<unknown>"
	}
	return append(s, leaf)
}
