// layernorm.cu: layer_norm over the trailing dims and its gradients. Every
// kernel is templated on its storage type and instantiated for float32,
// bfloat16 and float16 (FOR_FLOATS, common.cuh): x, g, the weight and bias
// and the outputs have that type, are read widened, and each output rounds
// once from the float the float32 kernel would store. The statistics stay
// double, in registers or in a double workspace.
//
// x is viewed as [rows, d], d the product of the Attrs.NormDims trailing
// dims. Statistics follow the CPU: mean, then the biased variance of the
// centred values (two passes, no cancellation), both accumulated in double,
// rstd = 1/√(var + eps) in double; the per-element affine map runs in double
// too (a few double operations per element are cheap next to the traffic).
// Row kernels use one threadIdx.y group per row: blockDim = (bx, by), bx a
// multiple of 32, bx·by ≤ 1024, any grid.
#include "common.cuh"

// row_stats gives the row group's mean and rstd of the row read by at(k, u)
// (see row_each); every thread of the block must call it.
template <bool C, typename A>
__device__ __forceinline__ void row_stats(A at, i64 d, bool live, double eps, double* sd,
                                          double* mean, double* rstd) {
  double s = 0;
  if (live) row_each<C>(d, [&](i64 k, int u) { s += (double)at(k, u); });
  s = row_allreduce(s, SumOp(), sd);
  const double m = s / (double)d;
  double q = 0;
  if (live)
    row_each<C>(d, [&](i64 k, int u) {
      const double c = (double)at(k, u) - m;
      q += c * c;
    });
  q = row_allreduce(q, SumOp(), sd);
  *mean = m;
  *rstd = 1.0 / sqrt(q / (double)d + eps);
}

template <bool C, typename T, typename TY>
__device__ __forceinline__ void layer_norm_body(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ b, TY* __restrict__ y,
                                                i64 rows, i64 d, double eps) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const T* p = x + row * d;
    float v[ROW_VPT];
    if (C && live) row_each<C>(d, [&](i64 k, int u) { v[u] = p[k]; });
    auto at = [&](i64 k, int u) { return C ? v[u] : (float)p[k]; };
    double mean, rstd;
    row_stats<C>(at, d, live, eps, sd, &mean, &rstd);
    if (!live) continue;
    TY* q = y + row * d;
    row_each<C>(d, [&](i64 k, int u) {
      double r = ((double)at(k, u) - mean) * rstd;
      if (w) r *= (double)(float)w[k];
      if (b) r += (double)(float)b[k];
      q[k] = (float)r;
    });
  }
}

// layer_norm_{f32,bf16,f16}: y = (x − mean)·rstd (· w) (+ b) per row of
// contiguous [rows, d] x and y; w and b are [d] or null. Row layout (rows
// of up to ROW_VPT·bx elements are read once).
#if PART(0)
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(1024) layer_norm_##S(                        \
      const T* x, const T* w, const T* b, T* y, i64 rows, i64 d, double eps) {              \
    if (row_fits(d)) layer_norm_body<true>(x, w, b, y, rows, d, eps);                       \
    else layer_norm_body<false>(x, w, b, y, rows, d, eps);                                  \
  }
FOR_FLOATS(K)
#undef K
#endif

// layer_norm_f32_{bf16,f16}: layer_norm_f32 storing a 16-bit y, each value
// rounded once from the float layer_norm_f32 would store (a cast of it
// rounds the same), for a layer norm only 16-bit GEMMs read.
#if PART(0)
#define K(TY, S)                                                                            \
  extern "C" __global__ void __launch_bounds__(1024) layer_norm_f32_##S(                    \
      const float* x, const float* w, const float* b, TY* y, i64 rows, i64 d, double eps) { \
    if (row_fits(d)) layer_norm_body<true>(x, w, b, y, rows, d, eps);                       \
    else layer_norm_body<false>(x, w, b, y, rows, d, eps);                                  \
  }
FOR_HALVES(K)
#undef K
#endif

// add_layer_norm_body: s = a + b (float32; b's row row % brows, so a b of
// fewer rows is broadcast over a's), then y = layer_norm(s) as
// layer_norm_body computes it from the float32 s, both per row, the row
// kept in registers between the two when it fits. Each thread reads back
// only elements it wrote itself, so the row group needs no barrier.
template <bool C, typename TB, typename TY>
__device__ __forceinline__ void add_layer_norm_body(const float* __restrict__ a,
                                                    const TB* __restrict__ b, i64 brows,
                                                    const float* __restrict__ w,
                                                    const float* __restrict__ bias,
                                                    float* __restrict__ s, TY* __restrict__ y,
                                                    i64 rows, i64 d, double eps) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const i64 off = row * d;
    const TB* pb = b + (live ? row % brows : 0) * d;
    float v[ROW_VPT];
    if (live)
      row_each<C>(d, [&](i64 k, int u) {
        const float t = a[off + k] + (float)pb[k];
        s[off + k] = t;
        if (C) v[u] = t;
      });
    auto at = [&](i64 k, int u) { return C ? v[u] : s[off + k]; };
    double mean, rstd;
    row_stats<C>(at, d, live, eps, sd, &mean, &rstd);
    if (!live) continue;
    TY* q = y + off;
    row_each<C>(d, [&](i64 k, int u) {
      double r = ((double)at(k, u) - mean) * rstd;
      if (w) r *= (double)w[k];
      if (bias) r += (double)bias[k];
      q[k] = (float)r;
    });
  }
}

// add_layer_norm_<b>_<y>: an add of float32 a [rows, d] and b [brows, d]
// (brows dividing rows) into float32 s, and the layer norm of s with
// float32 w and bias ([d] or null) into y: the add and its companion
// layer norm (graph.AddLayerNormProducer) in one pass. Row layout as
// layer_norm_*.
#if PART(1)
#define K2(TB, SX, TY, SY)                                                                    \
  extern "C" __global__ void __launch_bounds__(1024) add_layer_norm_##SX##_##SY(              \
      const float* a, const TB* b, i64 brows, const float* w, const float* bias, float* s,    \
      TY* y, i64 rows, i64 d, double eps) {                                                   \
    if (row_fits(d)) add_layer_norm_body<true>(a, b, brows, w, bias, s, y, rows, d, eps);     \
    else add_layer_norm_body<false>(a, b, brows, w, bias, s, y, rows, d, eps);                \
  }
#define K(TB, SB) K2(TB, SB, float, f32) K2(TB, SB, bf16, bf16) K2(TB, SB, f16, f16)
FOR_FLOATS(K)
#undef K
#endif
#undef K2

// ld4 reads 4 neighbouring values at p (16-byte aligned for float, 8 for
// 16 bits) widened to float; st4 stores 4, each rounded once. (Two-argument
// overloads beside common.cuh's float4 ld4/st4.)
__device__ __forceinline__ void ld4(const float* p, float* o) {
  const float4 v = *(const float4*)p;
  o[0] = v.x;
  o[1] = v.y;
  o[2] = v.z;
  o[3] = v.w;
}
template <typename T>
__device__ __forceinline__ void ld4(const T* p, float* o) {
  union {  // one 8-byte load, read as 4 values (a union: no aliasing cast)
    uint2 u;
    T e[4];
  } r;
  r.u = *(const uint2*)p;
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = (float)r.e[j];
}
__device__ __forceinline__ void st4(float* p, const float* v) {
  float4 r;
  r.x = v[0];
  r.y = v[1];
  r.z = v[2];
  r.w = v[3];
  *(float4*)p = r;
}
template <typename T>
__device__ __forceinline__ void st4(T* p, const float* v) {
  union {
    uint2 u;
    T e[4];
  } r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.e[j] = v[j];
  *(uint2*)p = r.u;
}

// LNW_MAXV bounds add_layer_norm_w4_*'s rows: 4·32·LNW_MAXV = 1024 values.
#define LNW_MAXV 8

// add_layer_norm_w4_t is add_layer_norm_body with one warp a row: lane l
// holds values 4(l + 32i) .. 4(l + 32i) + 3, read and written 4 at a time,
// and the row's sums meet by shuffles alone, no barrier. The arithmetic is
// add_layer_norm_body's: s = a + b in float, the statistics in double from
// s (mean, then the centred squares), y in double rounded once into TY;
// only the order of the double sums differs.
template <typename TB, typename TY>
__device__ __forceinline__ void add_layer_norm_w4_t(const float* __restrict__ a,
                                                    const TB* __restrict__ b, i64 brows,
                                                    const float* __restrict__ w,
                                                    const float* __restrict__ bias,
                                                    float* __restrict__ s, TY* __restrict__ y,
                                                    i64 rows, i64 d, double eps) {
  const int lane = threadIdx.x & 31;
  const i64 wpb = blockDim.x >> 5;
  const int nv = (int)(d >> 7);
  for (i64 row = (i64)blockIdx.x * wpb + (threadIdx.x >> 5); row < rows; row += (i64)gridDim.x * wpb) {
    const i64 off = row * d;
    const TB* pb = b + (row % brows) * d;
    float v[4 * LNW_MAXV];
    double sum = 0;
#pragma unroll
    for (int i = 0; i < LNW_MAXV; ++i) {
      if (i < nv) {
        const i64 k = 4 * (lane + 32 * i);
        float av[4], bv[4];
        ld4(a + off + k, av);
        ld4(pb + k, bv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[4 * i + j] = av[j] + bv[j];
          sum += (double)v[4 * i + j];
        }
        st4(s + off + k, &v[4 * i]);
      }
    }
    const double mean = warp_allreduce(sum, SumOp()) / (double)d;
    double q = 0;
#pragma unroll
    for (int i = 0; i < LNW_MAXV; ++i) {
      if (i < nv) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const double c = (double)v[4 * i + j] - mean;
          q += c * c;
        }
      }
    }
    const double rstd = 1.0 / sqrt(warp_allreduce(q, SumOp()) / (double)d + eps);
#pragma unroll
    for (int i = 0; i < LNW_MAXV; ++i) {
      if (i < nv) {
        const i64 k = 4 * (lane + 32 * i);
        float r[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          double t = ((double)v[4 * i + j] - mean) * rstd;
          if (w) t *= (double)w[k + j];
          if (bias) t += (double)bias[k + j];
          r[j] = (float)t;
        }
        st4(y + off + k, r);  // a 16-bit y rounds here, once
      }
    }
  }
}

// add_layer_norm_w4_<b>_<y>: add_layer_norm_<b>_<y> for rows of d ≤ 1024
// values, d a multiple of 128, every pointer 16-byte aligned (8 for 16-bit
// arrays): one warp a row (add_layer_norm_w4_t), blockDim.x a multiple of
// 32 (blockDim.y = 1), any grid.
#if PART(1)
#define K2(TB, SX, TY, SY)                                                                    \
  extern "C" __global__ void __launch_bounds__(256) add_layer_norm_w4_##SX##_##SY(            \
      const float* a, const TB* b, i64 brows, const float* w, const float* bias, float* s,    \
      TY* y, i64 rows, i64 d, double eps) {                                                   \
    add_layer_norm_w4_t(a, b, brows, w, bias, s, y, rows, d, eps);                            \
  }
#define K(TB, SB) K2(TB, SB, float, f32) K2(TB, SB, bf16, bf16) K2(TB, SB, f16, f16)
FOR_FLOATS(K)
#undef K
#endif
#undef K2

template <bool C, typename T>
__device__ __forceinline__ void layer_norm_grad_x_body(const T* __restrict__ g,
                                                       const T* __restrict__ x,
                                                       const T* __restrict__ w,
                                                       T* __restrict__ out, i64 rows, i64 d,
                                                       double eps) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const i64 off = row * d;
    float xv[ROW_VPT], gv[ROW_VPT];
    if (C && live)
      row_each<C>(d, [&](i64 k, int u) {
        xv[u] = x[off + k];
        gv[u] = g[off + k];
      });
    auto xat = [&](i64 k, int u) { return C ? xv[u] : (float)x[off + k]; };
    auto ghat = [&](i64 k, int u) {  // ĝ = g·w
      double r = (double)(C ? gv[u] : (float)g[off + k]);
      if (w) r *= (double)(float)w[k];
      return r;
    };
    double mean, rstd;
    row_stats<C>(xat, d, live, eps, sd, &mean, &rstd);
    double sg = 0, sgx = 0;
    if (live)
      row_each<C>(d, [&](i64 k, int u) {
        const double gh = ghat(k, u);
        sg += gh;
        sgx += gh * (((double)xat(k, u) - mean) * rstd);
      });
    sg = row_allreduce(sg, SumOp(), sd);
    sgx = row_allreduce(sgx, SumOp(), sd);
    if (!live) continue;
    sg /= (double)d;
    sgx /= (double)d;
    row_each<C>(d, [&](i64 k, int u) {
      const double xh = ((double)xat(k, u) - mean) * rstd;
      out[off + k] = (float)(rstd * (ghat(k, u) - sg - xh * sgx));
    });
  }
}

// layer_norm_grad_x_{f32,bf16,f16}: with x̂ = (x − mean)·rstd and ĝ = g·w (g
// alone when w is null), out = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)) per row of
// contiguous [rows, d] g, x, out. Row layout as layer_norm_*.
#if PART(2)
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(1024) layer_norm_grad_x_##S(                 \
      const T* g, const T* x, const T* w, T* out, i64 rows, i64 d, double eps) {            \
    if (row_fits(d)) layer_norm_grad_x_body<true>(g, x, w, out, rows, d, eps);              \
    else layer_norm_grad_x_body<false>(g, x, w, out, rows, d, eps);                         \
  }
FOR_FLOATS(K)
#undef K
#endif

template <bool C, typename T>
__device__ __forceinline__ void layer_norm_stats_body(const T* __restrict__ x,
                                                      double* __restrict__ stats, i64 rows, i64 d,
                                                      double eps) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const T* p = x + row * d;
    float v[ROW_VPT];
    if (C && live) row_each<C>(d, [&](i64 k, int u) { v[u] = p[k]; });
    double mean, rstd;
    row_stats<C>([&](i64 k, int u) { return C ? v[u] : (float)p[k]; }, d, live, eps, sd, &mean,
                 &rstd);
    if (live && threadIdx.x == 0) {
      stats[2 * row] = mean;
      stats[2 * row + 1] = rstd;
    }
  }
}

// layer_norm_stats_{f32,bf16,f16}: stats[2r] = mean and stats[2r+1] = rstd
// (double) of row r of contiguous [rows, d] x, for layer_norm_grad_w_*. Row
// layout as layer_norm_*.
#if PART(2)
#define K(T, S)                                                                               \
  extern "C" __global__ void __launch_bounds__(1024) layer_norm_stats_##S(                    \
      const T* x, double* stats, i64 rows, i64 d, double eps) {                               \
    if (row_fits(d)) layer_norm_stats_body<true>(x, stats, rows, d, eps);                     \
    else layer_norm_stats_body<false>(x, stats, rows, d, eps);                                \
  }
FOR_FLOATS(K)
#undef K
#endif

template <typename T>
__device__ __forceinline__ void layer_norm_grad_w_t(const T* __restrict__ g,
                                                    const T* __restrict__ x,
                                                    const double* __restrict__ stats,
                                                    T* __restrict__ out, float* __restrict__ part,
                                                    i64 rows, i64 d) {
  __shared__ double sd[1024];
  const i64 per = (rows + gridDim.y - 1) / gridDim.y;
  const i64 lo = imin(rows, (i64)blockIdx.y * per), hi = imin(rows, lo + per);
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  for (i64 j0 = (i64)blockIdx.x * blockDim.x; j0 < d; j0 += (i64)gridDim.x * blockDim.x) {
    const i64 j = j0 + threadIdx.x;
    const bool live = j < d;
    double s = 0;
    if (live)
      for (i64 r = lo + threadIdx.y; r < hi; r += blockDim.y)
        s += (double)(float)g[r * d + j] *
             (((double)(float)x[r * d + j] - stats[2 * r]) * stats[2 * r + 1]);
    sd[t] = s;
    __syncthreads();
    if (live && threadIdx.y == 0) {
      for (unsigned k = 1; k < blockDim.y; ++k) s += sd[k * blockDim.x + threadIdx.x];
      if (part) part[(i64)blockIdx.y * d + j] = (float)s;
      else out[j] = (float)s;
    }
    __syncthreads();
  }
}

// layer_norm_grad_w_{f32,bf16,f16}: Σ over the rows r of split s of
// g[r, j]·(x[r, j] − mean_r)·rstd_r, a column reduction over contiguous
// [rows, d] g and x with stats from layer_norm_stats_*, into out[j] when
// part is null (then gridDim.y must be 1), else into the float partials
// part[s·d + j], which reduce_splits_* (reduce.cu) sums into out over
// [splits, d]. blockDim = (bx, by), bx·by ≤ 1024: threadIdx.x along d
// (coalesced), threadIdx.y strides over rows. Grid: x = ceil(d/bx) (loops,
// so fewer is correct), y = splits.
#if PART(2)
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(1024) layer_norm_grad_w_##S(                    \
      const T* g, const T* x, const double* stats, T* out, float* part, i64 rows, i64 d) {     \
    layer_norm_grad_w_t(g, x, stats, out, part, rows, d);                                      \
  }
FOR_FLOATS(K)
#undef K
#endif

// The fused backward pass: layer_norm_grad_x with its weight's and bias's
// gradients (Σ g·x̂ and Σ g over the rows) from one read of g and x. Each
// row group (threadIdx.y of a block) takes rows grp, grp + G, grp + 2G, …
// (G = gridDim.x·blockDim.y groups), finds each row's statistics and dx as
// layer_norm_grad_x does, and adds its rows' g·x̂ and g into per-column
// double sums in registers; at the end each group stores its sums as float
// partials, and layer_norm_grad_wb_* adds the G partials of each column in
// a fixed order, so the results do not depend on timing (no atomics).
// While a row is computed the group's next row is already being loaded.
// A thread keeps LN_FUSED_VPT elements of a row, x − mean then x̂ and g
// then ĝ = g·w in place, in double: each value is widened once, and the
// per-row work (reductions, divisions, the square root) is shared by
// 8 elements a thread. The weight, widened, is in shared memory.

// LN_FUSED_VPT is how many elements of a row each thread keeps; the fused
// pass takes rows of d ≤ LN_FUSED_VPT·blockDim.x ≤ LN_FUSED_MAXD elements.
#define LN_FUSED_VPT 8
#define LN_FUSED_MAXD 2048

// row_sum2 is row_allreduce(SumOp) of *a and *b at once (one pair of
// barriers for both), in row_allreduce's order. scratch is a __shared__
// array of 64 doubles; every thread of the block must call it.
__device__ __forceinline__ void row_sum2(double* a, double* b, double* scratch) {
  double u = warp_allreduce(*a, SumOp()), v = warp_allreduce(*b, SumOp());
  if (blockDim.x > 32) {
    const unsigned wpr = blockDim.x >> 5;  // warps per row
    const unsigned first = threadIdx.y * wpr;
    __syncthreads();  // earlier readers of scratch are done
    if ((threadIdx.x & 31) == 0) {
      scratch[first + (threadIdx.x >> 5)] = u;
      scratch[32 + first + (threadIdx.x >> 5)] = v;
    }
    __syncthreads();
    u = scratch[first];
    v = scratch[32 + first];
    for (unsigned k = 1; k < wpr; ++k) {
      u += scratch[first + k];
      v += scratch[32 + first + k];
    }
  }
  *a = u;
  *b = v;
}

template <typename T>
__device__ __forceinline__ void layer_norm_grad_fused_t(const T* __restrict__ g,
                                                        const T* __restrict__ x,
                                                        const T* __restrict__ w,
                                                        T* __restrict__ out,
                                                        float* __restrict__ part, i64 rows,
                                                        i64 d, double eps,
                                                        const T* __restrict__ res,
                                                        bf16* __restrict__ ob,
                                                        f16* __restrict__ oh) {
  __shared__ double sd[32];
  __shared__ double s2[64];
  __shared__ double sw[LN_FUSED_MAXD];  // the weight, widened; 1 without one
  for (i64 k = threadIdx.y * blockDim.x + threadIdx.x; k < d; k += blockDim.x * blockDim.y)
    sw[k] = w ? (double)(float)w[k] : 1.0;
  __syncthreads();
  const i64 groups = (i64)gridDim.x * blockDim.y;
  const i64 grp = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  double dw[LN_FUSED_VPT], db[LN_FUSED_VPT];
  float xn[LN_FUSED_VPT], gn[LN_FUSED_VPT];  // the group's next row
#pragma unroll
  for (int u = 0; u < LN_FUSED_VPT; ++u) {
    dw[u] = 0;
    db[u] = 0;
    xn[u] = 0;
    gn[u] = 0;
  }
  auto load = [&](i64 row) {
    if (row >= rows) return;
    const i64 off = row * d;
#pragma unroll
    for (int u = 0; u < LN_FUSED_VPT; ++u) {
      const i64 k = threadIdx.x + (i64)u * blockDim.x;
      if (k < d) {
        xn[u] = x[off + k];
        gn[u] = g[off + k];
      }
    }
  };
  load(grp);
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += groups) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    double xd[LN_FUSED_VPT], gd[LN_FUSED_VPT];
#pragma unroll
    for (int u = 0; u < LN_FUSED_VPT; ++u) {
      xd[u] = (double)xn[u];
      gd[u] = (double)gn[u];
    }
    load(row + groups);
    // res for this row, asked for now so that its latency passes during
    // the three row reductions below rather than after them.
    float rv[LN_FUSED_VPT];
    if (res && live) {
#pragma unroll
      for (int u = 0; u < LN_FUSED_VPT; ++u) {
        const i64 k = threadIdx.x + (i64)u * blockDim.x;
        rv[u] = k < d ? (float)res[row * d + k] : 0.f;
      }
    }
    double s = 0;
    if (live) {
#pragma unroll
      for (int u = 0; u < LN_FUSED_VPT; ++u)
        if (threadIdx.x + (i64)u * blockDim.x < d) s += xd[u];
    }
    s = row_allreduce(s, SumOp(), sd);
    const double mean = s / (double)d;
    double q = 0;
    if (live) {
#pragma unroll
      for (int u = 0; u < LN_FUSED_VPT; ++u)
        if (threadIdx.x + (i64)u * blockDim.x < d) {
          xd[u] -= mean;
          q += xd[u] * xd[u];
        }
    }
    q = row_allreduce(q, SumOp(), sd);
    const double rstd = 1.0 / sqrt(q / (double)d + eps);
    double sg = 0, sgx = 0;
    if (live) {
#pragma unroll
      for (int u = 0; u < LN_FUSED_VPT; ++u) {
        const i64 k = threadIdx.x + (i64)u * blockDim.x;
        if (k < d) {
          xd[u] *= rstd;  // x̂
          dw[u] += gd[u] * xd[u];
          db[u] += gd[u];
          gd[u] *= sw[k];  // ĝ
          sg += gd[u];
          sgx += gd[u] * xd[u];
        }
      }
    }
    row_sum2(&sg, &sgx, s2);
    if (!live) continue;
    sg /= (double)d;
    sgx /= (double)d;
    const i64 off = row * d;
#pragma unroll
    for (int u = 0; u < LN_FUSED_VPT; ++u) {
      const i64 k = threadIdx.x + (i64)u * blockDim.x;
      if (k < d) {
        // Rounded into T, then res added and rounded again: the add that
        // layer_norm_grad_x_add replaces, bit for bit.
        T t;
        t = (float)(rstd * (gd[u] - sg - xd[u] * sgx));
        if (res) t = (float)t + rv[u];
        out[off + k] = t;
        if (ob) ob[off + k] = (float)t;
        if (oh) oh[off + k] = (float)t;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < LN_FUSED_VPT; ++u) {
    const i64 k = threadIdx.x + (i64)u * blockDim.x;
    if (k < d) {
      part[grp * d + k] = (float)dw[u];
      part[(groups + grp) * d + k] = (float)db[u];
    }
  }
}

// layer_norm_grad_fused_{f32,bf16,f16}: layer_norm_grad_x_* into out (plus
// res, when non-null: layer_norm_grad_x_add), and per row group the float
// partial sums of g·x̂ (part[grp·d + j]) and of g (part[(G + grp)·d + j])
// over the group's rows, for layer_norm_grad_wb_*; G = gridDim.x·blockDim.y.
// A non-null ob (oh) also gets out rounded to bfloat16 (float16): the
// gradient's 16-bit cast (graph.LayerNormGradCastProducer). blockDim =
// (bx, by): bx a multiple of 32, d ≤ LN_FUSED_VPT·bx, d ≤ LN_FUSED_MAXD,
// bx·by ≤ 256; any grid.
#if PART(3)
#define K(T, S)                                                                               \
  extern "C" __global__ void __launch_bounds__(256) layer_norm_grad_fused_##S(                \
      const T* g, const T* x, const T* w, T* out, float* part, i64 rows, i64 d, double eps,   \
      const T* res, bf16* ob, f16* oh) {                                                      \
    layer_norm_grad_fused_t(g, x, w, out, part, rows, d, eps, res, ob, oh);                   \
  }
FOR_FLOATS(K)
#undef K
#endif

template <typename T>
__device__ __forceinline__ void layer_norm_grad_wb_t(const float* __restrict__ part,
                                                     T* __restrict__ dw, T* __restrict__ db,
                                                     i64 groups, i64 d) {
  __shared__ double sd[1024];
  T* out = blockIdx.y == 0 ? dw : db;
  if (!out) return;  // the whole block: that output is not wanted
  const float* p = part + (i64)blockIdx.y * groups * d;
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  for (i64 j0 = (i64)blockIdx.x * blockDim.x; j0 < d; j0 += (i64)gridDim.x * blockDim.x) {
    const i64 j = j0 + threadIdx.x;
    const bool live = j < d;
    double s = 0;
    if (live) {
#pragma unroll 8
      for (i64 r = threadIdx.y; r < groups; r += blockDim.y) s += (double)p[r * d + j];
    }
    sd[t] = s;
    __syncthreads();
    if (live && threadIdx.y == 0) {
      for (unsigned k = 1; k < blockDim.y; ++k) s += sd[k * blockDim.x + threadIdx.x];
      out[j] = (float)s;
    }
    __syncthreads();
  }
}

// layer_norm_grad_wb_{f32,bf16,f16}: dw[j] = Σ over s < groups of
// part[s·d + j] and db[j] = Σ of part[(groups + s)·d + j], the partials of
// layer_norm_grad_fused_*, summed in double and rounded once; a null dw or
// db is skipped. blockDim = (bx, by), bx·by ≤ 1024: threadIdx.x along d,
// threadIdx.y strides over the partials. Grid: x = ceil(d/bx) (loops, so
// fewer is correct), y = 2 (dw, db).
#if PART(3)
#define K(T, S)                                                                         \
  extern "C" __global__ void __launch_bounds__(1024) layer_norm_grad_wb_##S(            \
      const float* part, T* dw, T* db, i64 groups, i64 d) {                             \
    layer_norm_grad_wb_t(part, dw, db, groups, d);                                      \
  }
FOR_FLOATS(K)
#undef K
#endif
