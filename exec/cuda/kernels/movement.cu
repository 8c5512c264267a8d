// movement.cu: copies that move elements without arithmetic — reshape,
// permute, expand, slice (+ its gradient), concat, and the chunk copies of
// the executor — for float32 and int64 buffers alike (suffix _f32 / _i64).
//
// Every kernel writes its destination contiguously, so writes coalesce;
// transpose_* also reads in tiles so both sides coalesce.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void copy_body(const T* __restrict__ src, T* __restrict__ dst, i64 n) {
  GRID_LOOP(i, n) dst[i] = src[i];
}

// copy_*: dst[i] = src[i] for i < n (reshape). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
copy_f32(const float* src, float* dst, i64 n) { copy_body(src, dst, n); }
extern "C" __global__ void __launch_bounds__(256)
copy_i64(const i64* src, i64* dst, i64 n) { copy_body(src, dst, n); }

template <typename T, typename I>
__device__ __forceinline__ void gather_loop(const T* __restrict__ src, T* __restrict__ dst, i64 n,
                                            i64 base, const Strided& g) {
  GRID_LOOP(i, n) dst[i] = src[base + offset_of<I>((I)i, g.rank, g.shape, g.stride)];
}

template <typename T>
__device__ __forceinline__ void gather_body(const T* src, T* dst, i64 n, i64 base,
                                            const Strided& g) {
  if (FITS32(n)) gather_loop<T, unsigned>(src, dst, n, base, g);
  else gather_loop<T, u64>(src, dst, n, base, g);
}

// gather_*: dst (contiguous over g.shape, n elements) takes the element of
// src at base + Σ idx_d·g.stride_d. Permute: stride_d = src's stride of axis
// perm[d]. Expand (broadcast): src's strides, 0 on broadcast axes. A strided
// slice or any view with a base offset works the same way. 1-D blocks, any
// grid. The Go side should drop size-1 axes and merge axes that stay
// adjacent, so rank and the divisions per element stay small.
extern "C" __global__ void __launch_bounds__(256)
gather_f32(const float* src, float* dst, i64 n, i64 base, Strided g) {
  gather_body(src, dst, n, base, g);
}
extern "C" __global__ void __launch_bounds__(256)
gather_i64(const i64* src, i64* dst, i64 n, i64 base, Strided g) {
  gather_body(src, dst, n, base, g);
}

#define TILE 32

template <typename T>
__device__ __forceinline__ void transpose_body(const T* __restrict__ src, T* __restrict__ dst,
                                               i64 batch, i64 r, i64 c) {
  __shared__ T tile[TILE][TILE + 1];  // +1: column reads hit distinct banks
  const i64 tilesR = (r + TILE - 1) / TILE, tilesC = (c + TILE - 1) / TILE;
  for (i64 bz = blockIdx.z; bz < batch; bz += gridDim.z) {
    const T* s = src + bz * r * c;
    T* d = dst + bz * r * c;
    for (i64 ty = blockIdx.y; ty < tilesR; ty += gridDim.y) {
      for (i64 tx = blockIdx.x; tx < tilesC; tx += gridDim.x) {
        const i64 r0 = ty * TILE, c0 = tx * TILE;
        for (unsigned k = threadIdx.y; k < TILE; k += blockDim.y) {
          const i64 i = r0 + k, j = c0 + threadIdx.x;
          if (i < r && j < c) tile[k][threadIdx.x] = s[i * c + j];
        }
        __syncthreads();
        for (unsigned k = threadIdx.y; k < TILE; k += blockDim.y) {
          const i64 j = c0 + k, i = r0 + threadIdx.x;  // dst row j, column i
          if (i < r && j < c) d[j * r + i] = tile[threadIdx.x][k];
        }
        __syncthreads();
      }
    }
  }
}

// transpose_*: dst[b, j, i] = src[b, i, j] for contiguous src [batch, r, c]
// and dst [batch, c, r]: the permutes that move the innermost axis (after
// merging axes, a swap of the last two). blockDim = (32, by), by dividing
// 32 (8 is a good choice); grid = (ceil(c/32), ceil(r/32), batch), each
// dimension capped at its limit (65535 for y and z): the kernel loops.
extern "C" __global__ void __launch_bounds__(1024)
transpose_f32(const float* src, float* dst, i64 batch, i64 r, i64 c) {
  transpose_body(src, dst, batch, r, c);
}
extern "C" __global__ void __launch_bounds__(1024)
transpose_i64(const i64* src, i64* dst, i64 batch, i64 r, i64 c) {
  transpose_body(src, dst, batch, r, c);
}

template <typename T>
__device__ __forceinline__ void slice_body(const T* __restrict__ src, T* __restrict__ dst,
                                           i64 outer, i64 n, i64 inner, i64 m, i64 start,
                                           i64 step) {
  const i64 total = outer * m * inner;
  GRID_LOOP(i, total) {
    const i64 row = i / inner, k = i - row * inner;  // row = o·m + j
    const i64 o = row / m, j = row - o * m;
    dst[i] = src[(o * n + start + j * step) * inner + k];
  }
}

// slice_*: dst [outer, m, inner] = src [outer, n, inner] at indices start,
// start+step, … of the middle axis (m = ceil((end − start)/step), Attrs
// already normalised: step ≥ 1). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
slice_f32(const float* src, float* dst, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_body(src, dst, outer, n, inner, m, start, step);
}
extern "C" __global__ void __launch_bounds__(256)
slice_i64(const i64* src, i64* dst, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_body(src, dst, outer, n, inner, m, start, step);
}

// slice_grad_f32: out [outer, n, inner] = g [outer, m, inner] scattered back
// to the sliced positions, zeros elsewhere; every element of out is written
// (no fill needed). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
slice_grad_f32(const float* __restrict__ g, float* __restrict__ out, i64 outer, i64 n, i64 inner,
               i64 m, i64 start, i64 step) {
  const i64 total = outer * n * inner;
  GRID_LOOP(i, total) {
    const i64 row = i / inner, k = i - row * inner;  // row = o·n + a
    const i64 o = row / n, a = row - o * n;
    const i64 rel = a - start;
    float v = 0.f;
    if (rel >= 0 && rel % step == 0 && rel / step < m) v = g[(o * m + rel / step) * inner + k];
    out[i] = v;
  }
}

template <typename T>
__device__ __forceinline__ void copy2d_body(const T* __restrict__ src, i64 src_row, i64 src_off,
                                            T* __restrict__ dst, i64 dst_row, i64 dst_off,
                                            i64 rows, i64 len) {
  const i64 total = rows * len;
  GRID_LOOP(i, total) {
    const i64 r = i / len, j = i - r * len;
    dst[r * dst_row + dst_off + j] = src[r * src_row + src_off + j];
  }
}

// copy2d_*: dst[r·dst_row + dst_off + j] = src[r·src_row + src_off + j] for
// r < rows, j < len: a block of rows copied between two row-major views.
// Concat: for input k, rows = outer (product of dims before the axis),
// len = src_row = size_k·inner, dst_row = total·inner, dst_off = the
// preceding inputs' sizes·inner, src_off = 0. Placing a chunk into the whole
// batch along an axis (or taking it out) is the same with the chunk's and
// the whole's row lengths. 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
copy2d_f32(const float* src, i64 src_row, i64 src_off, float* dst, i64 dst_row, i64 dst_off,
           i64 rows, i64 len) {
  copy2d_body(src, src_row, src_off, dst, dst_row, dst_off, rows, len);
}
extern "C" __global__ void __launch_bounds__(256)
copy2d_i64(const i64* src, i64 src_row, i64 src_off, i64* dst, i64 dst_row, i64 dst_off, i64 rows,
           i64 len) {
  copy2d_body(src, src_row, src_off, dst, dst_row, dst_off, rows, len);
}
