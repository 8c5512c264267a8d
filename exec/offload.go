package exec

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// OffloadHost is an executor's host side of an offloaded optimizer
// (Options.Offload, ZeRO-Offload): for each trained parameter, by its
// host tensor, one host allocation of planner.OffloadElementBytes(slots)
// bytes per element holding its float32 master weights, its optimizer
// state and a bfloat16 staging buffer. CUDA allocates it page-locked
// (cuMemHostAlloc, so the gradient and weight copies are DMAs), the CPU
// from the Go heap. Pinned is the bytes held: a plan's HostPinned, to the
// byte, once every trained parameter has stepped.
//
// A step (Step) copies each final bfloat16 gradient into its staging
// buffer, runs optim.Adam's StepOffload over the masters on every core,
// and copies the staging buffers, now the updated weights rounded to
// bfloat16, back over the device's parameters. The masters start as the
// host tensors' values (and again after MarkStale: a checkpoint loaded);
// SyncHost copies them back into the host tensors.
type OffloadHost struct {
	// Alloc gives n bytes of host memory, aligned for float32; Free
	// gives them back. Nil: the Go heap (the CPU executor's).
	Alloc func(n int) ([]byte, error)
	Free  func(b []byte) error
	// Workers is how many goroutines update the masters (0: GOMAXPROCS).
	Workers int

	mu     sync.Mutex
	opt    optim.Optimizer // the latest step's: its state points into the memory
	params map[any]*offloaded
	order  []any
	pinned int64
}

// offloaded is one trained parameter's host memory.
type offloaded struct {
	mem    []byte
	master []float32
	state  [][]float32
	stage  []half.BF16
	stale  bool // the master is to be read from the host tensor
	dirty  bool // the master is newer than the host tensor
	host   []float32
}

// Pinned is the host bytes the offloaded parameters hold.
func (h *OffloadHost) Pinned() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.pinned
}

// entry is key's memory for n elements and slots state tensors, made on
// first use. With h.mu held.
func (h *OffloadHost) entry(key any, name string, n, slots int, host []float32) (*offloaded, error) {
	if e := h.params[key]; e != nil {
		if len(e.master) != n || len(e.state) != slots {
			return nil, graph.Errorf(graph.ErrShape, "offload: parameter %q has %d elements and %d state tensors; its host memory was made for %d and %d",
				name, n, slots, len(e.master), len(e.state))
		}
		e.host = host
		return e, nil
	}
	size := int64(n) * planner.OffloadElementBytes(slots)
	alloc := h.Alloc
	if size == 0 {
		alloc = func(int) ([]byte, error) { return nil, nil }
	} else if alloc == nil { // the zero OffloadHost: the Go heap
		alloc = func(n int) ([]byte, error) {
			w := make([]float32, (n+3)/4)
			return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), 4*len(w))[:n:n], nil
		}
	}
	mem, err := alloc(int(size))
	if err != nil {
		return nil, fmt.Errorf("offload: %d bytes of host memory for parameter %q: %w", size, name, err)
	}
	if int64(len(mem)) != size || (size > 0 && uintptr(unsafe.Pointer(&mem[0]))%4 != 0) {
		return nil, graph.Errorf(graph.ErrAttr, "offload: host allocation of %d bytes for %q gave %d bytes, or unaligned", size, name, len(mem))
	}
	e := &offloaded{mem: mem, stale: true, host: host}
	if n > 0 {
		f := unsafe.Slice((*float32)(unsafe.Pointer(&mem[0])), n*(1+slots))
		e.master = f[:n:n]
		for s := range slots {
			e.state = append(e.state, f[n*(1+s):n*(2+s):n*(2+s)])
		}
		e.stage = unsafe.Slice((*half.BF16)(unsafe.Pointer(&mem[4*n*(1+slots)])), n)
	} else {
		e.master, e.stage = []float32{}, []half.BF16{}
		for range slots {
			e.state = append(e.state, []float32{})
		}
	}
	if h.params == nil {
		h.params = map[any]*offloaded{}
	}
	h.params[key] = e
	h.order = append(h.order, key)
	h.pinned += size
	return e, nil
}

// Step runs the host half of an offloaded step of p's trained parameters
// (optim.Adam.StepOffloadEach):
// down(i, dst) copies the final gradient of p.Trained[i] (bfloat16) into
// dst, up(i, src) the new bfloat16 weights over the device's copy of the
// parameter. source gives each trained node's host tensor (its key, and
// the masters' first values). The optimizer must be *optim.Adam (Adam or
// AdamW); others are refused with graph.ErrAttr before anything changes.
// A gradient that cannot be copied changes nothing; a weight that cannot
// be copied back leaves the masters and the state updated and returns an
// *optim.PartialStepError naming the parameters whose device copies are
// stale.
func (h *OffloadHost) Step(p *planner.Program, source func(id int) tensor.Tensor, opt optim.Optimizer,
	down func(i int, dst []half.BF16) error, up func(i int, src []half.BF16) error) error {
	adam, ok := opt.(*optim.Adam)
	if !ok {
		return graph.Errorf(graph.ErrAttr, "offload: the offloaded optimizer runs Adam and AdamW (*optim.Adam), not %T", opt)
	}
	if len(p.Kept) != len(p.Trained) {
		return graph.Errorf(graph.ErrArity, "offload: %d trained parameters and %d gradients; they must pair up", len(p.Trained), len(p.Kept))
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.opt != nil && h.opt != opt {
		if err := h.detach(); err != nil {
			return err
		}
	}
	h.opt = opt
	slots := opt.StateSlots()
	es := make([]*offloaded, len(p.Trained))
	ps := make([]optim.OffloadParam, len(p.Trained))
	for i, id := range p.Trained {
		nd := p.Graph.Node(id)
		if dt := nd.Type.DType; dt != graph.BFloat16 {
			return graph.Errorf(graph.ErrDType, "offload: trained parameter %q (node %d) is %s on the device, want bfloat16", nd.Name, id, dt)
		}
		if g := p.Graph.Node(p.Kept[i]); g.Type.DType != graph.BFloat16 || g.Type.Numel() != nd.Type.Numel() {
			return graph.Errorf(graph.ErrDType, "offload: gradient of %q (node %d) is %s%v, want bfloat16%v", nd.Name, g.ID, g.Type.DType, g.Type.Shape, nd.Type.Shape)
		}
		t := source(id)
		f32 := *nd
		f32.Type.DType = graph.Float32
		host, err := ParamData(&f32, t)
		if err != nil {
			return err
		}
		e, err := h.entry(t, nd.Name, nd.Type.Numel(), slots, host)
		if err != nil {
			return err
		}
		es[i] = e
		ps[i] = optim.OffloadParam{Key: t, Name: nd.Name, Master: e.master, Grad: e.stage, Weight: e.stage, State: e.state}
	}
	for i := range es {
		if err := down(i, es[i].stage); err != nil {
			return err
		}
	}
	for _, e := range es {
		if e.stale {
			copy(e.master, e.host)
			e.stale = false
		}
	}
	// Each parameter's weights are copied back as soon as its update is
	// done, on this goroutine (the device's thread), while the workers
	// update the others: on CUDA an asynchronous DMA from pinned memory,
	// overlapping the rest of the update.
	err := adam.StepOffloadEach(ps, h.Workers, func(i int) error { return up(i, es[i].stage) })
	var pe *optim.PartialStepError
	if err != nil && !errors.As(err, &pe) {
		return err // refused before any change
	}
	for _, e := range es {
		e.dirty = true
	}
	return err
}

// SyncHost copies every master newer than its host tensor into it.
func (h *OffloadHost) SyncHost() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, k := range h.order {
		if e := h.params[k]; e.dirty && e.host != nil {
			copy(e.host, e.master)
			e.dirty = false
		}
	}
}

// MarkStale makes the next step read every master from its host tensor
// again (the host tensors were written: a checkpoint loaded).
func (h *OffloadHost) MarkStale() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, e := range h.params {
		e.stale, e.dirty = true, false
	}
}

// Release frees every parameter's host memory, after giving the latest
// step's optimizer copies of its state there (its State stays current).
func (h *OffloadHost) Release() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	errs := []error{h.detach()}
	for _, k := range h.order {
		if mem := h.params[k].mem; h.Free != nil && len(mem) > 0 {
			errs = append(errs, h.Free(mem))
		}
	}
	h.params, h.order, h.pinned, h.opt = nil, nil, 0, nil
	return errors.Join(errs...)
}

// detach gives the latest step's optimizer its state back in memory of
// its own (copies), so that the host buffers it points into may be freed
// or handed to another optimizer. With h.mu held.
func (h *OffloadHost) detach() error {
	c, ok := h.opt.(interface {
		State(key any) [][]float32
		ParamStep(key any) int
		SetState(key any, n, step int, slots [][]float32) error
	})
	if !ok {
		return nil
	}
	var errs []error
	for _, k := range h.order {
		e := h.params[k]
		if st := c.State(k); len(st) > 0 && len(e.state) > 0 && len(st[0]) > 0 && &st[0][0] == &e.state[0][0] {
			errs = append(errs, c.SetState(k, len(e.master), c.ParamStep(k), st)) // SetState copies
		}
	}
	return errors.Join(errs...)
}

// ParamKey is the resident key of the parameter whose host tensor is t.
func ParamKey(t tensor.Tensor) ResidentKey {
	return keyOf(planner.Buffer{Kind: planner.BufParam}, t)
}

// CheckOffload refuses Options.Offload where it cannot run: a program not
// compiled for it, no resident run, a loss scale or a reducer, or an
// optimizer other than Adam and AdamW; and a program compiled for it run
// without it.
func CheckOffload(p *planner.Program, o Options) error {
	if !o.Offload {
		if p.Offloaded && o.Optimizer != nil {
			return graph.Errorf(graph.ErrAttr, "offload: the program was compiled with planner.CompileOptions.Offload (no device state); run it with Options.Offload")
		}
		return nil
	}
	switch {
	case !p.Offloaded:
		return graph.Errorf(graph.ErrAttr, "offload: Options.Offload runs programs compiled with planner.CompileOptions.Offload")
	case !o.Resident:
		return graph.Errorf(graph.ErrAttr, "offload: Options.Offload keeps the parameters resident (set Options.Resident)")
	case o.LossScale != 0 || o.Reduce != nil || o.Update != nil:
		return graph.Errorf(graph.ErrAttr, "offload: Options.Offload takes no LossScale, Reduce or Update")
	}
	if _, ok := o.Optimizer.(*optim.Adam); !ok && o.Optimizer != nil {
		return graph.Errorf(graph.ErrAttr, "offload: the offloaded optimizer runs Adam and AdamW (*optim.Adam), not %T", o.Optimizer)
	}
	return nil
}
