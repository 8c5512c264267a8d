// dropout.cu: dropout with graph.DropoutKeep's counter-based mask,
// reproduced bit for bit: SplitMix64 over (seed, step, global batch row,
// element), u = (h >> 11)·2⁻⁵³, keep when u ≥ p. The mask depends only on
// those keys, so a chunked run draws the whole batch's mask and the
// gradient (the same kernel applied to g) redraws it instead of saving it.
#include "common.cuh"

// splitmix64 is SplitMix64's finaliser, as graph/rng.go; u64 arithmetic
// wraps like Go's uint64.
__device__ __forceinline__ u64 splitmix64(u64 x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// dropout_keep is graph.DropoutKeep. h >> 11 < 2⁵³ converts to double
// exactly and the scaling by 2⁻⁵³ is exact, so the comparison with p
// (Attrs.Scalar as a double) decides exactly as on the CPU.
__device__ __forceinline__ bool dropout_keep(u64 seed, u64 step, i64 row, i64 elem, double p) {
  const u64 h = splitmix64(seed ^ splitmix64(step ^ splitmix64((u64)row ^ splitmix64((u64)elem))));
  const double u = (double)(h >> 11) * (1.0 / 9007199254740992.0);  // 2⁻⁵³
  return u >= p;
}

// dropout_{f32,bf16,f16}: y = keep ? x·scale : 0 for contiguous x, y
// viewed as [outer, rows, inner] around the batch axis (rows = the chunk's
// extent of that axis; outer = 1, rows = 1, inner = n when the value has no
// batch axis). Element (o, r, k) is keyed by global row row_off + r (row_off
// = chunk start · PerSample) and element index o·inner + k, exactly as
// exec/cpu's dropoutKernel, so every dtype draws the same mask. x·scale is
// one float multiply, rounded once for a 16-bit y; scale = float32(1/(1−p))
// computed in double by the caller; p = Attrs.Scalar, seed = Attrs.Seed,
// step = Attrs.Counter. The gradient is this kernel applied to g with the
// same arguments. When x and y are 16-byte aligned, a thread loads and
// stores packs of 16 bytes (common.cuh, VEC_LOOP): one thread per pack,
// 1-D blocks, any grid.
template <typename I, typename T>
__device__ void dropout_loop(const T* __restrict__ x, T* __restrict__ y, i64 outer, i64 rows,
                             i64 inner, i64 row_off, u64 seed, u64 step, double p, float scale) {
  const I plane = (I)(rows * inner);
  const i64 n = outer * rows * inner;
  // at splits position i into (o, r, k).
  auto at = [&](i64 i, I* o, I* r, I* k) {
    *o = (I)i / plane;
    const I rem = (I)i - *o * plane;
    *r = rem / (I)inner;
    *k = rem - *r * (I)inner;
  };
  auto one = [&](float v, I o, I r, I k) {
    return dropout_keep(seed, step, row_off + (i64)r, (i64)o * inner + (i64)k, p) ? v * scale : 0.f;
  };
  constexpr int N = PackOf<T>::N;
  if (aligned16(x, y)) {
    VEC_LOOP(q, n, N) {
      const Vec<T, N> u = ldv<N>(x, q);
      Vec<T, N> v;
      I o, r, k;
      at(q * N, &o, &r, &k);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        v.v[j] = one((float)u.v[j], o, r, k);
        if (++k == (I)inner) {  // the next element starts a row
          k = 0;
          if (++r == (I)rows) {
            r = 0;
            ++o;
          }
        }
      }
      stv<N>(y, q, v);
    }
    VEC_TAIL(i, n, N) {
      I o, r, k;
      at(i, &o, &r, &k);
      y[i] = one((float)x[i], o, r, k);
    }
  } else {
    GRID_LOOP(i, n) {
      I o, r, k;
      at(i, &o, &r, &k);
      y[i] = one((float)x[i], o, r, k);
    }
  }
}

#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) dropout_##S(                                \
      const T* x, T* y, i64 outer, i64 rows, i64 inner, i64 row_off, u64 seed, u64 step, double p, \
      float scale) {                                                                            \
    if (FITS32(outer * rows * inner))                                                           \
      dropout_loop<unsigned>(x, y, outer, rows, inner, row_off, seed, step, p, scale);          \
    else                                                                                        \
      dropout_loop<u64>(x, y, outer, rows, inner, row_off, seed, step, p, scale);               \
  }
FOR_FLOATS(K)
#undef K
