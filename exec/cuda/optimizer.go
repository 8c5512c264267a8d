package cuda

import (
	"slices"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// The optimizer on the device.
//
// optim.SGD and optim.Adam run on the device (sgd_multi_f32,
// adam_multi_f32: kernels/optim.cu), from the plan the optimizer makes
// for the step (optim's PlanDevice): each parameter's group and own step
// count, the scheduled learning rates, Adam's per-parameter bias
// corrections, SGD's fresh momentum buffers, and clipping. Every number of
// the plan that changes from step to step is written to device scalars in
// the program's finish workspace (planner.OptimizerScalarBytes) by one
// optim_scalars_f64 launch per 480 words, queued like any launch (the host
// does not wait), and the update kernels read them there: their arguments
// are addresses and counts only. So the update (with clipping: the
// grad_norm_partial_f32 launches, grad_norm_finish, then the updates) is
// one segment of fixed fingerprint, which CUDA graphs capture once and
// replay every later step (graphs.go), whatever the schedule does.
//
// Clipping computes the norm on the device, into the scalars, and the
// update kernels scale each gradient by the factor grad_norm_finish wrote:
// no host synchronisation. The norm is copied into a pinned word of the
// optimizer's own behind the update (cuMemcpyDtoHAsync and an event), and
// the optimizer's LastGradNorm waits for that event only when called.
//
// State: the program's BufState buffers hold the state of the optimizer
// that last stepped them (residentBuf.owner). A step by another optimizer
// first downloads the previous owner's state into that optimizer's host
// copy (optim's SetDeviceCopy), then uploads its own (or zeroes the
// buffers for state it has not made yet): so Adam, then SGD, then the same
// Adam again continues Adam's moments, as PyTorch's optimizers, each with
// its own state, do. A state restored on the host (optim's SetState) is
// uploaded the same way. SyncState downloads the owners' state for a
// checkpoint; Close tells each owner that its device copy is gone.

// devOptimizer is an optimizer whose update the kernels implement.
type devOptimizer interface {
	optim.Optimizer
	PlanDevice([]optim.DeviceParam) (*optim.DevicePlan, error)
	CommitDevice(*optim.DevicePlan) error
	SetDeviceCopy(key any, slots [][]float32, kept bool) error
	SetGradNormReader(func() (float64, error))
	DeviceLost(key any)
}

// deviceOpt is opt as an optimizer the kernels run, ok false for others.
func deviceOpt(opt optim.Optimizer) (o devOptimizer, adam, ok bool) {
	switch v := opt.(type) {
	case *optim.SGD:
		return v, false, true
	case *optim.Adam:
		return v, true, true
	}
	return nil, false, false
}

// deviceOptimizer reports whether the kernels implement opt's update.
func deviceOptimizer(opt optim.Optimizer) bool {
	_, _, ok := deviceOpt(opt)
	return ok
}

// Kernel names of optim.cu beside the updates (kSGD, kAdam).
const (
	kOptimScalars = "optim_scalars_f64"
	kNormPartial  = "grad_norm_partial_f32"
	kNormFinish   = "grad_norm_finish"
)

// optimScalarWords is how many float64 words one optim_scalars_f64 launch
// writes (OPTIM_SCALARS in kernels/optim.cu).
const optimScalarWords = 480

// scalarList is kernels/optim.cu's ScalarList, passed by value.
type scalarList struct{ v [optimScalarWords]float64 }

// Word offsets in the device scalars (kernels/optim.cu's header).
const (
	scMaxNorm   = 0
	scNorm      = 1
	scHeader    = 4
	groupWords  = 8
	paramWords  = 2
	normThreads = 256
)

// deviceStep runs an optimizer the kernels implement (deviceOptimizer) on
// the device: p.Trained[i] is updated from kept[i] with its state in the
// program's state buffers and the step's scalars in ws. Resident
// parameters are marked newer than their host tensors, for
// Executor.SyncParams.
func (r *runner) deviceStep(kept []*alloc.Block, ws *alloc.Block) error {
	opt, adam, _ := deviceOpt(r.o.Optimizer)
	dps := make([]optim.DeviceParam, len(r.p.Trained))
	for i, id := range r.p.Trained {
		nd := r.node(id)
		dps[i] = optim.DeviceParam{Key: r.source(id), Name: nd.Name, N: nd.Type.Numel()}
	}
	pl, err := opt.PlanDevice(dps)
	if err != nil {
		return err
	}
	if len(pl.Groups) > planner.OptimizerGroups {
		return graph.Errorf(graph.ErrAttr, "cuda: the step's parameters are in %d groups; one device update takes at most %d",
			len(pl.Groups), planner.OptimizerGroups)
	}
	sc, err := r.optimScalars(ws)
	if err != nil {
		return err
	}
	ts, err := r.trainedBlocks(kept, pl.Slots)
	if err != nil {
		return err
	}
	if err := r.takeState(opt, pl, ts); err != nil {
		return err
	}
	k := r.kernels()
	if err := writeScalars(k, sc, scalarWords(adam, pl)); err != nil {
		return err
	}
	lists := optimLists(ts, pl)
	if err := r.optimUpdate(adam, opt, pl, lists, sc); err != nil {
		return err
	}
	if pl.Clip.On() {
		read, err := r.e.d.queueNorm(opt, sc+alloc.Ptr(8*scNorm))
		if err != nil {
			return err
		}
		opt.SetGradNormReader(read)
	}
	if err := opt.CommitDevice(pl); err != nil {
		return err
	}
	if !r.o.Resident { // the state blocks go with the call: the optimizer keeps their values
		if err := r.stateToHost(opt, pl, ts); err != nil {
			return err
		}
	}
	return r.markUpdated()
}

// markUpdated records that the resident trained parameters' device copies
// are newer than their host tensors.
func (r *runner) markUpdated() error {
	for _, id := range r.p.Trained {
		rb := r.residentParam(id)
		if rb == nil {
			continue
		}
		f, err := r.paramData(id)
		if err != nil {
			return err
		}
		rb.newer = f
	}
	return nil
}

// optimScalars is the address of the program's optimizer scalars in its
// finish workspace ws.
func (r *runner) optimScalars(ws *alloc.Block) (alloc.Ptr, error) {
	need := r.p.OptimizerScalars + planner.OptimizerScalarBytes(len(r.p.Trained))
	if !r.p.HasOptimizerScalars() || ws == nil || ws.Requested() < need {
		var got int64
		if ws != nil {
			got = ws.Requested()
		}
		return 0, graph.Errorf(graph.ErrAttr, "cuda: the device optimizer reads its scalars from the program's finish workspace (%d bytes; it has %d): compile the program with planner.CompileOptions.OptimizerScalars",
			need, got)
	}
	return ws.Ptr() + alloc.Ptr(r.p.OptimizerScalars), nil
}

// paramsAt is the word offset of the per-parameter scalars for n trained
// parameters (after the header and the group table).
func paramsAt(n int) int { return scHeader + groupWords*min(n, planner.OptimizerGroups) }

// partialsAt is the word offset of the norm kernels' partial results.
func partialsAt(n int) int { return paramsAt(n) + paramWords*n }

// scalarWords lays out pl's device scalars, up to the partial results
// (kernels/optim.cu): the header, each group's hyperparameters, each
// parameter's bias corrections (Adam) or fresh flag (SGD).
func scalarWords(adam bool, pl *optim.DevicePlan) []float64 {
	n := len(pl.Params)
	w := make([]float64, partialsAt(n))
	if pl.Clip.On() {
		w[scMaxNorm] = pl.Clip.MaxNorm
	}
	for k, h := range pl.Groups {
		g := w[scHeader+groupWords*k:]
		if adam {
			g[0], g[1], g[2], g[3], g[4], g[5] = h.LR, h.Beta1, h.Beta2, h.Eps, h.WeightDecay, h.Decay
		} else {
			g[0], g[1], g[2], g[3], g[4] = h.LR, h.Momentum, h.Dampening, h.WeightDecay, float64(boolInt(h.Nesterov))
		}
	}
	at := paramsAt(n)
	for i, u := range pl.Params {
		if adam {
			w[at+paramWords*i], w[at+paramWords*i+1] = u.C1, u.C2
		} else if u.Fresh {
			w[at+paramWords*i] = 1
		}
	}
	return w
}

// writeScalars queues the writes of words to the device at sc.
func writeScalars(k *kctx, sc alloc.Ptr, words []float64) error {
	for off := 0; off < len(words); off += optimScalarWords {
		var l scalarList
		n := copy(l.v[:], words[off:])
		if err := k.flat(kOptimScalars, int64(n), l, int64(n), sc+alloc.Ptr(8*off)); err != nil {
			return err
		}
	}
	return nil
}

// optimUpdate launches the update of lists (and, when clipping, the norm
// before it): replayed as a CUDA graph once its fingerprint (the kernels,
// their lists and the scalars' address, all fixed from step to step) has
// been seen twice, eagerly otherwise.
func (r *runner) optimUpdate(adam bool, opt devOptimizer, pl *optim.DevicePlan, lists []optimList, sc alloc.Ptr) error {
	n := len(pl.Params)
	clip, inf := pl.Clip.On(), pl.Clip.Inf()
	decoupled := false
	if a, ok := opt.(*optim.Adam); ok {
		decoupled = a.Decoupled
	}
	k := r.kernels()
	launch := func() error {
		if clip {
			part := sc + alloc.Ptr(8*partialsAt(n))
			for li := range lists {
				l := &lists[li]
				if err := k.launch(kNormPartial, [3]uint32{planner.OptimizerNormBlocks, 1, 1}, [3]uint32{normThreads, 1, 1},
					*l, int64(l.count), part+alloc.Ptr(8*planner.OptimizerNormBlocks*li), boolInt(inf)); err != nil {
					return err
				}
			}
			if err := k.launch(kNormFinish, [3]uint32{1, 1, 1}, [3]uint32{normThreads, 1, 1},
				sc, part, int64(planner.OptimizerNormBlocks*len(lists)), boolInt(inf)); err != nil {
				return err
			}
		}
		for li := range lists {
			l := &lists[li]
			var err error
			if adam {
				err = k.flat(kAdam, ceilDiv(l.off[l.count], adamPack), *l,
					int64(l.count), sc, int64(paramsAt(n)), boolInt(decoupled), boolInt(clip))
			} else {
				err = k.flat(kSGD, l.off[l.count], *l, int64(l.count), sc, int64(paramsAt(n)), boolInt(clip))
			}
			if err != nil {
				return err
			}
		}
		return nil
	}
	if r.g == nil || len(lists) == 0 {
		return launch()
	}
	fp := []uint64{optimSegment, uint64(boolInt(adam)), uint64(boolInt(decoupled)), uint64(boolInt(clip)), uint64(boolInt(inf)),
		uint64(sc), uint64(n), uint64(len(lists))}
	for li := range lists {
		fp = lists[li].appendWords(fp)
	}
	launches := len(lists)
	if clip {
		launches += len(lists) + 1
	}
	return r.segment(fp, launches, launch)
}

// adamPack is how many elements one thread of adam_multi_f32 updates
// (ADAM_PACK in kernels/optim.cu).
const adamPack = 4

// optimSegment marks an optimizer update's fingerprint: no node's
// fingerprint (which starts with the node's id) begins with it.
const optimSegment = 1<<63 | 0x6f7074696d // "optim"

// optimTensors is how many parameters one sgd_multi_f32 or adam_multi_f32
// launch takes (OPTIM_TENSORS in kernels/optim.cu).
const optimTensors = planner.OptimizerTensors

// optimList is kernels/optim.cu's OptimList, passed by value: parameter t
// is p[t] with gradient g[t] and state slots s0[t], s1[t] (0 where it has
// fewer), elements off[t] to off[t+1]−1 of the launch's flat range, in
// group grp[t], the step's parameter idx[t]. count is how many it lists;
// it is not part of the kernel's struct.
type optimList struct {
	p, g, s0, s1 [optimTensors]alloc.Ptr
	off          [optimTensors + 1]int64
	grp, idx     [optimTensors]int32
	count        int
}

// optimListBytes is the size of kernels/optim.cu's OptimList: the Go
// struct up to count, which the kernels do not read.
const optimListBytes = unsafe.Offsetof(optimList{}.count)

// appendWords appends the list's contents to a fingerprint.
func (l *optimList) appendWords(fp []uint64) []uint64 {
	c := l.count
	fp = append(fp, uint64(c))
	for t := range c {
		fp = append(fp, uint64(l.p[t]), uint64(l.g[t]), uint64(l.s0[t]), uint64(l.s1[t]),
			uint64(l.off[t+1]), uint64(l.grp[t])<<32|uint64(uint32(l.idx[t])))
	}
	return fp
}

// optimLists lists ps in order, optimTensors at a time, each with its
// group and index from pl. Parameters without elements are left out. A
// parameter block already in the list (a parameter trained twice) starts a
// new one, so its updates run one after the other as they would one
// launch each; a gradient shared by two parameters is only read, and may
// appear in one list twice.
func optimLists(ps []trained, pl *optim.DevicePlan) []optimList {
	var out []optimList
	var l optimList
	flush := func() {
		if l.count > 0 {
			out = append(out, l)
		}
		l = optimList{}
	}
	for i, t := range ps {
		if t.n == 0 {
			continue
		}
		if l.count == optimTensors || slices.Contains(l.p[:l.count], t.param) {
			flush()
		}
		c := l.count
		l.p[c], l.g[c] = t.param, t.grad
		if len(t.state) > 0 {
			l.s0[c] = t.state[0]
		}
		if len(t.state) > 1 {
			l.s1[c] = t.state[1]
		}
		l.off[c+1] = l.off[c] + t.n
		l.grp[c], l.idx[c] = int32(pl.Params[i].Group), int32(i)
		l.count++
	}
	flush()
	return out
}

// trained is one parameter's update: its block, gradient and state slots.
type trained struct {
	param, grad alloc.Ptr
	state       []alloc.Ptr
	n           int64
}

// trainedBlocks pairs each trained parameter with its gradient and its
// first slots state buffers.
func (r *runner) trainedBlocks(kept []*alloc.Block, slots int) ([]trained, error) {
	ts := make([]trained, len(r.p.Trained))
	for i, id := range r.p.Trained {
		nd := r.node(id)
		if nd.Type.DType != graph.Float32 {
			return nil, graph.Errorf(graph.ErrDType, "trained parameter %q (node %d) is %s, want float32", nd.Name, id, nd.Type.DType)
		}
		pb, err := r.paramBlock(id)
		if err != nil {
			return nil, err
		}
		g := r.node(r.p.Kept[i])
		if g.Type.Numel() != nd.Type.Numel() {
			return nil, graph.Errorf(graph.ErrShape, "trained parameter %q %v and its gradient (node %d) %v differ in size",
				nd.Name, nd.Type.Shape, g.ID, g.Type.Shape)
		}
		ts[i] = trained{param: pb.Ptr(), grad: kept[i].Ptr(), n: int64(nd.Type.Numel())}
		for s := range slots {
			sb := r.persist[persistKey{kind: planner.BufState, node: id, slot: s}]
			if sb == nil {
				return nil, graph.Errorf(graph.ErrArity, "%s needs %d state buffers per parameter; the program has fewer (compile with StateSlots = %d)",
					r.o.Optimizer.Name(), slots, slots)
			}
			ts[i].state = append(ts[i].state, sb.Ptr())
		}
	}
	return ts, nil
}

// stateResident is the resident record of trained parameter id's state
// slot, nil when the call keeps nothing resident.
func (r *runner) stateResident(id, slot int) *exec.Resident[*residentBuf] {
	k, ok := r.c.Key(planner.Buffer{Kind: planner.BufState, Node: id, Slot: slot})
	if !ok {
		return nil
	}
	return r.e.resident.Find(k)
}

// takeState makes the state buffers of ts opt's for the step planned in
// pl: another optimizer's state in them goes back to that optimizer
// first; then opt's own state that only its host holds is uploaded, and a
// fresh state zeroed. A state the optimizer believes on the device that
// the buffers do not hold is an error.
//
// A steady loop's step (nothing to upload or zero, no buffer made by this
// call, and every owned buffer opt's) skips the walk: looking up every
// parameter's slots costs tens of µs a step on a large model.
func (r *runner) takeState(opt devOptimizer, pl *optim.DevicePlan, ts []trained) error {
	if pl.Slots == 0 {
		return nil
	}
	moves := slices.ContainsFunc(pl.Params, func(u optim.ParamUpdate) bool { return u.Fresh || u.Upload != nil })
	if !moves && !r.filledState && r.e.soleOwner == opt && opt != nil {
		return nil
	}
	rbs := make([]*exec.Resident[*residentBuf], pl.Slots)
	for i, id := range r.p.Trained {
		u := &pl.Params[i]
		for s := range rbs {
			rbs[s] = r.stateResident(id, s)
		}
		for _, rb := range rbs {
			if rb != nil && rb.Val.owner != nil && rb.Val.owner != opt {
				if err := r.e.giveBack(rb.Val.owner, rb.Key().Data()); err != nil {
					return err
				}
			}
		}
		switch {
		case u.Fresh:
			for _, s := range ts[i].state {
				if err := r.e.d.Memzero(s, 4*ts[i].n); err != nil {
					return err
				}
			}
		case u.Upload != nil:
			for s, p := range ts[i].state {
				var err error
				if s < len(u.Upload) {
					err = copyHtoD(r.e.d, p, u.Upload[s], false)
				} else {
					err = r.e.d.Memzero(p, 4*ts[i].n)
				}
				if err != nil {
					return err
				}
			}
		default:
			for _, rb := range rbs {
				if rb == nil || rb.Val.owner != opt {
					return graph.Errorf(graph.ErrAttr, "cuda: %s believes the state of parameter %q is on the device, and this device does not hold it (another session's?)",
						opt.Name(), u.Name)
				}
			}
		}
		for _, rb := range rbs {
			if rb != nil {
				rb.Val.owner = opt
			}
		}
	}
	r.e.soleOwner = opt
	for _, rb := range r.e.resident.List() {
		if o := rb.Val.owner; o != nil && o != opt {
			r.e.soleOwner = nil
			break
		}
	}
	return nil
}

// stateToHost downloads ts's state into opt, whose device copy a call
// without residents frees.
func (r *runner) stateToHost(opt devOptimizer, pl *optim.DevicePlan, ts []trained) error {
	for i, t := range ts {
		if len(t.state) == 0 {
			continue
		}
		slots := make([][]float32, len(t.state))
		for s, p := range t.state {
			slots[s] = make([]float32, t.n)
			if err := CopyDtoH(r.e.d, slots[s], p); err != nil {
				return err
			}
		}
		if err := opt.SetDeviceCopy(pl.Params[i].Key, slots, false); err != nil {
			return err
		}
	}
	return nil
}

// giveBack downloads every state slot of the parameter whose host tensor
// is key that owner holds on the device into owner's host copy, and
// releases the buffers (another optimizer takes them). On the device
// thread, with e.mu held.
func (e *Executor) giveBack(owner devOptimizer, key any) error {
	var slots [][]float32
	var rbs []*exec.Resident[*residentBuf]
	for _, rb := range e.resident.List() {
		k := rb.Key()
		if k.Kind() != planner.BufState || k.Data() != key || rb.Val.owner != owner {
			continue
		}
		v, err := e.stateValue(rb)
		if err != nil {
			return err
		}
		for len(slots) <= k.Slot() {
			slots = append(slots, nil)
		}
		slots[k.Slot()] = v
		rbs = append(rbs, rb)
	}
	for _, rb := range rbs {
		rb.Val.owner = nil
	}
	if len(slots) == 0 || slices.ContainsFunc(slots, isNil) {
		owner.DeviceLost(key)
		return nil
	}
	return owner.SetDeviceCopy(key, slots, false)
}

// stateValue is a resident state buffer's float32 values: downloaded, or
// its host copy while yielded.
func (e *Executor) stateValue(rb *exec.Resident[*residentBuf]) ([]float32, error) {
	n := rb.Size / 4
	if rb.Blk == nil {
		return slices.Clone(rb.Val.host[:n]), nil
	}
	v := make([]float32, n)
	return v, CopyDtoH(e.d, v, rb.Blk.Ptr())
}

// SyncState downloads the optimizer state the device holds into each
// owning optimizer's host copy (optim's SetDeviceCopy), which State then
// returns, for a checkpoint; the device keeps its copy. While yielded it
// copies the executor's host copies.
func (e *Executor) SyncState() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	return e.d.do(func() error {
		type owned struct {
			opt devOptimizer
			key any
		}
		var order []owned
		slots := map[owned][][]float32{}
		for _, rb := range e.resident.List() {
			k := rb.Key()
			if k.Kind() != planner.BufState || rb.Val.owner == nil {
				continue
			}
			v, err := e.stateValue(rb)
			if err != nil {
				return err
			}
			o := owned{rb.Val.owner, k.Data()}
			if _, seen := slots[o]; !seen {
				order = append(order, o)
			}
			s := slots[o]
			for len(s) <= k.Slot() {
				s = append(s, nil)
			}
			s[k.Slot()] = v
			slots[o] = s
		}
		for _, o := range order {
			s := slots[o]
			if slices.ContainsFunc(s, isNil) {
				continue // a slot not on the device: the optimizer's own copy stands
			}
			if err := o.opt.SetDeviceCopy(o.key, s, true); err != nil {
				return err
			}
		}
		return nil
	})
}

func isNil(s []float32) bool { return s == nil }

// dropState tells every optimizer whose state the device holds that the
// copy is gone (Close). With e.mu held.
func (e *Executor) dropState() {
	for _, rb := range e.resident.List() {
		if rb.Key().Kind() == planner.BufState && rb.Val.owner != nil {
			rb.Val.owner.DeviceLost(rb.Key().Data())
			rb.Val.owner = nil
		}
	}
	e.soleOwner = nil
}

// hostStep runs any other optimizer on the host: the parameters' host
// tensors are brought up to date, updated by Step and uploaded again.
func (r *runner) hostStep(grads [][]float32) error {
	if err := r.paramsToHost(); err != nil {
		return err
	}
	ps, err := exec.HostParams(r.p, r.source, grads)
	if err != nil {
		return err
	}
	if err := r.o.Optimizer.Step(ps); err != nil {
		return err
	}
	return r.paramsToDevice()
}

// kUnscale is dynamic loss scaling's unscale and inf/NaN check
// (kernels/optim.cu).
const kUnscale = "grad_unscale_f32"

// unscaleTensors is how many tensors one grad_unscale_f32 launch takes
// (UNSCALE_TENSORS in kernels/optim.cu).
const unscaleTensors = 64

// unscaleList is kernels/optim.cu's UnscaleList, passed by value: tensor t
// is p[t] with elements off[t] to off[t+1]−1 of the launch's flat range.
type unscaleList struct {
	p   [unscaleTensors]alloc.Ptr
	off [unscaleTensors + 1]int64
}

// unscale multiplies every kept gradient on the device by 1/S
// (ExecOptions.LossScale) and checks them for inf and NaN: one
// grad_unscale_f32 launch per unscaleTensors gradients, all setting the
// flag in ws (the program's finish workspace, zeroed first), then one read
// of the flag. A block listed twice (two parameters sharing a gradient
// node) is unscaled once.
func (r *runner) unscale(kept []*alloc.Block, ws *alloc.Block) (finite bool, err error) {
	if ws == nil || r.p.CallerFinish() < exec.UnscaleBytes {
		return false, graph.Errorf(graph.ErrAttr, "cuda: unscaling needs the program's finish workspace for its flag (planner.CompileOptions.FinishWorkspace = exec.UnscaleBytes)")
	}
	if err := r.e.d.Memzero(ws.Ptr(), exec.UnscaleBytes); err != nil {
		return false, err
	}
	inv := exec.InvScale(r.o.LossScale)
	k := r.kernels()
	var l unscaleList
	count := 0
	launch := func() error {
		if count == 0 {
			return nil
		}
		err := k.flat(kUnscale, l.off[count], l, int64(count), inv, ws.Ptr())
		l, count = unscaleList{}, 0
		return err
	}
	for j, blk := range kept {
		n := int64(r.node(r.p.Kept[j]).Type.Numel())
		if n == 0 || slices.Contains(kept[:j], blk) {
			continue
		}
		l.p[count], l.off[count+1] = blk.Ptr(), l.off[count]+n
		count++
		if count == unscaleTensors {
			if err := launch(); err != nil {
				return false, err
			}
		}
	}
	if err := launch(); err != nil {
		return false, err
	}
	var flag [1]float32
	if err := CopyDtoH(r.e.d, flag[:], ws.Ptr()); err != nil { // waits for the launches
		return false, err
	}
	return flag[0] == 0, nil
}
