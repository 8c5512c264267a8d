package cuda

import (
	"fmt"
	"sync"
)

type (
	cublasHandle uintptr // cublasHandle_t
	cublasStatus int32   // cublasStatus_t
)

// cublasOperation_t and cublasMath_t values.
const (
	cublasOpN = 0
	cublasOpT = 1

	cublasDefaultMath      = 0
	cublasTF32TensorOpMath = 3
)

// cublasLib holds the libcublas entry points; C signatures in the comments.
// Device pointers are passed as CUdeviceptr, scalars by host pointer (the
// default CUBLAS_POINTER_MODE_HOST).
type cublasLib struct {
	// cublasStatus_t cublasCreate_v2(cublasHandle_t *handle)
	cublasCreate func(h *cublasHandle) cublasStatus
	// cublasStatus_t cublasDestroy_v2(cublasHandle_t handle)
	cublasDestroy func(h cublasHandle) cublasStatus
	// cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void *workspace, size_t workspaceSizeInBytes)
	cublasSetWorkspace func(h cublasHandle, ws CUdeviceptr, size uintptr) cublasStatus
	// cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId)
	cublasSetStream func(h cublasHandle, stream uintptr) cublasStatus
	// cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode)
	cublasSetMathMode func(h cublasHandle, mode int32) cublasStatus
	// cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
	//     int m, int n, int k, const float *alpha, const float *A, int lda,
	//     const float *B, int ldb, const float *beta, float *C, int ldc)
	cublasSgemm func(h cublasHandle, transa, transb int32, m, n, k int32, alpha *float32,
		a CUdeviceptr, lda int32, b CUdeviceptr, ldb int32, beta *float32, c CUdeviceptr, ldc int32) cublasStatus
	// cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
	//     int m, int n, int k, const float *alpha, const float *A, int lda, long long strideA,
	//     const float *B, int ldb, long long strideB, const float *beta,
	//     float *C, int ldc, long long strideC, int batchCount)
	cublasSgemmStridedBatched func(h cublasHandle, transa, transb int32, m, n, k int32, alpha *float32,
		a CUdeviceptr, lda int32, strideA int64, b CUdeviceptr, ldb int32, strideB int64, beta *float32,
		c CUdeviceptr, ldc int32, strideC int64, batch int32) cublasStatus
	// cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
	//     int m, int n, int k, const void *alpha, const void *A, cudaDataType_t Atype, int lda,
	//     const void *B, cudaDataType_t Btype, int ldb, const void *beta,
	//     void *C, cudaDataType_t Ctype, int ldc, cublasComputeType_t computeType, cublasGemmAlgo_t algo)
	cublasGemmEx func(h cublasHandle, transa, transb int32, m, n, k int32, alpha *float32,
		a CUdeviceptr, atype int32, lda int32, b CUdeviceptr, btype int32, ldb int32, beta *float32,
		c CUdeviceptr, ctype int32, ldc int32, compute int32, algo int32) cublasStatus
	// cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
	//     int m, int n, int k, const void *alpha, const void *A, cudaDataType_t Atype, int lda, long long strideA,
	//     const void *B, cudaDataType_t Btype, int ldb, long long strideB, const void *beta,
	//     void *C, cudaDataType_t Ctype, int ldc, long long strideC, int batchCount,
	//     cublasComputeType_t computeType, cublasGemmAlgo_t algo)
	cublasGemmStridedBatchedEx func(h cublasHandle, transa, transb int32, m, n, k int32, alpha *float32,
		a CUdeviceptr, atype int32, lda int32, strideA int64, b CUdeviceptr, btype int32, ldb int32, strideB int64,
		beta *float32, c CUdeviceptr, ctype int32, ldc int32, strideC int64, batch int32,
		compute int32, algo int32) cublasStatus
}

// cudaDataType_t, cublasComputeType_t and cublasGemmAlgo_t values of the
// 16-bit GEMMs: bfloat16 or float16 operands, float32 accumulation and
// scalars (PyTorch's autocast GEMMs).
const (
	cudaR16F  = 2
	cudaR16BF = 14

	cublasCompute32F  = 68
	cublasGemmDefault = -1
)

func (c *cublasLib) symbols() []symbol {
	return []symbol{
		sym(&c.cublasCreate, "cublasCreate_v2"),
		sym(&c.cublasDestroy, "cublasDestroy_v2"),
		sym(&c.cublasSetWorkspace, "cublasSetWorkspace_v2"),
		sym(&c.cublasSetStream, "cublasSetStream_v2"),
		sym(&c.cublasSetMathMode, "cublasSetMathMode"),
		sym(&c.cublasSgemm, "cublasSgemm_v2"),
		sym(&c.cublasSgemmStridedBatched, "cublasSgemmStridedBatched"),
		sym(&c.cublasGemmEx, "cublasGemmEx"),
		sym(&c.cublasGemmStridedBatchedEx, "cublasGemmStridedBatchedEx"),
	}
}

func checkBLAS(fn string, s cublasStatus) error {
	if s == 0 {
		return nil
	}
	return &CUBLASError{Func: fn, Code: int(s), Name: cublasStatusName(int(s))}
}

var cublasOnce struct {
	sync.Once
	c   *cublasLib
	err error
}

// loadCUBLAS dlopens libcublas, newest first, and binds its functions.
func loadCUBLAS() (*cublasLib, error) {
	cublasOnce.Do(func() {
		lib, err := dlopen("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so")
		if err != nil {
			cublasOnce.err = fmt.Errorf("%w: cannot load libcublas: %v", ErrNoLibrary, err)
			return
		}
		c := new(cublasLib)
		if err := bind(lib, c.symbols()); err != nil {
			cublasOnce.err = fmt.Errorf("%w: libcublas: %v", ErrNoLibrary, err)
			return
		}
		cublasOnce.c = c
	})
	return cublasOnce.c, cublasOnce.err
}
