// rotary.cu: rotary position embedding (graph.OpRotary) and its gradient.
// x is [B, T, N, d]: N heads of d at each of T positions; cs is the
// float32 table [T, d], cos θ_t,i in column i and sin θ_t,i in column
// d/2 + i (i < d/2). Heads n < end of position t rotate each pair (i,
// i + d/2) by sign·θ_t,i (Hugging Face's rotate_half):
//   y_i = x_i·c − x_{i+h}·s,   y_{i+h} = x_{i+h}·c + x_i·s   (h = d/2, s = sign·sin),
// in float32, each output rounded once; heads from end on are copied.
// A table of row width w = 2d is the full form: cos of every element in
// columns 0 to d − 1, sin in d to 2d − 1, and the pair's map
//   y_i = x_i·c_i − x_{i+h}·s_i,   y_{i+h} = x_{i+h}·c_{i+h} + x_i·s_{i+h},
// whose transpose rotary_grad applies (sign −1).
#include "common.cuh"

// ROT_HEADS is how many heads a thread of the vector path rotates with
// the one table pack it reads.
#define ROT_HEADS 4

template <typename T>
__device__ __forceinline__ void rot_pack(const T* __restrict__ x, T* __restrict__ y, i64 lo, i64 hi,
                                         const float* c, const float* ch, const float* s,
                                         const float* sh) {
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
      rb.v[j] = v * ch[q * N + j] + u * sh[q * N + j];
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

// table_lanes reads the four table values of 8 pairs from tab, the
// pack's first column in its row (w = d: c_hi = c_lo, s_hi = s_lo; w = 2d: all four differ) and,
// for sign −1, turns them into the transposed map's: s_lo ← −s_hi,
// s_hi ← −s_lo.
__device__ __forceinline__ void table_lanes(const float* __restrict__ tab, i64 d, i64 w, float sign, float* c,
                                            float* ch, float* s, float* sh) {
  const i64 h = d >> 1;
  const float* src[4] = {tab, tab + (w == d ? 0 : h), tab + (w == d ? h : d), tab + (w == d ? h : d + h)};
  float* dst[4] = {c, ch, s, sh};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float4 a = reinterpret_cast<const float4*>(src[k])[0], b = reinterpret_cast<const float4*>(src[k])[1];
    dst[k][0] = a.x; dst[k][1] = a.y; dst[k][2] = a.z; dst[k][3] = a.w;
    dst[k][4] = b.x; dst[k][5] = b.y; dst[k][6] = b.z; dst[k][7] = b.w;
  }
  if (sign < 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float lo = s[j];
      s[j] = -sh[j];
      sh[j] = -lo;
    }
  }
}

// rotary_vec: thread u takes pack p = u mod P (P = h/8) of ROT_HEADS
// consecutive heads of one position: the table's values of the pack are
// read once (they stay in cache for every sample), then for each head the
// 8 values at i and the 8 at i + h, 16 bytes at a time. Consecutive
// threads take consecutive packs, so a warp reads whole rows.
template <typename T>
__device__ __forceinline__ void rotary_vec(const T* __restrict__ x, const float* __restrict__ cs,
                                           T* __restrict__ y, i64 bt, i64 t, i64 n, i64 d, i64 w, i64 end,
                                           float sign) {
  const i64 h = d >> 1, P = h >> 3, groups = (n + ROT_HEADS - 1) / ROT_HEADS;
  GRID_LOOP(u, bt * groups * P) {
    const i64 p = u % P, rest = u / P;
    const i64 hg = rest % groups, row = rest / groups;  // row: b·T + t
    float c[8], ch[8], s[8], sh[8];
    table_lanes(cs + (row % t) * w + 8 * p, d, w, sign, c, ch, s, sh);
    const i64 n0 = hg * ROT_HEADS;
#pragma unroll
    for (int k = 0; k < ROT_HEADS; ++k) {
      const i64 hd = n0 + k;
      if (hd >= n) break;
      const i64 lo = (row * n + hd) * d + 8 * p;
      if (hd < end) rot_pack(x, y, lo, lo + h, c, ch, s, sh);
      else copy_pack(x, y, lo, lo + h);
    }
  }
}

// rotary_any is rotary_vec for any even d and alignment: one thread a pair.
template <typename T>
__device__ __forceinline__ void rotary_any(const T* __restrict__ x, const float* __restrict__ cs,
                                           T* __restrict__ y, i64 bt, i64 t, i64 n, i64 d, i64 w, i64 end,
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
    const float* tab = cs + (r / n % t) * w;
    const float c = tab[i];
    float ch = c, s = tab[h + i], sh = s;
    if (w != d) {
      ch = tab[h + i];
      s = tab[d + i];
      sh = tab[d + h + i];
    }
    if (sign < 0) {
      const float lo_s = s;
      s = -sh;
      sh = -lo_s;
    }
    y[lo] = a * c - b * s;
    y[lo + h] = b * ch + a * sh;
  }
}

// rotary_{f32,bf16,f16}: y = rotary(x) of contiguous x and y [bt·n, d]
// (bt = B·T rows of n heads, position t = row mod T), cs [T, w] float32
// (w = d, or 2d: the full form), heads below end rotated by sign·θ
// (sign 1: rotary, −1: rotary_grad, the transpose). vec selects the vector
// path (d % 16 == 0, x, y and cs 16-byte aligned): launch one thread per
// (position, head group of ROT_HEADS, pack of 8 pairs); the scalar path
// one per pair. Any grid.
#define K(T, S)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) rotary_##S(                                  \
      const T* x, const float* cs, T* y, i64 bt, i64 t, i64 n, i64 d, i64 w, i64 end, float sign, \
      i64 vec) {                                                                                 \
    if (vec) rotary_vec(x, cs, y, bt, t, n, d, w, end, sign);                                    \
    else rotary_any(x, cs, y, bt, t, n, d, w, end, sign);                                        \
  }
FOR_FLOATS(K)
#undef K
