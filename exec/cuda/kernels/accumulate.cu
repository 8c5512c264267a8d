// accumulate.cu: combining chunk results and filling buffers.
//
// Across chunks, parameter gradients and other batch sums add up, maxima
// combine by max, and per-sample outputs are placed along the batch axis
// (copy2d_* in movement.cu). Fill serves OpFill (gradient seeds, zeros) and
// zeroes accumulators and scatter targets. The float kernels are
// instantiated for float32, bfloat16 and float16 (FOR_FLOATS): 16-bit
// values compute in float32 and round once when stored.

#include "common.cuh"

// accumulate_{f32,bf16,f16}: dst[i] += src[i] (one float add, as the CPU;
// a 16-bit dst rounds each sum). 1-D blocks, any grid.
#define K(T, S)                                                                            \
  extern "C" __global__ void __launch_bounds__(256) accumulate_##S(T* __restrict__ dst,    \
                                                                   const T* __restrict__ src, \
                                                                   i64 n) {                \
    GRID_LOOP(i, n) dst[i] = (float)dst[i] + (float)src[i];                                \
  }
FOR_FLOATS(K)
#undef K

// accumulate_max_{f32,bf16,f16}: dst[i] = max(dst[i], src[i]) with
// math.Max's rules (NaN wins, +0 beats −0), for outputs that combine by max
// (exact in every dtype). 1-D blocks, any grid.
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) accumulate_max_##S(T* __restrict__ dst,    \
                                                                       const T* __restrict__ src, \
                                                                       i64 n) {                \
    GRID_LOOP(i, n) dst[i] = go_max((float)dst[i], (float)src[i]);                             \
  }
FOR_FLOATS(K)
#undef K

// fill_{f32,bf16,f16}: dst[i] = v (OpFill's float32(Attrs.Scalar), rounded
// once for a 16-bit dst). 1-D blocks, any grid.
template <typename T>
__device__ void fill_t(T* __restrict__ dst, i64 n, float v) {
  T t;
  t = v;
  GRID_LOOP(i, n) dst[i] = t;
}
#define K(T, S)                                                                    \
  extern "C" __global__ void __launch_bounds__(256) fill_##S(T* dst, i64 n, float v) { \
    fill_t(dst, n, v);                                                             \
  }
FOR_FLOATS(K)
#undef K

// fill_i64: dst[i] = v. 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
fill_i64(i64* __restrict__ dst, i64 n, i64 v) {
  GRID_LOOP(i, n) dst[i] = v;
}
