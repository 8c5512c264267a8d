package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// cudaR32F is CUDA_R_32F, the cudaDataType_t of a float32 C.
const cudaR32F = 0

// GemmToF32 is GemmOf for A and B of dtype dt and a float32 C: bfloat16 or
// float16 operands go through cublasGemmEx with float32 accumulation into
// a float32 C, which is never rounded to 16 bits, so a sum that goes on
// (beta = 1 over several calls) or that a kernel combines further rounds
// once, at the end, as the CPU's float32 sums do. For float32 it is Gemm.
func (b *BLAS) GemmToF32(dt graph.DType, transA, transB bool, m, n, k int, alpha float32, A alloc.Ptr, lda int,
	B alloc.Ptr, ldb int, beta float32, C alloc.Ptr, ldc int) error {
	if dt == graph.Float32 {
		return b.Gemm(transA, transB, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)
	}
	if err := checkGemm(transA, transB, m, n, k, lda, ldb, ldc, 1); err != nil {
		return err
	}
	ty, err := gemmType(dt)
	if err != nil {
		return err
	}
	if err := b.live(); err != nil {
		return err
	}
	if m == 0 || n == 0 {
		return nil
	}
	return b.d.do(func() error {
		return checkBLAS("cublasGemmEx", b.lib.cublasGemmEx(b.h, op(transB), op(transA),
			int32(n), int32(m), int32(k), &alpha,
			CUdeviceptr(B), ty, int32(ldb), CUdeviceptr(A), ty, int32(lda),
			&beta, CUdeviceptr(C), cudaR32F, int32(ldc), cublasCompute32F, cublasGemmDefault))
	})
}

// GemmStridedBatchedToF32 is GemmStridedBatchedOf for A and B of dtype dt
// and a float32 C, as GemmToF32.
func (b *BLAS) GemmStridedBatchedToF32(dt graph.DType, transA, transB bool, m, n, k int, alpha float32,
	A alloc.Ptr, lda int, strideA int64, B alloc.Ptr, ldb int, strideB int64,
	beta float32, C alloc.Ptr, ldc int, strideC int64, batch int) error {
	if dt == graph.Float32 {
		return b.GemmStridedBatched(transA, transB, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC, batch)
	}
	if err := checkGemm(transA, transB, m, n, k, lda, ldb, ldc, batch); err != nil {
		return err
	}
	ty, err := gemmType(dt)
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
		return checkBLAS("cublasGemmStridedBatchedEx", b.lib.cublasGemmStridedBatchedEx(b.h, op(transB), op(transA),
			int32(n), int32(m), int32(k), &alpha,
			CUdeviceptr(B), ty, int32(ldb), strideB, CUdeviceptr(A), ty, int32(lda), strideA,
			&beta, CUdeviceptr(C), cudaR32F, int32(ldc), strideC, int32(batch), cublasCompute32F, cublasGemmDefault))
	})
}
