package cuda

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// DriverReserve is the device memory a plan leaves free for the driver,
// which needs some of its own to map an allocation: on the H100 (driver
// 580) cuMemAlloc reached within 0.2–2.2 MiB of cuMemGetInfo's free bytes,
// in one allocation or in 79 (exec/cuda's TestDriverMappingReserve), and a
// plan that left 192 KiB free failed its last 12.7 GiB allocation. Twice
// the measured bound, so a plan that fills the card still runs.
const DriverReserve = 4 << 20

// DefaultWorkspace is a cuBLAS workspace size for NewBLAS: NVIDIA's
// recommendation for Hopper (4 MiB suffices before it).
const DefaultWorkspace = 32 << 20

// BLAS is a cuBLAS handle on a device. Its workspace is a block of the
// caching allocator, so cuBLAS allocates no device memory of its own during
// GEMMs and the planner sees every byte.
type BLAS struct {
	d   *Device
	lib *cublasLib
	h   cublasHandle
	a   *alloc.Allocator
	ws  *alloc.Block
	// lt is cuBLASLt's handle and plans (GemmEpilogue), made on first use;
	// stream is the stream both libraries launch on (setStream) and tf32
	// whether float32 GEMMs may use TF32 (SetTF32). On the device thread.
	lt     *ltState
	stream uintptr
	tf32   bool

	mu     sync.Mutex
	closed bool
}

// NewBLAS creates a cuBLAS handle on d with a workspace of workspace bytes
// taken from a. With 0 cuBLAS gets no workspace at all (and only the
// algorithms that need none), rather than one it allocates itself.
func (d *Device) NewBLAS(a *alloc.Allocator, workspace int64) (*BLAS, error) {
	if a == nil {
		return nil, graph.Errorf(graph.ErrAttr, "cuda: NewBLAS needs an allocator")
	}
	lib, err := loadCUBLAS()
	if err != nil {
		return nil, err
	}
	if workspace < 0 {
		return nil, graph.Errorf(graph.ErrAttr, "cuda: cuBLAS workspace of %d bytes", workspace)
	}
	b := &BLAS{d: d, lib: lib, a: a}
	var wsPtr CUdeviceptr
	if workspace > 0 {
		// The allocator calls the device through do, so take the block
		// before entering the device thread.
		if b.ws, err = a.Malloc(workspace, alloc.Tag{Node: -1, Op: "cublas_workspace"}); err != nil {
			return nil, err
		}
		wsPtr = CUdeviceptr(b.ws.Ptr())
	}
	err = d.do(func() error {
		if err := checkBLAS("cublasCreate_v2", lib.cublasCreate(&b.h)); err != nil {
			return err
		}
		// Without this call cuBLAS would allocate a workspace privately.
		if err := checkBLAS("cublasSetWorkspace_v2", lib.cublasSetWorkspace(b.h, wsPtr, uintptr(workspace))); err != nil {
			lib.cublasDestroy(b.h)
			return err
		}
		return nil
	})
	if err != nil {
		if b.ws != nil {
			err = errors.Join(err, a.Free(b.ws))
		}
		return nil, err
	}
	return b, nil
}

// setStream points the handle at stream s (0: the legacy default stream)
// and gives it its workspace again, which cublasSetStream resets to
// cuBLAS's own pool. On the device thread.
func (b *BLAS) setStream(s uintptr) error {
	if err := b.live(); err != nil {
		return err
	}
	if err := checkBLAS("cublasSetStream_v2", b.lib.cublasSetStream(b.h, s)); err != nil {
		return err
	}
	b.stream = s
	var p CUdeviceptr
	var n uintptr
	if b.ws != nil {
		p, n = CUdeviceptr(b.ws.Ptr()), uintptr(b.ws.Requested())
	}
	return checkBLAS("cublasSetWorkspace_v2", b.lib.cublasSetWorkspace(b.h, p, n))
}

// Workspace is the workspace block, nil when there is none.
func (b *BLAS) Workspace() *alloc.Block { return b.ws }

// SetTF32 lets single-precision GEMMs use TF32 tensor cores
// (CUBLAS_TF32_TENSOR_OP_MATH) or restores full FP32 (CUBLAS_DEFAULT_MATH).
func (b *BLAS) SetTF32(on bool) error {
	if err := b.live(); err != nil {
		return err
	}
	mode := int32(cublasDefaultMath)
	if on {
		mode = cublasTF32TensorOpMath
	}
	return b.d.do(func() error {
		b.tf32 = on
		return checkBLAS("cublasSetMathMode", b.lib.cublasSetMathMode(b.h, mode))
	})
}

// Gemm computes C = alpha·op(A)·op(B) + beta·C for row-major matrices:
// op(A) is m×k, op(B) is k×n and C is m×n. A is stored k×m when transA
// (m×k otherwise), B is stored n×k when transB (k×n otherwise), and lda,
// ldb, ldc are the row strides in elements.
//
// cuBLAS is column-major, and a row-major matrix read column-major is its
// transpose, so this is the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ with the
// operands swapped: no copies.
func (b *BLAS) Gemm(transA, transB bool, m, n, k int, alpha float32, A alloc.Ptr, lda int,
	B alloc.Ptr, ldb int, beta float32, C alloc.Ptr, ldc int) error {
	return b.GemmOf(graph.Float32, transA, transB, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)
}

// GemmOf is Gemm for matrices of dtype dt: float32 (cublasSgemm, on TF32
// tensor cores under SetTF32), or bfloat16 or float16 (cublasGemmEx with
// float32 accumulation, alpha and beta, rounding C once).
func (b *BLAS) GemmOf(dt graph.DType, transA, transB bool, m, n, k int, alpha float32, A alloc.Ptr, lda int,
	B alloc.Ptr, ldb int, beta float32, C alloc.Ptr, ldc int) error {
	return b.gemm(dt, dt, transA, transB, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)
}

// gemm is GemmOf with A and B of dtype ab and C of dtype c: cublasSgemm
// when both are float32, cublasGemmEx with float32 accumulation otherwise.
func (b *BLAS) gemm(ab, c graph.DType, transA, transB bool, m, n, k int, alpha float32, A alloc.Ptr, lda int,
	B alloc.Ptr, ldb int, beta float32, C alloc.Ptr, ldc int) error {
	ty, cty, err := b.checkCall(ab, c, transA, transB, m, n, k, lda, ldb, ldc)
	if err != nil {
		return err
	}
	if m == 0 || n == 0 {
		return nil
	}
	return b.d.do(func() error {
		if ab == graph.Float32 && c == graph.Float32 {
			return checkBLAS("cublasSgemm_v2", b.lib.cublasSgemm(b.h, op(transB), op(transA),
				int32(n), int32(m), int32(k), &alpha,
				CUdeviceptr(B), int32(ldb), CUdeviceptr(A), int32(lda),
				&beta, CUdeviceptr(C), int32(ldc)))
		}
		return checkBLAS("cublasGemmEx", b.lib.cublasGemmEx(b.h, op(transB), op(transA),
			int32(n), int32(m), int32(k), &alpha,
			CUdeviceptr(B), ty, int32(ldb), CUdeviceptr(A), ty, int32(lda),
			&beta, CUdeviceptr(C), cty, int32(ldc), cublasCompute32F, cublasGemmDefault))
	})
}

// checkCall validates one row-major GEMM of A and B of dtype ab into C of
// dtype c (checkGemm) and the handle, and returns their cudaDataType_t
// values.
func (b *BLAS) checkCall(ab, c graph.DType, transA, transB bool, m, n, k, lda, ldb, ldc int) (ty, cty int32, err error) {
	if err := checkGemm(transA, transB, m, n, k, lda, ldb, ldc, 1); err != nil {
		return 0, 0, err
	}
	if ty, err = gemmType(ab); err != nil {
		return 0, 0, err
	}
	if cty, err = gemmType(c); err != nil {
		return 0, 0, err
	}
	return ty, cty, b.live()
}

// gemmType is dt's cudaDataType_t for GemmEx (CUDA_R_32F, 0, for
// float32).
func gemmType(dt graph.DType) (int32, error) {
	switch dt {
	case graph.Float32:
		return 0, nil
	case graph.BFloat16:
		return cudaR16BF, nil
	case graph.Float16:
		return cudaR16F, nil
	}
	return 0, graph.Errorf(graph.ErrDType, "cuda: gemm of %s matrices (float32, bfloat16 or float16)", dt)
}

// GemmStridedBatched runs batch independent Gemms; matrix i of A, B and C
// starts strideA, strideB, strideC elements after matrix i−1.
func (b *BLAS) GemmStridedBatched(transA, transB bool, m, n, k int, alpha float32,
	A alloc.Ptr, lda int, strideA int64, B alloc.Ptr, ldb int, strideB int64,
	beta float32, C alloc.Ptr, ldc int, strideC int64, batch int) error {
	return b.GemmStridedBatchedOf(graph.Float32, transA, transB, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
		beta, C, ldc, strideC, batch)
}

// GemmStridedBatchedOf is GemmStridedBatched for matrices of dtype dt, as
// GemmOf.
func (b *BLAS) GemmStridedBatchedOf(dt graph.DType, transA, transB bool, m, n, k int, alpha float32,
	A alloc.Ptr, lda int, strideA int64, B alloc.Ptr, ldb int, strideB int64,
	beta float32, C alloc.Ptr, ldc int, strideC int64, batch int) error {
	return b.gemmStridedBatched(dt, dt, transA, transB, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
		beta, C, ldc, strideC, batch)
}

// gemmStridedBatched is GemmStridedBatchedOf with A and B of dtype ab and
// C of dtype c, as gemm.
func (b *BLAS) gemmStridedBatched(ab, c graph.DType, transA, transB bool, m, n, k int, alpha float32,
	A alloc.Ptr, lda int, strideA int64, B alloc.Ptr, ldb int, strideB int64,
	beta float32, C alloc.Ptr, ldc int, strideC int64, batch int) error {
	if err := checkGemm(transA, transB, m, n, k, lda, ldb, ldc, batch); err != nil {
		return err
	}
	ty, err := gemmType(ab)
	if err != nil {
		return err
	}
	cty, err := gemmType(c)
	if err != nil {
		return err
	}
	if strideA < 0 || strideB < 0 || strideC < 0 {
		return graph.Errorf(graph.ErrShape, "cuda: gemm strides %d, %d, %d must not be negative", strideA, strideB, strideC)
	}
	if err := b.live(); err != nil {
		return err
	}
	if m == 0 || n == 0 || batch == 0 {
		return nil
	}
	return b.d.do(func() error {
		if ab == graph.Float32 && c == graph.Float32 {
			return checkBLAS("cublasSgemmStridedBatched", b.lib.cublasSgemmStridedBatched(b.h, op(transB), op(transA),
				int32(n), int32(m), int32(k), &alpha,
				CUdeviceptr(B), int32(ldb), strideB, CUdeviceptr(A), int32(lda), strideA,
				&beta, CUdeviceptr(C), int32(ldc), strideC, int32(batch)))
		}
		return checkBLAS("cublasGemmStridedBatchedEx", b.lib.cublasGemmStridedBatchedEx(b.h, op(transB), op(transA),
			int32(n), int32(m), int32(k), &alpha,
			CUdeviceptr(B), ty, int32(ldb), strideB, CUdeviceptr(A), ty, int32(lda), strideA,
			&beta, CUdeviceptr(C), cty, int32(ldc), strideC, int32(batch), cublasCompute32F, cublasGemmDefault))
	})
}

func op(trans bool) int32 {
	if trans {
		return cublasOpT
	}
	return cublasOpN
}

// checkGemm validates row-major GEMM dimensions: every size fits cuBLAS's
// int and each leading dimension covers a stored row.
func checkGemm(transA, transB bool, m, n, k, lda, ldb, ldc, batch int) error {
	for _, v := range []int{m, n, k, lda, ldb, ldc, batch} {
		if v < 0 || v > math.MaxInt32 {
			return graph.Errorf(graph.ErrShape, "cuda: gemm m=%d n=%d k=%d lda=%d ldb=%d ldc=%d batch=%d: sizes must be in [0, 2³¹)",
				m, n, k, lda, ldb, ldc, batch)
		}
	}
	colsA, colsB := k, n
	if transA {
		colsA = m
	}
	if transB {
		colsB = k
	}
	if lda < max(1, colsA) || ldb < max(1, colsB) || ldc < max(1, n) {
		return graph.Errorf(graph.ErrShape,
			"cuda: gemm m=%d n=%d k=%d transA=%t transB=%t: need lda ≥ %d, ldb ≥ %d, ldc ≥ %d, got %d, %d, %d",
			m, n, k, transA, transB, max(1, colsA), max(1, colsB), max(1, n), lda, ldb, ldc)
	}
	return nil
}

// Close destroys the handle (cublasDestroy synchronises the device) and
// returns the workspace to the allocator.
func (b *BLAS) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	err := b.d.do(func() error {
		return errors.Join(b.ltClose(), checkBLAS("cublasDestroy_v2", b.lib.cublasDestroy(b.h)))
	})
	if b.ws != nil {
		err = errors.Join(err, b.a.Free(b.ws))
	}
	return err
}

func (b *BLAS) live() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("%w: cuBLAS handle", ErrClosed)
	}
	return nil
}
