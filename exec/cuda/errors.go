package cuda

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/alloc"
)

// Sentinel errors.
var (
	// ErrNoGPU means there is no usable CUDA device: libcuda.so.1 is
	// missing, cuInit failed or no device is present. The wrapping error
	// says which.
	ErrNoGPU = errors.New("no CUDA GPU")
	// ErrNoLibrary means NVRTC or cuBLAS could not be loaded.
	ErrNoLibrary = errors.New("CUDA library not available")
	// ErrClosed is returned by calls on a closed Device, Module or BLAS.
	ErrClosed = errors.New("cuda: closed")
)

// CUresult codes the package reacts to.
const (
	cudaSuccess      = 0
	cudaErrorInvalid = 1
	cudaErrorOOM     = 2
)

// CUDAError is a failed driver API call.
type CUDAError struct {
	Func string // e.g. "cuMemAlloc_v2"
	Code int    // the CUresult
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
}

func (e *CUDAError) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d)", e.Func, e.Name, e.Code)
}

// Unwrap makes an out-of-memory result match alloc.ErrDeviceOOM, so the
// caching allocator releases its cache and retries.
func (e *CUDAError) Unwrap() error {
	if e.Code == cudaErrorOOM {
		return alloc.ErrDeviceOOM
	}
	return nil
}

// NVRTCError is a failed NVRTC call. A failed compilation carries the
// compiler's log.
type NVRTCError struct {
	Func string // e.g. "nvrtcCompileProgram"
	Code int    // the nvrtcResult
	Name string // e.g. "NVRTC_ERROR_COMPILATION"
	Log  string // the program log, when there is one
}

func (e *NVRTCError) Error() string {
	s := fmt.Sprintf("nvrtc: %s: %s (%d)", e.Func, e.Name, e.Code)
	if e.Log != "" {
		s += "\n" + e.Log
	}
	return s
}

// CUBLASError is a failed cuBLAS call.
type CUBLASError struct {
	Func string // e.g. "cublasSgemm_v2"
	Code int    // the cublasStatus_t
	Name string // e.g. "CUBLAS_STATUS_INVALID_VALUE"
}

func (e *CUBLASError) Error() string {
	return fmt.Sprintf("cublas: %s: %s (%d)", e.Func, e.Name, e.Code)
}

// Unwrap makes CUBLAS_STATUS_ALLOC_FAILED match alloc.ErrDeviceOOM.
func (e *CUBLASError) Unwrap() error {
	if e.Code == cublasStatusAllocFailed {
		return alloc.ErrDeviceOOM
	}
	return nil
}

const cublasStatusAllocFailed = 3

// cublasStatusNames are the values of cublasStatus_t; cuBLAS has no
// function that names them.
var cublasStatusNames = map[int]string{
	0:  "CUBLAS_STATUS_SUCCESS",
	1:  "CUBLAS_STATUS_NOT_INITIALIZED",
	3:  "CUBLAS_STATUS_ALLOC_FAILED",
	7:  "CUBLAS_STATUS_INVALID_VALUE",
	8:  "CUBLAS_STATUS_ARCH_MISMATCH",
	11: "CUBLAS_STATUS_MAPPING_ERROR",
	13: "CUBLAS_STATUS_EXECUTION_FAILED",
	14: "CUBLAS_STATUS_INTERNAL_ERROR",
	15: "CUBLAS_STATUS_NOT_SUPPORTED",
	16: "CUBLAS_STATUS_LICENSE_ERROR",
}

func cublasStatusName(code int) string {
	if n, ok := cublasStatusNames[code]; ok {
		return n
	}
	return fmt.Sprintf("CUBLAS_STATUS_%d", code)
}

// ErrKernelArgs is wrapped by the error of a launch whose argument count is
// not the kernel's parameter count: the executor's own mistake, caught on
// the host instead of the driver reading past the argument array.
var ErrKernelArgs = errors.New("cuda: kernel launched with the wrong number of arguments")

// ErrWorkspace means a node's workspace block is smaller than its CUDA
// kernels need: the program was compiled without cuda.Workspace.
var ErrWorkspace = errors.New("cuda: workspace smaller than the kernels need (compile programs with cuda.Workspace)")

// ErrChannelsLast is wrapped by the error of a channels-last convolution
// (graph.Attrs.ChannelsLast) that cuDNN does not take (no cuDNN, a shape
// or dtype it refuses, misaligned operands, no algorithm within the
// workspace) and whose workspace cannot hold the NCHW copies it would run
// on instead (convnchw.go): a program compiled with a workspace rule
// smaller than the package's, with ErrWorkspace. The executor's own
// convolution kernels (im2col) are NCHW only; batch norm and pooling have
// channels-last kernels of their own.
var ErrChannelsLast = errors.New("cuda: channels-last convolution that cuDNN does not take")
