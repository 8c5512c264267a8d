package exec

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unsafe"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// ResidentKey identifies a persistent buffer across runs: a parameter or
// constant by its host tensor, an optimizer state slot by its parameter's
// tensor and slot.
type ResidentKey struct {
	data any
	kind planner.BufferKind
	slot int
}

// Data is the host tensor the key names the buffer by: the parameter's
// or constant's, or for optimizer state its parameter's.
func (k ResidentKey) Data() any { return k.data }

// Kind is the buffer's kind.
func (k ResidentKey) Kind() planner.BufferKind { return k.kind }

// Slot is the optimizer state slot of a BufState key.
func (k ResidentKey) Slot() int { return k.slot }

// StateKey is the key of optimizer state slot of the parameter whose host
// tensor is t.
func StateKey(t tensor.Tensor, slot int) ResidentKey {
	return keyOf(planner.Buffer{Kind: planner.BufState, Slot: slot}, t)
}

// Resident is a buffer an executor keeps allocated across runs. Val is
// the executor's own record of it (exec/cpu: the value; exec/cuda: the
// host copy while yielded).
type Resident[V any] struct {
	Blk   *alloc.Block // nil while yielded
	Size  int64        // requested bytes
	Tag   alloc.Tag    // the tag of the program that first allocated it
	Val   V
	key   ResidentKey
	konst bool // a constant's: released by the first run that does not read it
	// snap is a small constant's value as it was uploaded (constantValue),
	// nil for others: a new constant of the same value takes its place.
	snap *constValue
}

// Held is a resident buffer as a plan sees it (Executor.Held).
type Held struct {
	Key   ResidentKey
	Bytes int64
	Tag   alloc.Tag
	// Const marks a constant's buffer, which the first run whose program
	// does not read it releases (ReleaseUnread, Unreleased).
	Const bool
	snap  *constValue // Resident.snap
}

// HeldKey is held as a cache key for choices made by planning within it
// (a Session's recompute and loss-chunk choices): each resident's kind,
// slot, bytes and what it is, its host tensor, or for a small constant
// its uploaded value, which a constant of that value made anew takes over
// (ReleaseUnread), so that a loop making one every step keeps its key.
func HeldKey(held []Held) string {
	var b strings.Builder
	for _, h := range held {
		var id any = h.Key.data
		if h.snap != nil {
			id = h.snap
		}
		fmt.Fprintf(&b, "%d/%d/%d/%t/%p;", h.Key.kind, h.Key.slot, h.Bytes, h.Const, id)
	}
	return b.String()
}

// MaxRekeyBytes bounds the constants a resident constant of the same
// value can stand for (ReleaseUnread): a loss's 1/N, a mask, a table made
// anew every step. Their values are kept on the host, as uploaded, and
// compared when a run does not read the resident's own tensor.
const MaxRekeyBytes = 1 << 20

// constValue is a constant's dtype, shape and bytes.
type constValue struct {
	dtype tensor.Dtype
	shape []int
	bytes []byte
}

// constantValue copies t's value when it is a dense, contiguous tensor of
// at most MaxRekeyBytes; nil otherwise.
func constantValue(t tensor.Tensor) *constValue {
	raw, ok := rawBytes(t)
	if !ok || len(raw) == 0 || len(raw) > MaxRekeyBytes {
		return nil
	}
	return &constValue{dtype: t.Dtype(), shape: slices.Clone([]int(t.Shape())), bytes: slices.Clone(raw)}
}

// same reports whether t holds exactly v's value.
func (v *constValue) same(t tensor.Tensor) bool {
	if v == nil || t.Dtype() != v.dtype || !slices.Equal([]int(t.Shape()), v.shape) {
		return false
	}
	raw, ok := rawBytes(t)
	return ok && bytes.Equal(raw, v.bytes)
}

// rawBytes is the memory of a dense, contiguous tensor of a fixed-size
// dtype, without a copy.
func rawBytes(t tensor.Tensor) ([]byte, bool) {
	d, ok := t.(*tensor.Dense)
	if !ok || d == nil || d.RequiresIterator() {
		return nil, false
	}
	var raw []byte
	switch d.Dtype() {
	case tensor.Float32:
		raw = asBytes(d.Float32s())
	case tensor.Float64:
		raw = asBytes(d.Float64s())
	case tensor.Int64:
		raw = asBytes(d.Int64s())
	case tensor.Int32:
		raw = asBytes(d.Int32s())
	case tensor.Int:
		raw = asBytes(d.Ints())
	case tensor.Uint8:
		raw = asBytes(d.Uint8s())
	default:
		return nil, false
	}
	return raw, len(raw) == d.Len()*int(d.Dtype().Size())
}

func asBytes[T any](x []T) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(x))), len(x)*int(unsafe.Sizeof(x[0])))
}

// rekeyed pairs each resident constant p does not read with a constant p
// reads and nothing holds (its key, in p's order) whose value is the one
// the resident was uploaded with, by index in held: that resident then
// stands for it, renamed, instead of being released and the new one
// allocated, so a loop that makes a constant of the same value every step
// keeps its device and its allocator's cache as they are.
func rekeyed(p *planner.Program, held []Held, read map[ResidentKey]bool) map[int]ResidentKey {
	var out map[int]ResidentKey
	var have map[ResidentKey]bool
	taken := map[int]bool{} // p's persistent buffers already paired
	for i, h := range held {
		if !h.Const || h.snap == nil || read[h.Key] {
			continue
		}
		if have == nil {
			have = make(map[ResidentKey]bool, len(held))
			for _, h := range held {
				have[h.Key] = true
			}
		}
		for j, bi := range p.Persistent {
			b := p.Buffers[bi]
			nd := p.Graph.Node(b.Node)
			if taken[j] || b.Kind != planner.BufParam || nd.Op != graph.OpConst || nd.Value == nil || b.Bytes(0) != h.Bytes {
				continue
			}
			if k := keyOf(b, nd.Value); !have[k] && h.snap.same(nd.Value) {
				if out == nil {
					out = map[int]ResidentKey{}
				}
				out[i], taken[j] = k, true
				break
			}
		}
	}
	return out
}

// Residents is an executor's table of resident buffers, in allocation
// order, and whether they are yielded. The zero value is empty and ready.
// It takes no lock: the executor holds its own around every call.
type Residents[V any] struct {
	byKey   map[ResidentKey]*Resident[V]
	list    []*Resident[V]
	yielded bool
	// held is Held's answer while the list is unchanged (nil after a
	// change): every training step asks, and the list changes rarely.
	held []Held
}

// Key is the resident's key.
func (rb *Resident[V]) Key() ResidentKey { return rb.key }

// Find is the resident buffer of k, nil when there is none.
func (rs *Residents[V]) Find(k ResidentKey) *Resident[V] { return rs.byKey[k] }

// List is every resident buffer, in allocation order.
func (rs *Residents[V]) List() []*Resident[V] { return rs.list }

// Yielded reports whether the resident buffers are given back.
func (rs *Residents[V]) Yielded() bool { return rs.yielded }

// HoldsConstants reports whether a resident is a constant's: without one,
// ReleaseUnread has nothing to free.
func (rs *Residents[V]) HoldsConstants() bool {
	return slices.ContainsFunc(rs.list, func(rb *Resident[V]) bool { return rb.konst })
}

// keep records a persistent buffer just allocated and filled.
func (rs *Residents[V]) keep(k ResidentKey, pb planner.Buffer, blk *alloc.Block, v V, konst bool) {
	if rs.byKey == nil {
		rs.byKey = map[ResidentKey]*Resident[V]{}
	}
	rb := &Resident[V]{Blk: blk, Size: pb.Bytes(0), Tag: pb.Tag, Val: v, key: k, konst: konst}
	if t, ok := k.data.(tensor.Tensor); ok && konst {
		rb.snap = constantValue(t) // the value just uploaded
	}
	rs.byKey[k] = rb
	rs.list = append(rs.list, rb)
	rs.held = nil
}

// Yield frees every resident block, calling save first on each (to keep a
// host copy of what lives only on the device), and empties a's cache, so
// with nothing else allocated its reserved bytes drop to what it holds
// outside any program. Yielding twice frees nothing more.
func (rs *Residents[V]) Yield(a *alloc.Allocator, save func(*Resident[V]) error) error {
	for _, rb := range rs.list {
		if rb.Blk == nil {
			continue
		}
		if save != nil {
			if err := save(rb); err != nil {
				return err
			}
		}
		if err := a.Free(rb.Blk); err != nil {
			return err
		}
		rb.Blk = nil
	}
	rs.yielded = true
	return a.EmptyCache()
}

// Restore allocates the blocks Yield freed again, in the order they were
// first allocated, calling load on each to refill it. If one cannot be
// allocated or filled it frees what it allocated, empties a's cache, stays
// yielded and returns the error (the allocator's wraps
// alloc.ErrOutOfMemory). Without a Yield it does nothing.
func (rs *Residents[V]) Restore(a *alloc.Allocator, load func(*Resident[V]) error) error {
	if !rs.yielded {
		return nil
	}
	var got []*Resident[V]
	undo := func(err error) error {
		for _, g := range got {
			err = errors.Join(err, a.Free(g.Blk))
			g.Blk = nil
		}
		return errors.Join(err, a.EmptyCache())
	}
	for _, rb := range rs.list {
		if rb.Blk != nil {
			continue
		}
		blk, err := a.Malloc(rb.Size, rb.Tag)
		if err != nil {
			return undo(err)
		}
		rb.Blk = blk
		got = append(got, rb)
		if load != nil {
			if err := load(rb); err != nil {
				return undo(err)
			}
		}
	}
	rs.yielded = false
	return nil
}

// Held lists the resident buffers, in allocation order. The slice is
// shared by every call until the list changes: callers must not modify it.
func (rs *Residents[V]) Held() []Held {
	if rs.held == nil && len(rs.list) > 0 {
		rs.held = make([]Held, len(rs.list))
		for i, rb := range rs.list {
			rs.held[i] = Held{Key: rb.key, Bytes: rb.Size, Tag: rb.Tag, Const: rb.konst, snap: rb.snap}
		}
	}
	return rs.held
}

// ReleaseUnread frees the resident constants that p does not read (a
// constant made anew every step is read by one step only) and reports
// whether it freed any. A small one whose uploaded value equals a
// constant p reads and nothing holds stands for that one instead, its key
// renamed (rekeyed): nothing is freed for it. The others keep their
// allocation order; when a freed one lay between two that stay, the rest
// are moved together (Yield with save, then Restore with load), so the
// allocator holds what allocating the remaining residents in order on an
// empty device leaves, which is what the planner simulates.
func (rs *Residents[V]) ReleaseUnread(a *alloc.Allocator, p *planner.Program, save, load func(*Resident[V]) error) (bool, error) {
	if !rs.HoldsConstants() {
		return false, nil // nothing to look up (every training step asks)
	}
	read := readKeys(p)
	renamed := rekeyed(p, rs.Held(), read)
	for i, k := range renamed {
		rb := rs.list[i]
		delete(rs.byKey, rb.key)
		rb.key = k
		rs.byKey[k] = rb
		rs.held = nil
	}
	kept := rs.list[:0:0]
	var freed []*Resident[V]
	gap := false // a freed resident lies before one that stays
	for _, rb := range rs.list {
		if rb.konst && !read[rb.key] {
			freed = append(freed, rb)
			continue
		}
		gap = gap || len(freed) > 0
		kept = append(kept, rb)
	}
	if len(freed) == 0 {
		return false, nil
	}
	if gap && !rs.yielded {
		if err := rs.Yield(a, save); err != nil {
			return true, err
		}
	}
	rs.list = kept
	rs.held = nil
	for _, rb := range freed {
		delete(rs.byKey, rb.key)
		if rb.Blk != nil {
			if err := a.Free(rb.Blk); err != nil {
				return true, err
			}
			rb.Blk = nil
		}
	}
	if gap {
		return true, rs.Restore(a, load)
	}
	return true, nil
}

// readKeys is the set of resident keys p's persistent buffers read.
func readKeys(p *planner.Program) map[ResidentKey]bool {
	read := map[ResidentKey]bool{}
	for _, bi := range p.Persistent {
		b := p.Buffers[bi]
		if t := p.Graph.Node(b.Node).Value; t != nil {
			read[keyOf(b, t)] = true
		}
	}
	return read
}

// Unreleased is held, an executor's residents in allocation order, less
// the constants that ReleaseUnread(p) would free: what a run of p finds
// resident, for planning p without running it. held is returned as it is
// when it holds no constant.
func Unreleased(p *planner.Program, held []Held) []Held {
	if !slices.ContainsFunc(held, func(h Held) bool { return h.Const }) {
		return held
	}
	read := readKeys(p)
	renamed := rekeyed(p, held, read)
	out := make([]Held, 0, len(held))
	for i, h := range held {
		if k, ok := renamed[i]; ok {
			h.Key = k
		}
		if !h.Const || read[h.Key] {
			out = append(out, h)
		}
	}
	return out
}

// Release frees every resident block and forgets them all (an executor's
// Close).
func (rs *Residents[V]) Release(a *alloc.Allocator) error {
	var errs []error
	for _, rb := range rs.list {
		if rb.Blk != nil {
			errs = append(errs, a.Free(rb.Blk))
		}
	}
	rs.byKey, rs.list, rs.yielded, rs.held = nil, nil, false, nil
	return errors.Join(errs...)
}

// Call is the host side of one Execute: the program, the options, the
// executor's residents and the combined outputs. Executors embed it in
// their planner.Hooks.
type Call[V any] struct {
	P      *planner.Program
	O      Options
	R      *Residents[V]
	KeptOf []int      // KeptOutputs(P)
	Outs   []*HostBuf // combined outputs
	// Made holds the persistent blocks this call allocated and keeps no
	// resident (with Resident off): Free releases them.
	Made []*alloc.Block
	// Skipped is Result.Skipped: the executor's Finish found a non-finite
	// unscaled gradient (Options.LossScale) and ran no update.
	Skipped bool
}

// NewCall starts the host side of running p with o over rs.
func NewCall[V any](p *planner.Program, o Options, rs *Residents[V]) (*Call[V], error) {
	keptOf, err := KeptOutputs(p)
	if err != nil {
		return nil, err
	}
	return &Call[V]{P: p, O: o, R: rs, KeptOf: keptOf, Outs: make([]*HostBuf, len(p.Outputs))}, nil
}

// Source is the data of source node id: Options.Feed's, else the node's
// own value.
func (c *Call[V]) Source(id int) tensor.Tensor {
	if c.O.Feed != nil {
		if t := c.O.Feed(id); t != nil {
			return t
		}
	}
	return c.P.Graph.Node(id).Value
}

// Key is the resident key of a parameter or state buffer of a resident
// call; ok is false for every other buffer.
func (c *Call[V]) Key(b planner.Buffer) (k ResidentKey, ok bool) {
	if !c.O.Resident || (b.Kind != planner.BufParam && b.Kind != planner.BufState) {
		return k, false
	}
	t := c.Source(b.Node)
	if t == nil {
		return k, false
	}
	return keyOf(b, t), true
}

func keyOf(b planner.Buffer, t tensor.Tensor) ResidentKey {
	return ResidentKey{data: t, kind: b.Kind, slot: b.Slot}
}

// HoldsExactly reports whether held, an executor's residents in
// allocation order, are exactly p's persistent buffers in p's order, each
// with its key (the residents' keys are distinct, so the persistent
// buffers' are too): a steady training loop's device. PlanResidents then
// lists each resident as the persistent buffer at its index, which a plan
// treats as a fresh device that has run p once, as it treats no residents
// at all, so a caller may plan with none.
func HoldsExactly(p *planner.Program, held []Held) bool {
	if len(held) != len(p.Persistent) {
		return false
	}
	for i, bi := range p.Persistent {
		b, h := &p.Buffers[bi], &held[i]
		t := p.Graph.Node(b.Node).Value
		if t == nil || h.Key.data != t || h.Key.kind != b.Kind || h.Key.slot != b.Slot {
			return false
		}
	}
	return true
}

// PlanResidents describes held, an executor's residents in allocation
// order, to the planner for program p: each stands for the persistent
// buffer of p with its key (from the nodes' own values), if any.
func PlanResidents(p *planner.Program, held []Held) []planner.Held {
	out := make([]planner.Held, len(held))
	// A steady loop holds exactly the program's persistent buffers, in the
	// program's order: that is the answer, found without building a map.
	if HoldsExactly(p, held) {
		for i, h := range held {
			out[i] = planner.Held{Bytes: h.Bytes, Tag: h.Tag, Buffer: p.Persistent[i]}
		}
		return out
	}
	buf := map[ResidentKey]int{}
	for _, bi := range p.Persistent {
		b := p.Buffers[bi]
		if t := p.Graph.Node(b.Node).Value; t != nil {
			buf[keyOf(b, t)] = bi
		}
	}
	for i, h := range held {
		bi, ok := buf[h.Key]
		if !ok {
			bi = -1
		}
		out[i] = planner.Held{Bytes: h.Bytes, Tag: h.Tag, Buffer: bi}
	}
	return out
}

// Resident is b's resident buffer holding a block, or nil.
func (c *Call[V]) Resident(b planner.Buffer) *Resident[V] {
	if k, ok := c.Key(b); ok {
		if rb := c.R.Find(k); rb != nil && rb.Blk != nil {
			return rb
		}
	}
	return nil
}

// Keep records persistent buffer pb just allocated in blk and filled with
// v: resident when the call keeps it so, otherwise (accumulators aside,
// which the replay frees) to be freed by Free.
func (c *Call[V]) Keep(pb planner.Buffer, blk *alloc.Block, v V) {
	if k, ok := c.Key(pb); ok {
		c.R.keep(k, pb, blk, v, c.P.Graph.Node(pb.Node).Op == graph.OpConst)
	} else if pb.Kind != planner.BufAccumulator {
		c.Made = append(c.Made, blk)
	}
}

// Free releases the blocks Keep left to the call and returns err, or the
// first Free error when err is nil.
func (c *Call[V]) Free(a *alloc.Allocator, err error) error {
	for _, blk := range c.Made {
		if ferr := a.Free(blk); err == nil && ferr != nil {
			err = ferr
		}
	}
	c.Made = nil
	return err
}

// ChunkDone is planner.Hooks.ChunkDone's host side: kept outputs are added
// into their accumulators by add (with several chunks; a single chunk's
// go to Finish as they are), every other output is read to the host by
// read and combined.
func (c *Call[V]) ChunkDone(ch planner.Chunk, outs, acc []*alloc.Block,
	add func(o int, acc, out *alloc.Block) error,
	read func(o int, blk *alloc.Block, size int) (*HostBuf, error)) error {
	for i, o := range c.P.Outputs {
		if j := c.KeptOf[i]; j >= 0 {
			if acc != nil {
				if err := add(o, acc[j], outs[i]); err != nil {
					return err
				}
			}
			continue
		}
		v, err := read(o, outs[i], ch.Size)
		if err != nil {
			return err
		}
		c.Outs[i] = Combine(c.Outs[i], v, c.P, o, ch)
	}
	return nil
}

// SetKept makes the kept outputs' results: grads[j] is kept entry j's
// final sum; with private set each output gets a copy.
func (c *Call[V]) SetKept(grads [][]float32, private bool) {
	for i, o := range c.P.Outputs {
		if j := c.KeptOf[i]; j >= 0 {
			f := grads[j]
			if private {
				f = append([]float32(nil), f...)
			}
			c.Outs[i] = &HostBuf{Shape: c.P.Graph.Node(o).Type.Shape, F: f}
		}
	}
}
