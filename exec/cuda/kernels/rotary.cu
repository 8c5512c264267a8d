// rotary.cu: rotary position embedding (graph.OpRotary) and its gradient.
// x is [B, T, N, d]: N heads of d at each of T positions; cs is the
// float32 table [T, d], cos θ_t,i in column i and sin θ_t,i in column
// d/2 + i (i < d/2). Heads n < end of position t rotate each pair (i,
// i + d/2) by sign·θ_t,i (Hugging Face's rotate_half):
//   y_i = x_i·c − x_{i+h}·s,   y_{i+h} = x_{i+h}·c + x_i·s   (h = d/2, s = sign·sin),
// in float32, each output rounded once; heads from end on are copied.
#include "common.cuh"

// ROT_HEADS is how many heads a thread of the vector path rotates with
// the one table pack it reads.
#define ROT_HEADS 4

template <typename T>
__device__ __forceinline__ void rot_pack(const T* __restrict__ x, T* __restrict__ y, i64 lo, i64 hi,
                                         const float* c, const float* s) {
  constexpr int N = 16 / sizeof(T);  // values a 16-byte pack holds
  static_assert(8 % N == 0, "packs of 4 or 8");
#pragma unroll
  for (int q = 0; q < 8 / N; ++q) {
    const Vec<T, N> a = *reinterpret_cast<const Vec<T, N>*>(x + lo + q * N);
    const Vec<T, N> b = *reinterpret_cast<const Vec<T, N>*>(x + hi + q * N);
    Vec<T, N> ra, rb;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float u = (float)a.v[j], v = (float)b.v[j];
      ra.v[j] = u * c[q * N + j] - v * s[q * N + j];
      rb.v[j] = v * c[q * N + j] + u * s[q * N + j];
    }
    *reinterpret_cast<Vec<T, N>*>(y + lo + q * N) = ra;
    *reinterpret_cast<Vec<T, N>*>(y + hi + q * N) = rb;
  }
}

template <typename T>
__device__ __forceinline__ void copy_pack(const T* __restrict__ x, T* __restrict__ y, i64 lo, i64 hi) {
  constexpr int N = 16 / sizeof(T);
#pragma unroll
  for (int q = 0; q < 8 / N; ++q) {
    *reinterpret_cast<Vec<T, N>*>(y + lo + q * N) = *reinterpret_cast<const Vec<T, N>*>(x + lo + q * N);
    *reinterpret_cast<Vec<T, N>*>(y + hi + q * N) = *reinterpret_cast<const Vec<T, N>*>(x + hi + q * N);
  }
}

// rotary_vec: thread u takes pack p = u mod P (P = h/8) of ROT_HEADS
// consecutive heads of one position: the table's 8 cos and 8 sin values
// of the pack are read once (they stay in cache for every sample), then
// for each head the 8 values at i and the 8 at i + h, 16 bytes at a time.
// Consecutive threads take consecutive packs, so a warp reads whole rows.
template <typename T>
__device__ __forceinline__ void rotary_vec(const T* __restrict__ x, const float* __restrict__ cs,
                                           T* __restrict__ y, i64 bt, i64 t, i64 n, i64 d, i64 end,
                                           float sign) {
  const i64 h = d >> 1, P = h >> 3, groups = (n + ROT_HEADS - 1) / ROT_HEADS;
  GRID_LOOP(u, bt * groups * P) {
    const i64 p = u % P, rest = u / P;
    const i64 hg = rest % groups, row = rest / groups;  // row: b·T + t
    const float* tab = cs + (row % t) * d + 8 * p;
    float c[8], s[8];
    {
      const float4 c0 = reinterpret_cast<const float4*>(tab)[0], c1 = reinterpret_cast<const float4*>(tab)[1];
      const float4 s0 = reinterpret_cast<const float4*>(tab + h)[0], s1 = reinterpret_cast<const float4*>(tab + h)[1];
      c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w; c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
      s[0] = s0.x; s[1] = s0.y; s[2] = s0.z; s[3] = s0.w; s[4] = s1.x; s[5] = s1.y; s[6] = s1.z; s[7] = s1.w;
#pragma unroll
      for (int j = 0; j < 8; ++j) s[j] *= sign;
    }
    const i64 n0 = hg * ROT_HEADS;
#pragma unroll
    for (int k = 0; k < ROT_HEADS; ++k) {
      const i64 hd = n0 + k;
      if (hd >= n) break;
      const i64 lo = (row * n + hd) * d + 8 * p;
      if (hd < end) rot_pack(x, y, lo, lo + h, c, s);
      else copy_pack(x, y, lo, lo + h);
    }
  }
}

// rotary_any is rotary_vec for any even d and alignment: one thread a pair.
template <typename T>
__device__ __forceinline__ void rotary_any(const T* __restrict__ x, const float* __restrict__ cs,
                                           T* __restrict__ y, i64 bt, i64 t, i64 n, i64 d, i64 end,
                                           float sign) {
  const i64 h = d >> 1;
  GRID_LOOP(u, bt * n * h) {
    const i64 i = u % h, r = u / h;  // r: (b·T + t)·N + head
    const i64 lo = r * d + i;
    const float a = (float)x[lo], b = (float)x[lo + h];
    if (r % n >= end) {
      y[lo] = a;
      y[lo + h] = b;
      continue;
    }
    const float* tab = cs + (r / n % t) * d;
    const float c = tab[i], s = sign * tab[h + i];
    y[lo] = a * c - b * s;
    y[lo + h] = b * c + a * s;
  }
}

// rotary_{f32,bf16,f16}: y = rotary(x) of contiguous x and y [bt·n, d]
// (bt = B·T rows of n heads, position t = row mod T), cs [T, d] float32,
// heads below end rotated by sign·θ (sign 1: rotary, −1: rotary_grad).
// vec selects the vector path (d % 16 == 0, x, y and cs 16-byte aligned):
// launch one thread per (position, head group of ROT_HEADS, pack of 8
// pairs); the scalar path one per pair. Any grid.
#define K(T, S)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) rotary_##S(                                  \
      const T* x, const float* cs, T* y, i64 bt, i64 t, i64 n, i64 d, i64 end, float sign,       \
      i64 vec) {                                                                                 \
    if (vec) rotary_vec(x, cs, y, bt, t, n, d, end, sign);                                       \
    else rotary_any(x, cs, y, bt, t, n, d, end, sign);                                           \
  }
FOR_FLOATS(K)
#undef K
