package lazy

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// Graph is a computation graph under construction.
type Graph struct {
	ir       *graph.Graph
	leaves   map[*leaf]int // params and consts adopted by this graph
	leafAt   map[int]*leaf // the inverse of leaves
	inputs   int           // batched inputs (Wrap, Placeholder)
	imported map[*Graph][]int
	updates  []StepUpdate // OnStep's, in order
	// scopeSites parallels the module scopes: the call site recorded on
	// entering an internal module's scope (PushInternalScope), "" for
	// other scopes. Ops made inside an internal module take it instead of
	// walking the stack again.
	scopeSites []string
	// entered is EnterInternal's stack: each entry's site, and how many
	// scopes were open when it was made.
	entered []enteredSite
	// precheck's scratch: the input types and attributes it passes to a
	// shape rule, kept so that each call allocates neither.
	types []graph.Type
	attrs graph.Attrs
	// sized: made by newInputGraph, so its size is the next one's hint.
	sized bool
}

// StepUpdate is a value a training step of its graph computes alongside
// the loss and gradients, and what the step does with it (Graph.OnStep).
type StepUpdate struct {
	Value *Tensor
	Apply func(*tensor.Dense) error
}

// OnStep registers t, a value of g, as part of every training step run on
// g: batchfit.Session.Step computes it in the same run as the loss and the
// gradients (the same chunks; the planner counts it) and, once the run
// has succeeded, calls apply with its value, before returning. Eval and
// other runs of g leave it alone. Graphs have no side effects; this is how
// one asks for a step to have one, once per step: nn.BatchNorm2d with
// PerChunkStats updates its running statistics so. Registering a value of
// another graph, or an erroneous one, is an error, and so is a nil apply.
func (g *Graph) OnStep(t *Tensor, apply func(*tensor.Dense) error) error {
	switch {
	case t.Err() != nil:
		return t.Err()
	case t.Graph() != g:
		return &graph.OpError{Op: "on_step", Err: graph.Errorf(graph.ErrMixedGraphs, "the value is not a node of this graph")}
	case apply == nil:
		return &graph.OpError{Op: "on_step", Err: graph.Errorf(graph.ErrNilTensor, "nil apply")}
	}
	g.updates = append(g.updates, StepUpdate{Value: t, Apply: apply})
	return nil
}

// StepUpdates lists what OnStep registered on g, in order.
func (g *Graph) StepUpdates() []StepUpdate {
	if g == nil {
		return nil
	}
	return slices.Clone(g.updates)
}

// NewGraph returns an empty graph.
func NewGraph() *Graph { return newGraph(0, 0) }

func newGraph(nodes, leaves int) *Graph {
	g := &Graph{ir: graph.New(), leaves: make(map[*leaf]int, leaves), leafAt: make(map[int]*leaf, leaves)}
	if nodes > 0 {
		g.ir.Grow(nodes)
	}
	return g
}

// A training loop builds the same graph every step. The graphs made by
// Wrap, WrapAs and Placeholder (the loop's, where the functions of the
// same names on a Graph add to one) record how many nodes and leaves they
// have reached, and the next one starts with room for as many: one node
// list allocated per step instead of a dozen growing copies of it (a node
// is some 450 bytes), which was a quarter of GPT-2 small's graph build.
var (
	inputGraphNodes  atomic.Int64
	inputGraphLeaves atomic.Int64
)

// maxReservedNodes bounds the reservation, whatever a graph reached.
const maxReservedNodes = 1 << 16

// newInputGraph is NewGraph for Wrap, WrapAs and Placeholder, sized as the
// previous such graph.
func newInputGraph() *Graph {
	g := newGraph(int(min(inputGraphNodes.Load(), maxReservedNodes)), int(min(inputGraphLeaves.Load(), maxReservedNodes)))
	g.sized = true
	return g
}

// grew records g's size for the next newInputGraph, when g is one.
func (g *Graph) grew() {
	if g.sized {
		inputGraphNodes.Store(int64(g.ir.Len()))
		inputGraphLeaves.Store(int64(len(g.leaves)))
	}
}

// IR is the underlying graph, for executors and analyses.
func (g *Graph) IR() *graph.Graph { return g.ir }

// PushScope enters a module scope (nn modules name their nodes with it).
func (g *Graph) PushScope(name string) {
	g.ir.PushScope(name)
	g.scopeSites = append(g.scopeSites, "")
}

// PushInternalScope enters the scope of one of batchfit's own modules
// (packages nn and models), whose Forward calls no user code except
// through other modules' scopes. The user's call site is found once,
// here (or taken from an enclosing internal scope), and every op made
// directly inside the scope takes it: the site
// each op would find by walking its own stack, since every frame between
// such an op and this call is batchfit's. A training loop that rebuilds
// GPT-2 small's graph each step walks the stack once per module instead
// of once per op.
func (g *Graph) PushInternalScope(name string) {
	g.ir.PushScope(name)
	// Inside another internal module's scope the caller is that module's
	// code, so the site is its scope's.
	at := g.scopeSite()
	if at == "" {
		at = site()
	}
	g.scopeSites = append(g.scopeSites, at)
}

// PopScope leaves the innermost module scope.
func (g *Graph) PopScope() {
	g.ir.PopScope()
	if n := len(g.scopeSites); n > 0 {
		g.scopeSites = g.scopeSites[:n-1]
	}
}

// scopeSite is the site ops made now take without walking the stack: the
// innermost EnterInternal's, when no scope was opened since; else the
// innermost scope's recorded site, "" when the scope is not an internal
// module's (or there is none).
func (g *Graph) scopeSite() string {
	if n := len(g.entered); n > 0 && g.entered[n-1].depth == len(g.scopeSites) {
		return g.entered[n-1].at
	}
	if n := len(g.scopeSites); n > 0 {
		return g.scopeSites[n-1]
	}
	return ""
}

type enteredSite struct {
	at    string
	depth int
}

// EnterInternal starts a stretch of graph building by one of batchfit's
// own functions (packages nn and models) that its caller may have called
// directly, outside any module scope (a model's Forward, models.Loss):
// until LeaveInternal, the ops it makes outside further scopes take the
// call site found here, once, as PushInternalScope's do, rather than each
// walking the stack to the same answer. A module scope opened meanwhile
// (a user's module among a Sequential's children) hides it until closed.
func (g *Graph) EnterInternal() {
	at := g.scopeSite()
	if at == "" {
		at = site()
	}
	g.entered = append(g.entered, enteredSite{at: at, depth: len(g.scopeSites)})
}

// LeaveInternal ends the innermost EnterInternal.
func (g *Graph) LeaveInternal() {
	if n := len(g.entered); n > 0 {
		g.entered = g.entered[:n-1]
	}
}

// leaf is a parameter or constant not tied to any graph.
type leaf struct {
	op     graph.Op
	name   string
	typ    graph.Type
	value  tensor.Tensor // nil for shape-only leaves
	frozen bool          // a parameter SetFrozen marked
}

// Tensor is a lazy value: a node of a graph, a free leaf, or an error.
type Tensor struct {
	g    *Graph
	id   int
	leaf *leaf
	err  error
}

// Err returns the first error met while building this tensor, or nil.
func (t *Tensor) Err() error {
	if t == nil {
		return &graph.OpError{Op: "tensor", Err: graph.Errorf(graph.ErrNilTensor, "nil *lazy.Tensor")}
	}
	return t.err
}

func (t *Tensor) typ() graph.Type {
	switch {
	case t == nil || t.err != nil || t.zero():
		return graph.Type{BatchAxis: -1}
	case t.leaf != nil:
		return t.leaf.typ
	}
	return t.g.ir.Node(t.id).Type
}

// zero reports a Tensor not made by this package (a zero value): no graph,
// no leaf, no error.
func (t *Tensor) zero() bool { return t.g == nil && t.leaf == nil && t.err == nil }

// Shape is the tensor's full-batch shape (nil after an error).
func (t *Tensor) Shape() []int { return slices.Clone(t.typ().Shape) }

// DType is the element type.
func (t *Tensor) DType() graph.DType { return t.typ().DType }

// BatchAxis is the axis carrying the batch, or −1.
func (t *Tensor) BatchAxis() int { return t.typ().BatchAxis }

// Type is everything shape inference knows about the tensor.
func (t *Tensor) Type() graph.Type { return t.typ() }

// Graph is the graph the tensor belongs to (nil for free leaves and errors).
func (t *Tensor) Graph() *Graph {
	if t == nil {
		return nil
	}
	return t.g
}

// ID is the tensor's node id in its graph (−1 for free leaves and errors).
func (t *Tensor) ID() int {
	if t == nil || t.g == nil {
		return -1
	}
	return t.id
}

// Name is the parameter name of a Param, or "".
func (t *Tensor) Name() string {
	if t != nil && t.leaf != nil {
		return t.leaf.name
	}
	if t != nil && t.g != nil {
		return t.g.ir.Node(t.id).Name
	}
	return ""
}

// SetFrozen marks a parameter frozen (on) or trainable again. A
// batchfit.Session's Step leaves a frozen parameter in its list out, as if
// it were not listed: no gradient is computed for it (no gradient buffer),
// the optimizer neither updates it nor keeps state for it, and the step's
// plan is the smaller for it. Its value is read as any parameter's. Other
// tensors than parameters are left as they are.
func (t *Tensor) SetFrozen(on bool) {
	if t != nil && t.leaf != nil && t.leaf.op == graph.OpParam {
		t.leaf.frozen = on
	}
}

// Frozen reports whether the tensor is a parameter marked frozen.
func (t *Tensor) Frozen() bool { return t != nil && t.leaf != nil && t.leaf.frozen }

// Value is the data of a source tensor (Wrap, Param, Const), or nil.
func (t *Tensor) Value() tensor.Tensor {
	switch {
	case t == nil:
		return nil
	case t.leaf != nil:
		return t.leaf.value
	case t.g != nil:
		return t.g.ir.Node(t.id).Value
	}
	return nil
}

func (t *Tensor) String() string {
	if t.Err() != nil {
		return "lazy.Tensor(error: " + t.Err().Error() + ")"
	}
	ty := t.typ()
	return fmt.Sprintf("lazy.Tensor(%s%v, batch axis %d)", ty.DType, ty.Shape, ty.BatchAxis)
}

// ErrorTensor returns a tensor holding err, so packages that build on lazy
// (package nn) reject bad input the way ops do: with a sticky error, never a
// panic. An err that already carries a *graph.OpError is kept as it is; any
// other is wrapped in one naming op, shapes and the caller's file:line.
func ErrorTensor(op string, err error, shapes ...[]int) *Tensor {
	var oe *graph.OpError
	if errors.As(err, &oe) {
		return &Tensor{id: -1, err: err}
	}
	return errTensor(op, site(), err, shapes...)
}

func errTensor(op string, site string, err error, shapes ...[]int) *Tensor {
	return &Tensor{id: -1, err: &graph.OpError{Op: op, Shapes: shapes, Site: site, Err: err}}
}

// site returns the file:line of the first caller outside batchfit's
// graph-building packages, so errors point at user code.
//
// A training loop builds the same graph every step: each return address's
// answer (its file:line, and whether its frames are all batchfit's) is
// resolved once and cached, and the stack is unwound a few frames at a
// time, as far as the first caller outside batchfit (usually within a
// handful), not to a fixed depth.
func site() string {
	var pcs [3]uintptr
	last := "?"
	for skip := 2; ; { // runtime.Callers and site itself
		n := runtime.Callers(skip, pcs[:])
		for _, pc := range pcs[:n] {
			ps := siteOf(pc)
			if ps.user {
				return ps.at
			}
			last = ps.at
		}
		if n < len(pcs) { // the stack's end: batchfit's frames all the way
			return last
		}
		skip += n
	}
}

// pcSite is site's answer for one return address: the file:line of its
// first frame outside batchfit (of its last frame when all are
// batchfit's: one address is several frames where calls were inlined).
type pcSite struct {
	at   string
	user bool
}

// sites caches siteOf's answers, up to maxCachedSites addresses.
var (
	sites       sync.Map // uintptr → pcSite
	sitesCached atomic.Int64
)

const maxCachedSites = 1 << 16

func siteOf(pc uintptr) pcSite {
	if s, ok := sites.Load(pc); ok {
		return s.(pcSite)
	}
	var ps pcSite
	frames := runtime.CallersFrames([]uintptr{pc})
	for {
		f, more := frames.Next()
		ps.at = shortFile(f.File) + fmt.Sprintf(":%d", f.Line)
		if !internalFrame(f) {
			ps.user = true
			break
		}
		if !more {
			break
		}
	}
	if sitesCached.Add(1) <= maxCachedSites {
		sites.Store(pc, ps)
	}
	return ps
}

// internalPackages build graphs, or run their steps (the Session, dist's
// Trainer), on the user's behalf; their frames are skipped.
var internalPackages = []string{"github.com/batchfit/batchfit/lazy.", "github.com/batchfit/batchfit/nn.",
	"github.com/batchfit/batchfit/models.", "github.com/batchfit/batchfit.", "github.com/batchfit/batchfit/dist."}

func internalFrame(f runtime.Frame) bool {
	if strings.HasSuffix(f.File, "_test.go") {
		return false
	}
	for _, p := range internalPackages {
		if strings.HasPrefix(f.Function, p) {
			return true
		}
	}
	return false
}

func shortFile(file string) string {
	if i := strings.LastIndex(file, "/"); i >= 0 {
		if j := strings.LastIndex(file[:i], "/"); j >= 0 {
			return file[j+1:]
		}
	}
	return file
}

// nilTensor reports a nil interface or a typed nil pointer (a nil
// *tensor.Dense), whose methods would panic.
func nilTensor(t tensor.Tensor) bool {
	if t == nil {
		return true
	}
	v := reflect.ValueOf(t)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// dtypeOf maps a gorgonia dtype to batchfit's.
func dtypeOf(t tensor.Tensor) (graph.DType, error) {
	dt := t.Dtype()
	switch dt {
	case tensor.Float32:
		return graph.Float32, nil
	case tensor.Int64:
		return graph.Int64, nil
	}
	name := "none" // a zero tensor.Dense has no dtype, and formatting it panics
	if dt.Type != nil {
		name = dt.String()
	}
	return graph.InvalidDType, graph.Errorf(graph.ErrDType, "unsupported dtype %s (want float32 or int64)", name)
}

// emptyData rejects data with an axis of length 0: the executors read
// element 0 of every input, so a zero-size tensor would panic mid-run.
// Shape-only sources (Placeholder, ParamSpec) have no data and may be
// empty.
func emptyData(t tensor.Tensor) error {
	shape := shapeOf(t)
	if i := slices.Index(shape, 0); i >= 0 {
		return graph.Errorf(graph.ErrShape, "zero-size data: axis %d of %v is 0", i, shape)
	}
	return nil
}

func shapeOf(t tensor.Tensor) []int {
	s := t.Shape()
	if s.IsScalar() {
		return []int{}
	}
	return slices.Clone([]int(s))
}

// Wrap makes a new graph whose input is t, with axis batchDim as the batch.
// Data of an unsupported dtype or of zero size (an axis of length 0) gives
// an error tensor, a *graph.OpError wrapping graph.ErrDType or ErrShape.
func Wrap(t tensor.Tensor, batchDim int) *Tensor { return newInputGraph().wrap(site(), t, batchDim) }

// Wrap adds t to g as a batched input with axis batchDim as the batch.
func (g *Graph) Wrap(t tensor.Tensor, batchDim int) *Tensor { return g.wrap(site(), t, batchDim) }

// WrapAs makes a new graph whose input is the float32 tensor t stored as
// dtype dt: float16 or bfloat16 data enters batchfit this way, as float32
// values that executors round to nearest even when they read them (the
// caller's tensor is not changed). dt Float32 is Wrap. Outputs of 16-bit
// values come back as float32 tensors holding the rounded values; package
// half converts such values to and from their 16-bit encodings.
func WrapAs(t tensor.Tensor, dt graph.DType, batchDim int) *Tensor {
	return newInputGraph().wrapAs(site(), t, dt, batchDim)
}

// WrapAs adds the float32 tensor t to g as a batched input of dtype dt
// (see the function WrapAs).
func (g *Graph) WrapAs(t tensor.Tensor, dt graph.DType, batchDim int) *Tensor {
	return g.wrapAs(site(), t, dt, batchDim)
}

func (g *Graph) wrap(at string, t tensor.Tensor, batchDim int) *Tensor {
	return g.wrapAs(at, t, graph.InvalidDType, batchDim)
}

// wrapAs wraps t as an input of dtype as, or of its data's dtype when as
// is InvalidDType.
func (g *Graph) wrapAs(at string, t tensor.Tensor, as graph.DType, batchDim int) *Tensor {
	if nilTensor(t) {
		return errTensor("wrap", at, graph.Errorf(graph.ErrNilTensor, "nil tensor.Tensor"))
	}
	dt, err := dtypeOf(t)
	if err == nil {
		err = emptyData(t)
	}
	if err == nil && as != graph.InvalidDType && as != dt {
		if dt != graph.Float32 || !as.IsHalf() {
			err = graph.Errorf(graph.ErrDType, "%s data cannot be wrapped as %s: 16-bit inputs take float32 data", dt, as)
		}
		dt = as
	}
	if err != nil {
		return errTensor("wrap", at, err, shapeOf(t))
	}
	return g.source(at, graph.Node{Op: graph.OpInput, Value: t,
		Type: graph.Type{Shape: shapeOf(t), DType: dt, BatchAxis: batchDim}})
}

// Placeholder makes a new graph whose input has the given shape and no data,
// for dry runs that only need shapes and bytes.
func Placeholder(shape []int, dt graph.DType, batchDim int) *Tensor {
	return newInputGraph().Placeholder(shape, dt, batchDim)
}

// Placeholder adds a shape-only batched input to g.
func (g *Graph) Placeholder(shape []int, dt graph.DType, batchDim int) *Tensor {
	return g.source(site(), graph.Node{Op: graph.OpInput,
		Type: graph.Type{Shape: slices.Clone(shape), DType: dt, BatchAxis: batchDim}})
}

func (g *Graph) source(at string, n graph.Node) *Tensor {
	if g == nil {
		return errTensor(n.Op.String(), at, graph.Errorf(graph.ErrNilTensor, "nil *lazy.Graph"), n.Type.Shape)
	}
	n.Site = at
	id, err := g.ir.Append(n)
	if err != nil {
		return errTensor(n.Op.String(), at, err, n.Type.Shape)
	}
	if n.Op == graph.OpInput {
		g.inputs++
	}
	return &Tensor{g: g, id: id}
}

// Param wraps t as a trainable parameter named name ("layers.0.weight").
// It belongs to no graph until an op uses it. Data Wrap refuses, Param
// refuses the same way.
func Param(t tensor.Tensor, name string) *Tensor { return newLeaf(site(), graph.OpParam, t, name) }

// ParamAs wraps the float32 tensor t as a parameter named name stored as
// dtype dt: a float16 or bfloat16 parameter takes half the device memory,
// its values rounded to nearest even when executors read them (t is not
// changed), as WrapAs does for inputs. dt Float32 is Param. A 16-bit
// parameter is for reading, not training (trained parameters stay float32
// master weights): freeze it (SetFrozen) and list it, or leave it out of a
// step's parameters.
func ParamAs(t tensor.Tensor, dt graph.DType, name string) *Tensor {
	at := site()
	p := newLeaf(at, graph.OpParam, t, name)
	if p.err != nil || dt == graph.Float32 {
		return p
	}
	if p.leaf.typ.DType != graph.Float32 || !dt.IsHalf() {
		return errTensor("param", at, graph.Errorf(graph.ErrDType, "%s data cannot be stored as %s: 16-bit parameters take float32 data",
			p.leaf.typ.DType, dt), p.leaf.typ.Shape)
	}
	p.leaf.typ.DType = dt
	return p
}

// Const wraps t as a constant; data Wrap refuses, Const refuses the same way.
func Const(t tensor.Tensor) *Tensor { return newLeaf(site(), graph.OpConst, t, "") }

// ParamSpec is a shape-only parameter, for dry runs of large models.
func ParamSpec(shape []int, dt graph.DType, name string) *Tensor {
	return &Tensor{id: -1, leaf: &leaf{op: graph.OpParam, name: name,
		typ: graph.Type{Shape: slices.Clone(shape), DType: dt, BatchAxis: -1, PerSample: 1}}}
}

func newLeaf(at string, op graph.Op, t tensor.Tensor, name string) *Tensor {
	if nilTensor(t) {
		return errTensor(op.String(), at, graph.Errorf(graph.ErrNilTensor, "nil tensor.Tensor"))
	}
	dt, err := dtypeOf(t)
	if err == nil {
		err = emptyData(t)
	}
	if err != nil {
		return errTensor(op.String(), at, err, shapeOf(t))
	}
	return &Tensor{id: -1, leaf: &leaf{op: op, name: name, value: t,
		typ: graph.Type{Shape: shapeOf(t), DType: dt, BatchAxis: -1, PerSample: 1}}}
}

// bind returns t's node id in g, adopting a free leaf on first use.
func (g *Graph) bind(t *Tensor) (int, error) {
	if t.leaf == nil {
		return t.id, nil
	}
	if id, ok := g.leaves[t.leaf]; ok {
		return id, nil
	}
	id, err := g.ir.Append(graph.Node{Op: t.leaf.op, Name: t.leaf.name,
		Value: t.leaf.value, Type: t.leaf.typ})
	if err != nil {
		return -1, err
	}
	g.leaves[t.leaf] = id
	g.leafAt[id] = t.leaf
	return id, nil
}

// importNode copies node id of src, a graph without batched inputs (only
// parameters, constants and ops on them), into g with everything it needs,
// and returns its id in g. Each node is copied once per pair of graphs.
func (g *Graph) importNode(src *Graph, id int) (int, error) {
	idmap := g.imported[src]
	for len(idmap) < src.ir.Len() {
		idmap = append(idmap, -1)
	}
	if g.imported == nil { // made on the first import: most graphs import nothing
		g.imported = map[*Graph][]int{}
	}
	g.imported[src] = idmap
	need := make([]bool, id+1)
	need[id] = true
	for i := id; i >= 0; i-- { // mark id's ancestors
		if need[i] && idmap[i] < 0 {
			for _, in := range src.ir.Node(i).Inputs {
				need[in] = true
			}
		}
	}
	for i := range need {
		if !need[i] || idmap[i] >= 0 {
			continue
		}
		n := *src.ir.Node(i)
		var err error
		if l, ok := src.leafAt[i]; ok {
			idmap[i], err = g.bind(&Tensor{id: -1, leaf: l})
		} else {
			n.Inputs = append([]int(nil), n.Inputs...)
			for k, in := range n.Inputs {
				n.Inputs[k] = idmap[in]
			}
			idmap[i], err = g.ir.Append(n)
		}
		if err != nil {
			return -1, err
		}
	}
	return idmap[id], nil
}

// apply appends op over inputs, returning an error tensor on any failure.
func apply(op graph.Op, attrs graph.Attrs, inputs ...*Tensor) *Tensor {
	// shapes are the first n inputs' shapes, which only an error needs.
	shapes := func(n int) [][]int {
		s := make([][]int, n)
		for i := range s {
			s[i] = inputs[i].Shape()
		}
		return s
	}
	var g *Graph
	for i, in := range inputs {
		if in == nil {
			return errTensor(op.String(), site(), graph.Errorf(graph.ErrNilTensor, "input %d is nil", i), shapes(i)...)
		}
		if in.err != nil {
			return &Tensor{id: -1, err: in.err} // sticky: the first error wins
		}
		if in.zero() {
			return errTensor(op.String(), site(), graph.Errorf(graph.ErrNilTensor,
				"input %d is a zero lazy.Tensor, not made by Wrap, Param or an op", i), shapes(i)...)
		}
	}
	// The result joins the graph holding batched inputs (else the first
	// graph met); values computed from parameters and constants alone are
	// imported into it. Two graphs with batched inputs cannot meet.
	for _, in := range inputs {
		if in.g != nil && (g == nil || g.inputs == 0 && in.g.inputs > 0) {
			g = in.g
		}
	}
	for i, in := range inputs {
		if in.g != nil && in.g != g && in.g.inputs > 0 {
			return errTensor(op.String(), site(), graph.Errorf(graph.ErrMixedGraphs,
				"input %d belongs to another graph", i), shapes(len(inputs))...)
		}
	}
	if g == nil {
		g = NewGraph()
	}
	at := g.scopeSite()
	if at == "" {
		at = site()
	}
	if err := g.precheck(op, attrs, inputs); err != nil {
		return errTensor(op.String(), at, err, shapes(len(inputs))...)
	}
	ids := make([]int, len(inputs))
	for i, in := range inputs {
		bind := g.bind
		if in.g != nil && in.g != g {
			bind = func(t *Tensor) (int, error) { return g.importNode(t.g, t.id) }
		}
		id, err := bind(in)
		if err != nil {
			return errTensor(op.String(), at, err, shapes(len(inputs))...)
		}
		ids[i] = id
	}
	id, err := g.ir.Append(graph.Node{Op: op, Inputs: ids, Attrs: attrs, Site: at})
	if err != nil {
		return errTensor(op.String(), at, err, shapes(len(inputs))...)
	}
	g.grew()
	return &Tensor{g: g, id: id}
}

// precheck runs op's shape rule before apply adopts leaves new to g, so a
// rejected op leaves no orphan parameter or constant node behind. Graphs
// that reuse adopted leaves skip it.
func (g *Graph) precheck(op graph.Op, attrs graph.Attrs, inputs []*Tensor) error {
	fresh := false
	for _, in := range inputs {
		if in.leaf != nil {
			if _, ok := g.leaves[in.leaf]; !ok {
				fresh = true
			}
		}
		fresh = fresh || in.g != nil && in.g != g // would be imported
	}
	if !fresh {
		return nil
	}
	types := g.types[:0]
	for _, in := range inputs {
		types = append(types, in.typ())
	}
	g.types, g.attrs = types, attrs
	_, err := op.Rule(&g.attrs, types, g.ir.Batch())
	return err
}

// NodeOf returns t's node id in g: its own id when t was made in g, the
// adopted node when t is a Param or Const that g uses, −1 otherwise.
func (g *Graph) NodeOf(t *Tensor) int {
	switch {
	case g == nil || t == nil || t.err != nil:
		return -1
	case t.g == g:
		return t.id
	case t.leaf != nil:
		if id, ok := g.leaves[t.leaf]; ok {
			return id
		}
	}
	return -1
}
