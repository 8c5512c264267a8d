// batchnorm.cu: batch_norm per channel over [n, c, inner] data (x [N, C, ...]
// with inner the product of the trailing axes), and its gradients. Every
// kernel is templated on its storage type and instantiated for float32,
// bfloat16 and float16 (FOR_FLOATS, common.cuh): x, g, the per-channel
// inputs and the outputs have that type, are read widened, and each output
// rounds once from the float the float32 kernel would store.
//
// Statistics follow exec/cpu: per channel, the mean and then the biased
// variance of the centred values (two passes), accumulated in double;
// rstd = 1/√(var + eps) in double. They go to a double workspace stats
// [2·c] (mean, rstd per channel), made by batch_norm_stats_* from the batch
// (training mode) or by batch_norm_stats_running_* from the running
// statistics (evaluation mode). The per-element maps run in double with
// non-fusing intrinsics, as the CPU computes them.
#include "common.cuh"

__device__ __forceinline__ double bn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double bn_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double bn_sub(double a, double b) { return __dsub_rn(a, b); }

// bn_each calls f(i) with the flat index i = (i_n·c + k)·inner + j of each
// of channel k's n·inner values this thread takes: the t-th value, t =
// i_n·inner + j, for t = threadIdx.x, threadIdx.x + blockDim.x, …, in that
// order. It walks image
// by image, (i, j) with t = i·inner + j, so it divides once, not once per
// value (a 64-bit division per value made these kernels slow on large
// channels: 6.7 ms for one [64, 64, 112, 112] gradient on the H100).
template <typename F>
__device__ __forceinline__ void bn_each(i64 k, i64 n, i64 c, i64 inner, F f) {
  if (inner <= 0) return;
  const i64 bd = blockDim.x;
  const i64 di = bd / inner, dj = bd - di * inner;
  i64 i = threadIdx.x / inner, j = threadIdx.x - i * inner;
  while (i < n) {
    f((i * c + k) * inner + j);
    i += di;
    j += dj;
    if (j >= inner) {
      j -= inner;
      ++i;
    }
  }
}

// bn_ld widens a stored value to double.
template <typename T>
__device__ __forceinline__ double bn_ld(const T* p, i64 i) {
  return (double)(float)p[i];
}

template <typename T>
__device__ __forceinline__ void batch_norm_stats_t(const T* __restrict__ x,
                                                   double* __restrict__ stats, i64 n, i64 c,
                                                   i64 inner, double eps) {
  __shared__ double sd[32];
  const i64 m = n * inner;
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    double s = 0;
    bn_each(k, n, c, inner, [&](i64 i) { s += bn_ld(x, i); });
    s = row_allreduce(s, SumOp(), sd);
    const double mean = m > 0 ? s / (double)m : 0.0;
    double q = 0;
    bn_each(k, n, c, inner, [&](i64 i) {
      const double d = bn_ld(x, i) - mean;
      q += d * d;
    });
    q = row_allreduce(q, SumOp(), sd);
    if (threadIdx.x == 0) {
      stats[2 * k] = mean;
      stats[2 * k + 1] = m > 0 ? 1.0 / sqrt(q / (double)m + eps) : 0.0;
    }
  }
}

// batch_norm_stats_{f32,bf16,f16}: stats[2k] = mean and stats[2k+1] = rstd
// (double) of channel k's n·inner values (both 0 when there are none, as on
// the CPU). One block per channel (blocks loop over channels): blockDim.x a
// multiple of 32 up to 1024, blockDim.y = 1, any grid.
#define K(T, S)                                                                    \
  extern "C" __global__ void __launch_bounds__(1024) batch_norm_stats_##S(         \
      const T* x, double* stats, i64 n, i64 c, i64 inner, double eps) {            \
    batch_norm_stats_t(x, stats, n, c, inner, eps);                                \
  }
FOR_FLOATS(K)
#undef K

// batch_norm_moments_{f32,bf16,f16}: batch_norm_stats's value, the [2, c]
// output out: out[k] the mean and out[c + k] the unbiased variance
// Σ(x − mean)²/(m − 1) of channel k's m = n·inner values, both in double
// (two passes, as batch_norm_stats_*) and rounded once, as the CPU's
// float64 → float32 (→ 16-bit) stores. The host refuses m ≤ 1. One block
// per channel (blocks loop over channels): blockDim.x a multiple of 32 up
// to 1024, blockDim.y = 1, any grid.
template <typename T>
__device__ __forceinline__ void batch_norm_moments_t(const T* __restrict__ x, T* __restrict__ out,
                                                     i64 n, i64 c, i64 inner) {
  __shared__ double sd[32];
  const i64 m = n * inner;
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    double s = 0;
    bn_each(k, n, c, inner, [&](i64 i) { s += bn_ld(x, i); });
    s = row_allreduce(s, SumOp(), sd);
    const double mean = s / (double)m;
    double q = 0;
    bn_each(k, n, c, inner, [&](i64 i) {
      const double d = bn_ld(x, i) - mean;
      q += d * d;
    });
    q = row_allreduce(q, SumOp(), sd);
    if (threadIdx.x == 0) {
      out[k] = (float)mean;
      out[c + k] = (float)(q / (double)(m - 1));
    }
  }
}
#define K(T, S)                                                                    \
  extern "C" __global__ void __launch_bounds__(1024) batch_norm_moments_##S(       \
      const T* x, T* out, i64 n, i64 c, i64 inner) {                               \
    batch_norm_moments_t(x, out, n, c, inner);                                     \
  }
FOR_FLOATS(K)
#undef K

// batch_norm_stats_running_{f32,bf16,f16}: stats from running statistics
// [c]: mean = rmean[k], rstd = 1/√(rvar[k] + eps). 1-D blocks over c, any
// grid.
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) batch_norm_stats_running_##S(        \
      const T* __restrict__ rmean, const T* __restrict__ rvar, double* __restrict__ stats, \
      i64 c, double eps) {                                                               \
    GRID_LOOP(k, c) {                                                                    \
      stats[2 * k] = bn_ld(rmean, k);                                                       \
      stats[2 * k + 1] = 1.0 / sqrt(bn_ld(rvar, k) + eps);                                  \
    }                                                                                    \
  }
FOR_FLOATS(K)
#undef K

template <typename T>
__device__ __forceinline__ void batch_norm_t(const T* __restrict__ x,
                                             const double* __restrict__ stats,
                                             const T* __restrict__ w, const T* __restrict__ b,
                                             T* __restrict__ y, i64 n, i64 c, i64 inner) {
  const i64 total = n * c * inner;
  GRID_LOOP(t, total) {
    const i64 k = (t / inner) % c;
    double scale = stats[2 * k + 1];
    if (w) scale = bn_mul(scale, bn_ld(w, k));
    double shift = bn_mul(-stats[2 * k], scale);
    if (b) shift = bn_add(shift, bn_ld(b, k));
    y[t] = (float)bn_add(bn_mul(bn_ld(x, t), scale), shift);
  }
}

// batch_norm_{f32,bf16,f16}: y = x·scale + shift per channel with scale =
// rstd (· w[k]) and shift = −mean·scale (+ b[k]); w and b are [c] or null.
// 1-D blocks over n·c·inner, any grid.
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) batch_norm_##S(                      \
      const T* x, const double* stats, const T* w, const T* b, T* y, i64 n, i64 c,       \
      i64 inner) {                                                                       \
    batch_norm_t(x, stats, w, b, y, n, c, inner);                                        \
  }
FOR_FLOATS(K)
#undef K

template <typename T>
__device__ __forceinline__ void batch_norm_grad_x_t(const T* __restrict__ g,
                                                    const T* __restrict__ x,
                                                    const T* __restrict__ w,
                                                    const double* __restrict__ stats,
                                                    T* __restrict__ out, i64 n, i64 c,
                                                    i64 inner) {
  __shared__ double sd[32];
  const i64 m = n * inner;
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    const double wk = w ? bn_ld(w, k) : 1.0;
    const double mean = stats[2 * k], rstd = stats[2 * k + 1];
    double sg = 0, sgx = 0;
    bn_each(k, n, c, inner, [&](i64 i) {
      const double gh = bn_mul(bn_ld(g, i), wk);
      sg += gh;
      sgx += bn_mul(bn_mul(gh, bn_sub(bn_ld(x, i), mean)), rstd);
    });
    sg = row_allreduce(sg, SumOp(), sd);
    sgx = row_allreduce(sgx, SumOp(), sd);
    sg /= (double)m;
    sgx /= (double)m;
    bn_each(k, n, c, inner, [&](i64 i) {
      const double xh = bn_mul(bn_sub(bn_ld(x, i), mean), rstd);
      const double v = bn_sub(bn_sub(bn_mul(bn_ld(g, i), wk), sg), bn_mul(xh, sgx));
      out[i] = (float)bn_mul(rstd, v);
    });
  }
}

// batch_norm_grad_x_{f32,bf16,f16}: the training-mode gradient of the
// input: with ĝ = g·w[k] (g when w is null), x̂ = (x − mean)·rstd and M =
// n·inner values per channel, out = rstd·(ĝ − Σĝ/M − x̂·Σ(ĝ·x̂)/M). stats
// from batch_norm_stats_*. One block per channel as batch_norm_stats_*.
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(1024) batch_norm_grad_x_##S(              \
      const T* g, const T* x, const T* w, const double* stats, T* out, i64 n, i64 c,     \
      i64 inner) {                                                                       \
    batch_norm_grad_x_t(g, x, w, stats, out, n, c, inner);                               \
  }
FOR_FLOATS(K)
#undef K

template <typename T>
__device__ __forceinline__ void batch_norm_grad_w_t(const T* __restrict__ g,
                                                    const T* __restrict__ x,
                                                    const double* __restrict__ stats,
                                                    T* __restrict__ out, i64 n, i64 c,
                                                    i64 inner) {
  __shared__ double sd[32];
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    const double mean = stats[2 * k];
    double s = 0;
    bn_each(k, n, c, inner, [&](i64 i) { s += bn_mul(bn_ld(g, i), bn_sub(bn_ld(x, i), mean)); });
    s = row_allreduce(s, SumOp(), sd);
    if (threadIdx.x == 0) out[k] = (float)bn_mul(s, stats[2 * k + 1]);
  }
}

// batch_norm_grad_w_{f32,bf16,f16}: out[k] = (Σ g·(x − mean))·rstd over
// channel k's values, with stats of either mode. One block per channel as
// batch_norm_stats_*.
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(1024) batch_norm_grad_w_##S(                  \
      const T* g, const T* x, const double* stats, T* out, i64 n, i64 c, i64 inner) {        \
    batch_norm_grad_w_t(g, x, stats, out, n, c, inner);                                      \
  }
FOR_FLOATS(K)
#undef K
