// batchnorm.cu: batch_norm per channel over x [N, C, ...] viewed as rows
// [n·c, inner] (inner the product of the trailing axes; row r = i·c + k
// holds image i's channel k), its gradients and batch_norm_stats.
//
// Every pass is spread over all rows, not one block per channel (a
// [64, 64, 112, 112] tensor has 64 channels for 132 SMs):
//   batch_norm_rows_*        per row, the double sums Σx, Σx², and with g
//                            Σg and Σg·x, into a [n·c, 4] workspace;
//   batch_norm_coef          per channel, from those sums (training mode) or
//                            the running statistics (evaluation mode), the
//                            forward map's scale and shift (double);
//   batch_norm_*             y = x·scale + shift, every element;
//   batch_norm_grad_coef     per channel, the input gradient's map dx =
//                            A·g + B·x + C and the weight and bias
//                            gradients;
//   batch_norm_grad_x_*      dx, every element;
//   batch_norm_moments       batch_norm_stats's [2, c] output.
// The per-channel kernels sum a [rows, c, 4] workspace over its rows, one
// warp a channel: rows = n over NCHW row sums ([n·c, 4], row i·c + k), or
// the channels-last vector path's row chunks (below). m, the values per
// channel, is given apart from rows.
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
// activations a network makes. The scalar maps run in double with
// non-fusing intrinsics, as the CPU computes them.
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

// bn_channel sums channel k's partial sums Σx, Σx², Σg, Σgx over the rows
// of part [rows, c, 4], one warp a channel: lane l takes rows l, l + 32, …
// and the lanes meet in a butterfly, so every lane holds the totals, in an
// order fixed by rows alone (deterministic). blockDim.x must be 32.
__device__ __forceinline__ void bn_channel(const double* __restrict__ part, i64 rows, i64 c, i64 k,
                                           double s[4]) {
  double a = 0, b = 0, d = 0, e = 0;
  for (i64 j = threadIdx.x; j < rows; j += 32) {
    const double* p = part + 4 * (j * c + k);
    a += p[0];
    b += p[1];
    d += p[2];
    e += p[3];
  }
  s[0] = warp_allreduce(a, SumOp());
  s[1] = warp_allreduce(b, SumOp());
  s[2] = warp_allreduce(d, SumOp());
  s[3] = warp_allreduce(e, SumOp());
}

// BN_CHANNELS walks the channels [0, c) one warp each: blockDim (32, by),
// warp threadIdx.y of block blockIdx.x takes channel blockIdx.x·by +
// threadIdx.y, then strides by the grid (any grid is correct). The loop is
// uniform across a warp, as bn_channel's butterfly needs.
#define BN_CHANNELS(k, c)                                                        \
  for (i64 k = (i64)blockIdx.x * blockDim.y + threadIdx.y; k < (i64)(c);          \
       k += (i64)gridDim.x * blockDim.y)

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
// from part's rows (training: rmean null; m values a channel) or the
// running statistics rmean, rvar. w, b, rmean, rvar are [c] of dtype pdt,
// or null. Launched as BN_CHANNELS says (one warp a channel).
extern "C" __global__ void __launch_bounds__(256)
    batch_norm_coef(const double* part, const void* w, const void* b, const void* rmean,
                    const void* rvar, i64 pdt, double* coef, i64 rows, i64 c, i64 m, double eps) {
  BN_CHANNELS(k, c) {
    double s[4] = {0, 0, 0, 0};
    if (!rmean) bn_channel(part, rows, c, k, s);
    if (threadIdx.x == 0) {
      double mean, rstd;
      bn_stats(s, (double)m, rmean, rvar, pdt, k, eps, &mean, &rstd);
      double scale = rstd;
      if (w) scale = bn_mul(scale, bn_load(w, pdt, k));
      double shift = bn_mul(-mean, scale);
      if (b) shift = bn_add(shift, bn_load(b, pdt, k));
      coef[2 * k] = scale;
      coef[2 * k + 1] = shift;
    }
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

// batch_norm_grad_coef: for channel k with m values, mean and rstd as
// batch_norm_coef's, w = w[k] (1 when null) and D = Σg·x − mean·Σg
// (= Σg·(x − mean)):
//   the weight gradient Σg·x̂ = rstd·D, into dw[k] (dtype odt) unless null;
//   the bias gradient Σg, into db[k] (dtype bdt) unless null;
//   with coef non-null (training mode), the input gradient
//   rstd·(ĝ − Σĝ/M − x̂·Σ(ĝ·x̂)/M), ĝ = g·w, M = m, as dx = A·g + B·x + C:
//   A = rstd·w, B = −rstd³·w·D/M, C = −A·Σg/M − B·mean, at coef[3k..3k+2].
// Launched as BN_CHANNELS says (one warp a channel).
extern "C" __global__ void __launch_bounds__(256)
    batch_norm_grad_coef(const double* part, const void* w, const void* rmean, const void* rvar,
                         i64 pdt, double* coef, void* dw, i64 odt, void* db, i64 bdt, i64 rows,
                         i64 c, i64 m, double eps) {
  BN_CHANNELS(k, c) {
    double s[4];
    bn_channel(part, rows, c, k, s);
    if (threadIdx.x == 0) {
      const double mm = (double)m;
      double mean, rstd;
      bn_stats(s, mm, rmean, rvar, pdt, k, eps, &mean, &rstd);
      const double d = s[3] - mean * s[2];
      if (dw) bn_store(dw, odt, k, bn_mul(rstd, d));
      if (db) bn_store(db, bdt, k, s[2]);
      if (coef) {
        const double wk = w ? bn_load(w, pdt, k) : 1.0;
        const double a = rstd * wk;
        const double bb = mm > 0 ? -(rstd * rstd * a * d) / mm : 0.0;
        const double cc = mm > 0 ? -(a * s[2]) / mm - bb * mean : 0.0;
        coef[3 * k] = a;
        coef[3 * k + 1] = bb;
        coef[3 * k + 2] = cc;
      }
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
// 1) of channel k's m values (the host refuses m ≤ 1), each rounded once.
// Launched as BN_CHANNELS says (one warp a channel).
extern "C" __global__ void __launch_bounds__(256)
    batch_norm_moments(const double* part, void* out, i64 odt, i64 rows, i64 c, i64 m) {
  BN_CHANNELS(k, c) {
    double s[4];
    bn_channel(part, rows, c, k, s);
    if (threadIdx.x == 0) {
      const double mm = (double)m, mean = s[0] / mm;
      double q = s[1] - mm * mean * mean;
      if (q < 0) q = 0;
      bn_store(out, odt, k, mean);
      bn_store(out, odt, c + k, q / (mm - 1));
    }
  }
}

// Channels last (graph.Attrs.ChannelsLast): x, g, y and dx [n, hw, c]
// (NHWC with hw = h·w). The scalar kernels below put the row sums in the
// same [n·c, 4] workspace (row i·c + k: image i, channel k), so
// batch_norm_coef, batch_norm_grad_coef and batch_norm_moments serve both
// layouts; only the element-wise passes and the row sums have
// channels-last twins. The vector path at the end of the file is what
// exec/cuda runs where it applies.

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

// Channels last, 16-byte vectors: the path exec/cuda takes where c is a
// multiple of V = 16/sizeof(T) (8 bfloat16 or float16 values, 4 float32)
// and x, g, y and dx are 16-byte aligned. The positions of every image
// make one axis of P = n·hw positions, each a row of c channels; a thread
// owns one channel group of V channels (cg = blockIdx.y·blockDim.x +
// threadIdx.x, the same for its whole life: no per-element channel
// arithmetic) and moves it with one 16-byte load or store a position.
// blockDim = (bx, by): bx a power of two ≤ 32 (the groups of a block's
// channel tile), bx·by = BN_VEC_BLOCK; grid.y over the ⌈(c/V)/bx⌉ tiles.
//
// batch_norm_rows_nhwc_vec_{f32,bf16,f16}: the positions fall into row
// chunks of lc = by·ppt (the last one shorter), and part [rows, c, 4],
// rows = ⌈P/lc⌉, gets each chunk's Σx, Σx², Σg, Σg·x per channel (the last
// two 0 when g is null): the per-channel kernels sum them over the rows
// with m = n·hw. Every position lies in exactly one chunk, so the rows
// sum to the channel's sums exactly as the NCHW row sums do. grid.x loops
// over the chunks (any grid); thread (tx, ty) of chunk r takes positions
// r·lc + ty + j·by, j < ppt.
//
// Accuracy: a thread sums its ≤ ppt ≤ 32 positions in A = BnAcc<T>, then
// the block's threads and the rows meet in double. For 16-bit T, A is
// float32 and every term is exact in it (a bfloat16 square or product has
// ≤ 16 significant bits, a float16 one ≤ 22, under float32's 24; a
// bfloat16 beyond 1.8e19 would overflow x², which no activation reaches),
// so the only rounding before double is the float32 sum of ≤ 32 terms:
// relative error ≤ 31·2⁻²⁴ ≈ 2e-6 of Σ|term| in the worst case (√32·2⁻²⁴ ≈
// 3e-7 typically), three orders below a 16-bit value's half ulp (2⁻⁹,
// 2⁻¹²). The variance Σx²/m − mean² carries that error times (1 +
// mean²/var), as the double kernels carry theirs; for activations with
// |mean| ≤ 10·std the statistics stay within 2e-4 relative of the double
// kernels' even in the worst case, below the one rounding of every 16-bit
// output. For float32 T, A is double: the same sums as the double kernels
// in another order.
//
// The maps (batch_norm_nhwc_vec_*, batch_norm_grad_x_nhwc_vec_*) run in
// float32 with fused multiply-adds for 16-bit T (the coefficients rounded
// to float32: an error near 2⁻²³ of |x·scale| + |shift|, far below the
// output's rounding) and as the scalar kernels, in double without fusing,
// for float32 T. Each thread maps BN_VEC_UNROLL positions by apart per
// pass; grid.x over the positions in blocks of by·BN_VEC_UNROLL (loops).
// No atomics: for a given launch the results are the same every run.
#define BN_VEC_BLOCK 256
#define BN_VEC_WARPS (BN_VEC_BLOCK / 32)
#define BN_VEC_UNROLL 4

// BnAcc<T> is what a thread sums values of T in (see above).
template <typename T>
struct BnAcc {
  typedef float type;
};
template <>
struct BnAcc<float> {
  typedef double type;
};

// bn_fma2 is x·a + b in the maps' arithmetic: one fused float32 operation,
// or double without fusing (the scalar kernels' order).
__device__ __forceinline__ float bn_fma2(float x, float a, float b) { return __fmaf_rn(x, a, b); }
__device__ __forceinline__ double bn_fma2(double x, double a, double b) { return bn_add(bn_mul(x, a), b); }

// bn_dx is dx = A·g + B·x + C in the maps' arithmetic, as bn_fma2.
__device__ __forceinline__ float bn_dx(float a, float g, float b, float x, float c) {
  return __fmaf_rn(a, g, __fmaf_rn(b, x, c));
}
__device__ __forceinline__ double bn_dx(double a, double g, double b, double x, double c) {
  return bn_add(bn_add(bn_mul(a, g), bn_mul(b, x)), c);
}

// batch_norm_rows_nhwc_vec_t: NQ = 2 sums x alone, NQ = 4 x and g. sd is
// BN_VEC_WARPS·256 doubles of shared memory.
template <typename T, int NQ>
__device__ __forceinline__ void batch_norm_rows_nhwc_vec_t(const T* __restrict__ x,
                                                           const T* __restrict__ g,
                                                           double* __restrict__ part, i64 P, i64 c,
                                                           i64 ppt, double* sd) {
  constexpr int V = 16 / sizeof(T);
  typedef typename BnAcc<T>::type A;
  const i64 G = c / V;
  const int bx = blockDim.x, by = blockDim.y;
  const int tid = threadIdx.y * bx + threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 cg = (i64)blockIdx.y * bx + threadIdx.x;
  const bool live = cg < G;
  const i64 lc = (i64)by * ppt;
  const i64 rows = (P + lc - 1) / lc;
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    A s[4][V];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int v = 0; v < V; ++v) s[q][v] = 0;
    }
    if (live) {
      const i64 p0 = r * lc + threadIdx.y, end = imin(P, (r + 1) * lc);
      for (i64 j = 0; j < ppt; j += BN_VEC_UNROLL) {
        Vec<T, V> xv[BN_VEC_UNROLL], gv[BN_VEC_UNROLL];
        bool ok[BN_VEC_UNROLL];
#pragma unroll
        for (int u = 0; u < BN_VEC_UNROLL; ++u) {
          const i64 p = p0 + (j + u) * by;
          ok[u] = j + u < ppt && p < end;
          if (ok[u]) {
            xv[u] = ldv<V>(x, p * G + cg);
            if (NQ == 4) gv[u] = ldv<V>(g, p * G + cg);
          }
        }
#pragma unroll
        for (int u = 0; u < BN_VEC_UNROLL; ++u) {
          if (ok[u]) {
#pragma unroll
            for (int v = 0; v < V; ++v) {
              const A xf = (A)(float)xv[u].v[v];
              s[0][v] += xf;
              s[1][v] += xf * xf;
              if (NQ == 4) {
                const A gf = (A)(float)gv[u].v[v];
                s[2][v] += gf;
                s[3][v] += gf * xf;
              }
            }
          }
        }
      }
    }
    // The block's threads meet in double: a butterfly over the warp's
    // position lanes (lanes bx apart share a channel group), then the
    // warps' sums in shared memory, one quantity at a time.
    double tot[4] = {0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        double d = (double)s[q][v];
        for (int o = bx; o < 32; o <<= 1) d += __shfl_xor_sync(FULL_MASK, d, o);
        if (lane < bx) sd[warp * 256 + lane * V + v] = d;
      }
      __syncthreads();
      if (tid < bx * V) {
        double a = 0;
        for (int w = 0; w < BN_VEC_WARPS; ++w) a += sd[w * 256 + tid];
        tot[q] = a;
      }
      __syncthreads();
    }
    const i64 ch = (i64)blockIdx.y * bx * V + tid;
    if (tid < bx * V && ch < c) {
      double* p = part + 4 * (r * c + ch);
      p[0] = tot[0];
      p[1] = tot[1];
      p[2] = tot[2];
      p[3] = tot[3];
    }
  }
}

#define K(T, S)                                                                           \
  extern "C" __global__ void __launch_bounds__(BN_VEC_BLOCK) batch_norm_rows_nhwc_vec_##S( \
      const T* x, const T* g, double* part, i64 P, i64 c, i64 ppt) {                      \
    __shared__ double sd[BN_VEC_WARPS * 256];                                             \
    if (g)                                                                                \
      batch_norm_rows_nhwc_vec_t<T, 4>(x, g, part, P, c, ppt, sd);                        \
    else                                                                                  \
      batch_norm_rows_nhwc_vec_t<T, 2>(x, g, part, P, c, ppt, sd);                        \
  }
FOR_FLOATS(K)
#undef K

// bn_nhwc_vec_map writes out = f(v, a, b) over P positions of channel
// group cg (G groups of 16 bytes a position): BN_VEC_UNROLL positions by
// apart per pass, each thread loading all of them (a's, and b's when NIn
// is 2) before it stores any; f gets element v's values widened to float
// (b's 0 when NIn is 1) and returns the output element's float value.
template <int NIn, typename T, typename F>
__device__ __forceinline__ void bn_nhwc_vec_map(const T* __restrict__ a, const T* __restrict__ b,
                                                T* __restrict__ out, i64 P, i64 G, i64 cg, F f) {
  constexpr int V = 16 / sizeof(T);
  const i64 by = blockDim.y, step = (i64)gridDim.x * by * BN_VEC_UNROLL;
  for (i64 p0 = (i64)blockIdx.x * by * BN_VEC_UNROLL + threadIdx.y; p0 < P; p0 += step) {
    Vec<T, V> av[BN_VEC_UNROLL], bv[BN_VEC_UNROLL];
#pragma unroll
    for (int u = 0; u < BN_VEC_UNROLL; ++u) {
      const i64 p = p0 + u * by;
      if (p < P) {
        av[u] = ldv<V>(a, p * G + cg);
        if (NIn == 2) bv[u] = ldv<V>(b, p * G + cg);
      }
    }
#pragma unroll
    for (int u = 0; u < BN_VEC_UNROLL; ++u) {
      const i64 p = p0 + u * by;
      if (p < P) {
        Vec<T, V> o;
#pragma unroll
        for (int v = 0; v < V; ++v) o.v[v] = f(v, (float)av[u].v[v], NIn == 2 ? (float)bv[u].v[v] : 0.f);
        stv<V>(out, p * G + cg, o);
      }
    }
  }
}

// batch_norm_nhwc_vec_{f32,bf16,f16}: y = x·scale + shift over P positions
// of c channels (batch_norm_coef's coef), 16 bytes a position and thread.
template <typename T>
__device__ __forceinline__ void batch_norm_nhwc_vec_t(const T* __restrict__ x,
                                                      const double* __restrict__ coef,
                                                      T* __restrict__ y, i64 P, i64 c) {
  constexpr int V = 16 / sizeof(T);
  typedef typename BnAcc<T>::type A;
  const i64 G = c / V, cg = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  if (cg >= G) return;
  A sc[V], sh[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    sc[v] = (A)coef[2 * (cg * V + v)];
    sh[v] = (A)coef[2 * (cg * V + v) + 1];
  }
  bn_nhwc_vec_map<1>(x, x, y, P, G, cg,
                     [&](int v, float xe, float) { return (float)bn_fma2((A)xe, sc[v], sh[v]); });
}

#define K(T, S)                                                                      \
  extern "C" __global__ void __launch_bounds__(BN_VEC_BLOCK) batch_norm_nhwc_vec_##S( \
      const T* x, const double* coef, T* y, i64 P, i64 c) {                          \
    batch_norm_nhwc_vec_t(x, coef, y, P, c);                                         \
  }
FOR_FLOATS(K)
#undef K

// batch_norm_grad_x_nhwc_vec_{f32,bf16,f16}: dx = A·g + B·x + C over P
// positions of c channels (batch_norm_grad_coef's coef), as
// batch_norm_nhwc_vec_*.
template <typename T>
__device__ __forceinline__ void batch_norm_grad_x_nhwc_vec_t(const T* __restrict__ g,
                                                             const T* __restrict__ x,
                                                             const double* __restrict__ coef,
                                                             T* __restrict__ out, i64 P, i64 c) {
  constexpr int V = 16 / sizeof(T);
  typedef typename BnAcc<T>::type A;
  const i64 G = c / V, cg = (i64)blockIdx.y * blockDim.x + threadIdx.x;
  if (cg >= G) return;
  A ca[V], cb[V], cc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const double* q = coef + 3 * (cg * V + v);
    ca[v] = (A)q[0];
    cb[v] = (A)q[1];
    cc[v] = (A)q[2];
  }
  bn_nhwc_vec_map<2>(g, x, out, P, G, cg, [&](int v, float ge, float xe) {
    return (float)bn_dx(ca[v], (A)ge, cb[v], (A)xe, cc[v]);
  });
}

#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(BN_VEC_BLOCK) batch_norm_grad_x_nhwc_vec_##S( \
      const T* g, const T* x, const double* coef, T* out, i64 P, i64 c) {                   \
    batch_norm_grad_x_nhwc_vec_t(g, x, coef, out, P, c);                                    \
  }
FOR_FLOATS(K)
#undef K
