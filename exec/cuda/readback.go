package cuda

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// Early reads of a chunk's host outputs, and the step's tail left running.
//
// A training step's host outputs (the loss, a batch norm's running
// statistics) are final at the end of the forward pass, long before the
// backward pass and the optimizer end. The runner copies them into pinned
// host memory as soon as the last of them is written (cuMemcpyDtoHAsync on
// stream 0, behind the kernels that wrote them, and an event), keeps
// launching, and waits for that event at ChunkDone. A resident Execute then
// returns without waiting for the step's last kernels: the caller's next
// graph build and Step's host work overlap the device's backward pass and
// optimizer, instead of following them (Execute's doc says what waits for
// them). Pinned memory is host memory: the allocator and the plans do not
// see it.

// readPlan is where a program's host outputs are final in each chunk: after
// the Run call that writes the last of their buffers.
type readPlan struct {
	after int   // Run calls into a chunk after which all are final; 0: read at ChunkDone
	outs  []int // the host outputs' indices in Program.Outputs
	slot  []int // per buffer: its index in bufs, −1 for the others
	bufs  []int // the host outputs' buffers, once each
}

// planReads finds p's read point. Host outputs are the outputs keptOf
// marks −1 (exec.Call.KeptOf). An output whose buffer is persistent, or
// which no run step of a chunk writes, leaves every read at ChunkDone.
func planReads(p *planner.Program, keptOf []int) *readPlan {
	rp := &readPlan{slot: make([]int, len(p.Buffers))}
	for i := range rp.slot {
		rp.slot[i] = -1
	}
	for i, o := range p.Outputs {
		if keptOf[i] >= 0 {
			continue
		}
		bi := p.OutputBuf[o]
		if bi < 0 || p.Buffers[bi].Kind != planner.BufOutput {
			return &readPlan{}
		}
		rp.outs = append(rp.outs, i)
		if rp.slot[bi] < 0 {
			rp.slot[bi] = len(rp.bufs)
			rp.bufs = append(rp.bufs, bi)
		}
	}
	last := make([]int, len(rp.bufs)) // Run calls up to each buffer's last writer
	runs := 0
	for _, st := range p.Steps {
		if st.Kind != planner.StepRun {
			continue
		}
		runs++
		// A reshape shares its input's buffer: every node whose output is
		// the buffer writes it (or, running nothing, follows its writer).
		if bi := p.OutputBuf[st.Node]; bi >= 0 && rp.slot[bi] >= 0 {
			last[rp.slot[bi]] = runs
		}
	}
	for _, n := range last {
		if n == 0 {
			return &readPlan{}
		}
		rp.after = max(rp.after, n)
	}
	return rp
}

// readPlans caches each program's readPlan for the executor (under its
// mutex). A Session keeps a few programs; the cache forgets all of them
// when it grows past readPlansMax.
type readPlans map[*planner.Program]*readPlan

const readPlansMax = 64

func (rs *readPlans) of(p *planner.Program, keptOf []int) *readPlan {
	if rp := (*rs)[p]; rp != nil {
		return rp
	}
	if *rs == nil || len(*rs) >= readPlansMax {
		*rs = readPlans{}
	}
	rp := planReads(p, keptOf)
	(*rs)[p] = rp
	return rp
}

// chunkReads is one call's early reads: the host outputs' blocks as the
// chunk's runs write them, and where their copies landed.
type chunkReads struct {
	plan   *readPlan
	runs   int            // Run calls into the current chunk
	blocks []*alloc.Block // per plan.bufs entry: this chunk's block
	off    []uintptr      // per plan.bufs entry: where its copy lands in the readback buffer
	queued bool           // the copies and their event are on stream 0, not yet waited for
}

// afterRun notes node nd's run into block out and, at the read point,
// queues the copies of the chunk's host outputs.
func (r *runner) afterRun(nd *graph.Node, c planner.Chunk, out *alloc.Block) error {
	rd := &r.reads
	if rd.plan == nil || rd.plan.after == 0 {
		return nil
	}
	rd.runs++
	if bi := r.p.OutputBuf[nd.ID]; bi >= 0 && rd.plan.slot[bi] >= 0 {
		rd.blocks[rd.plan.slot[bi]] = out
	}
	if rd.runs != rd.plan.after {
		return nil
	}
	if err := r.flush(); err != nil {
		return err
	}
	var total uintptr
	for k, bi := range rd.plan.bufs {
		rd.off[k] = total
		total += alignUp(uintptr(r.p.Buffers[bi].Bytes(c.Size)), 16)
	}
	rb, err := r.e.d.readbackOnThread(total)
	if err != nil {
		return err
	}
	drv := r.e.d.drv
	for k, bi := range rd.plan.bufs {
		if n := uintptr(r.p.Buffers[bi].Bytes(c.Size)); n > 0 {
			if err := drv.check("cuMemcpyDtoHAsync_v2", drv.cuMemcpyDtoHAsync(unsafe.Add(rb.buf, rd.off[k]), CUdeviceptr(rd.blocks[k].Ptr()), n, 0)); err != nil {
				return err
			}
		}
	}
	if err := drv.check("cuEventRecord", drv.cuEventRecord(rb.ev, 0)); err != nil {
		return err
	}
	rd.queued, rb.busy = true, true
	r.e.earlyReads.Add(1)
	return nil
}

// read is ChunkDone's reader: host output id's value at chunk size b from
// the chunk's early copy when it has one, else downloaded from blk now.
func (r *runner) read(id int, blk *alloc.Block, b int) (*exec.HostBuf, error) {
	rd := &r.reads
	bi := r.p.OutputBuf[id]
	if !rd.queued || bi < 0 || rd.plan.slot[bi] < 0 {
		return r.download(id, blk, b)
	}
	rb := r.e.d.readback
	if rb.busy {
		r.e.d.waits.Add(1)
		if err := r.e.d.drv.check("cuEventSynchronize", r.e.d.drv.cuEventSynchronize(rb.ev)); err != nil {
			return nil, err
		}
		rb.busy = false
	}
	nd := r.node(id)
	if err := deviceDType(nd); err != nil {
		return nil, err
	}
	shape := nd.Type.AtBatch(b)
	if int64(graph.Numel(shape))*int64(nd.Type.DType.Size()) > r.p.Buffers[bi].Bytes(b) {
		return r.download(id, blk, b) // not all of it was copied
	}
	v := exec.NewHostBuf(nd.Type.DType, shape)
	src := unsafe.Add(rb.buf, rd.off[rd.plan.slot[bi]])
	switch dt := nd.Type.DType; {
	case v.F == nil:
		copy(v.I, unsafe.Slice((*int64)(src), len(v.I)))
	case dt.IsHalf():
		decodeHalf(dt, v.F, unsafe.Slice((*uint16)(src), len(v.F)))
	default:
		copy(v.F, unsafe.Slice((*float32)(src), len(v.F)))
	}
	return v, nil
}

// chunkRead ends a chunk's early reads (after ChunkDone read them).
func (r *runner) chunkRead() {
	r.reads.runs, r.reads.queued = 0, false
}

func alignUp(n, a uintptr) uintptr { return (n + a - 1) &^ (a - 1) }

// readbackBuf is a device's pinned buffer for early reads and the event
// after the copies into it. Only the device thread uses it.
type readbackBuf struct {
	buf  unsafe.Pointer
	size uintptr
	ev   CUevent
	busy bool // copies were queued since ev was last waited on
}

// readbackOnThread returns the device's readback buffer with at least n
// bytes, made or grown on first need, once its queued copies are done.
func (d *Device) readbackOnThread(n uintptr) (*readbackBuf, error) {
	rb := d.readback
	drv := d.drv
	if rb == nil {
		rb = &readbackBuf{}
		if err := drv.check("cuEventCreate", drv.cuEventCreate(&rb.ev, cuEventDisableTiming)); err != nil {
			return nil, err
		}
		d.readback = rb
	}
	if rb.busy {
		d.waits.Add(1)
		if err := drv.check("cuEventSynchronize", drv.cuEventSynchronize(rb.ev)); err != nil {
			return nil, err
		}
		rb.busy = false
	}
	if n <= rb.size {
		return rb, nil
	}
	size := max(uintptr(64<<10), rb.size)
	for size < n {
		size *= 2
	}
	if rb.buf != nil {
		if err := drv.check("cuMemFreeHost", drv.cuMemFreeHost(rb.buf)); err != nil {
			return nil, err
		}
		rb.buf, rb.size = nil, 0
	}
	if err := drv.check("cuMemHostAlloc", drv.cuMemHostAlloc(&rb.buf, size, 0)); err != nil {
		return nil, err
	}
	rb.size = size
	return rb, nil
}

// freeReadback waits for rb's copies and frees its buffer and event, on
// the device thread.
func (d *Device) freeReadback(rb *readbackBuf) error {
	if rb == nil {
		return nil
	}
	drv := d.drv
	var errs []error
	if rb.busy {
		errs = append(errs, drv.check("cuEventSynchronize", drv.cuEventSynchronize(rb.ev)))
	}
	errs = append(errs, drv.check("cuEventDestroy", drv.cuEventDestroy(rb.ev)))
	if rb.buf != nil {
		errs = append(errs, drv.check("cuMemFreeHost", drv.cuMemFreeHost(rb.buf)))
	}
	return errors.Join(errs...)
}

// Gradient norms of clipping read back lazily (optimizer.go).

// normWords is how many optimizers' norms a device's pinned page holds.
const normWords = 512

// normReads is a device's pinned words where clipping optimizers' norms
// land, one word and one event per optimizer. Only the device thread uses
// it.
type normReads struct {
	buf   unsafe.Pointer // normWords float64 words
	slots map[any]*normSlot
	next  int // the next word to hand out; past normWords they are shared
}

// normSlot is one optimizer's word: its index, the event after the latest
// copy into it and how many copies were queued.
type normSlot struct {
	i   int
	ev  CUevent
	gen uint64
}

// queueNorm copies the float64 at src (the norm the update's kernels
// computed) into owner's pinned word behind the work queued so far, and
// returns the function that waits for that copy and reads it. On the
// device thread.
func (d *Device) queueNorm(owner any, src alloc.Ptr) (func() (float64, error), error) {
	drv := d.drv
	nr := d.norms
	if nr == nil {
		nr = &normReads{slots: map[any]*normSlot{}}
		if err := drv.check("cuMemHostAlloc", drv.cuMemHostAlloc(&nr.buf, 8*normWords, 0)); err != nil {
			return nil, err
		}
		d.norms = nr
	}
	s := nr.slots[owner]
	if s == nil {
		s = &normSlot{i: nr.next % normWords}
		if err := drv.check("cuEventCreate", drv.cuEventCreate(&s.ev, cuEventDisableTiming)); err != nil {
			return nil, err
		}
		nr.next++
		nr.slots[owner] = s
	}
	word := unsafe.Add(nr.buf, 8*s.i)
	if err := drv.check("cuMemcpyDtoHAsync_v2", drv.cuMemcpyDtoHAsync(word, CUdeviceptr(src), 8, 0)); err != nil {
		return nil, err
	}
	if err := drv.check("cuEventRecord", drv.cuEventRecord(s.ev, 0)); err != nil {
		return nil, err
	}
	s.gen++
	gen := s.gen
	return func() (float64, error) {
		var v float64
		err := d.do(func() error {
			if d.norms != nr {
				return fmt.Errorf("%w: the device's gradient norms were released", ErrClosed)
			}
			if s.gen != gen {
				return errors.New("cuda: a later step of another optimizer sharing its pinned word overwrote the gradient norm")
			}
			d.waits.Add(1)
			if err := drv.check("cuEventSynchronize", drv.cuEventSynchronize(s.ev)); err != nil {
				return err
			}
			v = *(*float64)(word)
			return nil
		})
		return v, err
	}, nil
}

// freeNorms waits for nr's copies and frees its page and events, on the
// device thread.
func (d *Device) freeNorms(nr *normReads) error {
	if nr == nil {
		return nil
	}
	drv := d.drv
	var errs []error
	for _, s := range nr.slots {
		errs = append(errs, drv.check("cuEventSynchronize", drv.cuEventSynchronize(s.ev)),
			drv.check("cuEventDestroy", drv.cuEventDestroy(s.ev)))
	}
	errs = append(errs, drv.check("cuMemFreeHost", drv.cuMemFreeHost(nr.buf)))
	d.norms = nil
	return errors.Join(errs...)
}
