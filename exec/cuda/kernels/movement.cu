// movement.cu: copies that move elements without arithmetic — reshape,
// permute, expand, slice (+ its gradient), concat, and the chunk copies of
// the executor. They move bits, so they go by element size: _f32 for
// float32 (float), _b16 for bfloat16 and float16 alike (unsigned short),
// _i64 for int64 (slice_grad: _f32 and _b16).
//
// Every kernel writes its destination contiguously, so writes coalesce;
// transpose_* also reads in tiles so both sides coalesce.
#include "common.cuh"

// copy_body copies 16 bytes a thread and step when both sides are aligned.
template <typename T>
__device__ __forceinline__ void copy_body(const T* __restrict__ src, T* __restrict__ dst, i64 n) {
  if (aligned16(src, dst)) {
    const i64 units = n * (i64)sizeof(T) / 16, done = units * 16 / (i64)sizeof(T);
    GRID_LOOP(q, units) reinterpret_cast<uint4*>(dst)[q] = reinterpret_cast<const uint4*>(src)[q];
    for (i64 i = done + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
      dst[i] = src[i];
  } else {
    GRID_LOOP(i, n) dst[i] = src[i];
  }
}

typedef unsigned short b16;  // a bfloat16 or float16 element, as bits

// copy_*: dst[i] = src[i] for i < n (reshape). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
copy_f32(const float* src, float* dst, i64 n) { copy_body(src, dst, n); }
extern "C" __global__ void __launch_bounds__(256)
copy_b16(const b16* src, b16* dst, i64 n) { copy_body(src, dst, n); }
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
gather_b16(const b16* src, b16* dst, i64 n, i64 base, Strided g) {
  gather_body(src, dst, n, base, g);
}
extern "C" __global__ void __launch_bounds__(256)
gather_i64(const i64* src, i64* dst, i64 n, i64 base, Strided g) {
  gather_body(src, dst, n, base, g);
}

template <typename I>
__device__ __forceinline__ void gather_rows_loop(const uint4* __restrict__ src,
                                                 uint4* __restrict__ dst, i64 rows, i64 units,
                                                 const Strided& g, i64 per) {
  GRID_LOOP(q, rows * units) {
    const I r = (I)q / (I)units;
    const I j = (I)q - r * (I)units;
    dst[q] = src[offset_of<I>(r, g.rank, g.shape, g.stride) / per + (i64)j];
  }
}

// gather_rows_body moves rows of len elements of T in 16-byte units of per
// = 16/sizeof(T) elements.
template <typename T>
__device__ __forceinline__ void gather_rows_body(const T* src, T* dst, i64 rows, i64 len,
                                                 const Strided& g) {
  const i64 per = 16 / (i64)sizeof(T);
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  if (FITS32(rows * len)) gather_rows_loop<unsigned>(s, d, rows, len / per, g, per);
  else gather_rows_loop<u64>(s, d, rows, len / per, g, per);
}

// gather_rows_*: gather_* for a gather whose innermost axis is contiguous
// on both sides (a permute that keeps the last axis, an expand of a
// trailing vector): dst [rows, len] takes row r from src at Σ idx_d ·
// g.stride_d over g.shape (the outer axes), 16 bytes at a time. len and
// every stride are multiples of 16 bytes' worth of elements (4 float32, 8
// 16-bit, 2 int64), and src and dst 16-byte aligned (the caller checks).
// One thread per 16 bytes, any grid.
extern "C" __global__ void __launch_bounds__(256)
gather_rows_f32(const float* src, float* dst, i64 rows, i64 len, Strided g) {
  gather_rows_body(src, dst, rows, len, g);
}
extern "C" __global__ void __launch_bounds__(256)
gather_rows_b16(const b16* src, b16* dst, i64 rows, i64 len, Strided g) {
  gather_rows_body(src, dst, rows, len, g);
}
extern "C" __global__ void __launch_bounds__(256)
gather_rows_i64(const i64* src, i64* dst, i64 rows, i64 len, Strided g) {
  gather_rows_body(src, dst, rows, len, g);
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

#define TILE2 64

// transpose_b16: transpose_* for 16-bit elements, in 64×64 tiles whose
// threads move pairs of neighbours: one 32-bit access each when r and c are
// even and both pointers 4-byte aligned, two 16-bit ones otherwise, so a
// warp reads and writes 128-byte rows either way. blockDim = (32, by), by
// dividing 64 (8 is a good choice); grid = (ceil(c/64), ceil(r/64), batch),
// each dimension capped at its limit: the kernel loops.
extern "C" __global__ void __launch_bounds__(1024)
transpose_b16(const b16* __restrict__ src, b16* __restrict__ dst, i64 batch, i64 r, i64 c) {
  __shared__ b16 tile[TILE2][TILE2 + 1];  // odd pitch: column reads hit distinct banks
  const bool paired = ((r | c) & 1) == 0 && (((u64)src | (u64)dst) & 3) == 0;
  const i64 tilesR = (r + TILE2 - 1) / TILE2, tilesC = (c + TILE2 - 1) / TILE2;
  const unsigned x2 = 2 * threadIdx.x;
  for (i64 bz = blockIdx.z; bz < batch; bz += gridDim.z) {
    const b16* s = src + bz * r * c;
    b16* d = dst + bz * r * c;
    for (i64 ty = blockIdx.y; ty < tilesR; ty += gridDim.y) {
      for (i64 tx = blockIdx.x; tx < tilesC; tx += gridDim.x) {
        const i64 r0 = ty * TILE2, c0 = tx * TILE2;
        const i64 j = c0 + x2;  // src columns j, j + 1
        for (unsigned k = threadIdx.y; k < TILE2; k += blockDim.y) {
          const i64 i = r0 + k;
          if (i >= r) break;
          b16 a = 0, b = 0;
          if (paired) {
            if (j < c) {
              const unsigned w = *reinterpret_cast<const unsigned*>(s + i * c + j);
              a = (b16)(w & 0xffffu);
              b = (b16)(w >> 16);
            }
          } else {
            if (j < c) a = s[i * c + j];
            if (j + 1 < c) b = s[i * c + j + 1];
          }
          tile[k][x2] = a;
          tile[k][x2 + 1] = b;
        }
        __syncthreads();
        const i64 i = r0 + x2;  // dst columns i, i + 1 (src rows)
        for (unsigned k = threadIdx.y; k < TILE2; k += blockDim.y) {
          const i64 jj = c0 + k;  // dst row (src column)
          if (jj >= c) break;
          const b16 a = tile[x2][k], b = tile[x2 + 1][k];
          if (paired) {
            if (i < r) *reinterpret_cast<unsigned*>(d + jj * r + i) = (unsigned)a | ((unsigned)b << 16);
          } else {
            if (i < r) d[jj * r + i] = a;
            if (i + 1 < r) d[jj * r + i + 1] = b;
          }
        }
        __syncthreads();
      }
    }
  }
}

template <typename T, typename I>
__device__ __forceinline__ void slice_loop(const T* __restrict__ src, T* __restrict__ dst,
                                           i64 outer, i64 n, i64 inner, i64 m, i64 start,
                                           i64 step) {
  const i64 total = outer * m * inner;
  GRID_LOOP(i, total) {
    const I row = (I)i / (I)inner, k = (I)i - row * (I)inner;  // row = o·m + j
    const I o = row / (I)m, j = row - o * (I)m;
    dst[i] = src[((i64)o * n + start + (i64)j * step) * inner + (i64)k];
  }
}

template <typename T>
__device__ __forceinline__ void slice_body(const T* src, T* dst, i64 outer, i64 n, i64 inner,
                                           i64 m, i64 start, i64 step) {
  if (FITS32(outer * n * inner)) slice_loop<T, unsigned>(src, dst, outer, n, inner, m, start, step);
  else slice_loop<T, u64>(src, dst, outer, n, inner, m, start, step);
}

// slice_*: dst [outer, m, inner] = src [outer, n, inner] at indices start,
// start+step, … of the middle axis (m = ceil((end − start)/step), Attrs
// already normalised: step ≥ 1). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
slice_f32(const float* src, float* dst, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_body(src, dst, outer, n, inner, m, start, step);
}
extern "C" __global__ void __launch_bounds__(256)
slice_b16(const b16* src, b16* dst, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_body(src, dst, outer, n, inner, m, start, step);
}
extern "C" __global__ void __launch_bounds__(256)
slice_i64(const i64* src, i64* dst, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_body(src, dst, outer, n, inner, m, start, step);
}

template <typename T, typename I>
__device__ __forceinline__ void slice_grad_loop(const T* __restrict__ g, T* __restrict__ out,
                                                i64 outer, i64 n, i64 inner, i64 m, i64 start,
                                                i64 step) {
  GRID_LOOP(i, outer * n * inner) {
    const I row = (I)i / (I)inner, k = (I)i - row * (I)inner;  // row = o·n + a
    const I o = row / (I)n, a = row - o * (I)n;
    const i64 rel = (i64)a - start;
    T v = 0;  // +0 in every float format
    if (rel >= 0 && rel % step == 0 && rel / step < m) v = g[((i64)o * m + rel / step) * inner + (i64)k];
    out[i] = v;
  }
}

template <typename T>
__device__ __forceinline__ void slice_grad_body(const T* g, T* out, i64 outer, i64 n, i64 inner,
                                                i64 m, i64 start, i64 step) {
  if (FITS32(outer * n * inner)) slice_grad_loop<T, unsigned>(g, out, outer, n, inner, m, start, step);
  else slice_grad_loop<T, u64>(g, out, outer, n, inner, m, start, step);
}

// slice_grad_{f32,b16}: out [outer, n, inner] = g [outer, m, inner]
// scattered back to the sliced positions, zeros elsewhere; every element of
// out is written (no fill needed). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
slice_grad_f32(const float* g, float* out, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_grad_body(g, out, outer, n, inner, m, start, step);
}
extern "C" __global__ void __launch_bounds__(256)
slice_grad_b16(const b16* g, b16* out, i64 outer, i64 n, i64 inner, i64 m, i64 start, i64 step) {
  slice_grad_body(g, out, outer, n, inner, m, start, step);
}

template <typename T, typename I>
__device__ __forceinline__ void copy2d_loop(const T* __restrict__ src, i64 src_row, i64 src_off,
                                            T* __restrict__ dst, i64 dst_row, i64 dst_off,
                                            i64 rows, i64 len) {
  GRID_LOOP(i, rows * len) {
    const I r = (I)i / (I)len, j = (I)i - r * (I)len;
    dst[(i64)r * dst_row + dst_off + (i64)j] = src[(i64)r * src_row + src_off + (i64)j];
  }
}

// copy2d_body moves 16-byte units when the rows, offsets and pointers allow
// it (every row of a concat input or a step-1 slice with sizes multiples of
// 16 bytes), elements otherwise.
template <typename T>
__device__ __forceinline__ void copy2d_body(const T* src, i64 src_row, i64 src_off, T* dst,
                                            i64 dst_row, i64 dst_off, i64 rows, i64 len) {
  const i64 u = 16 / (i64)sizeof(T);  // elements per unit
  if (aligned16(src, dst) && len % u == 0 && src_row % u == 0 && dst_row % u == 0 &&
      src_off % u == 0 && dst_off % u == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    if (FITS32(rows * len))
      copy2d_loop<uint4, unsigned>(s4, src_row / u, src_off / u, d4, dst_row / u, dst_off / u, rows, len / u);
    else
      copy2d_loop<uint4, u64>(s4, src_row / u, src_off / u, d4, dst_row / u, dst_off / u, rows, len / u);
  } else if (FITS32(rows * len)) {
    copy2d_loop<T, unsigned>(src, src_row, src_off, dst, dst_row, dst_off, rows, len);
  } else {
    copy2d_loop<T, u64>(src, src_row, src_off, dst, dst_row, dst_off, rows, len);
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
copy2d_b16(const b16* src, i64 src_row, i64 src_off, b16* dst, i64 dst_row, i64 dst_off,
           i64 rows, i64 len) {
  copy2d_body(src, src_row, src_off, dst, dst_row, dst_off, rows, len);
}
extern "C" __global__ void __launch_bounds__(256)
copy2d_i64(const i64* src, i64 src_row, i64 src_off, i64* dst, i64 dst_row, i64 dst_off, i64 rows,
           i64 len) {
  copy2d_body(src, src_row, src_off, dst, dst_row, dst_off, rows, len);
}
