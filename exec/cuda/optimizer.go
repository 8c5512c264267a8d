package cuda

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// deviceOptimizer reports whether the kernels implement opt's update.
func deviceOptimizer(opt optim.Optimizer) bool {
	switch opt.(type) {
	case *optim.SGD, *optim.Adam:
		return true
	}
	return false
}

// deviceStep runs an optimizer the kernels implement (deviceOptimizer) on
// the device: p.Trained[i] is updated from kept[i] with its state in the
// program's state buffers. Resident parameters are marked newer than their
// host tensors, for Executor.SyncParams.
func (r *runner) deviceStep(kept []*alloc.Block) error {
	if err := r.deviceUpdate(kept); err != nil {
		return err
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

// deviceUpdate runs the step's SGD or Adam update on the device: the
// trained parameters are listed optimTensors at a time, one sgd_multi_f32 or
// adam_multi_f32 launch per list (optimLists).
func (r *runner) deviceUpdate(kept []*alloc.Block) error {
	switch opt := r.o.Optimizer.(type) {
	case *optim.SGD:
		slots := 0
		if opt.Momentum != 0 {
			slots = 1
		}
		ps, err := r.trainedBlocks(kept, slots)
		if err != nil {
			return err
		}
		first := opt.Steps() == 0
		if err := opt.Step(nil); err != nil { // checks the hyperparameters, counts the step
			return err
		}
		k := r.kernels()
		return optimLists(ps, func(l *optimList, count int) error {
			return k.flat(kSGD, l.off[count], *l, int64(count), opt.LR, opt.Momentum, opt.Dampening,
				opt.WeightDecay, boolInt(opt.Nesterov), boolInt(first))
		})
	case *optim.Adam:
		ps, err := r.trainedBlocks(kept, 2)
		if err != nil {
			return err
		}
		steps := opt.Steps()
		if err := opt.Step(nil); err != nil {
			return err
		}
		if steps == 0 { // a fresh optimizer: no moments yet, even on resident buffers
			for _, t := range ps {
				for _, s := range t.state {
					if err := r.e.d.Memzero(s, 4*t.n); err != nil {
						return err
					}
				}
			}
		}
		tt := float64(steps + 1)
		c1, c2 := 1-math.Pow(opt.Beta1, tt), 1-math.Pow(opt.Beta2, tt) // as optim.Adam.Step
		k := r.kernels()
		return optimLists(ps, func(l *optimList, count int) error {
			return k.flat(kAdam, l.off[count], *l, int64(count), opt.LR, opt.Beta1, opt.Beta2,
				opt.Eps, opt.WeightDecay, c1, c2, boolInt(opt.Decoupled))
		})
	}
	return graph.Errorf(graph.ErrAttr, "cuda: no device kernels for optimizer %T", r.o.Optimizer)
}

// optimTensors is how many parameters one sgd_multi_f32 or adam_multi_f32
// launch takes (OPTIM_TENSORS in kernels/optim.cu).
const optimTensors = 64

// optimList is kernels/optim.cu's OptimList, passed by value: parameter t
// is p[t] with gradient g[t] and state slots s0[t], s1[t] (0 where it has
// fewer), elements off[t] to off[t+1]−1 of the launch's flat range.
type optimList struct {
	p, g, s0, s1 [optimTensors]alloc.Ptr
	off          [optimTensors + 1]int64
}

// optimLists lists ps in order, optimTensors at a time, and calls launch
// on each list with its count. Parameters without elements are left out. A
// parameter block already in the list (a parameter trained twice) starts a
// new one, so its updates run one after the other as they would one launch
// each; a gradient shared by two parameters is only read, and may appear
// in one list twice.
func optimLists(ps []trained, launch func(l *optimList, count int) error) error {
	var l optimList
	count := 0
	flush := func() error {
		if count == 0 {
			return nil
		}
		err := launch(&l, count)
		l, count = optimList{}, 0
		return err
	}
	for _, t := range ps {
		if t.n == 0 {
			continue
		}
		if count == optimTensors || slices.Contains(l.p[:count], t.param) {
			if err := flush(); err != nil {
				return err
			}
		}
		l.p[count], l.g[count] = t.param, t.grad
		if len(t.state) > 0 {
			l.s0[count] = t.state[0]
		}
		if len(t.state) > 1 {
			l.s1[count] = t.state[1]
		}
		l.off[count+1] = l.off[count] + t.n
		count++
	}
	return flush()
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
	if ws == nil || ws.Requested() < exec.UnscaleBytes {
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
