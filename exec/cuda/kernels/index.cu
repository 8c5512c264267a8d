// index.cu: embedding lookups and their gradient, for float32, bfloat16
// and float16 tables (FOR_FLOATS).
//
// Indices are data, so only a kernel can find one out of range. Kernels
// that read indices take `bad`, a device u64 the Go side sets to all ones
// (cuMemsetD8 0xFF) before the launch, or null to skip the check: each
// offending position k lowers it with atomicMin, so afterwards it holds the
// first bad position, or all ones when there was none. The output is then
// incomplete and must be discarded (the CPU returns an error instead).
#include "common.cuh"

// embedding_{f32,bf16,f16}: out[k·d + j] = w[idx[k]·d + j] for k < nidx,
// j < d, with w [v, d] and out of w's dtype (a copy: no rounding). An
// out-of-range index gives a zero row and is reported in bad. 1-D blocks,
// any grid.
template <typename T>
__device__ void embedding_t(const i64* __restrict__ idx, const T* __restrict__ w,
                            T* __restrict__ out, i64 nidx, i64 v, i64 d, u64* bad) {
  const i64 total = nidx * d;
  GRID_LOOP(i, total) {
    const i64 k = i / d, j = i - k * d;
    const i64 row = idx[k];
    if (row < 0 || row >= v) {
      out[i] = 0.f;
      if (j == 0) report_bad(bad, k);
      continue;
    }
    out[i] = w[row * d + j];
  }
}
#define K(T, S)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) embedding_##S(const i64* idx, const T* w, T* out, \
                                                                  i64 nidx, i64 v, i64 d, u64* bad) { \
    embedding_t(idx, w, out, nidx, v, d, bad);                                                   \
  }
FOR_FLOATS(K)
#undef K

// embedding_grad_{f32,bf16,f16}: acc[idx[k]·d + j] += g[k·d + j] with a
// float atomicAdd, for g of the suffix's dtype and acc a float32 [v, d]
// zero-filled by the caller: the float32 output itself, or for a 16-bit
// gradient a float32 workspace that cast_f32_* then rounds once into the
// output, as the CPU rounds its float32 sums. Rows hit by several indices
// receive their sums in an unspecified order, so the last bits may vary
// between runs. Out-of-range indices are skipped and reported. 1-D blocks,
// any grid.
template <typename T>
__device__ void embedding_grad_t(const T* __restrict__ g, const i64* __restrict__ idx, float* acc,
                                 i64 nidx, i64 v, i64 d, u64* bad) {
  const i64 total = nidx * d;
  GRID_LOOP(i, total) {
    const i64 k = i / d, j = i - k * d;
    const i64 row = idx[k];
    if (row < 0 || row >= v) {
      if (j == 0) report_bad(bad, k);
      continue;
    }
    atomicAdd(acc + row * d + j, (float)g[i]);
  }
}
#define K(T, S)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) embedding_grad_##S(                   \
      const T* g, const i64* idx, float* acc, i64 nidx, i64 v, i64 d, u64* bad) {         \
    embedding_grad_t(g, idx, acc, nidx, v, d, bad);                                       \
  }
FOR_FLOATS(K)
#undef K
