// index.cu: embedding lookups and their gradient.
//
// Indices are data, so only a kernel can find one out of range. Kernels
// that read indices take `bad`, a device u64 the Go side sets to all ones
// (cuMemsetD8 0xFF) before the launch, or null to skip the check: each
// offending position k lowers it with atomicMin, so afterwards it holds the
// first bad position, or all ones when there was none. The output is then
// incomplete and must be discarded (the CPU returns an error instead).
#include "common.cuh"

// embedding_f32: out[k·d + j] = w[idx[k]·d + j] for k < nidx, j < d, with
// w [v, d]. An out-of-range index gives a zero row and is reported in bad.
// 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
embedding_f32(const i64* __restrict__ idx, const float* __restrict__ w, float* __restrict__ out,
              i64 nidx, i64 v, i64 d, u64* bad) {
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

// embedding_grad_f32: out[idx[k]·d + j] += g[k·d + j] with atomicAdd, out
// [v, d] zero-filled by the caller (fill_f32). Rows hit by several indices
// receive their sums in an unspecified order, so the last bits may vary
// between runs. Out-of-range indices are skipped and reported. 1-D blocks,
// any grid.
extern "C" __global__ void __launch_bounds__(256)
embedding_grad_f32(const float* __restrict__ g, const i64* __restrict__ idx, float* out, i64 nidx,
                   i64 v, i64 d, u64* bad) {
  const i64 total = nidx * d;
  GRID_LOOP(i, total) {
    const i64 k = i / d, j = i - k * d;
    const i64 row = idx[k];
    if (row < 0 || row >= v) {
      if (j == 0) report_bad(bad, k);
      continue;
    }
    atomicAdd(out + row * d + j, g[i]);
  }
}
