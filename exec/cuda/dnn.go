package cuda

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// DNN is a cuDNN handle on a device and the convolution plans it has made.
//
// The planner fixes every workspace before a step runs, and cuDNN must not
// allocate behind the allocator's back. By default a plain float32
// convolution's algorithm is chosen at compile time by a timed search
// whose results are cached on disk (convfind.go), and the node declares
// exactly the chosen algorithm's workspace. Without the search
// (ExecutorOptions.ConvHeuristics, 16-bit and TF32 convolutions unless
// ExecutorOptions.ConvSearchAll, a program compiled with the package's
// static Workspace, or a shape the search left alone) the workspace is
// declared by a formula of its shapes (the im2col kernels' workspace plus
// convDNNBytes: its input, output and weight in bytes) and cuDNN's own
// ranking (the _v7 heuristics, no timing, so the choice is the same on
// every run of a device and cuDNN version) is searched for the best
// deterministic algorithm that needs no more. A shape no such algorithm
// takes runs on the im2col kernels, whose workspace that declaration also
// covers. A convolution whose tensors have more elements than cuDNN's
// descriptors describe runs in slices along N, each plan and workspace
// the slices' (convsplit.go).
type DNN struct {
	d        *Device
	lib      *cudnnLib
	h        cudnnHandle
	tf32     bool
	overhead atomic.Int64

	mu        sync.Mutex
	plans     map[planKey]*convPlan
	bnPlans   map[bnKey]*bnPlan
	fallbacks int
	closed    bool
	// splitConvs counts the convolutions run in slices along N
	// (convsplit.go), splitSlices their slices.
	splitConvs, splitSlices atomic.Int64
	// gone is closed as the device thread sees it: set before the
	// handle's destruction is queued there, so a search that runs after
	// it finds it set and never touches the destroyed handle.
	gone atomic.Bool
	bn   *cudnnBNLib // nil when cuDNN lacks its batch norm, or it is not asked for

	// find is the timed search's choices and counts (convfind.go); ks and
	// blas are the executor's kernels and cuBLAS, for timing the im2col
	// path beside cuDNN's algorithms (nil: cuDNN's alone).
	find findState
	ks   *kernelSet
	blas *BLAS

	// Fused attention (dnn_sdpa.go): plans by key, calls run per pass,
	// calls left to the kernels by reason; noSDPA is
	// ExecutorOptions.NoCuDNNAttention; sdpaWSCap, when sdpaWSCapped,
	// caps the plan workspace a call may use (tests).
	sdpaPlans     map[sdpaKey]*sdpaPlan
	sdpaRuns      [2]int
	sdpaFallbacks map[string]int
	noSDPA        bool
	sdpaWSCap     int64
	sdpaWSCapped  bool
}

// convPass is one of a convolution's three passes.
type convPass int8

const (
	convForward convPass = iota
	convGradInput
	convGradWeight
)

func (p convPass) String() string {
	return [...]string{"forward", "grad_input", "grad_weight"}[p]
}

// convKey is everything a convolution plan depends on: the pass, dtype,
// the input x [N, C, H, W], weight w [O, C/g, kh, kw] and output y [N, O,
// Ho, Wo] of the forward convolution (logical sizes), the window, and the
// memory layout: NCHW and KCRS, or NHWC and KRSC (cuDNN's tensor-core
// layout, the one its 16-bit kernels run without transposing).
type convKey struct {
	pass             convPass
	dt               graph.DType
	x, w, y          [4]int64
	pad, stride, dil [2]int64
	groups           int64
	budget           int64 // the workspace's bytes
	nhwc             bool  // x, y NHWC and w KRSC in memory (graph.Attrs.ChannelsLast)
}

// planKey is a plan's key and the timed choice it draws on (nil: the
// heuristics alone).
type planKey struct {
	convKey
	choice *convChoice
}

// convPlan is a plan's descriptors and algorithm; ok is false when no
// algorithm fits the budget (the convolution runs on im2col instead).
type convPlan struct {
	xd, yd cudnnTensorDesc
	wd     cudnnFilterDesc
	cd     cudnnConvDesc
	algo   int32
	ws     int64
	ok     bool
	im2col bool // the timed search chose the im2col path (ok is false)
}

// newDNN loads cuDNN and creates a handle on d, measuring the device
// memory the handle took (cuMemGetInfo before and after): Overhead.
func (d *Device) newDNN(tf32 bool) (*DNN, error) {
	lib, err := loadCUDNN()
	if err != nil {
		return nil, err
	}
	n := &DNN{d: d, lib: lib, bn: lib.bn, tf32: tf32, plans: map[planKey]*convPlan{}, bnPlans: map[bnKey]*bnPlan{},
		sdpaPlans: map[sdpaKey]*sdpaPlan{}, sdpaFallbacks: map[string]int{}}
	err = d.do(func() error {
		var before, after, total uintptr
		if err := d.drv.check("cuMemGetInfo_v2", d.drv.cuMemGetInfo(&before, &total)); err != nil {
			return err
		}
		if err := lib.check("cudnnCreate", lib.cudnnCreate(&n.h)); err != nil {
			return err
		}
		if err := d.drv.check("cuMemGetInfo_v2", d.drv.cuMemGetInfo(&after, &total)); err != nil {
			return errors.Join(err, lib.check("cudnnDestroy", lib.cudnnDestroy(n.h)))
		}
		n.overhead.Store(max(0, int64(before)-int64(after)))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return n, nil
}

// setStream points the handle at stream s (0: the legacy default
// stream). On the device thread.
func (n *DNN) setStream(s uintptr) error {
	return n.lib.check("cudnnSetStream", n.lib.cudnnSetStream(n.h, s))
}

// Version is cuDNN's version, "9.14.0".
func (n *DNN) Version() string { return formatCUDNNVersion(n.lib.version) }

// Overhead is the device memory cuDNN took outside every allocator: what
// the handle took when it was created, and what the timed searches left
// behind (the kernels cuDNN loaded as it tried them), each measured with
// cuMemGetInfo around it.
func (n *DNN) Overhead() int64 { return n.overhead.Load() }

// ConvStats counts the convolution plans made, and the fallbacks to im2col:
// plans that found no cuDNN algorithm within their workspace, and calls
// cuDNN refused as not supported.
func (n *DNN) ConvStats() (plans, fallbacks int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.plans), n.fallbacks
}

// SplitStats counts the convolutions cuDNN ran in slices along N, their
// tensors too large for its descriptors whole (convsplit.go), and the
// slices they ran in.
func (n *DNN) SplitStats() (convs, slices int64) { return n.splitConvs.Load(), n.splitSlices.Load() }

// Close destroys the plans' descriptors and the handle.
func (n *DNN) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil
	}
	n.closed = true
	n.gone.Store(true)
	return n.d.do(func() error {
		var errs []error
		for _, p := range n.plans {
			errs = append(errs, n.destroy(p))
		}
		for _, p := range n.bnPlans {
			errs = append(errs, n.destroyBN(p))
		}
		for _, p := range n.sdpaPlans {
			errs = append(errs, p.destroy())
		}
		n.plans, n.bnPlans, n.sdpaPlans = nil, nil, nil
		errs = append(errs, n.lib.check("cudnnDestroy", n.lib.cudnnDestroy(n.h)))
		return errors.Join(errs...)
	})
}

// destroy destroys p's descriptors; a nil plan has none.
func (n *DNN) destroy(p *convPlan) error {
	if p == nil {
		return nil
	}
	l := n.lib
	var errs []error
	if p.xd != 0 {
		errs = append(errs, l.check("cudnnDestroyTensorDescriptor", l.cudnnDestroyTensorDescriptor(p.xd)))
	}
	if p.yd != 0 {
		errs = append(errs, l.check("cudnnDestroyTensorDescriptor", l.cudnnDestroyTensorDescriptor(p.yd)))
	}
	if p.wd != 0 {
		errs = append(errs, l.check("cudnnDestroyFilterDescriptor", l.cudnnDestroyFilterDescriptor(p.wd)))
	}
	if p.cd != 0 {
		errs = append(errs, l.check("cudnnDestroyConvolutionDescriptor", l.cudnnDestroyConvolutionDescriptor(p.cd)))
	}
	return errors.Join(errs...)
}

// cudnnDType is dt's cudnnDataType_t.
func cudnnDType(dt graph.DType) (int32, bool) {
	switch dt {
	case graph.Float32:
		return cudnnDataFloat, true
	case graph.BFloat16:
		return cudnnDataBFloat16, true
	case graph.Float16:
		return cudnnDataHalf, true
	}
	return 0, false
}

// convDNNBytes is what a convolution adds to its im2col workspace for
// cuDNN: the bytes of its input x, output y and weight w, room for the
// algorithms that transpose their operands and for the NCHW copies of a
// channels-last convolution cuDNN refuses (convnchw.go). It grows with the chunk as
// the tensors do (affine in the batch, as the planner requires); cuDNN
// may use the whole declared workspace.
func convDNNBytes(x, y, w []int, size int64) int64 {
	return size*int64(graph.Numel(x)+graph.Numel(y)+graph.Numel(w)) + convCopySlack
}

// newConvKey is the key of pass over geometry geo in dtype dt within
// budget bytes of workspace, channels last when nhwc.
func newConvKey(pass convPass, dt graph.DType, geo convGeom, budget int64, nhwc bool) convKey {
	wd := geo.Window
	return convKey{pass: pass, dt: dt, budget: budget, nhwc: nhwc,
		x:   [4]int64{wd.N, wd.C, wd.H, wd.W},
		w:   [4]int64{geo.o, geo.cg, wd.KH, wd.KW},
		y:   [4]int64{wd.N, geo.o, wd.HO, wd.WO},
		pad: [2]int64{wd.PH, wd.PW}, stride: [2]int64{wd.SH, wd.SW}, dil: [2]int64{wd.DH, wd.DW},
		groups: geo.groups}
}

// fftAlgo reports whether algo of pass is an FFT algorithm, whose float32
// results stray further from the direct sums than the float32 tolerance;
// plain float32 (no TF32) leaves them out.
func fftAlgo(pass convPass, algo int32) bool {
	switch pass {
	case convForward:
		return algo == 4 || algo == 5
	case convGradInput:
		return algo == 2 || algo == 3
	default:
		return algo == 2 || algo == 6
	}
}

// plan returns the plan of key, drawing on the timed choice (nil: the
// heuristics alone), making it on first use. It runs on the device
// thread.
func (n *DNN) plan(key convKey, choice *convChoice) (*convPlan, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil, fmt.Errorf("%w: cudnn handle", ErrClosed)
	}
	pk := planKey{key, choice}
	if p, ok := n.plans[pk]; ok {
		return p, nil
	}
	p, err := n.makePlan(key, choice)
	if err != nil {
		return nil, err
	}
	n.plans[pk] = p
	if !p.ok && !p.im2col {
		n.fallbacks++
	}
	return p, nil
}

// makePlan makes key's plan: the first of the choice's ranked algorithms
// whose workspace on key's shapes fits key's budget, else the best
// heuristic one that does, else none (ok false: im2col).
func (n *DNN) makePlan(key convKey, choice *convChoice) (*convPlan, error) {
	if _, ok := cudnnDType(key.dt); !ok {
		return &convPlan{}, nil
	}
	p, err := n.newConvDescs(key)
	if err != nil {
		return nil, err
	}
	ok, err := n.pickAlgo(p, key, choice)
	if err != nil {
		return nil, errors.Join(err, n.destroy(p))
	}
	p.ok = ok
	return p, nil
}

// pickAlgo sets p's algorithm (and math type) for key.
func (n *DNN) pickAlgo(p *convPlan, key convKey, choice *convChoice) (bool, error) {
	l := n.lib
	strict := n.strict(key.dt)
	if choice != nil {
		for _, r := range choice.ranked {
			if r.Algo == im2colAlgo {
				if r.Memory <= key.budget {
					p.im2col = true
					return false, nil
				}
				continue
			}
			if !strict {
				if err := n.setMath(p, r.Math); err != nil {
					return false, err
				}
			}
			ws, err := n.workspaceSize(p, key.pass, r.Algo)
			var ce *CUDNNError
			switch {
			case errors.As(err, &ce) && ce.NotSupported():
				continue
			case err != nil:
				return false, err
			case ws <= key.budget:
				p.algo, p.ws = r.Algo, ws
				return true, nil
			}
		}
		if err := n.setMath(p, n.mathOf(key.dt)); err != nil {
			return false, err
		}
	}
	var perf [16]cudnnAlgoPerf
	var got int32
	var fn string
	var s cudnnStatus
	switch key.pass {
	case convForward:
		fn, s = "cudnnGetConvolutionForwardAlgorithm_v7", l.cudnnGetConvolutionForwardAlgorithm(n.h, p.xd, p.wd, p.cd, p.yd, int32(len(perf)), &got, &perf[0])
	case convGradInput:
		fn, s = "cudnnGetConvolutionBackwardDataAlgorithm_v7", l.cudnnGetConvolutionBackwardDataAlgorithm(n.h, p.wd, p.yd, p.cd, p.xd, int32(len(perf)), &got, &perf[0])
	default:
		fn, s = "cudnnGetConvolutionBackwardFilterAlgorithm_v7", l.cudnnGetConvolutionBackwardFilterAlgorithm(n.h, p.xd, p.yd, p.cd, p.wd, int32(len(perf)), &got, &perf[0])
	}
	if err := l.check(fn, s); err != nil {
		var ce *CUDNNError
		if errors.As(err, &ce) && ce.NotSupported() {
			return false, nil // im2col takes it
		}
		return false, err
	}
	for _, c := range perf[:min(int(got), len(perf))] {
		switch {
		case c.Status != 0, c.Determinism != cudnnDeterministic, int64(c.Memory) > key.budget:
			continue
		case key.dt == graph.Float32 && c.MathType == cudnnTensorOpAllowConversion:
			continue // float32 rounded to 16 bits: never
		case strict && (c.MathType == cudnnTensorOpMath || fftAlgo(key.pass, c.Algo)):
			continue
		}
		if !strict {
			if err := n.setMath(p, c.MathType); err != nil {
				return false, err
			}
		}
		p.algo, p.ws = c.Algo, int64(c.Memory)
		return true, nil
	}
	return false, nil
}

// dnnConv runs pass on cuDNN when the executor has it and an algorithm
// fits the node's workspace: done reports whether it ran (else the im2col
// kernels run it). A channels-last convolution (nhwc: x, y NHWC, w KRSC)
// runs on cuDNN or fails with ErrChannelsLast, for its caller to run it on
// NCHW copies (convThroughNCHW): im2col is NCHW only. For the forward pass a, b, out are
// x, w, y; for grad_input g (dy), w, dx; for grad_weight x, g (dy), dw.
// beta is 1 to add to out (the forward pass's bias), 0 to overwrite it.
func (k *kctx) dnnConv(pass convPass, dt graph.DType, geo convGeom, nhwc bool, a, b, out operand, beta float32) (done bool, err error) {
	done, err = k.dnnConvRun(pass, dt, geo, nhwc, a, b, out, beta)
	if err == nil && !done && nhwc {
		key := newConvKey(pass, dt, geo, 0, true)
		return false, fmt.Errorf("conv2d %s of input %v, weight %v in %s, channels last: %w", pass, key.x, key.w, dt, ErrChannelsLast)
	}
	return done, err
}

// dnnConvRun is dnnConv, which it leaves to say that a channels-last node
// cannot run on im2col. A convolution whose tensors cuDNN's descriptors
// cannot describe runs in slices along N (convsplit.go).
func (k *kctx) dnnConvRun(pass convPass, dt graph.DType, geo convGeom, nhwc bool, a, b, out operand, beta float32) (done bool, err error) {
	n := k.dnn
	if n == nil || out.n() == 0 || (a.p|b.p|out.p)%16 != 0 {
		// cuDNN's tensor-core kernels want 16-byte aligned operands; a
		// chunk that starts mid-vector runs on im2col.
		return false, nil
	}
	// The plan's workspace is the node's, which Workspace sized.
	var budget int64
	if k.ws != nil {
		budget = k.ws.Requested()
	}
	key := newConvKey(pass, dt, geo, budget, nhwc)
	s := convSlice(key)
	if s == 0 { // no image at all, or one too large: im2col
		if nhwc && key.x[0] > 0 {
			return false, fmt.Errorf("conv2d %s in %s, channels last: %w: %w", pass, dt, ErrChannelsLast, errTooLarge(key))
		}
		return false, nil
	}
	// A node whose block is what the timed search declared for this chunk
	// size was compiled with the executor's Workspace and runs its choice;
	// any other (a program compiled with the static Workspace) runs on the
	// heuristics within its block, as it would on any executor.
	choice := n.choiceAt(k.g, k.nd, key)
	if choice != nil && budget != choice.fixed+choice.per*int64(k.c.Size) {
		choice = nil
	}
	// The plans of the slices (one: the whole batch), each within the
	// node's block; if either finds no algorithm, im2col runs it all.
	sizes := sliceSizes(key.x[0], s)
	plans := make([]*convPlan, len(sizes))
	var ws int64
	for i, m := range sizes {
		p, err := n.plan(sliceKey(key, m), choice)
		if err != nil {
			return false, fmt.Errorf("conv2d %s of input %v, weight %v in %s: %w", pass, key.x, key.w, dt, err)
		}
		if !p.ok {
			return false, nil
		}
		plans[i], ws = p, max(ws, p.ws)
	}
	wsp, err := k.workspace(ws)
	if err != nil {
		return false, err
	}
	size := elemSize(dt)
	xImg, yImg := size*key.x[1]*key.x[2]*key.x[3], size*key.y[1]*key.y[2]*key.y[3]
	for n0 := int64(0); n0 < key.x[0]; n0 += s {
		p := plans[0]
		if key.x[0]-n0 < s {
			p = plans[len(plans)-1]
		}
		// Slice n0's operands: x and y (or dy, dx) start n0 images on;
		// w, and dw, are whole.
		atX, atY := alloc.Ptr(n0*xImg), alloc.Ptr(n0*yImg)
		var pa, pb, po alloc.Ptr
		switch pass {
		case convForward: // a x, b w, out y
			pa, pb, po = a.p+atX, b.p, out.p+atY
		case convGradInput: // a dy, b w, out dx
			pa, pb, po = a.p+atY, b.p, out.p+atX
		default: // a x, b dy, out dw: the slices' sums add up
			pa, pb, po = a.p+atX, b.p+atY, out.p
			if n0 > 0 {
				beta = 1
			}
		}
		err := n.convCall(pass, p, pa, pb, po, wsp, beta)
		if err == nil {
			continue
		}
		var ce *CUDNNError
		if n0 == 0 && errors.As(err, &ce) && ce.NotSupported() {
			n.mu.Lock()
			n.fallbacks++
			n.mu.Unlock()
			return false, nil // im2col takes it
		}
		// A slice refused after others ran: their results are in out
		// (the forward pass has added to the bias), so im2col cannot
		// start over.
		at := ""
		if len(sizes) > 1 {
			at = fmt.Sprintf(", the slice of images from %d", n0)
		}
		if nhwc { // cuDNN answers BAD_PARAM for some channels-last shapes
			return false, fmt.Errorf("conv2d %s of input %v, weight %v in %s, channels last%s: %w: %w", pass, key.x, key.w, dt, at, ErrChannelsLast, err)
		}
		return false, fmt.Errorf("conv2d %s of input %v, weight %v in %s%s: %w", pass, key.x, key.w, dt, at, err)
	}
	if len(sizes) > 1 {
		n.splitConvs.Add(1)
		n.splitSlices.Add((key.x[0] + s - 1) / s)
	}
	return true, nil
}

// convCall runs pass of plan p once: for the forward pass pa, pb, po are
// x, w, y; for grad_input dy, w, dx; for grad_weight x, dy, dw; ws is p's
// workspace.
func (n *DNN) convCall(pass convPass, p *convPlan, pa, pb, po, ws alloc.Ptr, beta float32) error {
	l, one := n.lib, float32(1)
	var fn string
	var s cudnnStatus
	switch pass {
	case convForward:
		fn, s = "cudnnConvolutionForward", l.cudnnConvolutionForward(n.h, &one, p.xd, CUdeviceptr(pa), p.wd, CUdeviceptr(pb), p.cd, p.algo,
			CUdeviceptr(ws), uintptr(p.ws), &beta, p.yd, CUdeviceptr(po))
	case convGradInput:
		fn, s = "cudnnConvolutionBackwardData", l.cudnnConvolutionBackwardData(n.h, &one, p.wd, CUdeviceptr(pb), p.yd, CUdeviceptr(pa), p.cd, p.algo,
			CUdeviceptr(ws), uintptr(p.ws), &beta, p.xd, CUdeviceptr(po))
	default:
		fn, s = "cudnnConvolutionBackwardFilter", l.cudnnConvolutionBackwardFilter(n.h, &one, p.xd, CUdeviceptr(pa), p.yd, CUdeviceptr(pb), p.cd, p.algo,
			CUdeviceptr(ws), uintptr(p.ws), &beta, p.wd, CUdeviceptr(po))
	}
	return l.check(fn, s)
}
