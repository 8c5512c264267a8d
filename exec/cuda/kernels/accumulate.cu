// accumulate.cu: combining chunk results and filling buffers.
//
// Across chunks, parameter gradients and other batch sums add up, maxima
// combine by max, and per-sample outputs are placed along the batch axis
// (copy2d_* in movement.cu). Fill serves OpFill (gradient seeds, zeros) and
// zeroes accumulators and scatter targets.
#include "common.cuh"

// accumulate_f32: dst[i] += src[i] (float adds, as the CPU). 1-D blocks,
// any grid.
extern "C" __global__ void __launch_bounds__(256)
accumulate_f32(float* __restrict__ dst, const float* __restrict__ src, i64 n) {
  GRID_LOOP(i, n) dst[i] += src[i];
}

// accumulate_max_f32: dst[i] = max(dst[i], src[i]) with math.Max's rules
// (NaN wins, +0 beats −0), for outputs that combine by max. 1-D blocks, any
// grid.
extern "C" __global__ void __launch_bounds__(256)
accumulate_max_f32(float* __restrict__ dst, const float* __restrict__ src, i64 n) {
  GRID_LOOP(i, n) dst[i] = go_max(dst[i], src[i]);
}

// fill_f32: dst[i] = v (OpFill's float32(Attrs.Scalar)). 1-D blocks, any
// grid.
extern "C" __global__ void __launch_bounds__(256)
fill_f32(float* __restrict__ dst, i64 n, float v) {
  GRID_LOOP(i, n) dst[i] = v;
}

// fill_i64: dst[i] = v. 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
fill_i64(i64* __restrict__ dst, i64 n, i64 v) {
  GRID_LOOP(i, n) dst[i] = v;
}
