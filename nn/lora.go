package nn

import (
	"hash/fnv"
	"math"
	"slices"
	"strings"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// LoRA configures low-rank adapters (Hu et al., 2021), as PEFT's
// LoraConfig does: each target linear layer y = x·Wᵀ + b becomes
//
//	y = x·Wᵀ + b + (Alpha/Rank)·dropout(x)·Aᵀ·Bᵀ,  A [Rank, in], B [out, Rank]
//
// with W and b frozen and only A and B trained. A starts as PEFT's
// (kaiming_uniform with a = √5: uniform in ±1/√in), B at zero, so an
// adapted model starts as its base computes. Apply adapts a model.
type LoRA struct {
	// Rank is r, at least 1.
	Rank int
	// Alpha is lora_alpha: the update is scaled by Alpha/Rank. 0 means
	// Rank (a scale of 1).
	Alpha float64
	// Dropout is lora_dropout, in [0, 1): each adapter's own Dropout
	// module on its input, in training mode only (SetTraining), seeded
	// from the layer's path so that adapters reading one input draw
	// different masks.
	Dropout float64
	// Targets are target_modules: a linear layer is adapted when its
	// dotted module path equals a target or ends with "." and the target
	// ("q_proj" adapts every layer's q_proj, "layers.0.mlp.up_proj" one).
	// Every target must match at least one linear layer.
	Targets []string
	// Base is the dtype every base linear weight and bias and every
	// embedding table is frozen in (FreezeAs): zero means graph.BFloat16,
	// graph.Float32 keeps them float32. The model's other parameters (its
	// norms' weights) are frozen in float32.
	Base graph.DType
}

// DefaultLoRATargets are the Llama family's linear layers, every one
// PEFT's "all-linear" adapts but the output head.
var DefaultLoRATargets = []string{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

// Scale is Alpha/Rank (Alpha 0 meaning Rank).
func (c LoRA) Scale() float64 {
	if c.Alpha == 0 {
		return 1
	}
	return c.Alpha / float64(c.Rank)
}

// AlphaOrDefault is Alpha, or Rank when Alpha is 0.
func (c LoRA) AlphaOrDefault() float64 {
	if c.Alpha == 0 {
		return float64(c.Rank)
	}
	return c.Alpha
}

// Check reports a bad setting as a graph.ErrAttr.
func (c LoRA) Check() error {
	base := c.Base
	switch {
	case c.Rank < 1:
		return graph.Errorf(graph.ErrAttr, "nn.LoRA: rank must be at least 1, got %d", c.Rank)
	case !(c.Alpha >= 0) || math.IsInf(c.Alpha, 1):
		return graph.Errorf(graph.ErrAttr, "nn.LoRA: alpha must be finite and ≥ 0 (0: the rank), got %g", c.Alpha)
	case !(c.Dropout >= 0 && c.Dropout < 1):
		return graph.Errorf(graph.ErrAttr, "nn.LoRA: dropout %g is outside [0, 1)", c.Dropout)
	case len(c.Targets) == 0:
		return graph.Errorf(graph.ErrAttr, "nn.LoRA: no target modules (say which linear layers to adapt, such as %s)", strings.Join(DefaultLoRATargets, ","))
	case base != graph.InvalidDType && base != graph.Float32 && !base.IsHalf():
		return graph.Errorf(graph.ErrDType, "nn.LoRA: base weights are stored as float32, bfloat16 or float16, not %s", base)
	}
	for _, t := range c.Targets {
		if t == "" || strings.HasPrefix(t, ".") || strings.HasSuffix(t, ".") || strings.Contains(t, "..") {
			return graph.Errorf(graph.ErrAttr, "nn.LoRA: target module %q is not a module name or dotted path", t)
		}
	}
	return nil
}

// matches reports whether the module at path is one of c's targets.
func (c LoRA) matches(path string) bool {
	for _, t := range c.Targets {
		if path == t || strings.HasSuffix(path, "."+t) {
			return true
		}
	}
	return false
}

// LoRALinear is a linear layer with a low-rank adapter (LoRA.Apply puts
// it in place of the Linear it adapts): Forward is Base's output plus
// Delta. Base's parameters keep their names ("….q_proj.weight"); A and B
// are named as PEFT's modules name theirs ("….q_proj.lora_A.weight",
// "….q_proj.lora_B.weight").
type LoRALinear struct {
	Base *Linear
	A    *Param // [Rank, in]
	B    *Param // [out, Rank]
	// Rank and Alpha are the adapter's r and lora_alpha; its update is
	// scaled by Alpha/Rank.
	Rank  int
	Alpha float64
	// Dropout is applied to the adapter's input (lora_dropout); it is the
	// identity in evaluation mode and at P = 0.
	Dropout *Dropout
}

// Scale is Alpha/Rank.
func (l *LoRALinear) Scale() float64 { return l.Alpha / float64(l.Rank) }

// Forward is Base(x) + Delta(x).
func (l *LoRALinear) Forward(x *lazy.Tensor) *lazy.Tensor {
	return l.Base.Forward(x).Add(l.Delta(x))
}

// Delta is the adapter's update alone, (Alpha/Rank)·dropout(x)·Aᵀ·Bᵀ for
// x [..., in]: two thin matrix products, the scale applied to the [..., Rank]
// product between them (the smallest value on the path).
func (l *LoRALinear) Delta(x *lazy.Tensor) *lazy.Tensor {
	return l.Down(x).Linear(l.B.as(x), nil)
}

// Down is the adapter's first half, (Alpha/Rank)·dropout(x)·Aᵀ [..., Rank]:
// what a model that packs several projections into one product reads B's
// of side by side.
func (l *LoRALinear) Down(x *lazy.Tensor) *lazy.Tensor {
	u := x
	if l.Dropout != nil {
		u = l.Dropout.Forward(x)
	}
	u = u.Linear(l.A.as(x), nil)
	if s := l.Scale(); s != 1 {
		u = u.MulScalar(s)
	}
	return u
}

// Params returns Base's weight and bias, then A and B, as PEFT's
// named_parameters lists them.
func (l *LoRALinear) Params() []*Param { return append(l.Base.Params(), l.A, l.B) }

// List names the layer's modules as PEFT's LoraLayer does: base_layer and
// lora_dropout (so SetTraining reaches the dropout, and Dropouts lists
// it).
func (l *LoRALinear) List() []Child {
	cs := []Child{{Name: "base_layer", Module: l.Base}}
	if l.Dropout != nil {
		cs = append(cs, Child{Name: "lora_dropout", Module: l.Dropout})
	}
	return cs
}

// Err is the adapter's first parameter error, if any.
func (l *LoRALinear) Err() error {
	for _, p := range l.Params() {
		if err := p.Err(); err != nil {
			return err
		}
	}
	return nil
}

// NamedLoRA is an adapted layer with its dotted module path inside a
// model ("model.layers.0.self_attn.q_proj").
type NamedLoRA struct {
	Path  string
	Layer *LoRALinear
}

// Apply adapts m: every Linear whose module path is one of c's Targets is
// replaced, inside its container, by a LoRALinear over it, whose A and B
// are drawn from opt (shape-only with opt.ShapeOnly; always float32, the
// trained parameters' master weights); then every parameter of m but the
// adapters' is frozen (Freeze), linear weights and biases and embedding
// tables stored in c.Base (FreezeAs). It returns the adapted layers in
// module order. Apply before building the graphs that use m. A target
// that matches no linear layer, or matches a module that is not one (or
// one already adapted), is an error (graph.ErrAttr) and m is left as it
// was.
func (c LoRA) Apply(opt Options, m Module) ([]NamedLoRA, error) {
	if err := c.Check(); err != nil {
		return nil, err
	}
	if m == nil {
		return nil, graph.Errorf(graph.ErrNilTensor, "nn.LoRA: nil module")
	}
	if err := Check(m); err != nil {
		return nil, err
	}
	sites, err := c.sites(m)
	if err != nil {
		return nil, err
	}
	if opt.ShapeOnly {
		opt.Rand = nil
	}
	opt.DType = graph.InvalidDType // adapters are float32
	out := make([]NamedLoRA, 0, len(sites))
	for _, s := range sites {
		w := s.lin.Weight.Shape()
		if len(w) != 2 {
			return nil, graph.Errorf(graph.ErrShape, "nn.LoRA: %s.weight is %v, not [out, in]", s.path, w)
		}
		drop := NewDropout(c.Dropout)
		h := fnv.New64a()
		h.Write([]byte(s.path))
		drop.Seed = h.Sum64() // each adapter's own masks, as PEFT's lora_dropout modules draw theirs
		l := &LoRALinear{Base: s.lin, Rank: c.Rank, Alpha: c.AlphaOrDefault(), Dropout: drop,
			A: opt.Uniform(s.path+".lora_A.weight", []int{c.Rank, w[1]}, 1/math.Sqrt(float64(w[1]))),
			B: opt.Full(s.path+".lora_B.weight", []int{w[0], c.Rank}, 0)}
		if err := l.Err(); err != nil {
			return nil, err
		}
		out = append(out, NamedLoRA{Path: s.path, Layer: l})
	}
	for k, s := range sites {
		s.list[s.i].Module = out[k].Layer
	}
	c.freezeBase(m)
	return out, nil
}

// freezeBase freezes every parameter of m but the adapters': linear
// layers' and embeddings' in c.Base, the others in float32.
func (c LoRA) freezeBase(m Module) {
	dt := c.Base
	if dt == graph.InvalidDType {
		dt = graph.BFloat16
	}
	adapter := map[*Param]bool{}
	half := map[*Param]bool{}
	walk("", m, func(_ string, mod Module) {
		switch l := mod.(type) {
		case *LoRALinear:
			adapter[l.A], adapter[l.B] = true, true
		case *Linear:
			for _, p := range l.Params() {
				half[p] = true
			}
		case *Embedding:
			half[l.Weight] = true
		}
	})
	for _, p := range m.Params() {
		switch {
		case adapter[p]:
		case half[p]:
			_ = FreezeAs(dt, p) // dt was checked
		default:
			p.SetFrozen(true)
		}
	}
}

// loraSite is a linear layer Apply adapts: its container's list, its
// index there, and its path.
type loraSite struct {
	list []Child
	i    int
	path string
	lin  *Linear
}

// sites finds every linear layer c targets in m, changing nothing.
func (c LoRA) sites(m Module) ([]loraSite, error) {
	var sites []loraSite
	used := make([]bool, len(c.Targets))
	var bad error
	walk("", m, func(prefix string, mod Module) {
		if bad != nil {
			return
		}
		if _, ok := mod.(*LoRALinear); ok {
			return
		}
		lc, ok := mod.(interface{ List() []Child })
		if !ok {
			return
		}
		list := lc.List()
		for i, ch := range list {
			path := prefix + ch.Name
			if !c.matches(path) {
				continue
			}
			for k, t := range c.Targets {
				if path == t || strings.HasSuffix(path, "."+t) {
					used[k] = true
				}
			}
			lin, ok := ch.Module.(*Linear)
			if !ok {
				bad = graph.Errorf(graph.ErrAttr, "nn.LoRA: target module %s is a %T, not a linear layer (nn.Linear)", path, ch.Module)
				return
			}
			sites = append(sites, loraSite{list, i, path, lin})
		}
	})
	if bad != nil {
		return nil, bad
	}
	for k, t := range c.Targets {
		if !used[k] {
			return nil, graph.Errorf(graph.ErrAttr, "nn.LoRA: target module %q matches no module of the model", t)
		}
	}
	return sites, nil
}

// Targeted lists the paths of the linear layers Apply would adapt in m,
// in module order, with the weight's shape [out, in] of each, changing
// nothing; its errors are Apply's.
func (c LoRA) Targeted(m Module) (paths []string, shapes [][]int, err error) {
	if err := c.Check(); err != nil {
		return nil, nil, err
	}
	if m == nil {
		return nil, nil, graph.Errorf(graph.ErrNilTensor, "nn.LoRA: nil module")
	}
	sites, err := c.sites(m)
	if err != nil {
		return nil, nil, err
	}
	for _, s := range sites {
		paths = append(paths, s.path)
		shapes = append(shapes, s.lin.Weight.Shape())
	}
	return paths, shapes, nil
}

// LoRAAdapters lists m's adapted layers in module order, with their
// paths.
func LoRAAdapters(m Module) []NamedLoRA {
	var out []NamedLoRA
	walk("", m, func(prefix string, mod Module) {
		if l, ok := mod.(*LoRALinear); ok && l != nil {
			out = append(out, NamedLoRA{Path: strings.TrimSuffix(prefix, "."), Layer: l})
		}
	})
	return out
}

// LoRAReach lists, in module order, the paths of m's linear layers,
// adapted (LoRALinear) or not (Linear), whose paths targets match as
// LoRA.Targets match them: what a config of these targets adapts.
func LoRAReach(m Module, targets []string) []string {
	c := LoRA{Targets: targets}
	var out []string
	walk("", m, func(prefix string, mod Module) {
		if _, ok := mod.(*LoRALinear); ok {
			return
		}
		lc, ok := mod.(interface{ List() []Child })
		if !ok {
			return
		}
		for _, ch := range lc.List() {
			switch ch.Module.(type) {
			case *Linear, *LoRALinear:
				if p := prefix + ch.Name; c.matches(p) {
					out = append(out, p)
				}
			}
		}
	})
	return out
}

// LoRAParams lists the adapters' parameters of m (each layer's A, then
// B, in module order): what a LoRA fine-tune trains.
func LoRAParams(m Module) []*Param {
	var ps []*Param
	for _, a := range LoRAAdapters(m) {
		ps = append(ps, a.Layer.A, a.Layer.B)
	}
	return ps
}

// MergeLoRA is m's base parameters for export, in Params order without the
// adapters: each adapted weight replaced by a new float32 parameter of the
// same name holding W + (Alpha/Rank)·B·A (summed in float64, rounded
// once), the others as they are. Give it to hf.Save to write the merged
// model as a plain checkpoint. The values are the host's: after training
// in a Session, call its SyncParams first. W is its float32 host value; a
// base frozen in 16 bits computed with it rounded, the same values when
// the base was loaded from a 16-bit checkpoint. A shape-only model, or a base
// weight or adapter without float32 data, is an error (graph.ErrNoData).
func MergeLoRA(m Module) ([]*Param, error) {
	merged := map[*Param]*Param{}
	skip := map[*Param]bool{}
	for _, a := range LoRAAdapters(m) {
		l := a.Layer
		skip[l.A], skip[l.B] = true, true
		w, err := float32Data(l.Base.Weight)
		if err != nil {
			return nil, err
		}
		av, err := float32Data(l.A)
		if err != nil {
			return nil, err
		}
		bv, err := float32Data(l.B)
		if err != nil {
			return nil, err
		}
		shape := l.Base.Weight.Shape()
		out, in, r := shape[0], shape[1], l.Rank
		if !slices.Equal(l.A.Shape(), []int{r, in}) || !slices.Equal(l.B.Shape(), []int{out, r}) {
			return nil, graph.Errorf(graph.ErrShape, "nn.MergeLoRA: %s: A %v and B %v do not fit weight %v at rank %d",
				a.Path, l.A.Shape(), l.B.Shape(), shape, r)
		}
		s := l.Scale()
		data := make([]float32, out*in)
		row := make([]float64, in)
		for i := range out {
			clear(row)
			for k := range r {
				b := float64(bv[i*r+k])
				if b == 0 {
					continue
				}
				for j, a := range av[k*in : (k+1)*in] {
					row[j] += b * float64(a)
				}
			}
			for j := range in {
				data[i*in+j] = float32(float64(w[i*in+j]) + s*row[j])
			}
		}
		p := NewParam(l.Base.Weight.Name(), tensor.New(tensor.WithShape(out, in), tensor.WithBacking(data)))
		merged[l.Base.Weight] = p
	}
	var ps []*Param
	for _, p := range m.Params() {
		switch {
		case skip[p]:
		case merged[p] != nil:
			ps = append(ps, merged[p])
		default:
			ps = append(ps, p)
		}
	}
	return ps, nil
}

// float32Data is p's host float32 data, or a graph.ErrNoData.
func float32Data(p *Param) ([]float32, error) {
	v := p.Value()
	if v == nil {
		return nil, graph.Errorf(graph.ErrNoData, "parameter %s has no data (a shape-only model)", p.Name())
	}
	d, ok := v.Data().([]float32)
	if !ok || len(d) != graph.Numel(p.Shape()) {
		return nil, graph.Errorf(graph.ErrNoData, "parameter %s holds %T, not float32 data of %v", p.Name(), v.Data(), p.Shape())
	}
	return d, nil
}

// As is the parameter as a layer applied to x reads it: its own tensor,
// widened to x's float dtype when it is a 16-bit frozen parameter
// (FreezeAs) and x is not 16-bit, the cast a mixed precision policy drops
// again. For models written outside this package that read parameters
// directly (a tied output head reading the embedding table).
func (p *Param) As(x *lazy.Tensor) *lazy.Tensor { return p.as(x) }
