package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// GemmToF32 is GemmOf for A and B of dtype dt and a float32 C: bfloat16 or
// float16 operands go through cublasGemmEx with float32 accumulation into
// a float32 C, which is never rounded to 16 bits, so a sum that goes on
// (beta = 1 over several calls) or that a kernel combines further rounds
// once, at the end, as the CPU's float32 sums do. For float32 it is Gemm.
func (b *BLAS) GemmToF32(dt graph.DType, transA, transB bool, m, n, k int, alpha float32, A alloc.Ptr, lda int,
	B alloc.Ptr, ldb int, beta float32, C alloc.Ptr, ldc int) error {
	return b.gemm(dt, graph.Float32, transA, transB, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)
}

// GemmStridedBatchedToF32 is GemmStridedBatchedOf for A and B of dtype dt
// and a float32 C, as GemmToF32.
func (b *BLAS) GemmStridedBatchedToF32(dt graph.DType, transA, transB bool, m, n, k int, alpha float32,
	A alloc.Ptr, lda int, strideA int64, B alloc.Ptr, ldb int, strideB int64,
	beta float32, C alloc.Ptr, ldc int, strideC int64, batch int) error {
	return b.gemmStridedBatched(dt, graph.Float32, transA, transB, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
		beta, C, ldc, strideC, batch)
}
