package nn

import (
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// Module is a layer or a container of layers.
type Module interface {
	// Forward applies the module to x. Errors, x's included, come back as
	// the result's sticky error.
	Forward(x *lazy.Tensor) *lazy.Tensor
	// Params lists the module's parameters, its own first, then its
	// children's in child order, each once.
	Params() []*Param
}

// Param is a named parameter of a module. Its name is the dotted path from
// the outermost container it has been added to ("layers.3.weight"), and the
// lazy tensor carries the same name into every graph that uses it.
type Param struct {
	name string
	t    *lazy.Tensor
}

// NewParam wraps float32 data t as a parameter named name, for modules
// written outside this package.
func NewParam(name string, t tensor.Tensor) *Param {
	return &Param{name: name, t: lazy.Param(t, name)}
}

// Name is the parameter's dotted path.
func (p *Param) Name() string { return p.name }

// Tensor is the parameter as a lazy tensor, to use in Forward.
func (p *Param) Tensor() *lazy.Tensor { return p.t }

// Shape is the parameter's shape.
func (p *Param) Shape() []int { return p.t.Shape() }

// Value is the parameter's data, or nil in shape-only mode.
func (p *Param) Value() tensor.Tensor { return p.t.Value() }

// Err is the error met while making the parameter, or nil.
func (p *Param) Err() error { return p.t.Err() }

// prefix puts parent before the name. The lazy leaf is remade under the new
// name, so prefixing must happen before the parameter is used in a graph,
// which building bottom-up guarantees.
func (p *Param) prefix(parent string) {
	p.name = parent + "." + p.name
	p.remake(p.t.DType())
}

// remake makes the parameter's lazy leaf anew under its name, stored as
// dt, keeping whether it is frozen.
func (p *Param) remake(dt graph.DType) {
	frozen := p.t.Frozen()
	switch {
	case p.t.Err() != nil:
		return
	case p.t.Value() == nil:
		p.t = lazy.ParamSpec(p.t.Shape(), dt, p.name)
	default:
		p.t = lazy.ParamAs(p.t.Value(), dt, p.name)
	}
	p.t.SetFrozen(frozen)
}

// Options says how constructors make parameters. Rand draws initial values
// in construction order; with ShapeOnly set, parameters have shapes but no
// data and Rand is not used.
type Options struct {
	Rand      *rand.Rand
	ShapeOnly bool
	// DType is the parameters' element type, float32 when zero. Only
	// shape-only parameters may be float16 or bfloat16: they plan memory
	// for half-precision runs, while data lives in float32 slices. A
	// frozen parameter with data is stored in 16 bits by FreezeAs.
	DType graph.DType
	// PerChunkStats is what NewBatchNorm2d sets its layer's PerChunkStats
	// to: how a model built with these options opts every batch norm
	// layer in to per-chunk statistics at once (batchfit estimate's
	// --batchnorm per-chunk).
	PerChunkStats bool
}

// Seed returns Options drawing from a PCG source seeded with seed.
func Seed(seed uint64) Options {
	return Options{Rand: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// Uniform makes a float32 parameter drawn uniformly from [−bound, bound).
func (o Options) Uniform(name string, shape []int, bound float64) *Param {
	return o.make(name, shape, true, func(r *rand.Rand) float32 {
		return float32((2*r.Float64() - 1) * bound)
	})
}

// Normal makes a float32 parameter drawn from N(mean, std²).
func (o Options) Normal(name string, shape []int, mean, std float64) *Param {
	return o.make(name, shape, true, func(r *rand.Rand) float32 {
		return float32(mean + std*r.NormFloat64())
	})
}

// Full makes a float32 parameter with every element v; it needs no Rand.
func (o Options) Full(name string, shape []int, v float32) *Param {
	return o.make(name, shape, false, func(*rand.Rand) float32 { return v })
}

func (o Options) make(name string, shape []int, random bool, draw func(*rand.Rand) float32) *Param {
	for _, d := range shape {
		if d < 1 {
			return &Param{name: name, t: lazy.ErrorTensor("nn.param "+name,
				graph.Errorf(graph.ErrShape, "parameter %s: dimensions must be positive, got %v", name, shape), shape)}
		}
	}
	dt := o.DType
	if dt == graph.InvalidDType {
		dt = graph.Float32
	}
	if !dt.IsFloat() || !o.ShapeOnly && dt != graph.Float32 {
		return &Param{name: name, t: lazy.ErrorTensor("nn.param "+name,
			graph.Errorf(graph.ErrDType, "parameter %s: dtype %s needs ShapeOnly (parameters with data are float32)", name, dt), shape)}
	}
	if o.ShapeOnly {
		return &Param{name: name, t: lazy.ParamSpec(shape, dt, name)}
	}
	if random && o.Rand == nil {
		return &Param{name: name, t: lazy.ErrorTensor("nn.param "+name,
			graph.Errorf(graph.ErrAttr, "parameter %s: nn.Options has no Rand (set Rand, or ShapeOnly for a dry run)", name), shape)}
	}
	data := make([]float32, graph.Numel(shape))
	for i := range data {
		data[i] = draw(o.Rand)
	}
	t := tensor.New(tensor.WithShape(slices.Clone(shape)...), tensor.WithBacking(data))
	return NewParam(name, t)
}

// Check reports the first construction error of m or its children: a bad
// size, option or child. Forward returns the same error in its result.
func Check(m Module) error {
	if m == nil {
		return graph.Errorf(graph.ErrNilTensor, "nil nn.Module")
	}
	if e, ok := m.(interface{ Err() error }); ok {
		if err := e.Err(); err != nil {
			return err
		}
	}
	if _, ok := m.(*Sequential); ok {
		// Its parameters are its children's, which its Err (Children.Err)
		// has just checked: a model's Forward checks every step, and
		// listing a deep model's parameters at every level costs more
		// than the rest of its checks.
		return nil
	}
	for _, p := range m.Params() {
		if err := p.Err(); err != nil {
			return err
		}
	}
	return nil
}

// NumParams counts the elements of m's parameters.
func NumParams(m Module) int {
	n := 0
	for _, p := range m.Params() {
		n += graph.Numel(p.Shape())
	}
	return n
}

// fail returns x when it already carries an error (the first error wins),
// else a tensor holding err.
func fail(op string, err error, x *lazy.Tensor) *lazy.Tensor {
	if x != nil && x.Err() != nil {
		return x
	}
	return lazy.ErrorTensor(op, err, x.Shape())
}

// call runs m on x with name pushed as the graph's module scope.
func call(name string, m Module, x *lazy.Tensor) *lazy.Tensor {
	g := x.Graph()
	if g == nil { // an error (it just propagates) or a free leaf (no scope yet)
		return m.Forward(x)
	}
	if internalModule(m) {
		g.PushInternalScope(name)
	} else {
		g.PushScope(name)
	}
	defer g.PopScope()
	return m.Forward(x)
}

// internalModules caches internalModule's answer by module type.
var internalModules sync.Map // reflect.Type → bool

// internalModule reports whether m is one of batchfit's own modules
// (packages nn and models), whose ops may take their scope's call site
// (lazy.Graph.PushInternalScope): their Forward methods call user code
// only through other modules, which get scopes of their own.
func internalModule(m Module) bool {
	t := reflect.TypeOf(m)
	if t == nil {
		return false
	}
	if v, ok := internalModules.Load(t); ok {
		return v.(bool)
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	p := t.PkgPath()
	in := p == "github.com/batchfit/batchfit/nn" || p == "github.com/batchfit/batchfit/models"
	internalModules.Store(reflect.TypeOf(m), in)
	return in
}

// ParamTensors lists m's parameters as lazy tensors, in Params order, for
// gradients and training steps.
func ParamTensors(m Module) []*lazy.Tensor {
	ps := m.Params()
	ts := make([]*lazy.Tensor, len(ps))
	for i, p := range ps {
		ts[i] = p.Tensor()
	}
	return ts
}

// trainable is a module with a training mode.
type trainable interface{ setTraining(bool) }

func (d *Dropout) setTraining(on bool)      { d.Training = on }
func (bn *BatchNorm2d) setTraining(on bool) { bn.Training = on }

// SetTraining puts m and every module inside it in training (true) or
// evaluation (false) mode.
func SetTraining(m Module, on bool) {
	if t, ok := m.(trainable); ok {
		t.setTraining(on)
	}
	if c, ok := m.(interface{ List() []Child }); ok {
		for _, ch := range c.List() {
			if ch.Module != nil {
				SetTraining(ch.Module, on)
			}
		}
	}
}

// Buffer is a named tensor of a module's state that is not a parameter: a
// BatchNorm2d's running mean and variance. Name is its PyTorch state_dict
// key ("layer1.0.bn1.running_mean").
type Buffer struct {
	Name   string
	Tensor *lazy.Tensor
}

// Buffers lists the buffers of m and of every module inside it, in child
// order, named by the children's names as parameters are. PyTorch's
// state_dict also holds each batch norm's num_batches_tracked, a step
// counter nn does not keep (it only matters for momentum None, a
// cumulative average).
func Buffers(m Module) []Buffer {
	var bs []Buffer
	walk("", m, func(prefix string, m Module) {
		if bn, ok := m.(*BatchNorm2d); ok && bn != nil {
			bs = append(bs, Buffer{prefix + "running_mean", bn.RunningMean}, Buffer{prefix + "running_var", bn.RunningVar})
		}
	})
	return bs
}

// NamedDropout is a Dropout module with its dotted path inside a model
// ("h.0.drop"; "" for the model itself).
type NamedDropout struct {
	Path    string
	Dropout *Dropout
}

// Dropouts lists the Dropout modules of m and of every module inside it,
// in child order, by path: what a checkpoint saves of the masks' random
// stream (each one's Seed and Step), so that a resumed run draws the masks
// the uninterrupted one would have.
func Dropouts(m Module) []NamedDropout {
	var ds []NamedDropout
	walk("", m, func(prefix string, m Module) {
		if d, ok := m.(*Dropout); ok && d != nil {
			ds = append(ds, NamedDropout{strings.TrimSuffix(prefix, "."), d})
		}
	})
	return ds
}

// walk calls fn on m and on every module inside it (through List), in
// child order, with the dotted path of each followed by a dot ("" for m).
func walk(prefix string, m Module, fn func(prefix string, m Module)) {
	if m == nil {
		return
	}
	fn(prefix, m)
	if c, ok := m.(interface{ List() []Child }); ok {
		for _, ch := range c.List() {
			if ch.Module != nil {
				walk(prefix+ch.Name+".", ch.Module, fn)
			}
		}
	}
}
