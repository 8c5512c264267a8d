// batchnorm.cu: batch_norm per channel over x [N, C, ...] viewed as rows
// [n·c, inner] (inner the product of the trailing axes; row r = i·c + k
// holds image i's channel k), its gradients and batch_norm_stats.
//
// Every pass is spread over all rows, not one block per channel (a
// [64, 64, 112, 112] tensor has 64 channels for 132 SMs):
//   batch_norm_rows_*        per row, the double sums Σx, Σx², and with g
//                            Σg and Σg·x, into a [rows, 4] workspace;
//   batch_norm_coef          per channel, from those sums (training mode) or
//                            the running statistics (evaluation mode), the
//                            forward map's scale and shift (double);
//   batch_norm_*             y = x·scale + shift, every element;
//   batch_norm_grad_coef     per channel, the input gradient's map dx =
//                            A·g + B·x + C and the weight gradient;
//   batch_norm_grad_x_*      dx, every element;
//   batch_norm_moments       batch_norm_stats's [2, c] output.
// The element kernels are templated on the storage type T of x, g, y and
// dx (FOR_FLOATS): 16-bit values are read widened and each output rounds
// once. The per-channel kernels read the weight, bias and running
// statistics, and write the weight gradient and the moments, in a dtype
// given at run time (pdt, odt: 0 float32, 1 bfloat16, 2 float16): float32
// per-channel values beside 16-bit x are mixed precision's batch norm.
//
// Statistics are the batch's mean and biased variance, from double sums:
// var = Σx²/m − mean² (clamped at 0), rstd = 1/√(var + eps). The CPU
// subtracts the mean first (two passes); in double the two agree to
// ~1e-16·mean²/var relative, far below float32's resolution for any
// activations a network makes. The maps run in double with non-fusing
// intrinsics, as the CPU computes them.
#include "common.cuh"

__device__ __forceinline__ double bn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double bn_add(double a, double b) { return __dadd_rn(a, b); }

// bn_load widens element k of a per-channel array of dtype dt.
__device__ __forceinline__ double bn_load(const void* p, i64 dt, i64 k) {
  switch (dt) {
    case 1:
      return (double)(float)((const bf16*)p)[k];
    case 2:
      return (double)(float)((const f16*)p)[k];
  }
  return (double)((const float*)p)[k];
}

// bn_store rounds v into element k of an array of dtype dt (float64 →
// float32 → 16-bit, as the CPU's stores).
__device__ __forceinline__ void bn_store(void* p, i64 dt, i64 k, double v) {
  const float f = (float)v;
  switch (dt) {
    case 1:
      ((bf16*)p)[k] = f;
      return;
    case 2:
      ((f16*)p)[k] = f;
      return;
  }
  ((float*)p)[k] = f;
}

template <typename T>
__device__ __forceinline__ void batch_norm_rows_t(const T* __restrict__ x, const T* __restrict__ g,
                                                  double* __restrict__ part, i64 rows, i64 inner) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    double sx = 0, sxx = 0, sg = 0, sgx = 0;
    if (live) {
      const T* px = x + row * inner;
      if (g) {
        const T* pg = g + row * inner;
        for (i64 j = threadIdx.x; j < inner; j += blockDim.x) {
          const double v = (double)(float)px[j], w = (double)(float)pg[j];
          sx += v;
          sxx += v * v;
          sg += w;
          sgx += w * v;
        }
      } else {
        for (i64 j = threadIdx.x; j < inner; j += blockDim.x) {
          const double v = (double)(float)px[j];
          sx += v;
          sxx += v * v;
        }
      }
    }
    sx = row_allreduce(sx, SumOp(), sd);
    sxx = row_allreduce(sxx, SumOp(), sd);
    if (g) {
      sg = row_allreduce(sg, SumOp(), sd);
      sgx = row_allreduce(sgx, SumOp(), sd);
    }
    if (live && threadIdx.x == 0) {
      double* p = part + 4 * row;
      p[0] = sx;
      p[1] = sxx;
      p[2] = sg;
      p[3] = sgx;
    }
  }
}

// batch_norm_rows_{f32,bf16,f16}: part[4r..4r+3] = Σx, Σx², Σg, Σg·x over
// row r's inner values (the last two 0 when g is null). Row layout:
// blockDim = (bx, by), bx a multiple of 32, bx·by ≤ 1024; each threadIdx.y
// group takes one row; any grid.
#define K(T, S)                                                                     \
  extern "C" __global__ void __launch_bounds__(1024) batch_norm_rows_##S(           \
      const T* x, const T* g, double* part, i64 rows, i64 inner) {                  \
    batch_norm_rows_t(x, g, part, rows, inner);                                     \
  }
FOR_FLOATS(K)
#undef K

// bn_channel sums channel k's row sums over the n images: Σx, Σx², Σg, Σgx.
__device__ __forceinline__ void bn_channel(const double* part, i64 n, i64 c, i64 k, double s[4]) {
  s[0] = s[1] = s[2] = s[3] = 0;
  for (i64 i = 0; i < n; ++i) {
    const double* p = part + 4 * (i * c + k);
    s[0] += p[0];
    s[1] += p[1];
    s[2] += p[2];
    s[3] += p[3];
  }
}

// bn_stats gives channel k's mean and rstd: the batch's from its sums s
// over m values (training), or the running statistics' (rmean non-null).
__device__ __forceinline__ void bn_stats(const double s[4], double m, const void* rmean,
                                         const void* rvar, i64 pdt, i64 k, double eps,
                                         double* mean, double* rstd) {
  if (rmean) {
    *mean = bn_load(rmean, pdt, k);
    *rstd = 1.0 / sqrt(bn_load(rvar, pdt, k) + eps);
    return;
  }
  if (m <= 0) {
    *mean = *rstd = 0;  // no values: as the CPU
    return;
  }
  *mean = s[0] / m;
  double var = s[1] / m - *mean * *mean;
  if (var < 0) var = 0;
  *rstd = 1.0 / sqrt(var + eps);
}

// batch_norm_coef: coef[2k], coef[2k+1] = scale, shift of channel k with
// scale = rstd (· w[k]) and shift = −mean·scale (+ b[k]); mean and rstd
// from part (training: rmean null) or the running statistics rmean, rvar.
// w, b, rmean, rvar are [c] of dtype pdt, or null. 1-D blocks over c, any
// grid.
extern "C" __global__ void __launch_bounds__(256)
    batch_norm_coef(const double* part, const void* w, const void* b, const void* rmean,
                    const void* rvar, i64 pdt, double* coef, i64 n, i64 c, i64 inner, double eps) {
  GRID_LOOP(k, c) {
    double s[4] = {0, 0, 0, 0};
    if (!rmean) bn_channel(part, n, c, k, s);
    double mean, rstd;
    bn_stats(s, (double)(n * inner), rmean, rvar, pdt, k, eps, &mean, &rstd);
    double scale = rstd;
    if (w) scale = bn_mul(scale, bn_load(w, pdt, k));
    double shift = bn_mul(-mean, scale);
    if (b) shift = bn_add(shift, bn_load(b, pdt, k));
    coef[2 * k] = scale;
    coef[2 * k + 1] = shift;
  }
}

// bn_rows2 walks rows [0, rows) of inner elements with a 2-D grid: y (and
// its loop) over rows, x over each row's elements, so an element's channel
// costs no division.
#define BN_ROWS2(r, j, rows, inner)                                                          \
  for (i64 r = blockIdx.y; r < (rows); r += gridDim.y)                                      \
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < (inner); j += (i64)gridDim.x * blockDim.x)

// batch_norm_{f32,bf16,f16}: y = x·scale + shift with channel k's coef
// (batch_norm_coef). Blocks of 1-D threads; grid.x over a row's inner
// elements, grid.y over the rows (both loop, so any grid is correct).
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(256) batch_norm_##S(                         \
      const T* __restrict__ x, const double* __restrict__ coef, T* __restrict__ y, i64 rows, \
      i64 c, i64 inner) {                                                                   \
    BN_ROWS2(r, j, rows, inner) {                                                           \
      const i64 k = r % c, i = r * inner + j;                                               \
      y[i] = (float)bn_add(bn_mul((double)(float)x[i], coef[2 * k]), coef[2 * k + 1]);      \
    }                                                                                       \
  }
FOR_FLOATS(K)
#undef K

// batch_norm_grad_coef: for channel k with M = n·inner values, mean and
// rstd as batch_norm_coef's, w = w[k] (1 when null) and D = Σg·x − mean·Σg
// (= Σg·(x − mean)):
//   the weight gradient Σg·x̂ = rstd·D, into dw[k] (dtype odt) unless null;
//   with coef non-null (training mode), the input gradient
//   rstd·(ĝ − Σĝ/M − x̂·Σ(ĝ·x̂)/M), ĝ = g·w, as dx = A·g + B·x + C:
//   A = rstd·w, B = −rstd³·w·D/M, C = −A·Σg/M − B·mean, at coef[3k..3k+2].
// 1-D blocks over c, any grid.
extern "C" __global__ void __launch_bounds__(256)
    batch_norm_grad_coef(const double* part, const void* w, const void* rmean, const void* rvar,
                         i64 pdt, double* coef, void* dw, i64 odt, i64 n, i64 c, i64 inner,
                         double eps) {
  GRID_LOOP(k, c) {
    double s[4];
    bn_channel(part, n, c, k, s);
    const double m = (double)(n * inner);
    double mean, rstd;
    bn_stats(s, m, rmean, rvar, pdt, k, eps, &mean, &rstd);
    const double d = s[3] - mean * s[2];
    if (dw) bn_store(dw, odt, k, bn_mul(rstd, d));
    if (coef) {
      const double wk = w ? bn_load(w, pdt, k) : 1.0;
      const double a = rstd * wk;
      const double bb = m > 0 ? -(rstd * rstd * a * d) / m : 0.0;
      const double cc = m > 0 ? -(a * s[2]) / m - bb * mean : 0.0;
      coef[3 * k] = a;
      coef[3 * k + 1] = bb;
      coef[3 * k + 2] = cc;
    }
  }
}

// batch_norm_grad_x_{f32,bf16,f16}: dx = A·g + B·x + C with channel k's
// coef (batch_norm_grad_coef). Launched as batch_norm_*.
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) batch_norm_grad_x_##S(                      \
      const T* __restrict__ g, const T* __restrict__ x, const double* __restrict__ coef,        \
      T* __restrict__ out, i64 rows, i64 c, i64 inner) {                                        \
    BN_ROWS2(r, j, rows, inner) {                                                               \
      const i64 k = r % c, i = r * inner + j;                                                   \
      const double* q = coef + 3 * k;                                                           \
      out[i] = (float)bn_add(bn_add(bn_mul(q[0], (double)(float)g[i]), bn_mul(q[1], (double)(float)x[i])), q[2]); \
    }                                                                                           \
  }
FOR_FLOATS(K)
#undef K

// batch_norm_moments: batch_norm_stats's [2, c] output out (dtype odt):
// out[k] the mean and out[c + k] the unbiased variance (Σx² − m·mean²)/(m −
// 1) of channel k's m = n·inner values (the host refuses m ≤ 1), each
// rounded once. 1-D blocks over c, any grid.
extern "C" __global__ void __launch_bounds__(256)
    batch_norm_moments(const double* part, void* out, i64 odt, i64 n, i64 c, i64 inner) {
  GRID_LOOP(k, c) {
    double s[4];
    bn_channel(part, n, c, k, s);
    const double m = (double)(n * inner), mean = s[0] / m;
    double q = s[1] - m * mean * mean;
    if (q < 0) q = 0;
    bn_store(out, odt, k, mean);
    bn_store(out, odt, c + k, q / (m - 1));
  }
}

// Channels last (graph.Attrs.ChannelsLast): x, g, y and dx [n, hw, c]
// (NHWC with hw = h·w). The row sums go to the same [n·c, 4] workspace
// (row i·c + k: image i, channel k), so batch_norm_coef,
// batch_norm_grad_coef and batch_norm_moments serve both layouts; only the
// element-wise passes and the row sums have channels-last twins.

// batch_norm_rows_nhwc_{f32,bf16,f16}: part[4(i·c + k)..] = Σx, Σx², Σg,
// Σg·x over image i's hw values of channel k (the last two 0 when g is
// null). blockDim = (32, 16): threadIdx.x a channel (a warp reads 32
// neighbouring channels of one position), threadIdx.y strides the
// positions, and the 16 partial sums meet in shared memory; grid.x over
// the channels in tiles of 32, grid.y over the images (both loop, so any
// grid is correct).
template <typename T>
__device__ __forceinline__ void batch_norm_rows_nhwc_t(const T* __restrict__ x,
                                                       const T* __restrict__ g,
                                                       double* __restrict__ part, i64 n, i64 hw,
                                                       i64 c) {
  __shared__ double sd[4][16][32];
  for (i64 img = blockIdx.y; img < n; img += gridDim.y) {
    for (i64 k0 = (i64)blockIdx.x * 32; k0 < c; k0 += (i64)gridDim.x * 32) {
      const i64 k = k0 + threadIdx.x;
      double sx = 0, sxx = 0, sg = 0, sgx = 0;
      if (k < c) {
        const T* px = x + img * hw * c + k;
        if (g) {
          const T* pg = g + img * hw * c + k;
          for (i64 j = threadIdx.y; j < hw; j += blockDim.y) {
            const double v = (double)(float)px[j * c], w = (double)(float)pg[j * c];
            sx += v;
            sxx += v * v;
            sg += w;
            sgx += w * v;
          }
        } else {
          for (i64 j = threadIdx.y; j < hw; j += blockDim.y) {
            const double v = (double)(float)px[j * c];
            sx += v;
            sxx += v * v;
          }
        }
      }
      sd[0][threadIdx.y][threadIdx.x] = sx;
      sd[1][threadIdx.y][threadIdx.x] = sxx;
      sd[2][threadIdx.y][threadIdx.x] = sg;
      sd[3][threadIdx.y][threadIdx.x] = sgx;
      __syncthreads();
      if (threadIdx.y < 4 && k < c) {
        double s = 0;
        for (unsigned r = 0; r < blockDim.y; ++r) s += sd[threadIdx.y][r][threadIdx.x];
        part[4 * (img * c + k) + threadIdx.y] = s;
      }
      __syncthreads();
    }
  }
}

#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(512) batch_norm_rows_nhwc_##S(            \
      const T* x, const T* g, double* part, i64 n, i64 hw, i64 c) {                      \
    batch_norm_rows_nhwc_t(x, g, part, n, hw, c);                                        \
  }
FOR_FLOATS(K)
#undef K

// bn_channel_of is element i's channel in channels-last data of c channels.
__device__ __forceinline__ i64 bn_channel_of(i64 i, i64 c, bool fits) {
  return fits ? (i64)((unsigned)i % (unsigned)c) : i % c;
}

// batch_norm_nhwc_{f32,bf16,f16}: y = x·scale + shift with channel k's coef
// (batch_norm_coef), over total elements of channels-last data. 1-D blocks,
// any grid.
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(256) batch_norm_nhwc_##S(                    \
      const T* __restrict__ x, const double* __restrict__ coef, T* __restrict__ y, i64 total, \
      i64 c) {                                                                              \
    const bool fits = FITS32(total);                                                        \
    GRID_LOOP(i, total) {                                                                   \
      const i64 k = bn_channel_of(i, c, fits);                                              \
      y[i] = (float)bn_add(bn_mul((double)(float)x[i], coef[2 * k]), coef[2 * k + 1]);      \
    }                                                                                       \
  }
FOR_FLOATS(K)
#undef K

// batch_norm_grad_x_nhwc_{f32,bf16,f16}: dx = A·g + B·x + C with channel
// k's coef (batch_norm_grad_coef), over total elements of channels-last
// data. 1-D blocks, any grid.
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) batch_norm_grad_x_nhwc_##S(                 \
      const T* __restrict__ g, const T* __restrict__ x, const double* __restrict__ coef,        \
      T* __restrict__ out, i64 total, i64 c) {                                                  \
    const bool fits = FITS32(total);                                                            \
    GRID_LOOP(i, total) {                                                                       \
      const double* q = coef + 3 * bn_channel_of(i, c, fits);                                   \
      out[i] = (float)bn_add(bn_add(bn_mul(q[0], (double)(float)g[i]), bn_mul(q[1], (double)(float)x[i])), q[2]); \
    }                                                                                           \
  }
FOR_FLOATS(K)
#undef K
