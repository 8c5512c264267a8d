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

// dropout_f32: y = keep ? x·scale : 0 for contiguous x, y viewed as
// [outer, rows, inner] around the batch axis (rows = the chunk's extent of
// that axis; outer = 1, rows = 1, inner = n when the value has no batch
// axis). Element (o, r, k) is keyed by global row row_off + r (row_off =
// chunk start · PerSample) and element index o·inner + k, exactly as
// exec/cpu's dropoutKernel. scale = float32(1/(1−p)) computed in double by
// the caller; p = Attrs.Scalar, seed = Attrs.Seed, step = Attrs.Counter.
// The gradient is this kernel applied to g with the same arguments.
// 1-D blocks, any grid.
template <typename I>
__device__ void dropout_loop(const float* __restrict__ x, float* __restrict__ y, i64 outer,
                             i64 rows, i64 inner, i64 row_off, u64 seed, u64 step, double p,
                             float scale) {
  const I plane = (I)(rows * inner);
  const i64 n = outer * rows * inner;
  GRID_LOOP(i, n) {
    const I o = (I)i / plane, rem = (I)i - o * plane;
    const I r = rem / (I)inner, k = rem - r * (I)inner;
    const i64 elem = (i64)o * inner + (i64)k;
    y[i] = dropout_keep(seed, step, row_off + (i64)r, elem, p) ? x[i] * scale : 0.f;
  }
}

extern "C" __global__ void __launch_bounds__(256)
dropout_f32(const float* x, float* y, i64 outer, i64 rows, i64 inner, i64 row_off, u64 seed,
            u64 step, double p, float scale) {
  if (FITS32(outer * rows * inner))
    dropout_loop<unsigned>(x, y, outer, rows, inner, row_off, seed, step, p, scale);
  else
    dropout_loop<u64>(x, y, outer, rows, inner, row_off, seed, step, p, scale);
}
