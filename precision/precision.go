package precision

import (
	"errors"
	"fmt"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// Policy is a precision policy, named as the CLI's --precision flag names
// it.
type Policy string

// The policies.
const (
	FP32      Policy = "fp32"       // float32 everywhere (the default)
	TF32      Policy = "tf32"       // float32 values; CUDA matrix products on TF32 tensor cores
	BF16Mixed Policy = "bf16-mixed" // autocast to bfloat16
	FP16Mixed Policy = "fp16-mixed" // autocast to float16, with dynamic loss scaling by default
)

// Policies lists every policy, in the order help texts name them.
var Policies = []Policy{FP32, TF32, BF16Mixed, FP16Mixed}

// ErrUnknown is wrapped by the error Parse returns for a name that is no
// policy.
var ErrUnknown = errors.New("unknown precision policy")

// Parse maps a name to its policy; "" is FP32.
func Parse(name string) (Policy, error) {
	if name == "" {
		return FP32, nil
	}
	if p := Policy(name); slices.Contains(Policies, p) {
		return p, nil
	}
	return "", fmt.Errorf("%w %q (want %s)", ErrUnknown, name, Names())
}

// Names is the policies' names for messages: "fp32, tf32, bf16-mixed or fp16-mixed".
func Names() string {
	s := ""
	for i, p := range Policies {
		switch {
		case i == len(Policies)-1:
			s += " or "
		case i > 0:
			s += ", "
		}
		s += string(p)
	}
	return s
}

// Half is the 16-bit dtype the GEMM class computes in, or InvalidDType for
// policies that keep float32 values (fp32, tf32).
func (p Policy) Half() graph.DType {
	switch p {
	case BF16Mixed:
		return graph.BFloat16
	case FP16Mixed:
		return graph.Float16
	}
	return graph.InvalidDType
}

// Mixed reports whether the policy rewrites graphs (bf16-mixed, fp16-mixed).
func (p Policy) Mixed() bool { return p.Half() != graph.InvalidDType }

// Scaled reports whether training under the policy scales its loss
// unless told not to (LossScale.Off): fp16-mixed, whose float16 gradients
// underflow without it, as PyTorch users pair GradScaler with fp16
// autocast.
func (p Policy) Scaled() bool { return p == FP16Mixed }

// TF32 reports whether CUDA may run float32 matrix products on TF32
// tensor cores: the CUDA executor's ExecutorOptions.TF32.
func (p Policy) TF32() bool { return p == TF32 }

// class is how the pass treats an op's inputs.
type class uint8

const (
	keep       class = iota // run in the input's dtype
	lower                   // GEMM class: float inputs cast to the 16-bit dtype
	widen                   // float32 class: float inputs cast to float32
	common                  // concat: mixed float inputs cast to float32
	perChannel              // batch_norm: x as it is, its [C] inputs cast to float32
)

var classes = func() [graph.NumOps]class {
	var c [graph.NumOps]class
	for _, op := range []graph.Op{graph.OpMatMul, graph.OpLinear, graph.OpConv2d, graph.OpAttention, graph.OpAttentionQKV} {
		c[op] = lower
	}
	// cross_entropy is not among them: it reads 16-bit logits widened and
	// computes in float32 itself (graph's rule), which spares the float32
	// copy of the logits and of their gradient.
	// rms_norm is as layer_norm: float32 in, and with foldRMSNorms a
	// 16-bit result for the GEMMs that read it (halfNorm). rotary and
	// swiglu keep their inputs' dtype (the projections' 16 bits) and
	// compute in float32 inside, rounding once.
	for _, op := range []graph.Op{graph.OpSoftmax, graph.OpLogSoftmax, graph.OpLayerNorm, graph.OpRMSNorm,
		graph.OpMSE, graph.OpSum, graph.OpMean,
		graph.OpExp, graph.OpLog, graph.OpPow, graph.OpPowScalar, graph.OpRDivScalar} {
		c[op] = widen
	}
	c[graph.OpConcat] = common
	c[graph.OpBatchNorm] = perChannel
	return c
}()

// Apply rewrites g under policy p (see the package documentation) and
// returns the new graph and, for each node of g, its id there. A policy
// that keeps float32 values returns a copy of g. A graph holding gradient
// ops is refused (ErrAttr): apply the policy before autodiff.
func Apply(g *graph.Graph, p Policy) (*graph.Graph, []int, error) {
	if _, err := Parse(string(p)); err != nil {
		return nil, nil, err
	}
	out := graph.New()
	ids := make([]int, g.Len())
	type key struct {
		id int
		dt graph.DType
	}
	cache := map[key]int{} // casts: one per value and dtype
	users := consumers(g)
	// padded maps a node of g on a fused loss's chain (fusedLoss) to its
	// counterpart in out, which keeps the padded columns, and the class
	// count the chain's cross_entropy scores.
	type counterpart struct{ id, classes int }
	padded := map[int]counterpart{}
	// narrow maps a layer norm of g whose readers all cast it to the
	// 16-bit dtype (halfNorm) to its 16-bit counterpart in out.
	narrow := map[int]int{}
	cast := func(id int, dt graph.DType, at *graph.Node) (int, error) {
		src := g.Node(id)
		if have := out.Node(ids[id]).Type.DType; !have.IsFloat() || have == dt {
			return ids[id], nil
		}
		// A widening cast of a dt value back to dt is that value: a
		// 16-bit frozen weight that a layer widened to its input's float32
		// (nn.FreezeAs) is read as stored, with no copy.
		if src.Op == graph.OpCast && src.Type.DType == graph.Float32 && dt.IsHalf() {
			if in := ids[src.Inputs[0]]; out.Node(in).Type.DType == dt {
				return in, nil
			}
		}
		if h, ok := narrow[id]; ok && out.Node(h).Type.DType == dt {
			return h, nil
		}
		k := key{id, dt}
		if c, ok := cache[k]; ok {
			return c, nil
		}
		scope, site := at.Scope, at.Site
		if src.Op == graph.OpParam { // the parameter's one copy belongs to it
			scope, site = src.Scope, src.Site
		}
		c, err := out.Append(graph.Node{Op: graph.OpCast, Inputs: []int{ids[id]},
			Attrs: graph.Attrs{Target: graph.Type{DType: dt}}, Scope: scope, Site: site})
		if err == nil {
			cache[k] = c
		}
		return c, err
	}
	for i := range g.Len() {
		nd := g.Node(i)
		if nd.Op.Category() == graph.CatGrad {
			return nil, nil, &graph.OpError{Op: "precision " + string(p), Site: nd.Site,
				Err: graph.Errorf(graph.ErrAttr, "node %d is a gradient op (%s): apply the policy to the forward graph, before autodiff", i, nd.Op)}
		}
		n := graph.Node{Op: nd.Op, Attrs: nd.Attrs.Clone(), Name: nd.Name, Scope: nd.Scope, Site: nd.Site, Value: nd.Value}
		if nd.Op.Category() == graph.CatSource {
			n.Type = nd.Type
		}
		n.Inputs = make([]int, len(nd.Inputs))
		for k, in := range nd.Inputs {
			n.Inputs[k] = ids[in]
		}
		if dt := p.Half(); dt != graph.InvalidDType && int(nd.Op) < graph.NumOps {
			if err := castInputs(out, nd, classes[nd.Op], dt, n.Inputs, cast); err != nil {
				return nil, nil, err
			}
		}
		if dt := p.Half(); dt != graph.InvalidDType && nd.Op == graph.OpLinear && alignLinears {
			id, lin, ok, err := alignedLinear(out, n, dt)
			if err != nil {
				return nil, nil, &graph.OpError{Op: nd.Op.String(), Site: nd.Site, Err: err}
			}
			if ok {
				ids[i] = id
				if c, fuse := fusedLoss(g, users, i); fuse && fusePaddedLoss {
					padded[i] = counterpart{lin, c}
				}
				continue
			}
		}
		if len(nd.Inputs) > 0 {
			if src, ok := padded[nd.Inputs[0]]; ok {
				switch nd.Op {
				case graph.OpReshape: // [.., Vp] → [M, Vp], beside the (unread) reshape of the slice
					s := out.Node(src.id).Type.Shape
					r, err := out.Append(graph.Node{Op: graph.OpReshape, Inputs: []int{src.id},
						Attrs: graph.Attrs{Shape: []int{nd.Type.Shape[0], s[len(s)-1]}}, Scope: nd.Scope, Site: nd.Site})
					if err != nil {
						return nil, nil, &graph.OpError{Op: nd.Op.String(), Site: nd.Site, Err: err}
					}
					padded[i] = counterpart{r, src.classes}
				case graph.OpCrossEntropy:
					n.Inputs[0], n.Attrs.End = src.id, src.classes
				}
			}
		}
		id, err := out.Append(n)
		if err != nil {
			return nil, nil, &graph.OpError{Op: nd.Op.String(), Site: nd.Site, Err: err}
		}
		ids[i] = id
		if dt := p.Half(); dt != graph.InvalidDType && halfNorm(g, users, i) && out.Node(id).Type.DType == graph.Float32 {
			n.Attrs = n.Attrs.Clone()
			n.Attrs.Target = graph.Type{DType: dt}
			h, err := out.Append(n)
			if err != nil {
				return nil, nil, &graph.OpError{Op: nd.Op.String(), Site: nd.Site, Err: err}
			}
			narrow[i] = h
		}
	}
	return out, ids, nil
}

// halfNorm reports whether node i of g is a layer norm (with foldNorms on)
// or an RMS norm (with foldRMSNorms on) that only GEMM-class ops read:
// each would read a 16-bit cast of its float32 result. Apply then appends, beside the float32 layer norm, one that writes the 16-bit
// dtype itself (graph.OpLayerNorm's Attrs.Target), rounding once where the
// cast rounded, and the GEMMs read it: no cast runs, and the float32
// result (and its [.., d] buffer) exists only where asked for, as the
// float32 node stays in the graph read by nothing, so Apply's ids keep
// naming the float32 value (an Eval of it runs it). In backward the
// gradient comes back in the 16-bit dtype, and the layer norm's VJP casts
// it to float32, a cast that Step.FoldWideningCasts folds into the GEMM producing it.
func halfNorm(g *graph.Graph, users [][]int, i int) bool {
	switch op := g.Node(i).Op; {
	case len(users[i]) == 0, op == graph.OpLayerNorm && !foldNorms, op == graph.OpRMSNorm && !foldRMSNorms:
		return false
	case op != graph.OpLayerNorm && op != graph.OpRMSNorm:
		return false
	}
	for _, u := range users[i] {
		if op := g.Node(u).Op; int(op) >= graph.NumOps || classes[op] != lower {
			return false
		}
	}
	return true
}

// alignLinears turns alignedLinear on; tests turn it off to compare.
var alignLinears = true

// fusePaddedLoss turns fusedLoss's rewrite on; tests turn it off to compare.
var fusePaddedLoss = true

// foldNorms turns halfNorm's rewrite on: off by default; tests turn it on.
// It saves GPT-2 small's 25 layer-norm casts (bf16-mixed, batch 8, seq
// 1024: 157 M elements) but measured no faster on the H100 (27.1–27.25 ms
// a step with it, 27.09 ms without, main 27.6–27.8 ms), while the caching
// allocator's second step then needs a fresh segment for a large buffer
// more often: predicted (= measured) peak reserved rose at 28 of the
// batches 1–40 (6.24 → 6.99 GiB at batch 8, up to +3.9 GiB at 40; peak
// allocated unchanged), from the changed order of cached blocks, not from
// any buffer of its own.
var foldNorms = false

// foldRMSNorms is halfNorm's rewrite for rms_norm, on by default: a Llama
// block's input norm is read by the packed q|k|v projection and its
// post-attention norm by the gate and up projections, each reader of a
// float32 norm getting a cast of its own (casts of computed values are
// not shared), and the 16-bit norm is the residual add's companion
// (graph.AddRMSNormProducer), so the add writes the stream in float32 and
// the norm in 16 bits in one pass, and no float32 norm exists at all.
var foldRMSNorms = true

// consumers lists, for each node of g, the ids of the nodes that read it,
// once per input that names it.
func consumers(g *graph.Graph) [][]int {
	users := make([][]int, g.Len())
	for i := range g.Len() {
		for _, in := range g.Node(i).Inputs {
			users[in] = append(users[in], i)
		}
	}
	return users
}

// fusedLoss reports whether linear node lin of g, which alignedLinear
// pads, feeds nothing but a cross_entropy's logits: lin [N, V] read by it
// alone, or lin [.., V] read only by a reshape to [M, V] that only the
// cross_entropy reads (models.Loss's GPT head). Then Apply gives the
// cross_entropy the padded logits, reshaped to [M, Vp] where there was a
// reshape, with Attrs.End = the classes it scored (V, or its own End), so
// the slice and its gradient, each an [M, V] copy, never run: the padded
// columns take no part in the loss and get zero gradient, as the slice's
// gradient gave them. The slice (and the reshape of it) stay in the graph
// read by nothing, so Apply's ids still name values of the original shapes
// (a logits output an Eval asks for), and a program runs them only when
// asked. classes is the cross_entropy's class count.
func fusedLoss(g *graph.Graph, users [][]int, lin int) (classes int, ok bool) {
	v := g.Node(lin).Type.Shape
	logits := lin
	if u := users[lin]; len(u) != 1 {
		return 0, false
	} else if r := g.Node(u[0]); r.Op == graph.OpReshape {
		if len(r.Type.Shape) != 2 || r.Type.Shape[1] != v[len(v)-1] {
			return 0, false
		}
		logits = u[0]
	}
	u := users[logits]
	if len(u) != 1 {
		return 0, false
	}
	ce := g.Node(u[0])
	if ce.Op != graph.OpCrossEntropy || ce.Inputs[0] != logits || len(g.Node(logits).Type.Shape) != 2 {
		return 0, false
	}
	return graph.CrossEntropyClasses(&ce.Attrs, v[len(v)-1]), true
}

// Linear layers with this many outputs or more get aligned (alignedLinear):
// below it the padding's extra launches cost more than the faster GEMMs
// save.
const (
	alignMinOutputs = 1024
	alignOutputs    = 64 // outputs rounded up to a multiple of this
)

// alignedLinear appends 16-bit linear node n (its inputs already cast to
// dt) with its weight's rows padded, when its output count V = W's rows
// is at least alignMinOutputs and not a multiple of 8: a row of V 16-bit
// values is then not a whole number of 16-byte vectors, and cuBLAS falls
// back to slow kernels for the product and both its gradients (GPT-2's
// head, V = 50257: 15.5 ms of a 47 ms step on the H100). The weight (and
// bias) get zero rows up to Vp, V rounded up to alignOutputs, by a concat
// with a zero fill; the product runs at [.., Vp]; a slice keeps the first
// V outputs. The real outputs are the same dot products; in backward the
// slice's gradient is 0 in the padded columns, so the padded rows add
// nothing, and autodiff gives the weight's gradient as the padded one's
// first V rows. It returns the slice's id and the padded linear's, or ok
// false (nothing appended) when n is not such a node.
func alignedLinear(out *graph.Graph, n graph.Node, dt graph.DType) (id, lin int, ok bool, err error) {
	w := out.Node(n.Inputs[1]).Type
	if len(w.Shape) != 2 || w.DType != dt {
		return 0, 0, false, nil
	}
	v, c := w.Shape[0], w.Shape[1]
	if v < alignMinOutputs || v%8 == 0 {
		return 0, 0, false, nil
	}
	if len(n.Inputs) > 2 {
		if b := out.Node(n.Inputs[2]).Type; len(b.Shape) != 1 || b.DType != dt {
			return 0, 0, false, nil
		}
	}
	vp := (v + alignOutputs - 1) / alignOutputs * alignOutputs
	pad := func(in int, shape []int) (int, error) {
		z, err := out.Append(graph.Node{Op: graph.OpFill, Attrs: graph.Attrs{Target: graph.Type{Shape: shape, DType: dt}},
			Scope: n.Scope, Site: n.Site})
		if err != nil {
			return 0, err
		}
		return out.Append(graph.Node{Op: graph.OpConcat, Inputs: []int{in, z}, Scope: n.Scope, Site: n.Site})
	}
	ins := slices.Clone(n.Inputs)
	if ins[1], err = pad(ins[1], []int{vp - v, c}); err != nil {
		return 0, 0, false, err
	}
	if len(ins) > 2 {
		if ins[2], err = pad(ins[2], []int{vp - v}); err != nil {
			return 0, 0, false, err
		}
	}
	n.Inputs = ins
	lin, err = out.Append(n)
	if err != nil {
		return 0, 0, false, err
	}
	last := len(out.Node(lin).Type.Shape) - 1
	id, err = out.Append(graph.Node{Op: graph.OpSlice, Inputs: []int{lin},
		Attrs: graph.Attrs{Axis: last, Start: 0, End: v, Step: 1}, Scope: n.Scope, Site: n.Site})
	return id, lin, err == nil, err
}

// castInputs replaces the inputs of old node nd (already mapped into the
// new graph out, in ins) by casts as its class asks.
func castInputs(out *graph.Graph, nd *graph.Node, c class, dt graph.DType, ins []int,
	cast func(id int, dt graph.DType, at *graph.Node) (int, error)) error {
	to := graph.InvalidDType
	switch c {
	case lower:
		to = dt
	case widen:
		to = graph.Float32
	case common:
		for _, in := range ins {
			if t := out.Node(in).Type.DType; t.IsFloat() && t != out.Node(ins[0]).Type.DType {
				to = graph.Float32
			}
		}
	case perChannel:
		for k, in := range nd.Inputs[1:] {
			id, err := cast(in, graph.Float32, nd)
			if err != nil {
				return &graph.OpError{Op: "cast (before " + nd.Op.String() + ")", Site: nd.Site, Err: err}
			}
			ins[k+1] = id
		}
		return nil
	}
	if to == graph.InvalidDType {
		return nil
	}
	for k, in := range nd.Inputs {
		id, err := cast(in, to, nd)
		if err != nil {
			return &graph.OpError{Op: "cast (before " + nd.Op.String() + ")", Site: nd.Site, Err: err}
		}
		ins[k] = id
	}
	return nil
}

// Step is a training step's graph under a policy: the rewritten forward
// graph with its backward pass appended, and the ids in it of the loss,
// the parameters and their gradients (in the parameters' order). Package
// compile builds it, running the pipeline's passes in order; the methods
// here are the passes that rewrite a step (ScaleLoss, FoldWideningCasts,
// Rewrite).
type Step struct {
	Graph  *graph.Graph
	Loss   int
	Params []int
	Grads  []int
	// Scale is the id of the loss scale constant under loss scaling, −1
	// without. Scaled is the node the backward pass differentiates: Loss
	// × Scale under loss scaling, Loss without; the backward pass starts
	// after it (recompute.Step.Boundary is Scaled + 1).
	Scale, Scaled int
	// IDs maps the forward graph's nodes to Graph's: IDs[i] is node i's id
	// in Graph (Apply's ids; the identity when the step was built on the
	// forward graph itself), −1 for a slice, reshape or permute that a
	// mixed policy's attention fusion removed (graph.FuseAttentionQKV).
	IDs []int
}

// ScaleLoss appends dynamic loss scaling to s (see LossScale), before
// the backward pass: a float32 scalar constant node S, named
// "loss_scale", with data t (Scaler.Data; nil in a shape-only graph), and
// the product Loss × S, which becomes s.Scaled, the node the backward
// pass differentiates, so every gradient is S times the loss's. S is a
// constant, not an attribute: the graph's signature, and so its compiled
// program and plan, stay the same whatever S holds. The planner counts
// the constant (one small block, resident while its data stays the same
// tensor) and the product like any node.
func (s *Step) ScaleLoss(t tensor.Tensor) error {
	l := s.Graph.Node(s.Loss)
	if t != nil {
		if _, ok := t.Data().(float32); !ok || !t.Shape().IsScalar() {
			return graph.Errorf(graph.ErrDType, "precision: the loss scale's data is %v %v, want a float32 scalar", t.Dtype(), t.Shape())
		}
	}
	c, err := s.Graph.Append(graph.Node{Op: graph.OpConst, Name: "loss_scale", Value: t,
		Type: graph.Type{Shape: []int{}, DType: graph.Float32}, Scope: l.Scope, Site: l.Site})
	if err != nil {
		return &graph.OpError{Op: "loss scale", Site: l.Site, Err: err}
	}
	m, err := s.Graph.Append(graph.Node{Op: graph.OpMul, Inputs: []int{s.Loss, c}, Scope: l.Scope, Site: l.Site})
	if err != nil {
		return &graph.OpError{Op: "loss scale", Shapes: [][]int{l.Type.Shape}, Site: l.Site, Err: err}
	}
	s.Scale, s.Scaled = c, m
	return nil
}
