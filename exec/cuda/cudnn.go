package cuda

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
)

type (
	cudnnHandle     uintptr // cudnnHandle_t
	cudnnStatus     int32   // cudnnStatus_t
	cudnnTensorDesc uintptr // cudnnTensorDescriptor_t
	cudnnFilterDesc uintptr // cudnnFilterDescriptor_t
	cudnnConvDesc   uintptr // cudnnConvolutionDescriptor_t
)

// cudnnDataType_t, cudnnTensorFormat_t, cudnnConvolutionMode_t,
// cudnnMathType_t and cudnnDeterminism_t values.
const (
	cudnnDataFloat    = 0
	cudnnDataHalf     = 2
	cudnnDataBFloat16 = 9

	cudnnNCHW = 0
	cudnnNHWC = 1

	cudnnCrossCorrelation = 1

	cudnnDefaultMath             = 0
	cudnnTensorOpMath            = 1
	cudnnTensorOpAllowConversion = 2
	cudnnFMAMath                 = 3

	cudnnDeterministic = 1
)

// The number of cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t values in
// cuDNN 9: an algorithm id outside [0, count) is not one.
const (
	cudnnFwdAlgoCount       = 8
	cudnnBwdDataAlgoCount   = 6
	cudnnBwdFilterAlgoCount = 7
)

// cudnnAlgoPerf is cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t, which
// share one layout: the algorithm, its status, a time (-1 from the
// heuristics), its workspace bytes, determinism and math type.
type cudnnAlgoPerf struct {
	Algo        int32
	Status      cudnnStatus
	Time        float32
	_           int32
	Memory      uint64
	Determinism int32
	MathType    int32
	_           [3]int32
	_           int32
}

// cudnnFindLib holds the timed algorithm search and the workspace
// queries of the legacy convolution API (libcudnn_cnn.so.9); C signatures
// in the comments. The search runs every algorithm on buffers and a
// workspace the caller allocates (the Ex variants: cuDNN allocates
// nothing).
type cudnnFindLib struct {
	// cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
	//     const void *x, const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t convDesc,
	//     const cudnnTensorDescriptor_t yDesc, void *y, const int requestedAlgoCount, int *returnedAlgoCount,
	//     cudnnConvolutionFwdAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes)
	cudnnFindConvolutionForwardAlgorithmEx func(h cudnnHandle, xd cudnnTensorDesc, x CUdeviceptr, wd cudnnFilterDesc,
		w CUdeviceptr, c cudnnConvDesc, yd cudnnTensorDesc, y CUdeviceptr, requested int32, returned *int32,
		perf *cudnnAlgoPerf, ws CUdeviceptr, wsBytes uintptr) cudnnStatus
	// cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc,
	//     const void *w, const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
	//     const cudnnTensorDescriptor_t dxDesc, void *dx, const int requestedAlgoCount, int *returnedAlgoCount,
	//     cudnnConvolutionBwdDataAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes)
	cudnnFindConvolutionBackwardDataAlgorithmEx func(h cudnnHandle, wd cudnnFilterDesc, w CUdeviceptr, dyd cudnnTensorDesc,
		dy CUdeviceptr, c cudnnConvDesc, dxd cudnnTensorDesc, dx CUdeviceptr, requested int32, returned *int32,
		perf *cudnnAlgoPerf, ws CUdeviceptr, wsBytes uintptr) cudnnStatus
	// cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
	//     const void *x, const cudnnTensorDescriptor_t dyDesc, const void *y, const cudnnConvolutionDescriptor_t convDesc,
	//     const cudnnFilterDescriptor_t dwDesc, void *dw, const int requestedAlgoCount, int *returnedAlgoCount,
	//     cudnnConvolutionBwdFilterAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes)
	cudnnFindConvolutionBackwardFilterAlgorithmEx func(h cudnnHandle, xd cudnnTensorDesc, x CUdeviceptr, dyd cudnnTensorDesc,
		dy CUdeviceptr, c cudnnConvDesc, dwd cudnnFilterDesc, dw CUdeviceptr, requested int32, returned *int32,
		perf *cudnnAlgoPerf, ws CUdeviceptr, wsBytes uintptr) cudnnStatus

	// cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
	//     const cudnnFilterDescriptor_t wDesc, const cudnnConvolutionDescriptor_t convDesc,
	//     const cudnnTensorDescriptor_t yDesc, cudnnConvolutionFwdAlgo_t algo, size_t *sizeInBytes)
	cudnnGetConvolutionForwardWorkspaceSize func(h cudnnHandle, xd cudnnTensorDesc, wd cudnnFilterDesc, c cudnnConvDesc,
		yd cudnnTensorDesc, algo int32, size *uintptr) cudnnStatus
	// cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc,
	//     const cudnnTensorDescriptor_t dyDesc, const cudnnConvolutionDescriptor_t convDesc,
	//     const cudnnTensorDescriptor_t dxDesc, cudnnConvolutionBwdDataAlgo_t algo, size_t *sizeInBytes)
	cudnnGetConvolutionBackwardDataWorkspaceSize func(h cudnnHandle, wd cudnnFilterDesc, dyd cudnnTensorDesc, c cudnnConvDesc,
		dxd cudnnTensorDesc, algo int32, size *uintptr) cudnnStatus
	// cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc,
	//     const cudnnTensorDescriptor_t dyDesc, const cudnnConvolutionDescriptor_t convDesc,
	//     const cudnnFilterDescriptor_t gradDesc, cudnnConvolutionBwdFilterAlgo_t algo, size_t *sizeInBytes)
	cudnnGetConvolutionBackwardFilterWorkspaceSize func(h cudnnHandle, xd cudnnTensorDesc, dyd cudnnTensorDesc, c cudnnConvDesc,
		dwd cudnnFilterDesc, algo int32, size *uintptr) cudnnStatus
}

func (c *cudnnFindLib) symbols() []symbol {
	return []symbol{
		sym(&c.cudnnFindConvolutionForwardAlgorithmEx, "cudnnFindConvolutionForwardAlgorithmEx"),
		sym(&c.cudnnFindConvolutionBackwardDataAlgorithmEx, "cudnnFindConvolutionBackwardDataAlgorithmEx"),
		sym(&c.cudnnFindConvolutionBackwardFilterAlgorithmEx, "cudnnFindConvolutionBackwardFilterAlgorithmEx"),
		sym(&c.cudnnGetConvolutionForwardWorkspaceSize, "cudnnGetConvolutionForwardWorkspaceSize"),
		sym(&c.cudnnGetConvolutionBackwardDataWorkspaceSize, "cudnnGetConvolutionBackwardDataWorkspaceSize"),
		sym(&c.cudnnGetConvolutionBackwardFilterWorkspaceSize, "cudnnGetConvolutionBackwardFilterWorkspaceSize"),
	}
}

// cudnnLib holds the cuDNN 9 entry points of the legacy convolution API
// (libcudnn_cnn.so.9, with descriptors from libcudnn_graph and
// libcudnn_ops, all re-exported by the libcudnn.so.9 shim); C signatures in
// the comments. Scalars (alpha, beta) are float for every data type used
// here.
type cudnnLib struct {
	// size_t cudnnGetVersion(void)
	cudnnGetVersion func() uintptr
	// const char *cudnnGetErrorString(cudnnStatus_t status)
	cudnnGetErrorString func(s cudnnStatus) *byte
	// cudnnStatus_t cudnnCreate(cudnnHandle_t *handle)
	cudnnCreate func(h *cudnnHandle) cudnnStatus
	// cudnnStatus_t cudnnDestroy(cudnnHandle_t handle)
	cudnnDestroy func(h cudnnHandle) cudnnStatus
	// cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId)
	cudnnSetStream func(h cudnnHandle, stream uintptr) cudnnStatus

	// cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *d)
	cudnnCreateTensorDescriptor func(d *cudnnTensorDesc) cudnnStatus
	// cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format,
	//     cudnnDataType_t dataType, int n, int c, int h, int w)
	cudnnSetTensor4dDescriptor func(d cudnnTensorDesc, format, dt int32, n, c, h, w int32) cudnnStatus
	// cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d)
	cudnnDestroyTensorDescriptor func(d cudnnTensorDesc) cudnnStatus
	// cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t *d)
	cudnnCreateFilterDescriptor func(d *cudnnFilterDesc) cudnnStatus
	// cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t dataType,
	//     cudnnTensorFormat_t format, int k, int c, int h, int w)
	cudnnSetFilter4dDescriptor func(d cudnnFilterDesc, dt, format int32, k, c, h, w int32) cudnnStatus
	// cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d)
	cudnnDestroyFilterDescriptor func(d cudnnFilterDesc) cudnnStatus
	// cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t *d)
	cudnnCreateConvolutionDescriptor func(d *cudnnConvDesc) cudnnStatus
	// cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h, int pad_w,
	//     int u, int v, int dilation_h, int dilation_w, cudnnConvolutionMode_t mode, cudnnDataType_t computeType)
	cudnnSetConvolution2dDescriptor func(d cudnnConvDesc, padH, padW, u, v, dilH, dilW int32, mode, compute int32) cudnnStatus
	// cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t d, int groupCount)
	cudnnSetConvolutionGroupCount func(d cudnnConvDesc, groups int32) cudnnStatus
	// cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t mathType)
	cudnnSetConvolutionMathType func(d cudnnConvDesc, math int32) cudnnStatus
	// cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d)
	cudnnDestroyConvolutionDescriptor func(d cudnnConvDesc) cudnnStatus

	// cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, const cudnnTensorDescriptor_t x,
	//     const cudnnFilterDescriptor_t w, const cudnnConvolutionDescriptor_t conv, const cudnnTensorDescriptor_t y,
	//     const int requested, int *returned, cudnnConvolutionFwdAlgoPerf_t *perf)
	cudnnGetConvolutionForwardAlgorithm func(h cudnnHandle, x cudnnTensorDesc, w cudnnFilterDesc, c cudnnConvDesc,
		y cudnnTensorDesc, requested int32, returned *int32, perf *cudnnAlgoPerf) cudnnStatus
	// cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t h, const cudnnFilterDescriptor_t w,
	//     const cudnnTensorDescriptor_t dy, const cudnnConvolutionDescriptor_t conv, const cudnnTensorDescriptor_t dx,
	//     const int requested, int *returned, cudnnConvolutionBwdDataAlgoPerf_t *perf)
	cudnnGetConvolutionBackwardDataAlgorithm func(h cudnnHandle, w cudnnFilterDesc, dy cudnnTensorDesc, c cudnnConvDesc,
		dx cudnnTensorDesc, requested int32, returned *int32, perf *cudnnAlgoPerf) cudnnStatus
	// cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t h, const cudnnTensorDescriptor_t x,
	//     const cudnnTensorDescriptor_t dy, const cudnnConvolutionDescriptor_t conv, const cudnnFilterDescriptor_t dw,
	//     const int requested, int *returned, cudnnConvolutionBwdFilterAlgoPerf_t *perf)
	cudnnGetConvolutionBackwardFilterAlgorithm func(h cudnnHandle, x cudnnTensorDesc, dy cudnnTensorDesc, c cudnnConvDesc,
		dw cudnnFilterDesc, requested int32, returned *int32, perf *cudnnAlgoPerf) cudnnStatus

	// cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha, const cudnnTensorDescriptor_t xDesc,
	//     const void *x, const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t conv,
	//     cudnnConvolutionFwdAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
	//     const cudnnTensorDescriptor_t yDesc, void *y)
	cudnnConvolutionForward func(h cudnnHandle, alpha *float32, xd cudnnTensorDesc, x CUdeviceptr, wd cudnnFilterDesc,
		w CUdeviceptr, c cudnnConvDesc, algo int32, ws CUdeviceptr, wsBytes uintptr, beta *float32,
		yd cudnnTensorDesc, y CUdeviceptr) cudnnStatus
	// cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void *alpha, const cudnnFilterDescriptor_t wDesc,
	//     const void *w, const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t conv,
	//     cudnnConvolutionBwdDataAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
	//     const cudnnTensorDescriptor_t dxDesc, void *dx)
	cudnnConvolutionBackwardData func(h cudnnHandle, alpha *float32, wd cudnnFilterDesc, w CUdeviceptr, dyd cudnnTensorDesc,
		dy CUdeviceptr, c cudnnConvDesc, algo int32, ws CUdeviceptr, wsBytes uintptr, beta *float32,
		dxd cudnnTensorDesc, dx CUdeviceptr) cudnnStatus
	// cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void *alpha, const cudnnTensorDescriptor_t xDesc,
	//     const void *x, const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t conv,
	//     cudnnConvolutionBwdFilterAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
	//     const cudnnFilterDescriptor_t dwDesc, void *dw)
	cudnnConvolutionBackwardFilter func(h cudnnHandle, alpha *float32, xd cudnnTensorDesc, x CUdeviceptr, dyd cudnnTensorDesc,
		dy CUdeviceptr, c cudnnConvDesc, algo int32, ws CUdeviceptr, wsBytes uintptr, beta *float32,
		dwd cudnnFilterDesc, dw CUdeviceptr) cudnnStatus

	version int
	find    *cudnnFindLib    // nil when these libraries lack the timed search
	bn      *cudnnBNLib      // nil when these libraries lack the batch norm
	backend *cudnnBackendLib // nil when they lack the backend (graph) API
}

func (c *cudnnLib) symbols() []symbol {
	return []symbol{
		sym(&c.cudnnGetVersion, "cudnnGetVersion"),
		sym(&c.cudnnGetErrorString, "cudnnGetErrorString"),
		sym(&c.cudnnCreate, "cudnnCreate"),
		sym(&c.cudnnDestroy, "cudnnDestroy"),
		sym(&c.cudnnSetStream, "cudnnSetStream"),
		sym(&c.cudnnCreateTensorDescriptor, "cudnnCreateTensorDescriptor"),
		sym(&c.cudnnSetTensor4dDescriptor, "cudnnSetTensor4dDescriptor"),
		sym(&c.cudnnDestroyTensorDescriptor, "cudnnDestroyTensorDescriptor"),
		sym(&c.cudnnCreateFilterDescriptor, "cudnnCreateFilterDescriptor"),
		sym(&c.cudnnSetFilter4dDescriptor, "cudnnSetFilter4dDescriptor"),
		sym(&c.cudnnDestroyFilterDescriptor, "cudnnDestroyFilterDescriptor"),
		sym(&c.cudnnCreateConvolutionDescriptor, "cudnnCreateConvolutionDescriptor"),
		sym(&c.cudnnSetConvolution2dDescriptor, "cudnnSetConvolution2dDescriptor"),
		sym(&c.cudnnSetConvolutionGroupCount, "cudnnSetConvolutionGroupCount"),
		sym(&c.cudnnSetConvolutionMathType, "cudnnSetConvolutionMathType"),
		sym(&c.cudnnDestroyConvolutionDescriptor, "cudnnDestroyConvolutionDescriptor"),
		sym(&c.cudnnGetConvolutionForwardAlgorithm, "cudnnGetConvolutionForwardAlgorithm_v7"),
		sym(&c.cudnnGetConvolutionBackwardDataAlgorithm, "cudnnGetConvolutionBackwardDataAlgorithm_v7"),
		sym(&c.cudnnGetConvolutionBackwardFilterAlgorithm, "cudnnGetConvolutionBackwardFilterAlgorithm_v7"),
		sym(&c.cudnnConvolutionForward, "cudnnConvolutionForward"),
		sym(&c.cudnnConvolutionBackwardData, "cudnnConvolutionBackwardData"),
		sym(&c.cudnnConvolutionBackwardFilter, "cudnnConvolutionBackwardFilter"),
	}
}

// check turns a status into a *CUDNNError naming fn.
func (c *cudnnLib) check(fn string, s cudnnStatus) error {
	if s == 0 {
		return nil
	}
	return &CUDNNError{Func: fn, Code: int(s), Name: goString(c.cudnnGetErrorString(s))}
}

// CUDNNError is a cuDNN call that returned a status other than success.
type CUDNNError struct {
	Func string
	Code int
	Name string
}

func (e *CUDNNError) Error() string { return fmt.Sprintf("cudnn: %s: %s (%d)", e.Func, e.Name, e.Code) }

// NotSupported reports a CUDNN_STATUS_NOT_SUPPORTED* status (cuDNN 9
// numbers them 3000–3999): the call is valid but no kernel takes it.
func (e *CUDNNError) NotSupported() bool { return e.Code >= 3000 && e.Code < 4000 }

var cudnnOnce struct {
	sync.Once
	c   *cudnnLib
	err error
}

// cudnnNames are the libraries that export the legacy convolution API, the
// shim first. cuDNN 9 splits it: descriptors and the handle in
// libcudnn_graph, filters in libcudnn_ops, convolutions in libcudnn_cnn.
var cudnnNames = [][]string{
	{"libcudnn.so.9"},
	{"libcudnn_graph.so.9"},
	{"libcudnn_ops.so.9"},
	{"libcudnn_cnn.so.9"},
}

// loadCUDNN dlopens cuDNN 9 and binds its functions, once: each symbol
// from the first library that exports it. BATCHFIT_CUDNN_DIR names a
// directory to try first (a pip wheel's nvidia/cudnn/lib, say).
func loadCUDNN() (*cudnnLib, error) {
	cudnnOnce.Do(func() {
		var libs []uintptr
		var errs []error
		for _, names := range cudnnNames {
			if dir := os.Getenv("BATCHFIT_CUDNN_DIR"); dir != "" {
				if h, err := dlopen(filepath.Join(dir, names[0])); err == nil {
					libs = append(libs, h)
					continue
				}
			}
			h, err := dlopen(names...)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			libs = append(libs, h)
		}
		if len(libs) == 0 {
			cudnnOnce.err = fmt.Errorf("%w: cannot load libcudnn.so.9: %v", ErrNoLibrary, errors.Join(errs...))
			return
		}
		c := new(cudnnLib)
		if err := bindAny(libs, c.symbols()); err != nil {
			cudnnOnce.err = fmt.Errorf("%w: cudnn: %v", ErrNoLibrary, err)
			return
		}
		if f := new(cudnnFindLib); bindAny(libs, f.symbols()) == nil {
			c.find = f
		}
		if bn := new(cudnnBNLib); bindAny(libs, bn.symbols()) == nil {
			c.bn = bn
		}
		if be := new(cudnnBackendLib); bindAny(libs, be.symbols()) == nil {
			c.backend = be
		}
		c.version = int(c.cudnnGetVersion())
		if c.version < 90000 {
			cudnnOnce.err = fmt.Errorf("%w: cudnn %s, batchfit needs 9", ErrNoLibrary, formatCUDNNVersion(c.version))
			return
		}
		cudnnOnce.c = c
	})
	return cudnnOnce.c, cudnnOnce.err
}

// formatCUDNNVersion writes cuDNN 9's version number (major·10000 +
// minor·100 + patch) as "9.14.0".
func formatCUDNNVersion(v int) string {
	return fmt.Sprintf("%d.%d.%d", v/10000, v%10000/100, v%100)
}

// bindAny is bind over several libraries: each symbol from the first that
// exports it.
func bindAny(libs []uintptr, syms []symbol) error {
	for _, s := range syms {
		var err error
		for _, lib := range libs {
			if err = bind(lib, []symbol{s}); err == nil {
				break
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}
