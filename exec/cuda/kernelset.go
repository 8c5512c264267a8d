package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/batchfit/batchfit/graph"
)

// Kernel names, as declared extern "C" in kernels/*.cu (see
// kernels/README.md for each one's arguments and launch shape).
const (
	kAccumulate     = "accumulate_f32"
	kAccumulateMax  = "accumulate_max_f32"
	kFillF32        = "fill_f32"
	kFillI64        = "fill_i64"
	kBatchNorm      = "batch_norm_f32"
	kBatchNormRows  = "batch_norm_rows_f32"
	kBatchNormGradX = "batch_norm_grad_x_f32"

	kBatchNormNHWC      = "batch_norm_nhwc_f32"
	kBatchNormRowsNHWC  = "batch_norm_rows_nhwc_f32"
	kBatchNormGradXNHWC = "batch_norm_grad_x_nhwc_f32"
	// The channels-last vector path (16-byte loads and stores).
	kBatchNormRowsNHWCVec  = "batch_norm_rows_nhwc_vec_f32"
	kBatchNormNHWCVec      = "batch_norm_nhwc_vec_f32"
	kBatchNormGradXNHWCVec = "batch_norm_grad_x_nhwc_vec_f32"
	// Untyped: their per-channel operands' dtype comes at run time.
	kBatchNormCoef     = "batch_norm_coef"
	kBatchNormGradCoef = "batch_norm_grad_coef"
	kBatchNormMoment   = "batch_norm_moments"
	kIm2col            = "im2col_f32"
	kRegroup           = "regroup_f32"
	kCol2im            = "col2im_f32"
	kDropout           = "dropout_f32"
	kUnary             = "unary_f32"
	kScalar            = "scalar_f32"
	kBinary            = "binary_f32"
	kBinaryBcast       = "binary_bcast_f32"
	kReluGrad          = "relu_grad_f32"
	kGeluGrad          = "gelu_grad_f32"
	kUnaryGrad         = "unary_grad_f32"
	kMaximumScGrad     = "maximum_scalar_grad_f32"
	kMaximumGrad       = "maximum_grad_f32"
	kCausalMask        = "causal_mask_f32"
	kBiasFill          = "bias_fill_f32"
	kEmbedding         = "embedding_f32"
	kEmbeddingGrad     = "embedding_grad_f32"
	kLayerNorm         = "layer_norm_f32"
	kAddLayerNorm      = "add_layer_norm" // typed by b's and y's dtypes
	kAddLayerNormW4    = "add_layer_norm_w4"
	kLayerNormGradX    = "layer_norm_grad_x_f32"
	kLayerNormStats    = "layer_norm_stats_f32"
	kLayerNormGradW    = "layer_norm_grad_w_f32"
	kLayerNormFused    = "layer_norm_grad_fused_f32"
	kLayerNormGradWB   = "layer_norm_grad_wb_f32"
	kCrossEntropy      = "cross_entropy_rows_f32"
	kCrossEntFused     = "cross_entropy_fused_f32"
	kCrossEntGrad      = "cross_entropy_grad_f32"
	kMSEPartial        = "mse_partial_f32"
	kMSEGrad           = "mse_grad_f32"
	kSumF64            = "sum_f64_f32"
	kLinearCERows      = "linear_ce_rows_f32"
	kLinearCEAcc       = "linear_ce_acc"
	kCopy              = "copy_f32"
	kGather            = "gather_f32"
	kGatherRows        = "gather_rows_f32"
	kTranspose         = "transpose_f32"
	kSlice             = "slice_f32"
	kSliceGrad         = "slice_grad_f32"
	kCopy2d            = "copy2d_f32"
	kSGD               = "sgd_multi_f32"
	kAdam              = "adam_multi_f32"
	kMaxPool           = "max_pool2d_f32"
	kMaxPoolArgmax     = "max_pool2d_argmax_f32"
	kMaxPoolGrad       = "max_pool2d_grad_f32"
	kAvgPool           = "avg_pool2d_f32"
	kAvgPoolGrad       = "avg_pool2d_grad_f32"
	kMaxPoolNHWC       = "max_pool2d_nhwc_f32"
	kMaxPoolArgmaxNHWC = "max_pool2d_argmax_nhwc_f32"
	kMaxPoolGradNHWC   = "max_pool2d_grad_nhwc_f32"
	kAvgPoolNHWC       = "avg_pool2d_nhwc_f32"
	kAvgPoolGradNHWC   = "avg_pool2d_grad_nhwc_f32"
	kReduceRows        = "reduce_rows_f32"
	kReduceMid         = "reduce_mid_f32"
	kReduceMidV8       = "reduce_mid_v8_f32" // 16-bit instantiations only
	kReduceSplits      = "reduce_splits_f32"
	kReduceStrided     = "reduce_strided_f32"
	kMaxGrad           = "max_grad_f32"
	kSoftmaxRows       = "softmax_rows_f32"
	kSoftmaxCols       = "softmax_cols_f32"
	kSoftmaxGradRows   = "softmax_grad_rows_f32"
	kSoftmaxGradCols   = "softmax_grad_cols_f32"
	kRMSNorm           = "rms_norm_f32"
	kAddRMSNorm        = "add_rms_norm" // typed by b's and y's dtypes
	kRMSNormGrad       = "rms_norm_grad_f32"
	kRotary            = "rotary_f32"
	kSwiGLU            = "swiglu_f32"
	kSwiGLUGrad        = "swiglu_grad_f32"
	kAttentionFwd      = "attention_fwd_f32"
	kAttentionGradQ    = "attention_grad_q_f32"
	kAttentionGradKV   = "attention_grad_kv_f32"
)

// kernelFiles lists the executor's kernels by source file: one NVRTC
// module each. Every kernel file but smoke.cu (the foundation's test
// kernel) is here.
var kernelFiles = map[string][]string{
	"attention.cu":  slices.Concat(attnPlainKernels(), attnMMAKernels(), []string{kAttnRowsFwd, kAttnRowsBwd}),
	"accumulate.cu": append(allTyped(kAccumulate, kAccumulateMax, kFillF32), kFillI64),
	"batchnorm.cu": append(allTyped(kBatchNorm, kBatchNormRows, kBatchNormGradX, kBatchNormNHWC, kBatchNormRowsNHWC, kBatchNormGradXNHWC,
		kBatchNormRowsNHWCVec, kBatchNormNHWCVec, kBatchNormGradXNHWCVec),
		kBatchNormCoef, kBatchNormGradCoef, kBatchNormMoment),
	"conv.cu":    allTyped(kIm2col, kCol2im, kRegroup),
	"dropout.cu": allTyped(kDropout),
	"elementwise.cu": slices.Concat(allTyped(kUnary, kScalar, kBinary, kBinaryBcast, kReluGrad, kGeluGrad, kUnaryGrad,
		kMaximumScGrad, kMaximumGrad, kCausalMask, kBiasFill), mixedBinaryKernels(), castKernels()),
	"index.cu": allTyped(kEmbedding, kEmbeddingGrad),
	"layernorm.cu": slices.Concat(allTyped(kLayerNorm, kLayerNormGradX, kLayerNormStats, kLayerNormGradW, kLayerNormFused, kLayerNormGradWB),
		[]string{typed(kLayerNorm, graph.Float32, graph.BFloat16), typed(kLayerNorm, graph.Float32, graph.Float16)}, addLayerNormKernels()),
	"loss.cu":     append(allTyped(kCrossEntropy, kCrossEntFused, kCrossEntGrad, kMSEPartial, kMSEGrad, kSumF64, kLinearCERows), kLinearCEAcc),
	"movement.cu": append(allMoving(kCopy, kGather, kGatherRows, kTranspose, kSlice, kCopy2d), kSliceGrad, "slice_grad_b16"),
	"optim.cu":    {kSGD, kAdam, kUnscale, kOptimScalars, kNormPartial, kNormFinish},
	"pool.cu": allTyped(kMaxPool, kMaxPoolArgmax, kMaxPoolGrad, kAvgPool, kAvgPoolGrad,
		kMaxPoolNHWC, kMaxPoolArgmaxNHWC, kMaxPoolGradNHWC, kAvgPoolNHWC, kAvgPoolGradNHWC),
	"reduce.cu": append(allTyped(kReduceRows, kReduceMid, kReduceSplits, kReduceStrided, kMaxGrad),
		typed(kReduceMidV8, graph.BFloat16), typed(kReduceMidV8, graph.Float16)),
	"softmax.cu": allTyped(kSoftmaxRows, kSoftmaxCols, kSoftmaxGradRows, kSoftmaxGradCols),
	"rmsnorm.cu": slices.Concat(allTyped(kRMSNorm, kRMSNormGrad),
		[]string{typed(kRMSNorm, graph.Float32, graph.BFloat16), typed(kRMSNorm, graph.Float32, graph.Float16)}, addRMSNormKernels()),
	"rotary.cu": allTyped(kRotary),
	"swiglu.cu": allTyped(kSwiGLU, kSwiGLUGrad),
}

// kernelParts is how many NVRTC programs a kernel file compiles as, side
// by side: the file's kernels instantiated under #if PART(k) (common.cuh)
// compile in program k only. Whole, attention.cu took 28 s of a cold
// start on the H200 (its plain kernels' three passes 22 s of it) and
// elementwise.cu 21 s, loss.cu 13 s and layernorm.cu 11 s.
var kernelParts = map[string]int{"attention.cu": 6, "elementwise.cu": 4, "layernorm.cu": 4, "loss.cu": 3}

// partSource is part k of a kernel file's source: BATCHFIT_PART defined
// to k in front of it.
func partSource(src string, k int) string {
	return fmt.Sprintf("#define BATCHFIT_PART %d\n", k) + src
}

// kernel is a function of a loaded module.
type kernel struct {
	m *Module
	f CUfunction
	// params is how many parameters f takes (−1: the driver cannot say);
	// kctx.launch refuses another count with ErrKernelArgs, as the driver
	// would read past the argument array.
	params int
}

// kernelSet holds the executor's modules and functions.
type kernelSet struct {
	mods []*Module
	fns  map[string]kernel
	// resident memoises residentBlocks, by kernel and threads per block.
	mu       sync.Mutex
	resident map[residentKey]int64
	// pw holds the generated kernels of fused_pointwise (pointwise.go).
	pw pwCache
}

type residentKey struct {
	name    string
	threads int
}

// residentBlocks is how many blocks of threads threads of kernel name the
// whole device holds at once (its multiprocessors times Occupancy): a
// grid of at most that many runs in one wave.
func (ks *kernelSet) residentBlocks(d *Device, name string, threads int) (int64, error) {
	key := residentKey{name, threads}
	ks.mu.Lock()
	n, ok := ks.resident[key]
	ks.mu.Unlock()
	if ok {
		return n, nil
	}
	kn, err := ks.get(name)
	if err != nil {
		return 0, err
	}
	per, err := kn.m.Occupancy(kn.f, threads)
	if err != nil {
		return 0, err
	}
	n = int64(max(per, 1) * max(d.SMs(), 1))
	ks.mu.Lock()
	if ks.resident == nil {
		ks.resident = map[residentKey]int64{}
	}
	ks.resident[key] = n
	ks.mu.Unlock()
	return n, nil
}

// loadKernels compiles (or loads from the cubin cache) every file of
// kernelFiles and looks up its functions. The files, and the parts of the
// larger ones (kernelParts), compile side by side (compileAll): on an
// empty cache the start waits for the slowest program, not for the sum of
// them.
func loadKernels(d *Device) (*kernelSet, error) {
	ks := &kernelSet{fns: map[string]kernel{}}
	progs, err := kernelPrograms()
	if err != nil {
		return nil, err
	}
	names, srcs := make([]string, len(progs)), make([]string, len(progs))
	for i, p := range progs {
		names[i], srcs[i] = p.name, p.src
	}
	mods, err := compileAll(d, names, srcs)
	if err != nil {
		return nil, err
	}
	ks.mods = mods
	for i := 0; i < len(mods); {
		file, j := progs[i].file, i // mods[i:j] are file's programs
		for j < len(mods) && progs[j].file == file {
			j++
		}
		for _, n := range kernelFiles[file] {
			kn, err := findKernel(mods[i:j], n)
			if err != nil {
				return nil, errors.Join(fmt.Errorf("cuda: kernel %s of %s: %w", n, file, err), ks.close())
			}
			ks.fns[n] = kn
		}
		i = j
	}
	return ks, nil
}

// program is one NVRTC program of the executor's kernels: a kernel file,
// or part of one (kernelParts).
type program struct {
	file, name, src string
}

// kernelPrograms lists the programs of kernelFiles, by file name and part.
func kernelPrograms() ([]program, error) {
	var progs []program
	for _, file := range Names() {
		if _, ok := kernelFiles[file]; !ok {
			continue
		}
		src, err := Source(file)
		if err != nil {
			return nil, err
		}
		parts := kernelParts[file]
		if parts == 0 {
			progs = append(progs, program{file, file, src})
			continue
		}
		for k := range parts {
			progs = append(progs, program{file, fmt.Sprintf("%s[%d/%d]", file, k, parts), partSource(src, k)})
		}
	}
	return progs, nil
}

// findKernel finds kernel name in the first of mods that has it (a file
// compiled in parts has each kernel in one of them).
func findKernel(mods []*Module, name string) (kernel, error) {
	var err error
	for _, m := range mods {
		var f CUfunction
		if f, err = m.Function(name); err != nil {
			continue
		}
		params, err := m.ParamCount(f)
		if err != nil {
			return kernel{}, err
		}
		return kernel{m, f, params}, nil
	}
	return kernel{}, err
}

// compileAll is d.Compile of each (names[i], srcs[i]), on up to one
// goroutine per host core: NVRTC compiles programs on many threads at
// once, and each Compile loads its module through the device goroutine.
// The modules come back in the order given; on an error none stays
// loaded, and the error is the first program's in that order.
func compileAll(d *Device, names, srcs []string) ([]*Module, error) {
	mods := make([]*Module, len(names))
	errs := make([]error, len(names))
	workers := runtime.NumCPU()
	if d.onThread() {
		// Called from the device goroutine, whose loads the others would
		// wait for: one at a time, here.
		workers = 1
	}
	forEach(workers, len(names), func(i int) {
		mods[i], errs[i] = d.Compile(names[i], srcs[i])
	})
	var first error
	for _, err := range errs {
		if err != nil {
			first = err
			break
		}
	}
	if first == nil {
		return mods, nil
	}
	var closeErrs []error
	for _, m := range mods {
		if m != nil {
			closeErrs = append(closeErrs, m.Close())
		}
	}
	return nil, errors.Join(append([]error{first}, closeErrs...)...)
}

// forEach runs f(0…n−1) on at most workers goroutines and waits for them.
func forEach(workers, n int, f func(i int)) {
	workers = max(1, min(workers, n))
	if workers == 1 {
		for i := range n {
			f(i)
		}
		return
	}
	var (
		wg   sync.WaitGroup
		next atomic.Int64
	)
	for range workers {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				f(i)
			}
		})
	}
	wg.Wait()
}

func (ks *kernelSet) get(name string) (kernel, error) {
	k, ok := ks.fns[name]
	if !ok {
		return kernel{}, graph.Errorf(graph.ErrAttr, "cuda: no kernel %q loaded", name)
	}
	return k, nil
}

func (ks *kernelSet) close() error {
	var errs []error
	ks.mu.Lock()
	defer ks.mu.Unlock()
	for _, m := range ks.mods {
		errs = append(errs, m.Close())
	}
	ks.mods = nil
	return errors.Join(errs...)
}
