package cuda

import (
	"errors"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// cuDNN's batch norm (libcudnn_ops.so.9's legacy API), unless
// ExecutorOptions.NoCuDNNBatchNorm: batch_norm's forward pass in both modes
// and batch_norm_grad_x, over x [N, C, ...] viewed as NCHW [N, C, inner,
// 1] in SPATIAL mode (statistics over every axis but the channels). It
// runs where its per-channel values are float32: float32 models, and
// 16-bit x under mixed precision (float32 weight, bias and running
// statistics, as autocast calls it); other graphs, or a cuDNN without
// these symbols, run on kernels/batchnorm.cu. So do channels-last batch
// norms (graph.Attrs.ChannelsLast): cuDNN 9.14's legacy batch norm over
// NHWC descriptors took 60 ms forward and 194 ms backward a step of
// ResNet-50 at batch 64 in bfloat16 on the H100 (NCHW: 3.8 and 8.6).
//
// Its scale and bias must exist: a batch norm without weight (bias) hands
// it ones (zeros) from the workspace. The backward pass's scale and bias
// gradients are batch_norm_grad_w's output and the bias gradient's sum's
// when the planner made those nodes batch_norm_grad_x's companions, else
// they go to the workspace (dnnBNBytes).

// cudnnBatchNormMode_t: per channel, over N, H and W.
const cudnnBatchNormSpatial = 1

// cudnnBNLib holds the batch norm entry points; C signatures in comments.
type cudnnBNLib struct {
	// cudnnStatus_t cudnnDeriveBNTensorDescriptor(cudnnTensorDescriptor_t derivedBnDesc,
	//     const cudnnTensorDescriptor_t xDesc, cudnnBatchNormMode_t mode)
	cudnnDeriveBNTensorDescriptor func(d, x cudnnTensorDesc, mode int32) cudnnStatus
	// cudnnStatus_t cudnnBatchNormalizationForwardTraining(cudnnHandle_t handle, cudnnBatchNormMode_t mode,
	//     const void *alpha, const void *beta, const cudnnTensorDescriptor_t xDesc, const void *x,
	//     const cudnnTensorDescriptor_t yDesc, void *y, const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc,
	//     const void *bnScale, const void *bnBias, double exponentialAverageFactor, void *resultRunningMean,
	//     void *resultRunningVariance, double epsilon, void *resultSaveMean, void *resultSaveInvVariance)
	cudnnBatchNormalizationForwardTraining func(h cudnnHandle, mode int32, alpha, beta *float32,
		xd cudnnTensorDesc, x CUdeviceptr, yd cudnnTensorDesc, y CUdeviceptr, pd cudnnTensorDesc,
		scale, bias CUdeviceptr, factor float64, runMean, runVar CUdeviceptr, eps float64,
		saveMean, saveInvVar CUdeviceptr) cudnnStatus
	// cudnnStatus_t cudnnBatchNormalizationForwardInference(cudnnHandle_t handle, cudnnBatchNormMode_t mode,
	//     const void *alpha, const void *beta, const cudnnTensorDescriptor_t xDesc, const void *x,
	//     const cudnnTensorDescriptor_t yDesc, void *y, const cudnnTensorDescriptor_t bnScaleBiasMeanVarDesc,
	//     const void *bnScale, const void *bnBias, const void *estimatedMean, const void *estimatedVariance,
	//     double epsilon)
	cudnnBatchNormalizationForwardInference func(h cudnnHandle, mode int32, alpha, beta *float32,
		xd cudnnTensorDesc, x CUdeviceptr, yd cudnnTensorDesc, y CUdeviceptr, pd cudnnTensorDesc,
		scale, bias, mean, variance CUdeviceptr, eps float64) cudnnStatus
	// cudnnStatus_t cudnnBatchNormalizationBackward(cudnnHandle_t handle, cudnnBatchNormMode_t mode,
	//     const void *alphaDataDiff, const void *betaDataDiff, const void *alphaParamDiff,
	//     const void *betaParamDiff, const cudnnTensorDescriptor_t xDesc, const void *x,
	//     const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnTensorDescriptor_t dxDesc,
	//     void *dx, const cudnnTensorDescriptor_t dBnScaleBiasDesc, const void *bnScale,
	//     void *dBnScaleResult, void *dBnBiasResult, double epsilon, const void *savedMean,
	//     const void *savedInvVariance)
	cudnnBatchNormalizationBackward func(h cudnnHandle, mode int32, alphaData, betaData, alphaParam, betaParam *float32,
		xd cudnnTensorDesc, x CUdeviceptr, dyd cudnnTensorDesc, dy CUdeviceptr, dxd cudnnTensorDesc, dx CUdeviceptr,
		pd cudnnTensorDesc, scale, dScale, dBias CUdeviceptr, eps float64, savedMean, savedInvVar CUdeviceptr) cudnnStatus
}

func (c *cudnnBNLib) symbols() []symbol {
	return []symbol{
		sym(&c.cudnnDeriveBNTensorDescriptor, "cudnnDeriveBNTensorDescriptor"),
		sym(&c.cudnnBatchNormalizationForwardTraining, "cudnnBatchNormalizationForwardTraining"),
		sym(&c.cudnnBatchNormalizationForwardInference, "cudnnBatchNormalizationForwardInference"),
		sym(&c.cudnnBatchNormalizationBackward, "cudnnBatchNormalizationBackward"),
	}
}

// bnKey is a batch norm plan's dtype and x's [n, c, inner].
type bnKey struct {
	dt          graph.DType
	n, c, inner int64
}

// bnPlan holds x's descriptor (also y's, dy's and dx's) and the derived
// per-channel one.
type bnPlan struct {
	xd, pd cudnnTensorDesc
}

// dnnBNBytes is what the cuDNN batch norm adds to batch_norm's and
// batch_norm_grad_x's workspaces for c channels: three float32 [c]
// vectors (ones and zeros for a missing weight and bias, or the scale and
// bias gradients), each 256-aligned.
func dnnBNBytes(c int64) int64 { return 3 * align256(4*c) }

// bnPlan returns the plan of key, making it on first use; nil when cuDNN
// has no batch norm. It runs on the device thread.
func (n *DNN) bnPlan(key bnKey) (*bnPlan, error) {
	if n.bn == nil {
		return nil, nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil, errors.New("cudnn handle closed")
	}
	if p, ok := n.bnPlans[key]; ok {
		return p, nil
	}
	l := n.lib
	dt, _ := cudnnDType(key.dt)
	p := &bnPlan{}
	err := l.check("cudnnCreateTensorDescriptor", l.cudnnCreateTensorDescriptor(&p.xd))
	if err == nil {
		err = l.check("cudnnCreateTensorDescriptor", l.cudnnCreateTensorDescriptor(&p.pd))
	}
	if err == nil {
		err = l.check("cudnnSetTensor4dDescriptor", l.cudnnSetTensor4dDescriptor(p.xd, cudnnNCHW, dt,
			int32(key.n), int32(key.c), int32(key.inner), 1))
	}
	if err == nil {
		err = l.check("cudnnDeriveBNTensorDescriptor", n.bn.cudnnDeriveBNTensorDescriptor(p.pd, p.xd, cudnnBatchNormSpatial))
	}
	if err != nil {
		return nil, errors.Join(err, n.destroyBN(p))
	}
	n.bnPlans[key] = p
	return p, nil
}

func (n *DNN) destroyBN(p *bnPlan) error {
	l := n.lib
	var errs []error
	for _, d := range []cudnnTensorDesc{p.xd, p.pd} {
		if d != 0 {
			errs = append(errs, l.check("cudnnDestroyTensorDescriptor", l.cudnnDestroyTensorDescriptor(d)))
		}
	}
	return errors.Join(errs...)
}

// dnnBN is the cuDNN plan for a batch norm node over x with per-channel
// operands params (nil ones absent), or nil when cuDNN does not take it:
// no cuDNN batch norm, a dtype it lacks, per-channel values not float32,
// more elements than its descriptors describe (cudnnMaxElems: their
// sizes are int32; batchnorm.cu's kernels index in 64 bits), or
// misaligned operands.
func (k *kctx) dnnBN(x, out operand, params ...*operand) (*bnPlan, error) {
	if k.dnn == nil || k.dnn.bn == nil || x.dt != out.dt || x.n() == 0 || x.n() > cudnnMaxElems.Load() || (x.p|out.p)%16 != 0 {
		return nil, nil
	}
	if _, ok := cudnnDType(x.dt); !ok {
		return nil, nil
	}
	for _, p := range params {
		if p != nil && p.dt != graph.Float32 {
			return nil, nil
		}
	}
	n, c, inner, err := channels(k.nd.Op.String(), x)
	if err != nil || c == 0 {
		return nil, err
	}
	return k.dnn.bnPlan(bnKey{dt: x.dt, n: n, c: c, inner: inner})
}

// dnnOnes fills a float32 [c] of ones at p (the scale of a batch norm
// without weight).
func (k *kctx) dnnOnes(p alloc.Ptr, c int64) error {
	return k.flat(kFillF32, c, p, c, float32(1))
}

// dnnBatchNorm runs batch_norm on cuDNN: done reports whether it ran.
func (k *kctx) dnnBatchNorm(a *graph.Attrs, in []operand, out operand) (done bool, err error) {
	if a.ChannelsLast { // batchnorm.cu's channels-last kernels (see batchnorm.go)
		return false, nil
	}
	x := in[0]
	aff := graph.BatchNormAffine(a.Training)
	w, b := optional(in, aff), optional(in, aff+1)
	var runMean, runVar *operand
	if !a.Training {
		runMean, runVar = optional(in, 1), optional(in, 2)
		if runMean == nil || runVar == nil {
			return false, nil
		}
	}
	p, err := k.dnnBN(x, out, w, b, runMean, runVar)
	if p == nil || err != nil {
		return false, err
	}
	c := int64(x.shape[1])
	for _, q := range []*operand{w, b, runMean, runVar} {
		if q != nil && q.n() != c {
			return false, graph.Errorf(graph.ErrShape, "batch_norm per-channel input %v, want [%d]", q.shape, c)
		}
	}
	ws, err := k.workspace(statsBytes(c) + dnnBNBytes(c))
	if err != nil {
		return false, err
	}
	ones, zeros := ws+alloc.Ptr(statsBytes(c)), ws+alloc.Ptr(statsBytes(c)+align256(4*c))
	scale, bias := ptrOf(w), ptrOf(b)
	if w == nil {
		if err := k.dnnOnes(ones, c); err != nil {
			return false, err
		}
		scale = ones
	}
	if b == nil {
		if err := k.d.Memzero(zeros, 4*c); err != nil {
			return false, err
		}
		bias = zeros
	}
	l, bn, one, zero := k.dnn.lib, k.dnn.bn, float32(1), float32(0)
	if a.Training {
		s := bn.cudnnBatchNormalizationForwardTraining(k.dnn.h, cudnnBatchNormSpatial, &one, &zero,
			p.xd, CUdeviceptr(x.p), p.xd, CUdeviceptr(out.p), p.pd, CUdeviceptr(scale), CUdeviceptr(bias),
			0, 0, 0, a.Eps, 0, 0)
		return true, l.check("cudnnBatchNormalizationForwardTraining", s)
	}
	s := bn.cudnnBatchNormalizationForwardInference(k.dnn.h, cudnnBatchNormSpatial, &one, &zero,
		p.xd, CUdeviceptr(x.p), p.xd, CUdeviceptr(out.p), p.pd, CUdeviceptr(scale), CUdeviceptr(bias),
		CUdeviceptr(runMean.p), CUdeviceptr(runVar.p), a.Eps)
	return true, l.check("cudnnBatchNormalizationForwardInference", s)
}

// dnnBatchNormGradX runs batch_norm_grad_x on cuDNN (its backward pass,
// statistics recomputed from x): done reports whether it ran.
func (k *kctx) dnnBatchNormGradX(a *graph.Attrs, g, x operand, w *operand, out operand) (done bool, err error) {
	if a.ChannelsLast {
		return false, nil
	}
	if !a.Training || g.dt != x.dt || g.n() != x.n() || out.n() != x.n() || g.p%16 != 0 {
		return false, nil
	}
	p, err := k.dnnBN(x, out, w)
	if p == nil || err != nil {
		return false, err
	}
	c := int64(x.shape[1])
	if w != nil && w.n() != c {
		return false, graph.Errorf(graph.ErrShape, "batch_norm_grad_x weight %v, want [%d]", w.shape, c)
	}
	ws, err := k.workspace(statsBytes(c) + dnnBNBytes(c))
	if err != nil {
		return false, err
	}
	base := ws + alloc.Ptr(statsBytes(c))
	ones, dScale, dBias := base, base+alloc.Ptr(align256(4*c)), base+alloc.Ptr(2*align256(4*c))
	scale := ptrOf(w)
	if w == nil {
		if err := k.dnnOnes(ones, c); err != nil {
			return false, err
		}
		scale = ones
	}
	// Its companions batch_norm_grad_w (graph.BatchNormGradWProducer) and
	// the bias gradient (graph.BatchNormBiasGradProducer) are the scale's
	// and the bias's gradients: written straight into their outputs when
	// those are float32, else cast into them from the workspace.
	co := k.bnCompanions(c)
	if co.dw != nil && co.dw.dt == graph.Float32 {
		dScale = co.dw.p
	}
	if co.db != nil && co.db.dt == graph.Float32 {
		dBias = co.db.p
	}
	one, zero := float32(1), float32(0)
	s := k.dnn.bn.cudnnBatchNormalizationBackward(k.dnn.h, cudnnBatchNormSpatial, &one, &zero, &one, &zero,
		p.xd, CUdeviceptr(x.p), p.xd, CUdeviceptr(g.p), p.xd, CUdeviceptr(out.p), p.pd,
		CUdeviceptr(scale), CUdeviceptr(dScale), CUdeviceptr(dBias), a.Eps, 0, 0)
	if err := k.dnn.lib.check("cudnnBatchNormalizationBackward", s); err != nil {
		return true, err
	}
	for _, o := range []struct {
		v   *operand
		src alloc.Ptr
	}{{co.dw, dScale}, {co.db, dBias}} {
		if o.v != nil && o.v.dt != graph.Float32 {
			if err := k.packs(castKernel(graph.Float32, o.v.dt), c, perPack(graph.Float32, o.v.dt), o.src, o.v.p, c); err != nil {
				return true, err
			}
		}
	}
	co.done()
	return true, nil
}
