// rmsnorm.cu: rms_norm over the trailing dims, fused with the residual
// add before it, and its backward pass. x is viewed as [rows, d], d the
// product of the Attrs.NormDims trailing dims; y = x·rstd·w with rstd =
// 1/√(mean(x²) + eps). Every value is widened to float on load and the
// arithmetic is float32 (Σx² and Σĝ·x per row in float, the weight
// gradient's partials in float, summed in double by
// layer_norm_grad_wb_*); each output rounds once into its storage type.
//
// Two paths, one arithmetic: the vector path (16-byte loads and stores,
// 8 values a thread a pack) when d is a multiple of 8 and every array is
// 16-byte aligned, the scalar path otherwise. A row group is the
// blockDim.x threads of one threadIdx.y; the host picks blockDim.x so a
// row fits the group's registers on the vector path.
#include "common.cuh"

// Pack I/O: 8 neighbouring values at p (16-byte aligned), widened to
// float, or stored each rounded once.
__device__ __forceinline__ void ld8(const float* p, float* o) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void ld8(const T* p, float* o) {
  const Vec<T, 8> v = *reinterpret_cast<const Vec<T, 8>*>(p);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = (float)v.v[j];
}
__device__ __forceinline__ void st8(float* p, const float* v) {
  float4 a, b;
  a.x = v[0]; a.y = v[1]; a.z = v[2]; a.w = v[3];
  b.x = v[4]; b.y = v[5]; b.z = v[6]; b.w = v[7];
  reinterpret_cast<float4*>(p)[0] = a;
  reinterpret_cast<float4*>(p)[1] = b;
}
template <typename T>
__device__ __forceinline__ void st8(T* p, const float* v) {
  Vec<T, 8> r;
#pragma unroll
  for (int j = 0; j < 8; ++j) r.v[j] = v[j];
  *reinterpret_cast<Vec<T, 8>*>(p) = r;
}

// rms_sum1 is row_allreduce(SumOp) of v in float over the row group.
// scratch is a __shared__ array of 64 floats; every thread of the block
// must call it.
__device__ __forceinline__ float rms_sum1(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  if (blockDim.x == 32) return v;
  const unsigned wpr = blockDim.x >> 5;
  const unsigned first = threadIdx.y * wpr;
  __syncthreads();  // earlier readers of scratch are done
  if ((threadIdx.x & 31) == 0) scratch[first + (threadIdx.x >> 5)] = v;
  __syncthreads();
  float r = scratch[first];
  for (unsigned k = 1; k < wpr; ++k) r += scratch[first + k];
  return r;
}

// rms_sum2 is row_allreduce(SumOp) of *a and *b at once over the row group
// (one pair of barriers when the row spans several warps). scratch is a
// __shared__ array of 64 floats; every thread of the block must call it.
__device__ __forceinline__ void rms_sum2(float* a, float* b, float* scratch) {
  float u = *a, v = *b;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u += __shfl_xor_sync(FULL_MASK, u, o);
    v += __shfl_xor_sync(FULL_MASK, v, o);
  }
  if (blockDim.x > 32) {
    const unsigned wpr = blockDim.x >> 5;
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

// RMS_VPACKS bounds the forward vector path: a thread keeps at most this
// many packs of a row (8·RMS_VPACKS floats in registers), so rows of up to
// 8·RMS_VPACKS·blockDim.x values fit.
#define RMS_VPACKS 8

// rms_fwd_vec: s = a + b (ADD; b's row is row % brows) or s = a, then
// y = s·rstd·w per row, the row held in registers between the two. Thread
// x of a row group holds packs x, x + bx, …; d % 8 == 0 and every array is
// 16-byte aligned. A written s is read back by nobody.
template <bool ADD, typename TA, typename TB, typename TW, typename TY>
__device__ __forceinline__ void rms_fwd_vec(const TA* __restrict__ a, const TB* __restrict__ b, i64 brows,
                                            const TW* __restrict__ w, float* __restrict__ s,
                                            TY* __restrict__ y, i64 rows, i64 d, float eps) {
  __shared__ float sd[64];
  const i64 packs = d >> 3;
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const i64 off = row * d;
    float v[8 * RMS_VPACKS];
    float ss = 0;
    if (live) {
#pragma unroll
      for (int i = 0; i < RMS_VPACKS; ++i) {
        const i64 p = threadIdx.x + (i64)i * blockDim.x;
        if (p < packs) {
          ld8(a + off + 8 * p, &v[8 * i]);
          if (ADD) {
            float bv[8];
            ld8(b + (row % brows) * d + 8 * p, bv);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[8 * i + j] += bv[j];
            st8(s + off + 8 * p, &v[8 * i]);
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) ss += v[8 * i + j] * v[8 * i + j];
        }
      }
    }
    ss = rms_sum1(ss, sd);
    if (!live) continue;
    const float rstd = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int i = 0; i < RMS_VPACKS; ++i) {
      const i64 p = threadIdx.x + (i64)i * blockDim.x;
      if (p < packs) {
        float wv[8], r[8];
        if (w) ld8(w + 8 * p, wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = w ? v[8 * i + j] * rstd * wv[j] : v[8 * i + j] * rstd;
        st8(y + off + 8 * p, r);
      }
    }
  }
}

// rms_fwd_any is rms_fwd_vec for any d and alignment: element k of a row
// goes to thread k mod bx, values read from memory on each pass (s, once
// written, is read back by the thread that wrote it).
template <bool ADD, typename TA, typename TB, typename TW, typename TY>
__device__ __forceinline__ void rms_fwd_any(const TA* __restrict__ a, const TB* __restrict__ b, i64 brows,
                                            const TW* __restrict__ w, float* __restrict__ s,
                                            TY* __restrict__ y, i64 rows, i64 d, float eps) {
  __shared__ float sd[64];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const i64 off = row * d;
    float ss = 0;
    if (live)
      for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
        float t = (float)a[off + k];
        if (ADD) {
          t += (float)b[(row % brows) * d + k];
          s[off + k] = t;
        }
        ss += t * t;
      }
    ss = rms_sum1(ss, sd);
    if (!live) continue;
    const float rstd = 1.0f / sqrtf(ss / (float)d + eps);
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
      const float t = ADD ? s[off + k] : (float)a[off + k];
      y[off + k] = w ? t * rstd * (float)w[k] : t * rstd;
    }
  }
}

// rms_norm_<x>[_<y>]: y = x·rstd·w per row of contiguous [rows, d] x and
// y, w [d] or null; y has x's dtype, or 16 bits from float32 x and w
// (rms_norm_f32_bf16, rms_norm_f32_f16: graph.OpRMSNorm's Attrs.Target).
// vec selects the vector path (d % 8 == 0, 16-byte aligned arrays, d ≤
// 8·RMS_VPACKS·blockDim.x). blockDim = (bx, by): bx a multiple of 32, bx·by
// ≤ 1024; any grid.
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm_##S(const T* x, const T* w, T* y,  \
                                                                  i64 rows, i64 d, float eps,    \
                                                                  i64 vec) {                     \
    if (vec) rms_fwd_vec<false>(x, (const float*)nullptr, 1, w, (float*)nullptr, y, rows, d, eps); \
    else rms_fwd_any<false>(x, (const float*)nullptr, 1, w, (float*)nullptr, y, rows, d, eps);     \
  }
FOR_FLOATS(K)
#undef K

// rms_norm_f32_{bf16,f16}: rms_norm_f32 storing a 16-bit y, each value
// rounded once from the float rms_norm_f32 would store.
#define K(TY, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm_f32_##S(                          \
      const float* x, const float* w, TY* y, i64 rows, i64 d, float eps, i64 vec) {             \
    if (vec) rms_fwd_vec<false>(x, (const float*)nullptr, 1, w, (float*)nullptr, y, rows, d, eps); \
    else rms_fwd_any<false>(x, (const float*)nullptr, 1, w, (float*)nullptr, y, rows, d, eps);     \
  }
FOR_HALVES(K)
#undef K

// add_rms_norm_<b>_<y>: an add of float32 a [rows, d] and b [brows, d]
// (brows dividing rows; b of any float dtype) into float32 s, and the
// rms_norm of s with a float32 w ([d] or null) into y: the add and its
// companion rms_norm (graph.AddRMSNormProducer) in one pass, the row in
// registers between the two on the vector path. Launch as rms_norm_*.
#define K2(TB, SX, TY, SY)                                                                      \
  extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_##SX##_##SY(                  \
      const float* a, const TB* b, i64 brows, const float* w, float* s, TY* y, i64 rows, i64 d,  \
      float eps, i64 vec) {                                                                     \
    if (vec) rms_fwd_vec<true>(a, b, brows, w, s, y, rows, d, eps);                             \
    else rms_fwd_any<true>(a, b, brows, w, s, y, rows, d, eps);                                 \
  }
#define K(TB, SB) K2(TB, SB, float, f32) K2(TB, SB, bf16, bf16) K2(TB, SB, f16, f16)
FOR_FLOATS(K)
#undef K
#undef K2

// The backward pass. Per row, with x̂ = x·rstd and ĝ = g·w,
//   dx = rstd·(ĝ − x̂·mean(ĝ·x̂)),
// plus res (rms_norm_grad_x_add), and the row's g·x̂ added to the weight
// gradient's partial sums. Each row group (threadIdx.y of a block) takes
// rows grp, grp + G, … (G = gridDim.x·blockDim.y groups) and keeps its
// columns' partials in registers (vector path) or in its own row of part
// (scalar path), stored at the end as float partials part[grp·d + j] for
// layer_norm_grad_wb_* to add up in a fixed order (no atomics: the result
// does not depend on timing). One pass over g and x gives dx, dw and,
// fused, the residual stream's gradient and its 16-bit cast.

// rms_bwd_vec: one pack of 8 columns a thread (bx = d/8 rounded up to 32),
// its weight and partials in registers; d % 8 == 0, arrays 16-byte
// aligned. out, part, res, ob and oh may each be null.
template <typename T>
__device__ __forceinline__ void rms_bwd_vec(const T* __restrict__ g, const T* __restrict__ x,
                                            const T* __restrict__ w, T* __restrict__ out,
                                            float* __restrict__ part, i64 rows, i64 d, float eps,
                                            const T* __restrict__ res, bf16* __restrict__ ob,
                                            f16* __restrict__ oh) {
  __shared__ float sd[64];
  const i64 groups = (i64)gridDim.x * blockDim.y;
  const i64 grp = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  const i64 k0 = 8 * (i64)threadIdx.x;
  const bool col = k0 < d;
  float wv[8], dw[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    wv[j] = 1;
    dw[j] = 0;
  }
  if (col && w) ld8(w + k0, wv);
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += groups) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows && col;
    const i64 off = row * d + k0;
    float xv[8], gv[8], rv[8];
    float ss = 0, sgx = 0;
    if (live) {
      ld8(x + off, xv);
      ld8(g + off, gv);
      if (res) ld8(res + off, rv);  // asked for now: its latency passes during the row sum
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        ss += xv[j] * xv[j];
        sgx += gv[j] * wv[j] * xv[j];  // ĝ·x
      }
    }
    rms_sum2(&ss, &sgx, sd);
    if (!live) continue;
    const float rstd = 1.0f / sqrtf(ss / (float)d + eps);
    const float m = sgx * rstd / (float)d;  // mean(ĝ·x̂)
    float o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float xh = xv[j] * rstd;
      dw[j] += gv[j] * xh;
      // Rounded into T, then res added and rounded again: the add that
      // rms_norm_grad_x_add replaces, bit for bit.
      T t;
      t = rstd * (gv[j] * wv[j] - xh * m);
      if (res) t = (float)t + rv[j];
      o[j] = (float)t;
    }
    if (out) st8(out + off, o);
    if (ob) st8(ob + off, o);
    if (oh) st8(oh + off, o);
  }
  if (part && col) st8(part + grp * d + k0, dw);
}

// rms_bwd_any is rms_bwd_vec for any d and alignment: element k of a row
// goes to thread k mod bx, values read from memory on each pass, the
// partials accumulated in the group's row of part.
template <typename T>
__device__ __forceinline__ void rms_bwd_any(const T* __restrict__ g, const T* __restrict__ x,
                                            const T* __restrict__ w, T* __restrict__ out,
                                            float* __restrict__ part, i64 rows, i64 d, float eps,
                                            const T* __restrict__ res, bf16* __restrict__ ob,
                                            f16* __restrict__ oh) {
  __shared__ float sd[64];
  const i64 groups = (i64)gridDim.x * blockDim.y;
  const i64 grp = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  float* pw = part ? part + grp * d : nullptr;
  if (pw)
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) pw[k] = 0;
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += groups) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const i64 off = row * d;
    float ss = 0, sgx = 0;
    if (live)
      for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
        const float xk = (float)x[off + k], gk = (float)g[off + k] * (w ? (float)w[k] : 1.0f);
        ss += xk * xk;
        sgx += gk * xk;
      }
    rms_sum2(&ss, &sgx, sd);
    if (!live) continue;
    const float rstd = 1.0f / sqrtf(ss / (float)d + eps);
    const float m = sgx * rstd / (float)d;
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
      const float xh = (float)x[off + k] * rstd, gk = (float)g[off + k];
      if (pw) pw[k] += gk * xh;
      T t;
      t = rstd * (gk * (w ? (float)w[k] : 1.0f) - xh * m);
      if (res) t = (float)t + (float)res[off + k];
      const float o = (float)t;
      if (out) out[off + k] = o;
      if (ob) ob[off + k] = o;
      if (oh) oh[off + k] = o;
    }
  }
}

// rms_norm_grad_{f32,bf16,f16}: dx (plus res) into out and the weight
// gradient's float partials into part [G, d] (G = gridDim.x·blockDim.y
// row groups; layer_norm_grad_wb_* with a null db sums them), from
// contiguous [rows, d] g, x, out, res and w [d]. Any of out, part, w, res,
// ob, oh may be null: rms_norm_grad_x without a companion passes no part,
// rms_norm_grad_w alone no out. A non-null ob (oh) also gets the result
// rounded to bfloat16 (float16): the gradient's 16-bit cast
// (graph.LayerNormGradCastProducer). vec selects the vector path (d % 8
// == 0, d ≤ 8·blockDim.x, 16-byte aligned arrays). blockDim = (bx, by), bx
// a multiple of 32, bx·by ≤ 1024; any grid (the host's holds the device
// in one wave).
#define K(T, S)                                                                                   \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm_grad_##S(                           \
      const T* g, const T* x, const T* w, T* out, float* part, i64 rows, i64 d, float eps,        \
      const T* res, bf16* ob, f16* oh, i64 vec) {                                                 \
    if (vec) rms_bwd_vec(g, x, w, out, part, rows, d, eps, res, ob, oh);                          \
    else rms_bwd_any(g, x, w, out, part, rows, d, eps, res, ob, oh);                              \
  }
FOR_FLOATS(K)
#undef K
