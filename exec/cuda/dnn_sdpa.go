package cuda

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sort"
	"strings"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// cuDNN's fused attention (SDPA) through the backend graph API, unless
// ExecutorOptions.NoCuDNNAttention: 16-bit q, k, v at head dim 64 or 128,
// no mask, as many key/value heads as query heads. The graphs are the ones
// NVIDIA's cudnn-frontend builds for scaled_dot_product_flash_attention
// (its CompositeSDPANode and CompositeSDPABackwardNode, no dropout, no
// bias), which cuDNN matches to its fused flash kernels: the forward pass
// gives o and Stats (the natural log-sum-exp of the scaled scores,
// float32 [B, H, T, 1]: exactly attention_lse's value), the backward pass
// dq, dk and dv from q, k, v, o, dO and Stats in one call.
//
// Every byte is planned. The backward graph's dQ accumulator (float32
// [B, H, T, d]) and softmax_sum (float32 [B, H, T]) live in the node's
// workspace, where the frontend puts them, and so does the plan's own
// workspace, which cuDNN only states once a plan is made on the GPU: the
// node declares sdpaPlanBytes for it, an upper bound measured over a spread
// of shapes (see there), and a plan that wants more is refused and the
// kernels of attention.cu run instead (counted in AttnStats). cuDNN runs on
// the handle's stream, the legacy default stream every launch of the
// executor uses, so it is ordered with them without cudnnSetStream.

// sdpaPass is a plan's pass.
type sdpaPass int8

const (
	sdpaForward sdpaPass = iota
	sdpaBackward
)

func (p sdpaPass) String() string { return [...]string{"forward", "backward"}[p] }

// sdpaKey is everything an SDPA plan depends on. The layouts are fixed by
// the shapes and packed (sdpaKey.strides): unpacked, q, k, v, o, dO and dq
// contiguous, dk and dv the halves of one [B, Hkv, S, 2d] array; packed
// (attention_qkv), q, k and v read in place from qkv [B, T, (H + 2·Hkv)·d], dq,
// dk and dv written likewise into d qkv, o and dO [B, T, H, d]. lse is
// [B, H, T] either way.
type sdpaKey struct {
	pass               sdpaPass
	dt                 graph.DType
	b, h, hkv, t, s, d int64
	causal             bool
	scale              float32
	packed             bool
}

// sdpaStrides are a plan's tensors' strides over [b, h, row, d]: q, k, v,
// o (and dO), dq, dk, dv.
type sdpaStrides struct{ q, k, v, o, dq, dk, dv []int64 }

// strides lays out key's tensors (see sdpaKey). Packed needs t = s.
func (key sdpaKey) strides() sdpaStrides {
	b, h, t, s, d := key.b, key.h, key.t, key.s, key.d
	if key.packed {
		p := (h + 2*key.hkv) * d // row pitch of qkv and d qkv: q's h heads, k's and v's hkv
		qkv := []int64{t * p, d, p, 1}
		o := []int64{t * h * d, d, h * d, 1}
		return sdpaStrides{q: qkv, k: qkv, v: qkv, o: o, dq: qkv, dk: qkv, dv: qkv}
	}
	q, kv := contiguous(b, h, t, d), contiguous(b, h, s, d)
	dkv := []int64{h * s * 2 * d, s * 2 * d, 2 * d, 1}
	return sdpaStrides{q: q, k: kv, v: kv, o: q, dq: q, dk: dkv, dv: dkv}
}

// transposed is strides st of [b, h, r, c] read as [b, h, c, r].
func transposed(st []int64) []int64 { return []int64{st[0], st[1], st[3], st[2]} }

// sdpaPlan is a finalized execution plan with the descriptors it was built
// from; ok is false when cuDNN gave none (why says why), and the kernels
// run the key's calls.
type sdpaPlan struct {
	bg      *bgraph
	plan    uintptr
	ws      int64 // the plan's own workspace
	engine  int64 // cuDNN's global engine index
	ok      bool
	why     string
	scalars *[3]float32 // by-value tensors sdpaScale, sdpaNegInf and sdpaOne: the scale, −Inf and 1
}

// Non-virtual tensors' unique ids (virtual ones count from sdpaVirtual).
const (
	sdpaQ = iota + 1
	sdpaK
	sdpaV
	sdpaO
	sdpaStats
	sdpaDO
	sdpaDQ
	sdpaDK
	sdpaDV
	sdpaDQAccum
	sdpaSoftmaxSum
	sdpaScale
	sdpaNegInf
	sdpaOne

	sdpaVirtual = 100
)

// AttnStats counts cuDNN's attention: plans made, calls it ran (forward
// and backward) and the calls left to attention.cu's kernels by reason.
type AttnStats struct {
	Plans, Forward, Backward int
	Fallbacks                map[string]int
}

// AttnStats is a copy of the executor's SDPA counters.
func (n *DNN) AttnStats() AttnStats {
	n.mu.Lock()
	defer n.mu.Unlock()
	s := AttnStats{Plans: len(n.sdpaPlans), Forward: n.sdpaRuns[sdpaForward], Backward: n.sdpaRuns[sdpaBackward], Fallbacks: map[string]int{}}
	for k, v := range n.sdpaFallbacks {
		s.Fallbacks[k] = v
	}
	return s
}

// String lists the fallbacks' reasons, most frequent first.
func (s AttnStats) String() string {
	type kv struct {
		k string
		v int
	}
	var all []kv
	for k, v := range s.Fallbacks {
		all = append(all, kv{k, v})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].v > all[j].v || all[i].v == all[j].v && all[i].k < all[j].k })
	var b strings.Builder
	fmt.Fprintf(&b, "%d plans, %d forward, %d backward on cuDNN", s.Plans, s.Forward, s.Backward)
	for _, x := range all {
		fmt.Fprintf(&b, "; %d× %s", x.v, x.k)
	}
	return b.String()
}

// fallback counts a call left to the kernels.
func (n *DNN) fallback(why string) {
	n.mu.Lock()
	n.sdpaFallbacks[why]++
	n.mu.Unlock()
}

// sdpaShape reports whether attention of dtype dt at head dim d, with or
// without a mask, h query and hkv key/value heads, is cuDNN's to run.
func sdpaShape(dt graph.DType, d int, masked bool, h, hkv int) bool {
	return attnMMAShape(dt, d, masked) && h == hkv
}

// Workspace of the cuDNN path, affine in the batch b (the planner needs
// it): the arrays the graphs keep in memory, 256 bytes of alignment slack
// before the plan's workspace, and sdpaPlanBytes.
//
//   - forward: Stats when attention_lse is no companion of the node (no
//     training), 4·B·H·T;
//   - backward: the dQ accumulator 4·B·H·T·d, then softmax_sum 4·B·H·T.
func sdpaFwdBytes(b, h, t, s, d int64) int64 {
	return 4*b*h*t + 256 + sdpaPlanBytes(sdpaForward, b, h, t, s, d)
}

func sdpaBwdBytes(b, h, t, s, d int64) int64 {
	return 4*b*h*t*(d+1) + 256 + sdpaPlanBytes(sdpaBackward, b, h, t, s, d)
}

// sdpaPlanBytes bounds the workspace cuDNN's plan asks for: a fixed 1 MiB
// for either pass, whatever the shape. Measured (TestCuDNNAttentionWorkspace
// prints each plan's) on an H200 with cuDNN 9.14.0, bfloat16 and float16,
// d 64 and 128, causal or not, T = S ∈ {1, 17, 64, 1000, 1024, 2048, 4096,
// 8192} at (B, H) ∈ {(1, 1), (1, 16), (8, 12), (32, 16)}: 288 plans, every
// one 256 bytes (engine 2, the fused flash kernels) but T = 1's forward,
// 0 bytes (engine 1). The dQ accumulator and softmax_sum, which grow with
// the shape, are the frontend's and ours (sdpaBwdBytes), not the plan's.
// The bound is 4096× the largest figure: a later cuDNN whose plans want
// more falls back to the kernels, counted, rather than overrun.
func sdpaPlanBytes(pass sdpaPass, b, h, t, s, d int64) int64 {
	return sdpaPlanFixed
}

const sdpaPlanFixed = 1 << 20

// sdpaLayout splits a node's workspace for pass: the arrays, then the
// plan's workspace at a 256-byte boundary.
type sdpaLayout struct {
	stats, dqAcc, sum, plan alloc.Ptr
}

func sdpaLayoutAt(ws alloc.Ptr, pass sdpaPass, b, h, t, d int64) (sdpaLayout, int64) {
	var l sdpaLayout
	var used int64
	if pass == sdpaForward {
		l.stats, used = ws, 4*b*h*t
	} else {
		l.dqAcc, l.sum, used = ws, ws+alloc.Ptr(4*b*h*t*d), 4*b*h*t*(d+1)
	}
	off := align256(used)
	l.plan = ws + alloc.Ptr(off)
	return l, off
}

// sdpaPlanFor returns key's plan, making it on first use. It runs on the
// device thread.
func (n *DNN) sdpaPlanFor(key sdpaKey) (*sdpaPlan, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil, fmt.Errorf("%w: cudnn handle", ErrClosed)
	}
	if p, ok := n.sdpaPlans[key]; ok {
		return p, nil
	}
	p := n.makeSDPAPlan(key)
	n.sdpaPlans[key] = p
	return p, nil
}

// makeSDPAPlan builds key's operation graph and takes the first engine
// configuration the heuristics rank (mode A, then FALLBACK) whose plan
// finalizes. A plan whose workspace exceeds what the node declared is
// refused at run time, not here: the plan is the key's whatever the budget.
func (n *DNN) makeSDPAPlan(key sdpaKey) *sdpaPlan {
	p := &sdpaPlan{scalars: &[3]float32{key.scale, float32(math.Inf(-1)), 1}}
	if n.lib.backend == nil {
		p.why = errNoBackendAPI.Error()
		return p
	}
	dt, ok := cudnnDType(key.dt)
	if !ok {
		p.why = "dtype " + key.dt.String()
		return p
	}
	bg := &bgraph{lib: n.lib, be: n.lib.backend, uid: sdpaVirtual}
	p.bg = bg
	if key.pass == sdpaForward {
		sdpaForwardGraph(bg, key, dt)
	} else {
		sdpaBackwardGraph(bg, key, dt)
	}
	if bg.err != nil {
		p.why = "operation graph: " + bg.err.Error()
		return p
	}
	og := bg.create(cudnnBackendOperationGraph)
	bg.setDesc(og, cudnnAttrOperationGraphOps, bg.ops...)
	h := n.h
	bg.set(og, cudnnAttrOperationGraphHandle, cudnnTypeHandle, 1, unsafe.Pointer(&h))
	bg.finalize(og, "operation graph")
	if bg.err != nil {
		p.why = bg.err.Error()
		return p
	}
	var whys []string
	for _, mode := range []int32{cudnnHeurModeA, cudnnHeurModeFallback} {
		plan, ws, engine, why := n.sdpaHeuristics(bg, og, mode)
		if plan != 0 {
			p.plan, p.ws, p.engine, p.ok = plan, ws, engine, true
			return p
		}
		whys = append(whys, why)
	}
	p.why = strings.Join(whys, "; ")
	return p
}

// sdpaHeuristics asks heuristics mode for engine configurations of og and
// returns the first plan that finalizes, with its workspace and engine, or
// 0 and why none did.
func (n *DNN) sdpaHeuristics(bg *bgraph, og uintptr, mode int32) (plan uintptr, ws, engine int64, why string) {
	l, be := n.lib, n.lib.backend
	heur := bg.create(cudnnBackendEngineHeurDesc)
	bg.setDesc(heur, cudnnAttrEngineHeurOperationGraph, og)
	bg.setInt32(heur, cudnnAttrEngineHeurMode, cudnnTypeHeurMode, mode)
	bg.finalize(heur, fmt.Sprintf("heuristics (mode %d)", mode))
	if bg.err != nil {
		why = bg.err.Error()
		bg.err = nil
		return 0, 0, 0, why
	}
	var count int64
	if err := l.check("cudnnBackendGetAttribute", be.cudnnBackendGetAttribute(heur, cudnnAttrEngineHeurResults,
		cudnnTypeBackendDescriptor, 0, &count, nil)); err != nil {
		return 0, 0, 0, fmt.Sprintf("heuristics (mode %d) count: %v", mode, err)
	}
	if count <= 0 {
		return 0, 0, 0, fmt.Sprintf("heuristics (mode %d): no engine", mode)
	}
	cfgs := make([]uintptr, count)
	for i := range cfgs {
		if cfgs[i] = bg.create(cudnnBackendEngineCfgDesc); bg.err != nil {
			why = bg.err.Error()
			bg.err = nil
			return 0, 0, 0, why
		}
	}
	if err := l.check("cudnnBackendGetAttribute", be.cudnnBackendGetAttribute(heur, cudnnAttrEngineHeurResults,
		cudnnTypeBackendDescriptor, count, &count, unsafe.Pointer(&cfgs[0]))); err != nil {
		return 0, 0, 0, fmt.Sprintf("heuristics (mode %d) results: %v", mode, err)
	}
	var whys []string
	h := n.h
	for _, cfg := range cfgs[:count] {
		var pl uintptr
		if err := l.check("cudnnBackendCreateDescriptor", be.cudnnBackendCreateDescriptor(cudnnBackendExecutionPlanDesc, &pl)); err != nil {
			return 0, 0, 0, err.Error()
		}
		s := be.cudnnBackendSetAttribute(pl, cudnnAttrExecutionPlanHandle, cudnnTypeHandle, 1, unsafe.Pointer(&h))
		if s == 0 {
			s = be.cudnnBackendSetAttribute(pl, cudnnAttrExecutionPlanEngineConfig, cudnnTypeBackendDescriptor, 1, unsafe.Pointer(&cfg))
		}
		if s == 0 {
			s = be.cudnnBackendFinalize(pl)
		}
		if s == 0 {
			var n int64
			s = be.cudnnBackendGetAttribute(pl, cudnnAttrExecutionPlanWorkspaceSize, cudnnTypeInt64, 1, &n, unsafe.Pointer(&ws))
		}
		if s != 0 {
			whys = append(whys, l.check("execution plan", s).Error())
			_ = be.cudnnBackendDestroyDescriptor(pl)
			continue
		}
		bg.descs = append(bg.descs, pl)
		return pl, ws, sdpaEngineIndex(bg, cfg), ""
	}
	return 0, 0, 0, fmt.Sprintf("heuristics (mode %d): %d configurations, none finalized: %s", mode, count, strings.Join(whys, ", "))
}

// sdpaEngineIndex is the global index of cfg's engine, −1 when cuDNN does
// not say.
func sdpaEngineIndex(bg *bgraph, cfg uintptr) int64 {
	be := bg.be
	var eng uintptr
	if be.cudnnBackendCreateDescriptor(cudnnBackendEngineDesc, &eng) != 0 {
		return -1
	}
	defer be.cudnnBackendDestroyDescriptor(eng)
	var n, idx int64
	if be.cudnnBackendGetAttribute(cfg, cudnnAttrEngineCfgEngine, cudnnTypeBackendDescriptor, 1, &n, unsafe.Pointer(&eng)) != 0 ||
		be.cudnnBackendGetAttribute(eng, cudnnAttrEngineGlobalIndex, cudnnTypeInt64, 1, &n, unsafe.Pointer(&idx)) != 0 {
		return -1
	}
	return idx
}

// contiguous is the row-major strides of dims.
func contiguous(dims ...int64) []int64 {
	st := make([]int64, len(dims))
	s := int64(1)
	for i := len(dims) - 1; i >= 0; i-- {
		st[i] = s
		s *= dims[i]
	}
	return st
}

// sdpaScores appends the scaled (and causally masked) scores of q·kᵀ to
// bg: the first half of both graphs. kt is kᵀ [b, h, d, s].
func sdpaScores(bg *bgraph, key sdpaKey, q, kt, scale btensor) btensor {
	b, h, t, s := key.b, key.h, key.t, key.s
	st := []int64{b, h, t, s}
	ss := contiguous(st...)
	raw := bg.virt(cudnnDataFloat, st, ss)
	bg.matmul(q, kt, raw)
	scaled := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseMul, cudnnDataFloat, -1, scaled, raw, scale)
	return scaled
}

// sdpaCausal appends the causal mask over scores x (PyTorch's is_causal,
// top-left aligned): row index ≥ column index keeps the score, the rest
// become −Inf.
func sdpaCausal(bg *bgraph, key sdpaKey, x, negInf btensor) btensor {
	st := []int64{key.b, key.h, key.t, key.s}
	ss := contiguous(st...)
	row, col := bg.virt(cudnnDataInt32, st, ss), bg.virt(cudnnDataInt32, st, ss)
	bg.pointwise(cudnnPointwiseGenIndex, cudnnDataFloat, 2, row, x)
	bg.pointwise(cudnnPointwiseGenIndex, cudnnDataFloat, 3, col, x)
	keep := bg.virt(cudnnDataBoolean, st, ss)
	bg.pointwise(cudnnPointwiseCmpGE, cudnnDataBoolean, -1, keep, row, col)
	y := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseBinarySelect, cudnnDataFloat, -1, y, x, negInf, keep)
	return y
}

// scalarTensor is a by-value float32 host scalar. Make one only for an
// operation that reads it: the variant pack names every by-value tensor
// made (bgraph.byVal), and cuDNN refuses a pack naming a tensor no
// operation reads (CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
// isCompatibleVariantPack).
func scalarTensor(bg *bgraph, uid int64) btensor {
	one := []int64{1, 1, 1, 1}
	return bg.tensor(uid, cudnnDataFloat, one, one, false, true)
}

// sdpaForwardGraph is the training forward pass: o = softmax(scale·q·kᵀ
// [causal]) · v and Stats = max + log Σ exp(scores − max).
func sdpaForwardGraph(bg *bgraph, key sdpaKey, dt int32) {
	b, h, t, s, d := key.b, key.h, key.t, key.s, key.d
	ls := key.strides()
	q := bg.tensor(sdpaQ, dt, []int64{b, h, t, d}, ls.q, false, false)
	kt := bg.tensor(sdpaK, dt, []int64{b, h, d, s}, transposed(ls.k), false, false)
	v := bg.tensor(sdpaV, dt, []int64{b, h, s, d}, ls.v, false, false)
	x := sdpaScores(bg, key, q, kt, scalarTensor(bg, sdpaScale))
	if key.causal {
		x = sdpaCausal(bg, key, x, scalarTensor(bg, sdpaNegInf))
	}
	// Softmax as the frontend composes it, with Stats.
	st, ss := []int64{b, h, t, s}, contiguous(b, h, t, s)
	rt, rs := []int64{b, h, t, 1}, []int64{h * t, t, 1, 1}
	mx := bg.virt(cudnnDataFloat, rt, rs)
	bg.reduction(cudnnReduceMax, x, mx)
	sub := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseSub, cudnnDataFloat, -1, sub, x, mx)
	e := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseExp, cudnnDataFloat, -1, e, sub)
	sum := bg.virt(cudnnDataFloat, rt, rs)
	bg.reduction(cudnnReduceAdd, e, sum)
	lg := bg.virt(cudnnDataFloat, rt, rs)
	bg.pointwise(cudnnPointwiseLog, cudnnDataFloat, -1, lg, sum)
	stats := bg.tensor(sdpaStats, cudnnDataFloat, rt, rs, false, false)
	bg.pointwise(cudnnPointwiseAdd, cudnnDataFloat, -1, stats, mx, lg)
	// p·v takes p in the inputs' dtype.
	p := bg.virt(dt, st, ss)
	bg.pointwise(cudnnPointwiseDiv, cudnnDataFloat, -1, p, e, sum)
	o := bg.tensor(sdpaO, dt, []int64{b, h, t, d}, ls.o, false, false)
	bg.matmul(p, v, o)
}

// sdpaBackwardGraph is the backward pass: with p = exp(scores − Stats),
// dv = pᵀ·dO, ds = scale·p∘(dO·vᵀ − Σ dO∘o), dk = dsᵀ·q and dq = ds·k (summed
// in float32 in the dQ accumulator, then cast). dk and dv are the halves
// of one [b, h, s, 2d] array, or (packed) thirds of d qkv with dq.
func sdpaBackwardGraph(bg *bgraph, key sdpaKey, dt int32) {
	b, h, t, s, d := key.b, key.h, key.t, key.s, key.d
	qd, qs := []int64{b, h, t, d}, contiguous(b, h, t, d)
	ls := key.strides()
	q := bg.tensor(sdpaQ, dt, qd, ls.q, false, false)
	kt := bg.tensor(sdpaK, dt, []int64{b, h, d, s}, transposed(ls.k), false, false)
	vt := bg.tensor(sdpaV, dt, []int64{b, h, d, s}, transposed(ls.v), false, false)
	o := bg.tensor(sdpaO, dt, qd, ls.o, false, false)
	dO := bg.tensor(sdpaDO, dt, qd, ls.o, false, false)
	rt, rs := []int64{b, h, t, 1}, []int64{h * t, t, 1, 1}
	stats := bg.tensor(sdpaStats, cudnnDataFloat, rt, rs, false, false)
	scale, one := scalarTensor(bg, sdpaScale), scalarTensor(bg, sdpaOne)

	// softmax_sum = Σ dO∘o per row (times 1: no dropout), in the workspace.
	dOo := bg.virt(cudnnDataFloat, qd, []int64{h * t * d, t * d, h * d, 1})
	bg.pointwise(cudnnPointwiseMul, cudnnDataFloat, -1, dOo, dO, o)
	red := bg.virt(cudnnDataFloat, rt, rs)
	bg.reduction(cudnnReduceAdd, dOo, red)
	softmaxSum := bg.tensor(sdpaSoftmaxSum, cudnnDataFloat, rt, rs, false, false)
	bg.pointwise(cudnnPointwiseMul, cudnnDataFloat, -1, softmaxSum, red, one)

	st, ss := []int64{b, h, t, s}, contiguous(b, h, t, s)
	x := sdpaScores(bg, key, q, kt, scale)
	sub := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseSub, cudnnDataFloat, -1, sub, x, stats)
	if key.causal {
		sub = sdpaCausal(bg, key, sub, scalarTensor(bg, sdpaNegInf))
	}
	p := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseExp, cudnnDataFloat, -1, p, sub)

	// dv = pᵀ·dO.
	tt, ts := []int64{b, h, s, t}, []int64{h * t * s, t * s, 1, s}
	pt := bg.virt(dt, tt, ts)
	bg.reshape(p, pt)
	kvd := []int64{b, h, s, d}
	dv := bg.tensor(sdpaDV, dt, kvd, ls.dv, false, false)
	bg.matmul(pt, dO, dv)

	// ds = scale·p∘(dO·vᵀ − softmax_sum).
	dp := bg.virt(cudnnDataFloat, st, ss)
	bg.matmul(dO, vt, dp)
	dps := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseSub, cudnnDataFloat, -1, dps, dp, softmaxSum)
	dsp := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseMul, cudnnDataFloat, -1, dsp, dps, p)
	ds := bg.virt(cudnnDataFloat, st, ss)
	bg.pointwise(cudnnPointwiseMul, cudnnDataFloat, -1, ds, dsp, scale)

	// dk = dsᵀ·q.
	dst := bg.virt(dt, tt, ts)
	bg.reshape(ds, dst)
	dk := bg.tensor(sdpaDK, dt, kvd, ls.dk, false, false)
	bg.matmul(dst, q, dk)

	// dq = ds·k, summed in the float32 accumulator; k seen untransposed (a
	// virtual tensor of the intermediate type, as the frontend's is).
	k := bg.virt(cudnnDataFloat, []int64{b, h, s, d}, []int64{h * s * d, s * d, d, 1})
	bg.reshape(kt, k)
	acc := bg.tensor(sdpaDQAccum, cudnnDataFloat, qd, qs, false, false)
	bg.matmul(ds, k, acc)
	dq := bg.tensor(sdpaDQ, dt, qd, ls.dq, false, false)
	bg.pointwise(cudnnPointwiseIdentity, cudnnDataFloat, -1, dq, acc)
}

// sdpaExecute runs plan p over the variant pack of uids and their
// addresses (device pointers; the by-value scalars' host addresses are
// added here) with workspace ws.
func (n *DNN) sdpaExecute(p *sdpaPlan, uids []int64, ptrs []uintptr, ws alloc.Ptr) error {
	l, be := n.lib, n.lib.backend
	// Exactly the graph's by-value tensors (see scalarTensor).
	for _, uid := range p.bg.byVal {
		uids = append(uids, uid)
		ptrs = append(ptrs, uintptr(unsafe.Pointer(&p.scalars[uid-sdpaScale])))
	}
	var vp uintptr
	if err := l.check("cudnnBackendCreateDescriptor", be.cudnnBackendCreateDescriptor(cudnnBackendVariantPackDesc, &vp)); err != nil {
		return err
	}
	wsp := uintptr(ws)
	s := be.cudnnBackendSetAttribute(vp, cudnnAttrVariantPackUniqueIDs, cudnnTypeInt64, int64(len(uids)), unsafe.Pointer(&uids[0]))
	if s == 0 {
		s = be.cudnnBackendSetAttribute(vp, cudnnAttrVariantPackDataPointers, cudnnTypeVoidPtr, int64(len(ptrs)), unsafe.Pointer(&ptrs[0]))
	}
	if s == 0 {
		s = be.cudnnBackendSetAttribute(vp, cudnnAttrVariantPackWorkspace, cudnnTypeVoidPtr, 1, unsafe.Pointer(&wsp))
	}
	if s == 0 {
		s = be.cudnnBackendFinalize(vp)
	}
	err := l.check("variant pack", s)
	if err == nil {
		err = l.check("cudnnBackendExecute", be.cudnnBackendExecute(n.h, p.plan, vp))
	}
	runtime.KeepAlive(p.scalars)
	return errors.Join(err, l.check("cudnnBackendDestroyDescriptor", be.cudnnBackendDestroyDescriptor(vp)))
}

// destroy destroys a plan's descriptors.
func (p *sdpaPlan) destroy() error {
	if p.bg == nil {
		return nil
	}
	return p.bg.destroy()
}

// sdpaPrepare is the cuDNN path's common part: whether a call is cuDNN's,
// and then its plan and the workspace at ws (wsBytes long, as the node
// declared it) split for it. A call it does not take is counted with its
// reason. It runs on the device thread.
func (n *DNN) sdpaPrepare(pass sdpaPass, dt graph.DType, sh attnShape, masked, packed bool, ws alloc.Ptr, wsBytes int64, ptrs ...alloc.Ptr) (*sdpaPlan, sdpaLayout, bool, error) {
	if n == nil || n.noSDPA {
		return nil, sdpaLayout{}, false, nil
	}
	if !sdpaShape(dt, sh.d, masked, sh.h, sh.hkv) {
		why := "shape"
		switch {
		case !dt.IsHalf():
			why = "dtype " + dt.String()
		case masked:
			why = "mask"
		case sh.h != sh.hkv:
			why = "grouped-query heads"
		case sh.d != 64 && sh.d != 128:
			why = fmt.Sprintf("head dim %d", sh.d)
		}
		n.fallback(why)
		return nil, sdpaLayout{}, false, nil
	}
	for _, p := range ptrs {
		if p%16 != 0 {
			n.fallback("alignment")
			return nil, sdpaLayout{}, false, nil
		}
	}
	b, h, t, s, d := int64(sh.b), int64(sh.h), int64(sh.t), int64(sh.s), int64(sh.d)
	if b*h*t == 0 || s == 0 {
		n.fallback("empty")
		return nil, sdpaLayout{}, false, nil
	}
	key := sdpaKey{pass: pass, dt: dt, b: b, h: h, hkv: int64(sh.hkv), t: t, s: s, d: d, causal: sh.causal, scale: sh.scale, packed: packed}
	p, err := n.sdpaPlanFor(key)
	if err != nil {
		return nil, sdpaLayout{}, false, err
	}
	if !p.ok {
		n.fallback("no plan")
		return nil, sdpaLayout{}, false, nil
	}
	l, off := sdpaLayoutAt(ws, pass, b, h, t, d)
	limit := wsBytes - off
	n.mu.Lock()
	if n.sdpaWSCapped {
		limit = min(limit, n.sdpaWSCap)
	}
	n.mu.Unlock()
	if p.ws > limit {
		n.fallback("workspace")
		return nil, sdpaLayout{}, false, nil
	}
	return p, l, true, nil
}

// nodeWorkspace is the node's workspace block's address and size.
func (k *kctx) nodeWorkspace() (alloc.Ptr, int64) {
	if k.ws == nil {
		return 0, 0
	}
	return k.ws.Ptr(), k.ws.Requested()
}

// dnnAttnFwd runs attention's forward pass on cuDNN when it takes it: o,
// and the log-sum-exp into lse (its companion's output) or, with lse nil,
// the workspace.
func (k *kctx) dnnAttnFwd(dt graph.DType, sh attnShape, q, kk, v operand, masked bool, o, lse *operand) (bool, error) {
	var pl alloc.Ptr
	if lse != nil {
		pl = lse.p
	}
	ws, n := k.nodeWorkspace()
	return k.dnn.sdpaForward(dt, sh, masked, false, q.p, kk.p, v.p, o.p, pl, ws, n)
}

// sdpaForward is dnnAttnFwd on addresses: lse 0 puts the log-sum-exp in
// the workspace. packed reads q, k, v at their addresses with qkv's
// strides and writes o [B, T, H, d] (sdpaKey.strides).
func (n *DNN) sdpaForward(dt graph.DType, sh attnShape, masked, packed bool, q, k, v, o, lse, ws alloc.Ptr, wsBytes int64) (bool, error) {
	p, l, ok, err := n.sdpaPrepare(sdpaForward, dt, sh, masked, packed, ws, wsBytes, q, k, v, o, lse)
	if !ok || err != nil {
		return false, err
	}
	if lse == 0 {
		lse = l.stats
	}
	uids := []int64{sdpaQ, sdpaK, sdpaV, sdpaO, sdpaStats}
	ptrs := []uintptr{uintptr(q), uintptr(k), uintptr(v), uintptr(o), uintptr(lse)}
	if err := n.sdpaExecute(p, uids, ptrs, l.plan); err != nil {
		return true, fmt.Errorf("cuDNN attention forward (engine %d): %w", p.engine, err)
	}
	n.ran(sdpaForward)
	return true, nil
}

// dnnAttnBwd runs attention's backward pass on cuDNN when it takes it: dq
// into dq, dk and dv into the halves of dkv.
func (k *kctx) dnnAttnBwd(dt graph.DType, sh attnShape, g, q, kk, v, o, lse, dq, dkv operand, masked bool) (bool, error) {
	ws, n := k.nodeWorkspace()
	dv := dkv.p + alloc.Ptr(sh.d*dt.Size())
	return k.dnn.sdpaBackward(dt, sh, masked, false, g.p, q.p, kk.p, v.p, o.p, lse.p, dq.p, dkv.p, dv, ws, n)
}

// sdpaBackward is dnnAttnBwd on addresses: dk and dv where they start
// (unpacked, the halves of dk|dv; packed, the thirds of d qkv with dq).
func (n *DNN) sdpaBackward(dt graph.DType, sh attnShape, masked, packed bool, g, q, k, v, o, lse, dq, dk, dv, ws alloc.Ptr, wsBytes int64) (bool, error) {
	p, l, ok, err := n.sdpaPrepare(sdpaBackward, dt, sh, masked, packed, ws, wsBytes, g, q, k, v, o, lse, dq, dk, dv)
	if !ok || err != nil {
		return false, err
	}
	if n.lib.version < 90600 {
		// cuDNN before 9.6 wants the dQ accumulator zeroed (the frontend's
		// memset); later versions clear it themselves.
		if err := n.d.Memzero(l.dqAcc, 4*int64(sh.b*sh.h*sh.t*sh.d)); err != nil {
			return true, err
		}
	}
	uids := []int64{sdpaQ, sdpaK, sdpaV, sdpaO, sdpaDO, sdpaStats, sdpaDQ, sdpaDK, sdpaDV, sdpaDQAccum, sdpaSoftmaxSum}
	ptrs := []uintptr{uintptr(q), uintptr(k), uintptr(v), uintptr(o), uintptr(g), uintptr(lse),
		uintptr(dq), uintptr(dk), uintptr(dv), uintptr(l.dqAcc), uintptr(l.sum)}
	if err := n.sdpaExecute(p, uids, ptrs, l.plan); err != nil {
		return true, fmt.Errorf("cuDNN attention backward (engine %d): %w", p.engine, err)
	}
	n.ran(sdpaBackward)
	return true, nil
}

func (n *DNN) ran(pass sdpaPass) {
	n.mu.Lock()
	n.sdpaRuns[pass]++
	n.mu.Unlock()
}
