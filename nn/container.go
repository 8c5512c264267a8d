package nn

import (
	"slices"
	"strconv"
	"strings"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// Child is a module with its name inside a container.
type Child struct {
	Name   string
	Module Module
}

// Children is an ordered list of named submodules. Embed it in a module
// written outside this package to get Params, Err and scoped calls:
//
//	type Block struct{ nn.Children }
//
//	b := &Block{nn.NewChildren(nn.Child{Name: "ln", Module: ln}, nn.Child{Name: "fc", Module: fc})}
//
//	func (b *Block) Forward(x *lazy.Tensor) *lazy.Tensor {
//		return x.Add(b.Call("fc", b.Call("ln", x))) // nodes in "…ln" and "…fc"
//	}
type Children struct {
	list []Child
	err  error
}

// NewChildren adopts cs in order, prefixing each child's parameter names
// with its name. Names must be non-empty, unique and free of dots; a
// parameter shared by two children keeps the name of its first.
func NewChildren(cs ...Child) Children {
	c := Children{list: append([]Child(nil), cs...)}
	seen := map[*Param]bool{}
	for i, ch := range cs {
		if err := c.checkName(i); err != nil {
			c.err = err
			return c
		}
		if ch.Module == nil {
			c.err = graph.Errorf(graph.ErrNilTensor, "child %q is a nil module", ch.Name)
			return c
		}
		for _, p := range ch.Module.Params() {
			if !seen[p] {
				seen[p] = true
				p.prefix(ch.Name)
			}
		}
	}
	return c
}

func (c *Children) checkName(i int) error {
	name := c.list[i].Name
	if name == "" || strings.Contains(name, ".") {
		return graph.Errorf(graph.ErrAttr, "child %d: name %q must be non-empty and contain no dot", i, name)
	}
	for _, prev := range c.list[:i] {
		if prev.Name == name {
			return graph.Errorf(graph.ErrAttr, "child name %q is used twice", name)
		}
	}
	return nil
}

// List returns the children in order; callers must not modify it.
func (c *Children) List() []Child { return c.list }

// Get returns the child named name, or nil.
func (c *Children) Get(name string) Module {
	for _, ch := range c.list {
		if ch.Name == name {
			return ch.Module
		}
	}
	return nil
}

// Call runs the child named name on x, under its name as module scope.
func (c *Children) Call(name string, x *lazy.Tensor) *lazy.Tensor {
	if c.err != nil {
		return fail("nn.Children", c.err, x)
	}
	m := c.Get(name)
	if m == nil {
		return fail("nn.Children", graph.Errorf(graph.ErrAttr, "no child named %q", name), x)
	}
	return call(name, m, x)
}

// Params lists every child's parameters in child order, each once.
func (c *Children) Params() []*Param {
	var ps []*Param
	var seen map[*Param]bool // once the list is long; a short one is scanned
	for _, ch := range c.list {
		if ch.Module == nil {
			continue
		}
		for _, p := range ch.Module.Params() {
			if seen == nil && len(ps) >= 16 {
				seen = make(map[*Param]bool, 2*len(ps))
				for _, q := range ps {
					seen[q] = true
				}
			}
			if seen == nil && slices.Contains(ps, p) || seen != nil && seen[p] {
				continue
			}
			if seen != nil {
				seen[p] = true
			}
			ps = append(ps, p)
		}
	}
	return ps
}

// Err is the first construction error of the list or of a child.
func (c *Children) Err() error {
	if c.err != nil {
		return c.err
	}
	for _, ch := range c.list {
		if err := Check(ch.Module); err != nil {
			return err
		}
	}
	return nil
}

// Sequential runs its children in order, each on the previous one's output.
type Sequential struct {
	Children
}

// NewSequential names mods "0", "1", "2", … as PyTorch's nn.Sequential does.
func NewSequential(mods ...Module) *Sequential {
	cs := make([]Child, len(mods))
	for i, m := range mods {
		cs[i] = Child{Name: strconv.Itoa(i), Module: m}
	}
	return &Sequential{NewChildren(cs...)}
}

// NewSequentialNamed keeps the given names ("embed", "layers", "head").
func NewSequentialNamed(cs ...Child) *Sequential { return &Sequential{NewChildren(cs...)} }

// Forward applies every child in order.
func (s *Sequential) Forward(x *lazy.Tensor) *lazy.Tensor {
	if s.err != nil {
		return fail("nn.Sequential", s.err, x)
	}
	if g := x.Graph(); g != nil { // the caller's site, found once for every child
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	for _, ch := range s.list {
		x = call(ch.Name, ch.Module, x)
	}
	return x
}

// MLP builds Linear(sizes[0], sizes[1]), activation, Linear(sizes[1],
// sizes[2]), … with biases and no activation after the last layer, named
// "0", "1", "2", …. The activation module is reused between layers, so it
// should have no parameters (ReLU{}, GELU{}).
func MLP(opt Options, sizes []int, activation Module) *Sequential {
	if len(sizes) < 2 {
		return &Sequential{Children{err: graph.Errorf(graph.ErrShape, "MLP needs at least two sizes, got %v", sizes)}}
	}
	if activation == nil {
		return &Sequential{Children{err: graph.Errorf(graph.ErrNilTensor, "MLP activation is a nil module")}}
	}
	var mods []Module
	for i := 0; i+1 < len(sizes); i++ {
		if i > 0 {
			mods = append(mods, activation)
		}
		mods = append(mods, NewLinear(opt, sizes[i], sizes[i+1], true))
	}
	return NewSequential(mods...)
}
