package optim

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/batchfit/batchfit/half"
)

// OffloadParam is one parameter of an offloaded step (ZeRO-Offload): the
// float32 master weights and the optimizer state live on the host, the
// device holds 16-bit weights and makes 16-bit gradients. Master is
// updated in place; Grad is the device's bfloat16 gradient as copied to
// the host; Weight receives the updated master rounded to bfloat16, for
// the device. Weight may be Grad itself (one staging buffer): each
// element's gradient is read before its weight is written, and the norm
// that clipping needs is taken over every gradient before any update.
type OffloadParam struct {
	Key    any
	Name   string
	Master []float32
	Grad   []half.BF16
	Weight []half.BF16
	// State, when set, is where the parameter's state tensors live from
	// this step on (an executor's pinned buffers, each of the master's
	// length, at least StateSlots of them): the step copies the state the
	// optimizer holds into them (zeros for a parameter's first step), and
	// the optimizer keeps them as the parameter's state (State returns
	// them, SetState replaces them). Nil: the optimizer allocates its own.
	State [][]float32
}

// OffloadShard is the elements one worker of an offloaded step takes at a
// time. The shards, and so the order of the float64 partial sums of the
// gradient norm, depend on the parameters' sizes only: the result is the
// same with any number of workers.
const OffloadShard = 1 << 16

// StepOffload is Step over OffloadParams, on workers goroutines (0:
// runtime.GOMAXPROCS): the same plan (groups, the schedule, per-parameter
// step counts and bias corrections, AdamW's decay factor), the same
// float64 arithmetic per element, the same state (State, SetState and
// checkpoints see it as Step's), reading each gradient widened exactly
// from bfloat16. Step over float32 gradients equal to those widened
// values gives the same masters and state to the bit, except that with
// clipping the 2-norm sums squares per OffloadShard and then adds the
// shards' sums in order, so the norm may differ from GradNorm's sequential
// sum by float64 rounding (the ∞-norm is exact); the clip factor, rounded
// to float32, is nearly always the same. A step that fails changes
// nothing.
func (o *Adam) StepOffload(params []OffloadParam, workers int) error {
	return o.StepOffloadEach(params, workers, nil)
}

// StepOffloadEach is StepOffload calling done(i), on the caller's
// goroutine, as soon as parameter i's update is complete (its Master,
// Weight and State final), while the workers go on with the others: an
// executor copies each parameter's new weights to its device there, the
// copy overlapping the rest of the update. done is called once for each
// parameter, in the order their updates complete. When done fails, it is
// not called again; the update still completes (the masters, the state
// and the step counts are the new step's) and the error returned is a
// *PartialStepError naming the parameters done was not called for, or
// failed for.
func (o *Adam) StepOffloadEach(params []OffloadParam, workers int, done func(i int) error) error {
	decoupled := o.Decoupled
	return o.offloadStep(o.rule(), params, workers, done, func(h Hyper, u *ParamUpdate, p OffloadParam, st [][]float32, lo, hi int, coef float32, clip bool) {
		m, v := st[0], st[1]
		for i := lo; i < hi; i++ {
			g32 := p.Grad[i].Float32()
			if clip {
				g32 *= coef
			}
			w, g := float64(p.Master[i]), float64(g32)
			if decoupled {
				w *= h.Decay
			} else {
				g += h.WeightDecay * w
			}
			mi := h.Beta1*float64(m[i]) + (1-h.Beta1)*g
			vi := h.Beta2*float64(v[i]) + (1-h.Beta2)*g*g
			m[i], v[i] = float32(mi), float32(vi)
			nw := float32(w - h.LR*(mi/u.C1)/(math.Sqrt(vi/u.C2)+h.Eps))
			p.Master[i] = nw
			p.Weight[i] = half.BF16From(nw)
		}
	})
}

// OffloadBytes is the host memory an offloaded step of a parameter of n
// elements holds with slots state tensors: the float32 master, the slots
// and one bfloat16 staging buffer (the gradient in, the new weights out).
func OffloadBytes(n int64, slots int) int64 { return n * (4 + 4*int64(slots) + 2) }

// shard is elements lo…hi of parameter p of an offloaded step.
type shard struct{ p, lo, hi int }

// offloadStep runs an offloaded step: plan, make the state, clip over
// every gradient, update in shards on workers goroutines, count. A step
// that fails changes nothing.
func (c *Common) offloadStep(r rule, params []OffloadParam, workers int, done func(i int) error,
	update func(h Hyper, u *ParamUpdate, p OffloadParam, st [][]float32, lo, hi int, coef float32, clip bool)) error {
	dps := make([]DeviceParam, len(params))
	for i, p := range params {
		if len(p.Master) != len(p.Grad) || len(p.Master) != len(p.Weight) {
			return fmt.Errorf("%w: offloaded parameter %q has %d master values, a gradient of %d and %d weights",
				ErrOptim, p.Name, len(p.Master), len(p.Grad), len(p.Weight))
		}
		for k, sl := range p.State {
			if len(sl) != len(p.Master) {
				return fmt.Errorf("%w: offloaded parameter %q has %d master values and a state buffer %d of %d",
					ErrOptim, p.Name, len(p.Master), k, len(sl))
			}
		}
		dps[i] = DeviceParam{Key: p.Key, Name: p.Name, N: len(p.Master)}
	}
	if workers < 0 {
		return fmt.Errorf("%w: %s: %d workers", ErrOptim, r.name, workers)
	}
	if workers == 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	var shards []shard
	for i, p := range params {
		for lo := 0; lo < len(p.Master); lo += OffloadShard {
			shards = append(shards, shard{p: i, lo: lo, hi: min(lo+OffloadShard, len(p.Master))})
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	pl, err := c.plan(r, dps, true)
	if err != nil {
		return err
	}
	var coef float32
	if pl.Clip.On() {
		inf := pl.Clip.Inf()
		part := make([]float64, len(shards))
		parallel(workers, len(shards), func(k int) {
			s := shards[k]
			var acc float64
			for _, b := range params[s.p].Grad[s.lo:s.hi] {
				x := float64(b.Float32())
				if inf {
					if a := math.Abs(x); a > acc || math.IsNaN(a) {
						acc = a
					}
				} else {
					acc += x * x
				}
			}
			part[k] = acc
		})
		var norm float64
		for _, x := range part {
			switch {
			case !inf:
				norm += x
			case math.IsNaN(x) || math.IsNaN(norm):
				norm = math.NaN()
			case x > norm:
				norm = x
			}
		}
		if !inf {
			norm = math.Sqrt(norm)
		}
		coef = ClipCoef(norm, pl.Clip.MaxNorm)
		c.setNorm(gradNorm{set: true, v: norm})
	}
	for i, p := range params {
		if need := r.slots(pl.Groups[pl.Params[i].Group]); p.State != nil && len(p.State) < need {
			return fmt.Errorf("%w: %s: offloaded parameter %q brings %d state buffers for %d slots", ErrOptim, r.name, p.Name, len(p.State), need)
		}
	}
	states := make([][][]float32, len(params))
	for i, p := range params {
		u := &pl.Params[i]
		st := c.record(p.Key, len(p.Master))
		need := r.slots(pl.Groups[u.Group])
		if p.State != nil {
			adopt(st, p.State[:min(len(p.State), max(need, len(st.slots)))], len(p.Master))
		}
		for len(st.slots) < need {
			st.slots = append(st.slots, make([]float32, len(p.Master)))
		}
		st.made = max(st.made, len(st.slots))
		st.step, st.host, st.dev = u.Step, true, false
		states[i] = st.slots
	}
	on := pl.Clip.On()
	left := make([]atomic.Int64, len(params)) // shards not yet updated, by parameter
	for _, s := range shards {
		left[s.p].Add(1)
	}
	finished := make(chan int, len(params))
	for i := range params {
		if left[i].Load() == 0 { // no elements: nothing to update
			finished <- i
		}
	}
	wait := start(workers, len(shards), func(k int) {
		s := shards[k]
		u := &pl.Params[s.p]
		update(pl.Groups[u.Group], u, params[s.p], states[s.p], s.lo, s.hi, coef, on)
		if left[s.p].Add(-1) == 0 {
			finished <- s.p
		}
	})
	var (
		derr error
		ok   = make([]bool, len(params))
	)
	for range params {
		i := <-finished
		if done != nil && derr == nil {
			if derr = done(i); derr == nil {
				ok[i] = true
			}
		}
	}
	wait()
	c.steps++
	if derr != nil {
		pe := &PartialStepError{Total: len(params), Err: derr}
		for i, p := range params {
			if ok[i] {
				pe.Copied++
			} else {
				pe.Stale = append(pe.Stale, p.Name)
			}
		}
		return pe
	}
	return nil
}

// adopt makes bufs st's slots: the current values copied in where st's
// slots are elsewhere, zeros for slots not made yet.
func adopt(st *paramState, bufs [][]float32, n int) {
	if n == 0 {
		st.slots = bufs
		return
	}
	for k, b := range bufs {
		switch {
		case k < len(st.slots) && k < st.made && &st.slots[k][0] == &b[0]:
		case k < len(st.slots) && k < st.made:
			copy(b, st.slots[k])
		default:
			clear(b)
		}
	}
	st.slots = bufs
}

// parallel runs f(0…n−1) on at most workers goroutines and waits.
func parallel(workers, n int, f func(k int)) {
	if min(workers, n) <= 1 {
		for k := range n {
			f(k)
		}
		return
	}
	start(workers, n, f)()
}

// start runs f(0…n−1), in order of k, on at most workers goroutines (one
// at least) and returns at once; wait waits for them.
func start(workers, n int, f func(k int)) (wait func()) {
	workers = max(1, min(workers, n))
	var (
		wg   sync.WaitGroup
		next int
		mu   sync.Mutex
	)
	for range workers {
		wg.Go(func() {
			for {
				mu.Lock()
				k := next
				next++
				mu.Unlock()
				if k >= n {
					return
				}
				f(k)
			}
		})
	}
	return wg.Wait
}

// ErrPartialStep is wrapped by a PartialStepError.
var ErrPartialStep = errors.New("offloaded step copied back only part of its weights")

// PartialStepError is an offloaded step whose host update ran (the
// masters, the optimizer state and its step counts are the new step's)
// but whose new 16-bit weights reached the device only for Copied of
// Total parameters: the device's copies of the others, named in Stale,
// are the previous step's. The masters are consistent; copying
// them into the host tensors and every one's 16-bit rounding to the
// device again (a batchfit.Session's SyncParams, then UploadParams)
// makes the device consistent with them. Err is why the copy stopped.
type PartialStepError struct {
	Copied, Total int
	Stale         []string
	Err           error
}

func (e *PartialStepError) Error() string {
	return fmt.Sprintf("%v: %d of %d parameters' new weights on the device; stale: %v: %v", ErrPartialStep, e.Copied, e.Total, e.Stale, e.Err)
}

// Unwrap gives ErrPartialStep and the cause.
func (e *PartialStepError) Unwrap() []error { return []error{ErrPartialStep, e.Err} }
