// attention.cu: fused scaled dot-product attention, FlashAttention-2 style,
// with plain fp32 FMAs, tensor-core kernels for 16-bit values at head
// dims 64 and 128 without a mask (attention_fwd_mma, attention_grad_q_mma,
// attention_grad_kv_mma), and the row kernels of the float32 path, which
// runs on cuBLAS (attention_rows_{fwd,bwd}_f32, at the end). Every plain
// kernel is templated on the storage type T of q, k, v, o, g and the
// outputs o, dq, dk|dv, and instantiated for bfloat16 and float16
// (FOR_HALVES; float32 no longer uses them):
// 16-bit values are widened as they are staged, all arithmetic is float32,
// and each output element rounds once when stored. lse is float32
// whatever T is; the mask may be any float dtype (mdt: 0 float32,
// 1 bfloat16, 2 float16).
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
#if PART(0)
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_ROWS) attention_fwd_##S(                    \
      const T* q, const T* k, const T* v, const void* mask, T* o, float* lse, i64 B, i64 H,    \
      i64 Hkv, i64 T_, i64 S_, i64 d, i64 ms0, i64 ms1, i64 ms2, i64 ms3, float scale,         \
      i64 causal, i64 mdt) {                                                                    \
    attention_fwd_t<T>({q, k, v, mask, B, H, Hkv, T_, S_, d, ms0, ms1, ms2, ms3, scale,        \
                        (int)causal, (int)mdt},                                                 \
                       o, lse);                                                                 \
  }
FOR_HALVES(K)
#undef K
#endif

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
#if PART(4)
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_ROWS) attention_grad_q_##S(                 \
      const T* g, const T* q, const T* k, const T* v, const T* o, const float* lse,            \
      const void* mask, T* dq, i64 B, i64 H, i64 Hkv, i64 T_, i64 S_, i64 d, i64 ms0, i64 ms1, \
      i64 ms2, i64 ms3, float scale, i64 causal, i64 mdt) {                                     \
    attention_grad_q_t<T>({q, k, v, mask, B, H, Hkv, T_, S_, d, ms0, ms1, ms2, ms3, scale,     \
                           (int)causal, (int)mdt},                                              \
                          g, o, lse, dq);                                                       \
  }
FOR_HALVES(K)
#undef K
#endif

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
#if PART(5)
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_ROWS) attention_grad_kv_##S(                \
      const T* g, const T* q, const T* k, const T* v, const T* o, const float* lse,            \
      const void* mask, T* dkv, i64 B, i64 H, i64 Hkv, i64 T_, i64 S_, i64 d, i64 ms0,         \
      i64 ms1, i64 ms2, i64 ms3, float scale, i64 causal, i64 mdt) {                            \
    attention_grad_kv_t<T>({q, k, v, mask, B, H, Hkv, T_, S_, d, ms0, ms1, ms2, ms3, scale,    \
                            (int)causal, (int)mdt},                                             \
                           g, o, lse, dkv);                                                     \
  }
FOR_HALVES(K)
#undef K
#endif

// ---------------------------------------------------------------------------
// Tensor-core forward for bfloat16 and float16 at head dims 64 and 128,
// without a mask: FlashAttention-2 with mma.sync m16n8k16 (16-bit inputs,
// float32 accumulation). A block of 4 warps takes 64 query rows of one
// (b, h), 16 rows a warp, and walks the keys in tiles of 64 staged in
// shared memory; each warp keeps its q rows as A fragments, computes its
// 16×64 scores with S = q·kᵀ, runs the online softmax on them in float32
// (expf, as the scalar kernel) and adds P·v into float32 accumulators, P
// rounded to T for the product as FlashAttention-2 does (the running sum l
// uses the unrounded p). o rounds once when stored; lse is float32. Causal
// tiles past the diagonal are skipped and the diagonal tile is masked.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16/.f16, and ldmatrix),
// lane = 4·gid + tig (gid = lane / 4 in [0, 8), tig = lane % 4); a 32-bit
// register holds two 16-bit values, the lower index in the low half:
//   A (16×16, row): a[0] = (gid, 2tig..2tig+1), a[1] = (gid+8, 2tig..),
//                   a[2] = (gid, 2tig+8..2tig+9), a[3] = (gid+8, 2tig+8..)
//   B (16×8, col):  b[0] = (k 2tig..2tig+1, n gid), b[1] = (k 2tig+8..2tig+9, n gid)
//   C (16×8, f32):  c[0], c[1] = (gid, 2tig), (gid, 2tig+1);
//                   c[2], c[3] = (gid+8, 2tig), (gid+8, 2tig+1)

#define ATT_MMA_ROWS 64     // query rows per block (16 per warp)
#define ATT_MMA_KEYS 64     // keys per staged tile
#define ATT_MMA_THREADS 128 // 4 warps

// mma16816 accumulates c += a·b for one m16n8k16 product; T (bf16 or
// f16) picks the instruction.
template <typename T>
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b);
template <>
__device__ __forceinline__ void mma16816<bf16>(float* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<f16>(float* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// pack2 rounds lo and hi to T and packs them, lo in the low half.
__device__ __forceinline__ unsigned short bits16(bf16, float f) { return bf16_bits(f); }
__device__ __forceinline__ unsigned short bits16(f16, float f) {
  unsigned short u;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(u) : "f"(f));
  return u;
}
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)bits16(T{}, lo) | ((unsigned)bits16(T{}, hi) << 16);
}

// a_frag packs the float32 C fragments of two adjacent 8-column tiles,
// c[2kc] and c[2kc + 1], rounded to T, into the A fragment of one 16-wide
// chunk: how a product's result feeds the next mma.sync as its left operand.
template <typename T, int N>
__device__ __forceinline__ void a_frag(const float (&c)[N][4], int kc, unsigned (&a)[4]) {
  a[0] = pack2<T>(c[2 * kc][0], c[2 * kc][1]);
  a[1] = pack2<T>(c[2 * kc][2], c[2 * kc][3]);
  a[2] = pack2<T>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
  a[3] = pack2<T>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
}

// smem_addr is the shared-space address of a generic pointer into shared
// memory, for ldmatrix.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// ldsm4t loads four 8×8 16-bit matrices transposed: lane l gives the
// address of row l % 8 of matrix l / 8, and r[m] is matrix m's fragment
// (lane gets elements (rows 2tig, 2tig+1; column gid)).
__device__ __forceinline__ void ldsm4t(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ldsm4 is ldsm4t without the transpose: lane gets elements (row gid;
// columns 2tig, 2tig+1) of each matrix.
__device__ __forceinline__ void ldsm4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ld32 reads the two 16-bit values at p (4-byte aligned) as one register.
__device__ __forceinline__ unsigned ld32(const void* p) { return *static_cast<const unsigned*>(p); }

// cp_async16 copies 16 bytes from global src to the shared-space address
// dst without staging them in registers (cp.async, sm_80 on), or writes 16
// zero bytes there when !valid (src is not read then, but must be a valid
// address). cp_async_commit closes the group of this thread's copies issued
// since the last one; cp_async_wait<N> waits until at most the N newest
// groups are in flight. Each thread waits for its own copies: a
// __syncthreads after the wait makes every thread's visible to all.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// att_mma_stage copies rows [j0, j0 + ROWS) of the [S, D] matrix src into
// dst (row stride D + 8 elements), zeros past row S, 16 bytes at a time,
// the ATT_MMA_THREADS threads of the block sharing the work.
template <int D, int ROWS = ATT_MMA_KEYS>
__device__ __forceinline__ void att_mma_stage(unsigned short* dst, const unsigned short* src,
                                              i64 j0, i64 S) {
  constexpr int PER_ROW = D / 8;  // 16-byte pieces per row
  constexpr int LD = D + 8;
  static_assert(ROWS * PER_ROW % ATT_MMA_THREADS == 0, "whole pieces per thread");
#pragma unroll
  for (int it = 0; it < ROWS * PER_ROW / ATT_MMA_THREADS; ++it) {
    const int x = threadIdx.x + it * ATT_MMA_THREADS;
    const int r = x / PER_ROW, c = (x % PER_ROW) * 8;
    uint4 v;
    v.x = v.y = v.z = v.w = 0u;
    if (j0 + r < S) v = *reinterpret_cast<const uint4*>(src + (j0 + r) * D + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = v;
  }
}

// att_mma_stage_async is att_mma_stage through cp_async16, into the
// shared-space address dst: the copies join the thread's open group.
template <int D, int ROWS>
__device__ __forceinline__ void att_mma_stage_async(unsigned dst, const unsigned short* src, i64 j0,
                                                    i64 S) {
  constexpr int PER_ROW = D / 8;  // 16-byte pieces per row
  constexpr int LD = D + 8;
  static_assert(ROWS * PER_ROW % ATT_MMA_THREADS == 0, "whole pieces per thread");
#pragma unroll
  for (int it = 0; it < ROWS * PER_ROW / ATT_MMA_THREADS; ++it) {
    const int x = threadIdx.x + it * ATT_MMA_THREADS;
    const int r = x / PER_ROW, c = (x % PER_ROW) * 8;
    const bool in = j0 + r < S;
    cp_async16(dst + (unsigned)((r * LD + c) * 2), in ? src + (j0 + r) * D + c : src, in);
  }
}

template <typename T, int D>
__device__ __forceinline__ void attention_fwd_mma_body(const T* __restrict__ q,
                                                       const T* __restrict__ k,
                                                       const T* __restrict__ v,
                                                       T* __restrict__ o, float* __restrict__ lse,
                                                       i64 H, i64 Hkv, i64 T_, i64 S, float scale,
                                                       bool causal) {
  constexpr int LD = D + 8;      // shared row stride (elements): conflict-free fragment reads
  constexpr int KC = D / 16;     // 16-wide chunks of the head dim (k of q·kᵀ)
  constexpr int NT = ATT_MMA_KEYS / 8;  // 8-key column tiles of the scores
  constexpr int DT = D / 8;      // 8-wide column tiles of o
  __shared__ __align__(16) unsigned short sk[ATT_MMA_KEYS * LD];
  __shared__ __align__(16) unsigned short sv[ATT_MMA_KEYS * LD];

  const i64 tiles = (T_ + ATT_MMA_ROWS - 1) / ATT_MMA_ROWS;
  const i64 bh = (i64)blockIdx.x / tiles, i0 = ((i64)blockIdx.x % tiles) * ATT_MMA_ROWS;
  const i64 b = bh / H, h = bh % H, hk = h / (H / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gid = lane >> 2, tig = lane & 3;
  const i64 r0 = i0 + warp * 16 + gid, r1 = r0 + 8;  // this thread's two query rows
  const unsigned short* qb = reinterpret_cast<const unsigned short*>(q) + bh * T_ * D;
  const unsigned short* kb = reinterpret_cast<const unsigned short*>(k) + (b * Hkv + hk) * S * D;
  const unsigned short* vb = reinterpret_cast<const unsigned short*>(v) + (b * Hkv + hk) * S * D;

  // q rows as A fragments; rows past T are zero (their results are not
  // stored).
  unsigned qa[KC][4];
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int c = kc * 16 + 2 * tig;
    qa[kc][0] = r0 < T_ ? ld32(qb + r0 * D + c) : 0u;
    qa[kc][1] = r1 < T_ ? ld32(qb + r1 * D + c) : 0u;
    qa[kc][2] = r0 < T_ ? ld32(qb + r0 * D + c + 8) : 0u;
    qa[kc][3] = r1 < T_ ? ld32(qb + r1 * D + c + 8) : 0u;
  }
  float acc[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  // Running max and this thread's part of the running sum, rows r0 and r1.
  float m[2] = {neg_inf_f(), neg_inf_f()}, l[2] = {0.f, 0.f};

  // ldmatrix row addresses for v: lane gives row (lane % 8) + 8·(matrix &
  // 1) of a 16-key chunk, columns 8·(matrix >> 1) of a 16-wide pair of o
  // tiles, so r[0], r[1] are the B fragment (keys 0–7, 8–15) of the first
  // tile and r[2], r[3] of the second.
  const int mat = lane >> 3;
  const unsigned sv_lane = smem_addr(sv + ((lane & 7) + 8 * (mat & 1)) * LD + 8 * (mat >> 1));

  const i64 send = causal ? imin(S, imin(T_, i0 + ATT_MMA_ROWS)) : S;
  for (i64 j0 = 0; j0 < send; j0 += ATT_MMA_KEYS) {
    __syncthreads();  // the previous tile's readers are done
    att_mma_stage<D>(sk, kb, j0, S);
    if (o) att_mma_stage<D>(sv, vb, j0, S);
    __syncthreads();

    // s = q·kᵀ for 16 rows × 64 keys: B fragments straight from sk rows
    // (key n = gid of the tile, dims 2tig.. and 2tig+8..).
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const unsigned short* kr = sk + (nt * 8 + gid) * LD + 2 * tig;
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        const unsigned bf[2] = {ld32(kr + kc * 16), ld32(kr + kc * 16 + 8)};
        mma16816<T>(s[nt], qa[kc], bf);
      }
    }

    // Scale, hide keys past S and (causal) past the row, and take each
    // row's tile max over the 4 lanes that share it.
    float mx[2] = {neg_inf_f(), neg_inf_f()};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const i64 j = j0 + nt * 8 + 2 * tig + (e & 1);
        const i64 i = (e < 2) ? r0 : r1;
        float x = s[nt][e] * scale;
        if (j >= S || (causal && j > i)) x = neg_inf_f();
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
      const float mn = fmaxf(m[r], mx[r]);
      // Nothing seen yet (mn = −Inf): keep everything as it is, p = 0.
      alpha[r] = mn == neg_inf_f() ? 1.f : expf(m[r] - mn);  // 0 while m is −Inf
      base[r] = mn == neg_inf_f() ? 0.f : mn;
      m[r] = mn;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = expf(s[nt][e] - base[e >> 1]);  // 0 for a hidden key
        s[nt][e] = p;
        l[e >> 1] += p;
      }
    }
    if (!o) continue;
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      acc[t][0] *= alpha[0];
      acc[t][1] *= alpha[0];
      acc[t][2] *= alpha[1];
      acc[t][3] *= alpha[1];
    }
    // o += P·v: the C fragments of two adjacent 8-key score tiles are the
    // A fragment of one 16-key chunk.
#pragma unroll
    for (int kc = 0; kc < ATT_MMA_KEYS / 16; ++kc) {
      unsigned pa[4];
      a_frag<T>(s, kc, pa);
#pragma unroll
      for (int t = 0; t < DT; t += 2) {
        unsigned bf[4];
        ldsm4t(bf, sv_lane + (unsigned)((kc * 16 * LD + t * 8) * 2));
        mma16816<T>(acc[t], pa, bf);
        mma16816<T>(acc[t + 1], pa, bf + 2);
      }
    }
  }

  // Whole-row sums over the 4 lanes of a row, then o = acc / l and lse.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
  }
  if (o) {
    const float inv0 = l[0] > 0.f ? 1.f / l[0] : 0.f, inv1 = l[1] > 0.f ? 1.f / l[1] : 0.f;
    unsigned short* ob = reinterpret_cast<unsigned short*>(o) + bh * T_ * D;
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      const int c = t * 8 + 2 * tig;
      if (r0 < T_)
        *reinterpret_cast<unsigned*>(ob + r0 * D + c) = pack2<T>(acc[t][0] * inv0, acc[t][1] * inv0);
      if (r1 < T_)
        *reinterpret_cast<unsigned*>(ob + r1 * D + c) = pack2<T>(acc[t][2] * inv1, acc[t][3] * inv1);
    }
  }
  if (lse && tig == 0) {
    if (r0 < T_) lse[bh * T_ + r0] = l[0] > 0.f ? m[0] + logf(l[0]) : neg_inf_f();
    if (r1 < T_) lse[bh * T_ + r1] = l[1] > 0.f ? m[1] + logf(l[1]) : neg_inf_f();
  }
}

// attention_fwd_mma_d{64,128}_{bf16,f16}: attention_fwd's o and/or lse (o
// or lse may be null) on tensor cores, for head dim 64 or 128 exactly and
// no mask. q, k, v and o must be 16-byte aligned. grid.x =
// B·H·⌈T/64⌉, block 128.
// ATT_MMA_INSTANCES(X) expands X(T, S, D, B) for the tensor-core
// kernels' storage types and head dims: B is the backward kernels' minimum
// blocks per multiprocessor (3 at d = 64, which fits; 1 at d = 128).
#define ATT_MMA_INSTANCES(X) X(bf16, bf16, 64, 3) X(bf16, bf16, 128, 1) X(f16, f16, 64, 3) X(f16, f16, 128, 1)

#if PART(1)
#define K(T, S, D, B)                                                                           \
  extern "C" __global__ void __launch_bounds__(ATT_MMA_THREADS) attention_fwd_mma_d##D##_##S(  \
      const T* q, const T* k, const T* v, T* o, float* lse, i64 H, i64 Hkv, i64 T_, i64 S_,    \
      float scale, i64 causal) {                                                                \
    attention_fwd_mma_body<T, D>(q, k, v, o, lse, H, Hkv, T_, S_, scale, causal != 0);          \
  }
ATT_MMA_INSTANCES(K)
#undef K
#endif

// ---------------------------------------------------------------------------
// Tensor-core backward for bfloat16 and float16 at head dims 64 and 128,
// without a mask: FlashAttention-2's backward split into a dq pass and a
// dk|dv pass, neither with atomics (every output element is summed by one
// thread in a fixed order, so the results are deterministic). Both
// recompute the scores with mma, p = exp(scale·s − lse) in float32 (expf,
// from the float32 lse of attention_lse), dp = g·vᵀ and ds = p·(dp − D_i),
// D_i = Σ g_i∘o_i. The products that take p or ds as an operand (dv += pᵀ·g,
// dk += dsᵀ·q, dq += ds·k) round them to T first, as FlashAttention-2 does;
// every sum is float32 and dq, dk, dv round once when stored. Hidden keys
// (causal, past S) and queries past T get p = 0, as do rows whose lse is
// −Inf (every key hidden), so their gradients are 0.
//
//   attention_grad_dot: D = Σ g∘o per query row, float32, into the dk|dv
//   pass's workspace (the dq pass computes its rows' D itself).
//   attention_grad_q_mma: a block of 4 warps per 64 query rows of one
//   (b, h), 16 rows a warp with q and g as A fragments in registers; key
//   tiles (64 keys at d = 64, 32 at d = 128, walked 32 keys a step) staged
//   in shared memory, two buffers, tile it + 1 copied in by cp.async while
//   tile it is read; s = q·kᵀ and dp = g·vᵀ take k and v rows as B
//   fragments (ldmatrix), dq += ds·k takes k through ldmatrix.trans.
//   attention_grad_kv_mma: a block of 4 warps per 64 keys of one (b, hkv),
//   16 keys a warp; k and v stay in shared memory (A fragments of sᵀ = k·qᵀ
//   and dpᵀ = v·gᵀ, ldmatrix); the query tiles (32 rows at d = 64, double
//   buffered as above; 16 at d = 128, one buffer, to fit 48 KiB of static
//   shared memory) of every query head of the group are staged in turn
//   with their lse and D, and pᵀ, dsᵀ (C fragments, keys by queries) become
//   the A fragments of dv += pᵀ·g and dk += dsᵀ·q (g and q through
//   ldmatrix.trans).
// Causal: the dq pass stops at the tile's last query, the dk|dv pass starts
// at its first key (BQ divides 64), a warp whose rows the tile hides whole
// skips it, and the diagonal tiles are masked element by element.
// scripts/cuda-emu checks these kernels on the host (no GPU).

// lo16 and hi16 widen the low and high 16-bit halves of a register.
template <typename T>
__device__ __forceinline__ float lo16(unsigned w) {
  T x;
  x.u = (unsigned short)(w & 0xffffu);
  return (float)x;
}
template <typename T>
__device__ __forceinline__ float hi16(unsigned w) {
  T x;
  x.u = (unsigned short)(w >> 16);
  return (float)x;
}

// dot2 is a·b for two registers of two T values each.
template <typename T>
__device__ __forceinline__ float dot2(unsigned a, unsigned b) {
  return lo16<T>(a) * lo16<T>(b) + hi16<T>(a) * hi16<T>(b);
}

// attention_grad_dot_{bf16,f16}: dot[r] = Σ_c g[r, c]·o[r, c] in float32
// for rows [0, rows) of length d (a multiple of 8; g and o 16-byte
// aligned). 8 threads a row, 16 bytes at a time; flat layout (any grid of
// 256-thread blocks).
template <typename T>
__device__ __forceinline__ void attention_grad_dot_t(const T* __restrict__ g,
                                                     const T* __restrict__ o,
                                                     float* __restrict__ dot, i64 rows, i64 d) {
  const int sub = threadIdx.x & 7;
  const i64 per = blockDim.x / 8;
  // r0 is uniform over the block, so every lane of a warp takes each trip.
  for (i64 r0 = (i64)blockIdx.x * per; r0 < rows; r0 += (i64)gridDim.x * per) {
    const i64 r = r0 + threadIdx.x / 8;
    float s = 0.f;
    if (r < rows) {
      for (i64 c = 8 * sub; c < d; c += 64) {
        const Vec<T, 8> x = ldv<8>(g + r * d + c, 0), y = ldv<8>(o + r * d + c, 0);
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf((float)x.v[j], (float)y.v[j], s);
      }
    }
    s += __shfl_xor_sync(FULL_MASK, s, 4);
    s += __shfl_xor_sync(FULL_MASK, s, 2);
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    if (r < rows && sub == 0) dot[r] = s;
  }
}
#if PART(0)
extern "C" __global__ void attention_grad_dot_bf16(const bf16* g, const bf16* o, float* dot, i64 rows,
                                                   i64 d) {
  attention_grad_dot_t<bf16>(g, o, dot, rows, d);
}
extern "C" __global__ void attention_grad_dot_f16(const f16* g, const f16* o, float* dot, i64 rows,
                                                  i64 d) {
  attention_grad_dot_t<f16>(g, o, dot, rows, d);
}
#endif

// att_row_lse is the lse a gradient pass uses for query row i: +Inf for
// a row past T or with every key hidden (lse −Inf), so that its p =
// exp(scale·s − lse) is 0.
__device__ __forceinline__ float att_row_lse(const float* lse, i64 row, bool live) {
  const float l = live ? lse[row] : neg_inf_f();
  return l == neg_inf_f() ? -neg_inf_f() : l;
}

// att_row_vals reads the lse (att_row_lse) and D of query row i of the
// head whose rows start at row0 (0 past T).
__device__ __forceinline__ void att_row_vals(const float* lse, const float* dot, i64 row0, i64 i,
                                             i64 T, float& l, float& d) {
  l = att_row_lse(lse, row0 + i, i < T);
  d = i < T ? dot[row0 + i] : 0.f;
}

template <typename T, int D>
__device__ __forceinline__ void attention_dq_mma_body(const T* __restrict__ g,
                                                      const T* __restrict__ q,
                                                      const T* __restrict__ k,
                                                      const T* __restrict__ v,
                                                      const T* __restrict__ o,
                                                      const float* __restrict__ lse,
                                                      T* __restrict__ dq, i64 H, i64 Hkv, i64 T_,
                                                      i64 S, float scale, bool causal) {
  constexpr int KEYS = D == 64 ? 64 : 32;  // keys per staged tile
  constexpr int SUB = 32;                  // keys per step within the tile
  constexpr int LD = D + 8;                // shared row stride (elements)
  constexpr int KC = D / 16;               // 16-wide chunks of the head dim
  constexpr int NT = SUB / 8;              // 8-key column tiles of s and dp
  constexpr int DT = D / 8;                // 8-wide column tiles of dq
  constexpr unsigned BUF = KEYS * LD * 2;  // bytes of one staged tile
  static_assert(KEYS % SUB == 0 && NT % 2 == 0, "whole steps, pairs of 8-key tiles");
  // Two buffers each: tile it + 1 is copied in (cp.async) while tile it
  // is read.
  __shared__ __align__(16) unsigned short sk[2 * KEYS * LD];
  __shared__ __align__(16) unsigned short sv[2 * KEYS * LD];

  const i64 tiles = (T_ + ATT_MMA_ROWS - 1) / ATT_MMA_ROWS;
  const i64 bh = (i64)blockIdx.x / tiles, i0 = ((i64)blockIdx.x % tiles) * ATT_MMA_ROWS;
  const i64 b = bh / H, h = bh % H, hk = h / (H / Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gid = lane >> 2, tig = lane & 3;
  const i64 r0 = i0 + warp * 16 + gid, r1 = r0 + 8;  // this thread's two query rows
  const unsigned short* qb = reinterpret_cast<const unsigned short*>(q) + bh * T_ * D;
  const unsigned short* gb = reinterpret_cast<const unsigned short*>(g) + bh * T_ * D;
  const unsigned short* ob = reinterpret_cast<const unsigned short*>(o) + bh * T_ * D;
  const unsigned short* kb = reinterpret_cast<const unsigned short*>(k) + (b * Hkv + hk) * S * D;
  const unsigned short* vb = reinterpret_cast<const unsigned short*>(v) + (b * Hkv + hk) * S * D;

  // q and g rows as A fragments (rows past T zero), and D of rows r0, r1:
  // this thread's 4·KC columns of g∘o, summed over the 4 lanes of a row.
  unsigned qa[KC][4], ga[KC][4];
  float dd[2] = {0.f, 0.f};
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int c = kc * 16 + 2 * tig;
    qa[kc][0] = r0 < T_ ? ld32(qb + r0 * D + c) : 0u;
    qa[kc][1] = r1 < T_ ? ld32(qb + r1 * D + c) : 0u;
    qa[kc][2] = r0 < T_ ? ld32(qb + r0 * D + c + 8) : 0u;
    qa[kc][3] = r1 < T_ ? ld32(qb + r1 * D + c + 8) : 0u;
    ga[kc][0] = r0 < T_ ? ld32(gb + r0 * D + c) : 0u;
    ga[kc][1] = r1 < T_ ? ld32(gb + r1 * D + c) : 0u;
    ga[kc][2] = r0 < T_ ? ld32(gb + r0 * D + c + 8) : 0u;
    ga[kc][3] = r1 < T_ ? ld32(gb + r1 * D + c + 8) : 0u;
    if (r0 < T_) dd[0] += dot2<T>(ga[kc][0], ld32(ob + r0 * D + c)) + dot2<T>(ga[kc][2], ld32(ob + r0 * D + c + 8));
    if (r1 < T_) dd[1] += dot2<T>(ga[kc][1], ld32(ob + r1 * D + c)) + dot2<T>(ga[kc][3], ld32(ob + r1 * D + c + 8));
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    dd[r] += __shfl_xor_sync(FULL_MASK, dd[r], 1);
    dd[r] += __shfl_xor_sync(FULL_MASK, dd[r], 2);
  }
  const float ls[2] = {att_row_lse(lse, bh * T_ + r0, r0 < T_), att_row_lse(lse, bh * T_ + r1, r1 < T_)};

  float acc[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  // ldmatrix row addresses. Lane l names row l % 8 of matrix m = l / 8.
  // B operand of ds·k (k index = key, n = head dim), k through .trans as
  // attention_fwd_mma reads v: matrices (keys + 8·(m & 1), dims + 8·(m >>
  // 1)), so r[0], r[1] are the B fragment of one 8-dim tile, r[2], r[3] of
  // the next. B operands of q·kᵀ and g·vᵀ (k index = head dim, n = key),
  // the rows as they are: matrices (keys + 8·(m >> 1), dims + 8·(m & 1)),
  // so r[0], r[1] are the B fragment of one 8-key tile, r[2], r[3] of the
  // next.
  const int mat = lane >> 3;
  const unsigned sk_lane = smem_addr(sk + ((lane & 7) + 8 * (mat & 1)) * LD + 8 * (mat >> 1));
  const int brow = ((lane & 7) + 8 * (mat >> 1)) * LD + 8 * (mat & 1);
  const unsigned sk_b = smem_addr(sk + brow), sv_b = smem_addr(sv + brow);

  // Causal: keys past the tile's last query are hidden from every row.
  const i64 send = causal ? imin(S, imin(T_, i0 + ATT_MMA_ROWS)) : S;
  const i64 n = (send + KEYS - 1) / KEYS;  // key tiles
  const unsigned sk0 = smem_addr(sk), sv0 = smem_addr(sv);
  if (n > 0) {
    att_mma_stage_async<D, KEYS>(sk0, kb, 0, S);
    att_mma_stage_async<D, KEYS>(sv0, vb, 0, S);
  }
  cp_async_commit();
  for (i64 it = 0; it < n; ++it) {
    const i64 j0 = it * KEYS;
    const unsigned cur = (unsigned)(it & 1) * BUF;  // this tile's buffer (byte offset)
    __syncthreads();  // the readers of the other buffer (tile it − 1) are done
    if (it + 1 < n) {
      att_mma_stage_async<D, KEYS>(sk0 + (BUF - cur), kb, j0 + KEYS, S);
      att_mma_stage_async<D, KEYS>(sv0 + (BUF - cur), vb, j0 + KEYS, S);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile it have landed
    __syncthreads();     // and every thread's
    // Sub-tiles of SUB keys bound the registers that s and dp take.
#pragma unroll 1
    for (int c0 = 0; c0 < KEYS; c0 += SUB) {
      // Causal: this and every later key is past every row of this warp.
      if (causal && j0 + c0 > i0 + warp * 16 + 15) break;

      // s = q·kᵀ and dp = g·vᵀ, 16 rows × SUB keys: B fragments of two
      // 8-key tiles per ldmatrix of the k and v rows.
      float s[NT][4], dp[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          const unsigned off = (unsigned)(((c0 + nt * 8) * LD + kc * 16) * 2);
          unsigned bf[4];
          ldsm4(bf, sk_b + cur + off);
          mma16816<T>(s[nt], qa[kc], bf);
          mma16816<T>(s[nt + 1], qa[kc], bf + 2);
          ldsm4(bf, sv_b + cur + off);
          mma16816<T>(dp[nt], ga[kc], bf);
          mma16816<T>(dp[nt + 1], ga[kc], bf + 2);
        }
      }
      // ds = p·(dp − D) into s; hidden keys get p = 0.
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const i64 j = j0 + c0 + nt * 8 + 2 * tig + (e & 1);
          const i64 i = (e < 2) ? r0 : r1;
          const float p = (j < S && !(causal && j > i)) ? expf(s[nt][e] * scale - ls[e >> 1]) : 0.f;
          s[nt][e] = p * (dp[nt][e] - dd[e >> 1]);
        }
      }
      // dq += ds·k: the C fragments of two adjacent 8-key tiles are the A
      // fragment of one 16-key chunk (ds rounded to T).
#pragma unroll
      for (int kc = 0; kc < SUB / 16; ++kc) {
        unsigned da[4];
        a_frag<T>(s, kc, da);
#pragma unroll
        for (int t = 0; t < DT; t += 2) {
          unsigned bf[4];
          ldsm4t(bf, sk_lane + cur + (unsigned)(((c0 + kc * 16) * LD + t * 8) * 2));
          mma16816<T>(acc[t], da, bf);
          mma16816<T>(acc[t + 1], da, bf + 2);
        }
      }
    }
  }

  unsigned short* dqb = reinterpret_cast<unsigned short*>(dq) + bh * T_ * D;
#pragma unroll
  for (int t = 0; t < DT; ++t) {
    const int c = t * 8 + 2 * tig;
    if (r0 < T_)
      *reinterpret_cast<unsigned*>(dqb + r0 * D + c) = pack2<T>(acc[t][0] * scale, acc[t][1] * scale);
    if (r1 < T_)
      *reinterpret_cast<unsigned*>(dqb + r1 * D + c) = pack2<T>(acc[t][2] * scale, acc[t][3] * scale);
  }
}

template <typename T, int D>
__device__ __forceinline__ void attention_dkv_mma_body(const T* __restrict__ g,
                                                       const T* __restrict__ q,
                                                       const T* __restrict__ k,
                                                       const T* __restrict__ v,
                                                       const float* __restrict__ lse,
                                                       const float* __restrict__ dot,
                                                       T* __restrict__ dkv, i64 H, i64 Hkv,
                                                       i64 T_, i64 S, float scale, bool causal) {
  constexpr int KEYS = ATT_MMA_KEYS;      // keys per block (16 per warp)
  constexpr int BQ = D == 64 ? 32 : 16;   // query rows per staged tile
  constexpr int NBUF = D == 64 ? 2 : 1;   // buffers of q and g tiles
  constexpr int LD = D + 8;               // shared row stride (elements)
  constexpr int KC = D / 16;              // 16-wide chunks of the head dim
  constexpr int NT = BQ / 8;              // 8-query column tiles of sᵀ and dpᵀ
  constexpr int DT = D / 8;               // 8-wide column tiles of dk and dv
  constexpr unsigned QBUF = BQ * LD * 2;  // bytes of one staged q or g tile
  static_assert(KEYS % BQ == 0, "causal query tiles start at the block's first key");
  static_assert(NT % 2 == 0, "pairs of 8-query tiles");
  // k and v stay; q and g tiles are double-buffered at d = 64 (tile it + 1
  // is copied in by cp.async while tile it is read); at d = 128 a second
  // buffer would pass 48 KiB, so the copy of a tile waits for the last.
  __shared__ __align__(16) unsigned short sk[KEYS * LD];
  __shared__ __align__(16) unsigned short sv[KEYS * LD];
  __shared__ __align__(16) unsigned short sq[NBUF * BQ * LD];
  __shared__ __align__(16) unsigned short sg[NBUF * BQ * LD];
  __shared__ float sl[BQ];  // lse of the staged queries (att_row_lse)
  __shared__ float sd[BQ];  // D of the staged queries

  const i64 tiles = (S + KEYS - 1) / KEYS;
  const i64 bhk = (i64)blockIdx.x / tiles, j0 = ((i64)blockIdx.x % tiles) * KEYS;
  const i64 b = bhk / Hkv, hk = bhk % Hkv, group = H / Hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gid = lane >> 2, tig = lane & 3;
  const i64 k0 = j0 + warp * 16 + gid, k1 = k0 + 8;  // this thread's two keys
  att_mma_stage<D, KEYS>(sk, reinterpret_cast<const unsigned short*>(k) + bhk * S * D, j0, S);
  att_mma_stage<D, KEYS>(sv, reinterpret_cast<const unsigned short*>(v) + bhk * S * D, j0, S);

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t) {
    dk[t][0] = dk[t][1] = dk[t][2] = dk[t][3] = 0.f;
    dv[t][0] = dv[t][1] = dv[t][2] = dv[t][3] = 0.f;
  }
  // ldmatrix row addresses. Lane l names row l % 8 of matrix m = l / 8.
  // Matrices (rows + 8·(m & 1), dims + 8·(m >> 1)): as they are, the A
  // fragment of 16 rows × 16 dims (this warp's k and v rows, for k·qᵀ and
  // v·gᵀ); through .trans, the B fragments of two 8-dim tiles (q and g as
  // the B operands of dsᵀ·q and pᵀ·g, k index = query, n = head dim), as
  // attention_fwd_mma reads v. Matrices (rows + 8·(m >> 1), dims + 8·(m &
  // 1)), as they are: the B fragments of two 8-query tiles (q and g rows
  // for k·qᵀ and v·gᵀ, k index = head dim, n = query).
  const int mat = lane >> 3;
  const int lrow = ((lane & 7) + 8 * (mat & 1)) * LD + 8 * (mat >> 1);
  const int brow = ((lane & 7) + 8 * (mat >> 1)) * LD + 8 * (mat & 1);
  const unsigned sk_a = smem_addr(sk + warp * 16 * LD + lrow), sv_a = smem_addr(sv + warp * 16 * LD + lrow);
  const unsigned sq_lane = smem_addr(sq + lrow), sg_lane = smem_addr(sg + lrow);
  const unsigned sq_b = smem_addr(sq + brow), sg_b = smem_addr(sg + brow);

  // The query tiles of every query head of the group in turn: tile it is
  // rows [i0, i0 + BQ) of head hk·group + it / per. Causal: queries before
  // the block's first key see none of its keys.
  const i64 istart = causal ? j0 : 0;
  const i64 per = istart < T_ ? (T_ - istart + BQ - 1) / BQ : 0, n = group * per;
  const i64 bh0 = b * H + hk * group;
  const unsigned short* qb = reinterpret_cast<const unsigned short*>(q);
  const unsigned short* gb = reinterpret_cast<const unsigned short*>(g);
  const unsigned sq0 = smem_addr(sq), sg0 = smem_addr(sg);
  // lse (att_row_lse) and D of query row threadIdx.x < BQ of the next tile,
  // read while the current one is worked on.
  float nl = 0.f, nd = 0.f;
  if (n > 0) {
    att_mma_stage_async<D, BQ>(sq0, qb + bh0 * T_ * D, istart, T_);
    att_mma_stage_async<D, BQ>(sg0, gb + bh0 * T_ * D, istart, T_);
    if (threadIdx.x < BQ) att_row_vals(lse, dot, bh0 * T_, istart + threadIdx.x, T_, nl, nd);
  }
  cp_async_commit();
  for (i64 it = 0; it < n; ++it) {
    const i64 i0 = istart + (it % per) * BQ;
    const unsigned cur = NBUF == 2 ? (unsigned)(it & 1) * QBUF : 0u;  // this tile's buffer
    __syncthreads();  // the readers of what is written below (tile it − 1) are done
    if (threadIdx.x < BQ) {
      sl[threadIdx.x] = nl;
      sd[threadIdx.x] = nd;
    }
    if (NBUF == 2) {
      if (it + 1 < n) {
        const i64 bh = bh0 + (it + 1) / per, i1 = istart + ((it + 1) % per) * BQ;
        att_mma_stage_async<D, BQ>(sq0 + (QBUF - cur), qb + bh * T_ * D, i1, T_);
        att_mma_stage_async<D, BQ>(sg0 + (QBUF - cur), gb + bh * T_ * D, i1, T_);
      }
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of tile it have landed
    } else {
      if (it > 0) {
        const i64 bh = bh0 + it / per;
        att_mma_stage_async<D, BQ>(sq0, qb + bh * T_ * D, i0, T_);
        att_mma_stage_async<D, BQ>(sg0, gb + bh * T_ * D, i0, T_);
      }
      cp_async_commit();
      cp_async_wait<0>();
    }
    if (threadIdx.x < BQ && it + 1 < n) {
      const i64 bh = bh0 + (it + 1) / per, i1 = istart + ((it + 1) % per) * BQ;
      att_row_vals(lse, dot, bh * T_, i1 + threadIdx.x, T_, nl, nd);
    }
    __syncthreads();  // tile it, its lse and D are in place for every thread
    // Causal: every query of the tile is before every key of this warp.
    if (causal && i0 + BQ - 1 < j0 + warp * 16) continue;

    // sᵀ = k·qᵀ and dpᵀ = v·gᵀ, 16 keys × BQ queries: the k and v A
    // fragments, and B fragments of two 8-query tiles, per ldmatrix.
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      unsigned kf[4], vf[4];
      ldsm4(kf, sk_a + (unsigned)(kc * 16 * 2));
      ldsm4(vf, sv_a + (unsigned)(kc * 16 * 2));
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        const unsigned off = cur + (unsigned)((nt * 8 * LD + kc * 16) * 2);
        unsigned bf[4];
        ldsm4(bf, sq_b + off);
        mma16816<T>(s[nt], kf, bf);
        mma16816<T>(s[nt + 1], kf, bf + 2);
        ldsm4(bf, sg_b + off);
        mma16816<T>(dp[nt], vf, bf);
        mma16816<T>(dp[nt + 1], vf, bf + 2);
      }
    }
    // pᵀ into s and dsᵀ = pᵀ·(dpᵀ − D) into dp; element e of tile nt is
    // key k0 (e < 2) or k1 and staged query c = nt·8 + 2tig + (e & 1).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * tig + (e & 1);
        const i64 j = (e < 2) ? k0 : k1;
        const float p = (j < S && !(causal && j > i0 + c)) ? expf(s[nt][e] * scale - sl[c]) : 0.f;
        s[nt][e] = p;
        dp[nt][e] = p * (dp[nt][e] - sd[c]);
      }
    }
    // dv += pᵀ·g and dk += dsᵀ·q: two adjacent 8-query C tiles make the A
    // fragment of one 16-query chunk (p and ds rounded to T).
#pragma unroll
    for (int kc = 0; kc < BQ / 16; ++kc) {
      unsigned pa[4];
      a_frag<T>(s, kc, pa);
      unsigned da[4];
      a_frag<T>(dp, kc, da);
#pragma unroll
      for (int t = 0; t < DT; t += 2) {
        const unsigned off = cur + (unsigned)((kc * 16 * LD + t * 8) * 2);
        unsigned bf[4];
        ldsm4t(bf, sg_lane + off);
        mma16816<T>(dv[t], pa, bf);
        mma16816<T>(dv[t + 1], pa, bf + 2);
        ldsm4t(bf, sq_lane + off);
        mma16816<T>(dk[t], da, bf);
        mma16816<T>(dk[t + 1], da, bf + 2);
      }
    }
  }

  // dk (times scale) in columns [0, D) of the packed row, dv in [D, 2D).
  unsigned short* out = reinterpret_cast<unsigned short*>(dkv) + bhk * S * 2 * D;
#pragma unroll
  for (int t = 0; t < DT; ++t) {
    const int c = t * 8 + 2 * tig;
    if (k0 < S) {
      *reinterpret_cast<unsigned*>(out + k0 * 2 * D + c) = pack2<T>(dk[t][0] * scale, dk[t][1] * scale);
      *reinterpret_cast<unsigned*>(out + k0 * 2 * D + D + c) = pack2<T>(dv[t][0], dv[t][1]);
    }
    if (k1 < S) {
      *reinterpret_cast<unsigned*>(out + k1 * 2 * D + c) = pack2<T>(dk[t][2] * scale, dk[t][3] * scale);
      *reinterpret_cast<unsigned*>(out + k1 * 2 * D + D + c) = pack2<T>(dv[t][2], dv[t][3]);
    }
  }
}

// attention_grad_q_mma_d{64,128}_{bf16,f16}: attention_grad_q without a
// mask on tensor cores, D computed from g and o. g, q, k, v, o and dq
// 16-byte aligned. grid.x = B·H·⌈T/64⌉, block 128.
#if PART(2)
#define K(T, S, D, B)                                                                            \
  extern "C" __global__ void __launch_bounds__(ATT_MMA_THREADS, B) attention_grad_q_mma_d##D##_##S( \
      const T* g, const T* q, const T* k, const T* v, const T* o, const float* lse, T* dq, i64 H,  \
      i64 Hkv, i64 T_, i64 S_, float scale, i64 causal) {                                          \
    attention_dq_mma_body<T, D>(g, q, k, v, o, lse, dq, H, Hkv, T_, S_, scale, causal != 0);       \
  }
ATT_MMA_INSTANCES(K)
#undef K
#endif

// attention_grad_kv_mma_d{64,128}_{bf16,f16}: attention_grad_kv without a
// mask on tensor cores, from dot = D (attention_grad_dot). g, q, k, v and
// dkv 16-byte aligned. grid.x = B·Hkv·⌈S/64⌉, block 128.
#if PART(3)
#define K(T, S, D, B)                                                                             \
  extern "C" __global__ void __launch_bounds__(ATT_MMA_THREADS, B) attention_grad_kv_mma_d##D##_##S( \
      const T* g, const T* q, const T* k, const T* v, const float* lse, const float* dot, T* dkv,    \
      i64 H, i64 Hkv, i64 T_, i64 S_, float scale, i64 causal) {                                    \
    attention_dkv_mma_body<T, D>(g, q, k, v, lse, dot, dkv, H, Hkv, T_, S_, scale, causal != 0);    \
  }
ATT_MMA_INSTANCES(K)
#undef K
#endif

// ---------------------------------------------------------------------------
// float32 attention on cuBLAS. exec/cuda (attention32.go) runs float32
// attention as strided-batched SGEMMs over one block of query rows
// [i0, i0 + nq) of every (b, h) at a time: s = scale·q·kᵀ (and dp = g·vᵀ
// for the gradients) into a float32 workspace of [B·H, nq, ld] values
// (keys [0, n), n ≤ ld; under causal n stops at the block's last query),
// then o = p·v, dq = ds·k, dk += dsᵀ·q, dv += pᵀ·g. These kernels do the
// row work between the GEMMs. Row r = bh·nq + (i − i0) of the block is
// query i of flat head bh = b·H + h. One warp per row, rows in a
// warp-stride loop (flat launch, block 256, any grid); every branch that
// precedes a shuffle is uniform over the warp.

#define ATT_ROW_LOOP(r, rows)                                                        \
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (i64)(rows); \
       r += ((i64)gridDim.x * blockDim.x) >> 5)

// att_row_s is score j of a workspace row: the GEMM's scale·q·k plus the
// mask (moff: the row's offset into it).
__device__ __forceinline__ float att_row_s(const float* row, const void* mask, int mdt, i64 moff,
                                           i64 ms3, i64 j) {
  return row[j] + (mask ? att_mask_at(mask, mdt, moff + j * ms3) : 0.f);
}

#if PART(0)
// attention_rows_fwd_f32: per row, the softmax of the scores over the
// visible keys (j < n, and j ≤ i under causal; a −Inf score is hidden):
// running max and sum per lane (expf, as attention_fwd), combined over the
// warp; lse[bh·T + i] = m + log l (−Inf when every key is hidden) when lse
// is not null; with writep ≠ 0, the row becomes p = exp(s − m)/l, 0 for
// hidden keys and for a row with every key hidden.
extern "C" __global__ void __launch_bounds__(256) attention_rows_fwd_f32(
    float* sp, const void* mask, float* lse, i64 writep, i64 rows, i64 nq, i64 n, i64 ld, i64 H,
    i64 T, i64 i0, i64 ms0, i64 ms1, i64 ms2, i64 ms3, i64 causal, i64 mdt) {
  const int lane = threadIdx.x & 31;
  const float ninf = neg_inf_f();
  ATT_ROW_LOOP(r, rows) {
    const i64 bh = r / nq, i = i0 + r % nq;
    const i64 moff = (bh / H) * ms0 + (bh % H) * ms1 + i * ms2;
    const i64 jend = causal ? imin(n, i + 1) : n;
    float* row = sp + r * ld;
    float m = ninf, l = 0.f;
    for (i64 j = lane; j < jend; j += 32) {
      const float s = att_row_s(row, mask, (int)mdt, moff, ms3, j);
      if (s == ninf) continue;
      if (s > m) {
        l *= expf(m - s);  // 0 while m is −Inf
        m = s;
      }
      l += expf(s - m);
    }
    // Both lanes of a pair compute the same two terms and add them in
    // either order, so every lane ends with the same m and l.
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(FULL_MASK, m, off);
      const float l2 = __shfl_xor_sync(FULL_MASK, l, off);
      const float mm = fmaxf(m, m2);
      const float a = m == ninf ? 0.f : l * expf(m - mm);
      const float b = m2 == ninf ? 0.f : l2 * expf(m2 - mm);
      m = mm;
      l = a + b;
    }
    // l is 0 only when every key is hidden (NaN scores make it NaN, which
    // then reaches lse and p).
    const bool empty = l == 0.f;
    if (lse != nullptr && lane == 0) lse[bh * T + i] = empty ? ninf : m + logf(l);
    if (writep) {
      const float inv = empty ? 0.f : 1.f / l;
      for (i64 j = lane; j < n; j += 32) {
        float p = 0.f;
        if (j < jend && !empty) p = expf(att_row_s(row, mask, (int)mdt, moff, ms3, j) - m) * inv;
        row[j] = p;
      }
    }
  }
}

// attention_rows_bwd_f32: per row, D = Σ_c g·o over the head dim (float32,
// lanes then the warp), and for every key j < n: p = exp(s − lse) (0 for a
// hidden key or a row whose lse is −Inf), dp (from g·vᵀ) becomes ds =
// p·(dp − D)·scale and, with keepp ≠ 0, s becomes p.
extern "C" __global__ void __launch_bounds__(256) attention_rows_bwd_f32(
    float* sp, float* dp, const float* g, const float* o, const float* lse, const void* mask,
    i64 keepp, i64 rows, i64 nq, i64 n, i64 ld, i64 H, i64 T, i64 d, i64 i0, i64 ms0, i64 ms1,
    i64 ms2, i64 ms3, float scale, i64 causal, i64 mdt) {
  const int lane = threadIdx.x & 31;
  const float ninf = neg_inf_f();
  ATT_ROW_LOOP(r, rows) {
    const i64 bh = r / nq, i = i0 + r % nq, q = bh * T + i;
    const float* gr = g + q * d;
    const float* orow = o + q * d;
    float D = 0.f;
    for (i64 c = lane; c < d; c += 32) D = fmaf(gr[c], orow[c], D);
    for (int off = 16; off > 0; off >>= 1) D += __shfl_xor_sync(FULL_MASK, D, off);
    const float li = lse[q];
    const i64 moff = (bh / H) * ms0 + (bh % H) * ms1 + i * ms2;
    const i64 jend = causal ? imin(n, i + 1) : n;
    float* srow = sp + r * ld;
    float* drow = dp + r * ld;
    for (i64 j = lane; j < n; j += 32) {
      float p = 0.f;
      if (j < jend && li != ninf) p = expf(att_row_s(srow, mask, (int)mdt, moff, ms3, j) - li);
      const float ds = p * (drow[j] - D) * scale;
      if (keepp) srow[j] = p;
      drow[j] = ds;
    }
  }
}
#endif
