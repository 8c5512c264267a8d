// batchnorm.cu: batch_norm per channel over [n, c, inner] data (x [N, C, ...]
// with inner the product of the trailing axes), and its gradients.
//
// Statistics follow exec/cpu: per channel, the mean and then the biased
// variance of the centred values (two passes), accumulated in double;
// rstd = 1/√(var + eps) in double. They go to a double workspace stats
// [2·c] (mean, rstd per channel), made by batch_norm_stats_f32 from the
// batch (training mode) or by batch_norm_stats_running_f32 from the running
// statistics (evaluation mode). The per-element maps run in double with
// non-fusing intrinsics, as the CPU computes them.
#include "common.cuh"

__device__ __forceinline__ double bn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double bn_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double bn_sub(double a, double b) { return __dsub_rn(a, b); }

// bn_at is the t-th of channel k's n·inner values.
__device__ __forceinline__ i64 bn_at(i64 t, i64 k, i64 c, i64 inner) {
  const i64 i = t / inner, j = t - i * inner;
  return (i * c + k) * inner + j;
}

// batch_norm_stats_f32: stats[2k] = mean and stats[2k+1] = rstd of channel
// k's n·inner values (both 0 when there are none, as on the CPU). One block
// per channel (blocks loop over channels): blockDim.x a multiple of 32 up
// to 1024, blockDim.y = 1, any grid.
extern "C" __global__ void __launch_bounds__(1024)
batch_norm_stats_f32(const float* __restrict__ x, double* __restrict__ stats, i64 n, i64 c,
                     i64 inner, double eps) {
  __shared__ double sd[32];
  const i64 m = n * inner;
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    double s = 0;
    for (i64 t = threadIdx.x; t < m; t += blockDim.x) s += (double)x[bn_at(t, k, c, inner)];
    s = row_allreduce(s, SumOp(), sd);
    const double mean = m > 0 ? s / (double)m : 0.0;
    double q = 0;
    for (i64 t = threadIdx.x; t < m; t += blockDim.x) {
      const double d = (double)x[bn_at(t, k, c, inner)] - mean;
      q += d * d;
    }
    q = row_allreduce(q, SumOp(), sd);
    if (threadIdx.x == 0) {
      stats[2 * k] = mean;
      stats[2 * k + 1] = m > 0 ? 1.0 / sqrt(q / (double)m + eps) : 0.0;
    }
  }
}

// batch_norm_stats_running_f32: stats from running statistics [c]:
// mean = rmean[k], rstd = 1/√(rvar[k] + eps). 1-D blocks over c, any grid.
extern "C" __global__ void __launch_bounds__(256)
batch_norm_stats_running_f32(const float* __restrict__ rmean, const float* __restrict__ rvar,
                             double* __restrict__ stats, i64 c, double eps) {
  GRID_LOOP(k, c) {
    stats[2 * k] = (double)rmean[k];
    stats[2 * k + 1] = 1.0 / sqrt((double)rvar[k] + eps);
  }
}

// batch_norm_f32: y = x·scale + shift per channel with scale = rstd (· w[k])
// and shift = −mean·scale (+ b[k]); w and b are [c] or null. 1-D blocks over
// n·c·inner, any grid.
extern "C" __global__ void __launch_bounds__(256)
batch_norm_f32(const float* __restrict__ x, const double* __restrict__ stats,
               const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ y,
               i64 n, i64 c, i64 inner) {
  const i64 total = n * c * inner;
  GRID_LOOP(t, total) {
    const i64 k = (t / inner) % c;
    double scale = stats[2 * k + 1];
    if (w) scale = bn_mul(scale, (double)w[k]);
    double shift = bn_mul(-stats[2 * k], scale);
    if (b) shift = bn_add(shift, (double)b[k]);
    y[t] = (float)bn_add(bn_mul((double)x[t], scale), shift);
  }
}

// batch_norm_grad_x_f32: the training-mode gradient of the input: with
// ĝ = g·w[k] (g when w is null), x̂ = (x − mean)·rstd and M = n·inner values
// per channel, out = rstd·(ĝ − Σĝ/M − x̂·Σ(ĝ·x̂)/M). stats from
// batch_norm_stats_f32. One block per channel as batch_norm_stats_f32.
extern "C" __global__ void __launch_bounds__(1024)
batch_norm_grad_x_f32(const float* __restrict__ g, const float* __restrict__ x,
                      const float* __restrict__ w, const double* __restrict__ stats,
                      float* __restrict__ out, i64 n, i64 c, i64 inner) {
  __shared__ double sd[32];
  const i64 m = n * inner;
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    const double wk = w ? (double)w[k] : 1.0;
    const double mean = stats[2 * k], rstd = stats[2 * k + 1];
    double sg = 0, sgx = 0;
    for (i64 t = threadIdx.x; t < m; t += blockDim.x) {
      const i64 i = bn_at(t, k, c, inner);
      const double gh = bn_mul((double)g[i], wk);
      sg += gh;
      sgx += bn_mul(bn_mul(gh, bn_sub((double)x[i], mean)), rstd);
    }
    sg = row_allreduce(sg, SumOp(), sd);
    sgx = row_allreduce(sgx, SumOp(), sd);
    sg /= (double)m;
    sgx /= (double)m;
    for (i64 t = threadIdx.x; t < m; t += blockDim.x) {
      const i64 i = bn_at(t, k, c, inner);
      const double xh = bn_mul(bn_sub((double)x[i], mean), rstd);
      const double v = bn_sub(bn_sub(bn_mul((double)g[i], wk), sg), bn_mul(xh, sgx));
      out[i] = (float)bn_mul(rstd, v);
    }
  }
}

// batch_norm_grad_w_f32: out[k] = (Σ g·(x − mean))·rstd over channel k's
// values, with stats of either mode. One block per channel as
// batch_norm_stats_f32.
extern "C" __global__ void __launch_bounds__(1024)
batch_norm_grad_w_f32(const float* __restrict__ g, const float* __restrict__ x,
                      const double* __restrict__ stats, float* __restrict__ out, i64 n, i64 c,
                      i64 inner) {
  __shared__ double sd[32];
  const i64 m = n * inner;
  for (i64 k = blockIdx.x; k < c; k += gridDim.x) {
    const double mean = stats[2 * k];
    double s = 0;
    for (i64 t = threadIdx.x; t < m; t += blockDim.x) {
      const i64 i = bn_at(t, k, c, inner);
      s += bn_mul((double)g[i], bn_sub((double)x[i], mean));
    }
    s = row_allreduce(s, SumOp(), sd);
    if (threadIdx.x == 0) out[k] = (float)bn_mul(s, stats[2 * k + 1]);
  }
}
