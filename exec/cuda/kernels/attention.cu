// attention.cu: fused scaled dot-product attention, FlashAttention-2 style,
// with plain fp32 FMAs. Every kernel is templated on the storage type T of
// q, k, v, o, g and the outputs o, dq, dk|dv, and instantiated for float32,
// bfloat16 and float16 (FOR_FLOATS): 16-bit values are widened as they are
// staged, all arithmetic is float32, and each output element rounds once
// when stored. lse is float32 whatever T is; the mask may be any float
// dtype (mdt: 0 float32, 1 bfloat16, 2 float16).
//
// q is [B, H, T, d], k and v [B, Hkv, S, d], all contiguous; query head h
// reads key/value head h / (H / Hkv). Scores s = scale·q·k + mask, the mask
// read at b·ms0 + h·ms1 + i·ms2 + j·ms3 (strides 0 on broadcast axes; a null
// mask adds nothing); with causal ≠ 0, key j > i is hidden. A hidden key
// (causal, or a −Inf mask) has weight 0; a query with every key hidden gets
// output 0, log-sum-exp −Inf and gradient 0. No [T, S] value is stored:
// scores are recomputed tile by tile, with the online softmax (running max
// and sum per query row) in the forward pass.
//
// Layout: one thread per row (query row in the forward and dq kernels, key
// row in the dk|dv kernel), ATT_ROWS threads per block, grid.x = (batch·
// heads)·(row tiles) flattened. The other operand's rows are staged in
// shared memory a tile at a time. Head dims up to 128: rows live in
// registers sized by the template's DMAX (64 or 128) and loops stop at the
// runtime d. Causal tiles past the diagonal are skipped.
#include "common.cuh"

#define ATT_ROWS 64
// Shared staging: two tiles of ATT_TILE(DMAX) rows of at most DMAX floats
// (32 KiB), plus two per-row floats for the dk|dv kernel.
#define ATT_TILE(DMAX) ((DMAX) > 64 ? 32 : 64)
#define ATT_SMEM (2 * 64 * 64)

template <typename E>
struct AttnArgs {
  const E* q;
  const E* k;
  const E* v;
  const void* mask;
  i64 B, H, Hkv, T, S, d;
  i64 ms0, ms1, ms2, ms3;
  float scale;
  int causal;
  int mdt;  // the mask's dtype: 0 float32, 1 bfloat16, 2 float16
};

// att_mask_at widens element x of a mask of dtype mdt.
__device__ __forceinline__ float att_mask_at(const void* m, int mdt, i64 x) {
  switch (mdt) {
    case 1: return (float)static_cast<const bf16*>(m)[x];
    case 2: return (float)static_cast<const f16*>(m)[x];
  }
  return static_cast<const float*>(m)[x];
}

template <typename T>
__device__ __forceinline__ float att_mask(const AttnArgs<T>& a, i64 b, i64 h, i64 i, i64 j) {
  return a.mask ? att_mask_at(a.mask, a.mdt, b * a.ms0 + h * a.ms1 + i * a.ms2 + j * a.ms3) : 0.f;
}

// att_stage copies rows [r0, r0 + n) of the [rows, d] matrix at src into
// dst (n·d floats, row stride d), widened, every thread of the block
// helping.
template <typename T>
__device__ __forceinline__ void att_stage(float* dst, const T* src, i64 r0, i64 n, i64 d) {
  const i64 total = n * d;
  for (i64 x = threadIdx.x; x < total; x += blockDim.x) dst[x] = (float)src[r0 * d + x];
}

// Forward: o (when non-null) and lse (when non-null) for one tile of
// ATT_ROWS query rows of one (b, h).
template <int DMAX, typename T>
__device__ __forceinline__ void attention_fwd_body(const AttnArgs<T> a, T* __restrict__ o,
                                                   float* __restrict__ lse, float* smem) {
  constexpr int BC = ATT_TILE(DMAX);
  const i64 tiles = (a.T + ATT_ROWS - 1) / ATT_ROWS;
  const i64 bh = (i64)blockIdx.x / tiles, i0 = ((i64)blockIdx.x % tiles) * ATT_ROWS;
  const i64 b = bh / a.H, h = bh % a.H, hk = h / (a.H / a.Hkv);
  const i64 d = a.d, i = i0 + threadIdx.x;
  const bool live = i < a.T;
  const T* kb = a.k + (b * a.Hkv + hk) * a.S * d;
  const T* vb = a.v + (b * a.Hkv + hk) * a.S * d;
  float* sk = smem;
  float* sv = smem + BC * DMAX;
  float qr[DMAX], acc[DMAX];
#pragma unroll
  for (int c = 0; c < DMAX; ++c) {
    qr[c] = (live && c < d) ? (float)a.q[(bh * a.T + i) * d + c] : 0.f;
    acc[c] = 0.f;
  }
  float m = neg_inf_f(), l = 0.f;
  // Keys past the tile's last query are hidden from every row under causal.
  const i64 send = a.causal ? imin(a.S, imin(a.T, i0 + ATT_ROWS)) : a.S;
  for (i64 j0 = 0; j0 < send; j0 += BC) {
    const i64 n = imin((i64)BC, send - j0);
    __syncthreads();
    att_stage(sk, kb, j0, n, d);
    if (o) att_stage(sv, vb, j0, n, d);
    __syncthreads();
    if (!live) continue;
    for (i64 t = 0; t < n; ++t) {
      const i64 j = j0 + t;
      if (a.causal && j > i) break;
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < DMAX; ++c)
        if (c < d) s = fmaf(qr[c], sk[t * d + c], s);
      s = s * a.scale + att_mask(a, b, h, i, j);
      if (s == neg_inf_f()) continue;
      if (s > m) {
        const float r = expf(m - s);  // 0 while m is −Inf
        l *= r;
        if (o) {
#pragma unroll
          for (int c = 0; c < DMAX; ++c) acc[c] *= r;
        }
        m = s;
      }
      const float p = expf(s - m);
      l += p;
      if (o) {
#pragma unroll
        for (int c = 0; c < DMAX; ++c)
          if (c < d) acc[c] = fmaf(p, sv[t * d + c], acc[c]);
      }
    }
  }
  if (!live) return;
  if (o) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int c = 0; c < DMAX; ++c)
      if (c < d) o[(bh * a.T + i) * d + c] = acc[c] * inv;
  }
  if (lse) lse[bh * a.T + i] = l > 0.f ? m + logf(l) : neg_inf_f();
}

// attention_fwd_{f32,bf16,f16}: o = softmax(s)·v and/or lse = log Σ
// exp(s) per query row (o or lse may be null). grid.x = B·H·⌈T/64⌉, block
// 64.
template <typename T>
__device__ __forceinline__ void attention_fwd_t(const AttnArgs<T>& a, T* o, float* lse) {
  __shared__ float smem[ATT_SMEM];
  if (a.d <= 64) attention_fwd_body<64>(a, o, lse, smem);
  else attention_fwd_body<128>(a, o, lse, smem);
}
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_ROWS) attention_fwd_##S(                    \
      const T* q, const T* k, const T* v, const void* mask, T* o, float* lse, i64 B, i64 H,    \
      i64 Hkv, i64 T_, i64 S_, i64 d, i64 ms0, i64 ms1, i64 ms2, i64 ms3, float scale,         \
      i64 causal, i64 mdt) {                                                                    \
    attention_fwd_t<T>({q, k, v, mask, B, H, Hkv, T_, S_, d, ms0, ms1, ms2, ms3, scale,        \
                        (int)causal, (int)mdt},                                                 \
                       o, lse);                                                                 \
  }
FOR_FLOATS(K)
#undef K

// dq for one tile of query rows: D = Σ g∘o, p = exp(s − lse), dq = scale·
// Σ_j p·(g·v_j − D)·k_j.
template <int DMAX, typename T>
__device__ __forceinline__ void attention_dq_body(const AttnArgs<T> a, const T* __restrict__ g,
                                                  const T* __restrict__ o,
                                                  const float* __restrict__ lse,
                                                  T* __restrict__ dq, float* smem) {
  constexpr int BC = ATT_TILE(DMAX);
  const i64 tiles = (a.T + ATT_ROWS - 1) / ATT_ROWS;
  const i64 bh = (i64)blockIdx.x / tiles, i0 = ((i64)blockIdx.x % tiles) * ATT_ROWS;
  const i64 b = bh / a.H, h = bh % a.H, hk = h / (a.H / a.Hkv);
  const i64 d = a.d, i = i0 + threadIdx.x;
  const float li = i < a.T ? lse[bh * a.T + i] : neg_inf_f();
  const bool live = i < a.T && li != neg_inf_f();
  const T* kb = a.k + (b * a.Hkv + hk) * a.S * d;
  const T* vb = a.v + (b * a.Hkv + hk) * a.S * d;
  float* sk = smem;
  float* sv = smem + BC * DMAX;
  float qr[DMAX], gr[DMAX], acc[DMAX];
  float dd = 0.f;
#pragma unroll
  for (int c = 0; c < DMAX; ++c) {
    const bool in = live && c < d;
    const i64 x = (bh * a.T + i) * d + c;
    qr[c] = in ? (float)a.q[x] : 0.f;
    gr[c] = in ? (float)g[x] : 0.f;
    if (in) dd = fmaf(gr[c], (float)o[x], dd);
    acc[c] = 0.f;
  }
  const i64 send = a.causal ? imin(a.S, imin(a.T, i0 + ATT_ROWS)) : a.S;
  for (i64 j0 = 0; j0 < send; j0 += BC) {
    const i64 n = imin((i64)BC, send - j0);
    __syncthreads();
    att_stage(sk, kb, j0, n, d);
    att_stage(sv, vb, j0, n, d);
    __syncthreads();
    if (!live) continue;
    for (i64 t = 0; t < n; ++t) {
      const i64 j = j0 + t;
      if (a.causal && j > i) break;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int c = 0; c < DMAX; ++c)
        if (c < d) {
          s = fmaf(qr[c], sk[t * d + c], s);
          dp = fmaf(gr[c], sv[t * d + c], dp);
        }
      s = s * a.scale + att_mask(a, b, h, i, j);
      if (s == neg_inf_f()) continue;
      const float ds = expf(s - li) * (dp - dd);
#pragma unroll
      for (int c = 0; c < DMAX; ++c)
        if (c < d) acc[c] = fmaf(ds, sk[t * d + c], acc[c]);
    }
  }
  if (i >= a.T) return;
#pragma unroll
  for (int c = 0; c < DMAX; ++c)
    if (c < d) dq[(bh * a.T + i) * d + c] = acc[c] * a.scale;
}

// attention_grad_q_{f32,bf16,f16}: dq [B, H, T, d] from g, o (both [B, H,
// T, d]) and lse [B, H, T] (float32). grid.x = B·H·⌈T/64⌉, block 64.
template <typename T>
__device__ __forceinline__ void attention_grad_q_t(const AttnArgs<T>& a, const T* g, const T* o,
                                                   const float* lse, T* dq) {
  __shared__ float smem[ATT_SMEM];
  if (a.d <= 64) attention_dq_body<64>(a, g, o, lse, dq, smem);
  else attention_dq_body<128>(a, g, o, lse, dq, smem);
}
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_ROWS) attention_grad_q_##S(                 \
      const T* g, const T* q, const T* k, const T* v, const T* o, const float* lse,            \
      const void* mask, T* dq, i64 B, i64 H, i64 Hkv, i64 T_, i64 S_, i64 d, i64 ms0, i64 ms1, \
      i64 ms2, i64 ms3, float scale, i64 causal, i64 mdt) {                                     \
    attention_grad_q_t<T>({q, k, v, mask, B, H, Hkv, T_, S_, d, ms0, ms1, ms2, ms3, scale,     \
                           (int)causal, (int)mdt},                                              \
                          g, o, lse, dq);                                                       \
  }
FOR_FLOATS(K)
#undef K

// dk and dv for one tile of key rows of one (b, hk), summed over the H/Hkv
// query heads of the group: per query row i (staged with its g row, lse
// and D = Σ g∘o), p = exp(s − lse), dv += p·g_i, dk += scale·p·(g_i·v −
// D)·q_i.
template <int DMAX, typename T>
__device__ __forceinline__ void attention_dkv_body(const AttnArgs<T> a, const T* __restrict__ g,
                                                   const T* __restrict__ o,
                                                   const float* __restrict__ lse,
                                                   T* __restrict__ dkv, float* smem,
                                                   float* srow) {
  constexpr int BR = ATT_TILE(DMAX);
  const i64 tiles = (a.S + ATT_ROWS - 1) / ATT_ROWS;
  const i64 bhk = (i64)blockIdx.x / tiles, j0 = ((i64)blockIdx.x % tiles) * ATT_ROWS;
  const i64 b = bhk / a.Hkv, hk = bhk % a.Hkv, group = a.H / a.Hkv;
  const i64 d = a.d, j = j0 + threadIdx.x;
  const bool live = j < a.S;
  float* sq = smem;
  float* sg = smem + BR * DMAX;
  float* sl = srow;       // lse of the staged rows
  float* sd = srow + 64;  // D of the staged rows
  float kr[DMAX], vr[DMAX], dk[DMAX], dv[DMAX];
#pragma unroll
  for (int c = 0; c < DMAX; ++c) {
    const bool in = live && c < d;
    const i64 x = (bhk * a.S + j) * d + c;
    kr[c] = in ? (float)a.k[x] : 0.f;
    vr[c] = in ? (float)a.v[x] : 0.f;
    dk[c] = 0.f;
    dv[c] = 0.f;
  }
  // Under causal, queries before the tile's first key see none of it.
  const i64 istart = a.causal ? (j0 / BR) * BR : 0;
  for (i64 h = hk * group; h < (hk + 1) * group; ++h) {
    const i64 bh = b * a.H + h;
    const T* qb = a.q + bh * a.T * d;
    const T* gb = g + bh * a.T * d;
    const T* ob = o + bh * a.T * d;
    for (i64 r0 = istart; r0 < a.T; r0 += BR) {
      const i64 n = imin((i64)BR, a.T - r0);
      __syncthreads();
      att_stage(sq, qb, r0, n, d);
      att_stage(sg, gb, r0, n, d);
      for (i64 t = threadIdx.x; t < n; t += blockDim.x) {
        float D = 0.f;
        for (i64 c = 0; c < d; ++c)
          D = fmaf((float)gb[(r0 + t) * d + c], (float)ob[(r0 + t) * d + c], D);
        sd[t] = D;
        sl[t] = lse[bh * a.T + r0 + t];
      }
      __syncthreads();
      if (!live) continue;
      for (i64 t = 0; t < n; ++t) {
        const i64 i = r0 + t;
        const float li = sl[t];
        if ((a.causal && j > i) || li == neg_inf_f()) continue;
        float s = 0.f, dp = 0.f;
#pragma unroll
        for (int c = 0; c < DMAX; ++c)
          if (c < d) {
            s = fmaf(sq[t * d + c], kr[c], s);
            dp = fmaf(sg[t * d + c], vr[c], dp);
          }
        s = s * a.scale + att_mask(a, b, h, i, j);
        if (s == neg_inf_f()) continue;
        const float p = expf(s - li);
        const float ds = p * (dp - sd[t]);
#pragma unroll
        for (int c = 0; c < DMAX; ++c)
          if (c < d) {
            dv[c] = fmaf(p, sg[t * d + c], dv[c]);
            dk[c] = fmaf(ds, sq[t * d + c], dk[c]);
          }
      }
    }
  }
  if (!live) return;
  T* out = dkv + (bhk * a.S + j) * 2 * d;
#pragma unroll
  for (int c = 0; c < DMAX; ++c)
    if (c < d) {
      out[c] = dk[c] * a.scale;
      out[d + c] = dv[c];
    }
}

// attention_grad_kv_{f32,bf16,f16}: dk|dv packed [B, Hkv, S, 2d] (dk in
// columns [0, d), dv in [d, 2d)) from g, o and lse (float32). grid.x =
// B·Hkv·⌈S/64⌉, block 64.
template <typename T>
__device__ __forceinline__ void attention_grad_kv_t(const AttnArgs<T>& a, const T* g, const T* o,
                                                    const float* lse, T* dkv) {
  __shared__ float smem[ATT_SMEM];
  __shared__ float srow[2 * 64];
  if (a.d <= 64) attention_dkv_body<64>(a, g, o, lse, dkv, smem, srow);
  else attention_dkv_body<128>(a, g, o, lse, dkv, smem, srow);
}
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_ROWS) attention_grad_kv_##S(                \
      const T* g, const T* q, const T* k, const T* v, const T* o, const float* lse,            \
      const void* mask, T* dkv, i64 B, i64 H, i64 Hkv, i64 T_, i64 S_, i64 d, i64 ms0,         \
      i64 ms1, i64 ms2, i64 ms3, float scale, i64 causal, i64 mdt) {                            \
    attention_grad_kv_t<T>({q, k, v, mask, B, H, Hkv, T_, S_, d, ms0, ms1, ms2, ms3, scale,    \
                            (int)causal, (int)mdt},                                             \
                           g, o, lse, dkv);                                                     \
  }
FOR_FLOATS(K)
#undef K
