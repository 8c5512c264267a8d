// reduce.cu: sum, mean and max over axes, and max's gradient. Every kernel
// is templated on its storage type and instantiated for float32, bfloat16
// and float16 (FOR_FLOATS, common.cuh): 16-bit values are read widened and
// each output rounds once when stored.
//
// Three layouts, chosen by the Go side after it drops size-1 axes and merges
// neighbouring axes that are both kept or both reduced:
//   reduce_rows_*     [rows, n], reducing the last axis (contiguous rows)
//   reduce_mid_*      [outer, n, inner], reducing the middle axis
//   reduce_strided_*  anything else, through a ReduceGeom
// Sums accumulate in double (cheap next to the memory traffic on any GPU,
// and close to the CPU's float64 accumulation) and convert to float, as the
// CPU's float32(sum·scale), before a 16-bit store rounds that float; max
// works in float, which is exact. The summation order is fixed by the launch
// configuration, so a given configuration gives reproducible results.
//
// Splitting: when there are few outputs and long reductions, a grid
// dimension (y for rows and strided, z for mid) splits each reduction into
// `splits` contiguous ranges, and a non-null `part` receives [splits,
// outputs] float partials instead of out; reduce_splits_* then combines
// them into out. Pass scale = 1 to the first pass of a mean and the real
// scale to reduce_splits_*. With part null, grid.y (rows, strided) or
// grid.z (mid) must be 1.
#include "common.cuh"

// R_SUM and R_MAX come from opcodes.cuh (generated).

// split_range gives the part [lo, hi) of [0, n) that split s of `splits`
// covers.
__device__ __forceinline__ void split_range(i64 n, i64 s, i64 splits, i64* lo, i64* hi) {
  const i64 per = (n + splits - 1) / splits;
  *lo = imin(n, s * per);
  *hi = imin(n, *lo + per);
}

// reduce_put stores output i's value v: a float partial in part when part
// is not null, else out[i] (rounded when TY is 16-bit).
template <typename TY>
__device__ __forceinline__ void reduce_put(TY* out, float* part, i64 i, float v) {
  if (part) part[i] = v;
  else out[i] = v;
}

template <typename T>
__device__ __forceinline__ void reduce_rows_t(const T* __restrict__ x, T* __restrict__ out,
                                              float* __restrict__ part, i64 rows, i64 n, i64 op,
                                              double scale) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  i64 lo, hi;
  split_range(n, blockIdx.y, gridDim.y, &lo, &hi);
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const T* p = x + row * n;
    if (op == R_MAX) {
      float m = neg_inf_f();
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x) m = go_max(m, (float)p[k]);
      m = row_allreduce(m, MaxOp(), sf);
      if (live && threadIdx.x == 0) reduce_put(out, part, blockIdx.y * rows + row, m);
    } else {
      double s = 0;
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x) s += (double)(float)p[k];
      s = row_allreduce(s, SumOp(), sd);
      if (live && threadIdx.x == 0) reduce_put(out, part, blockIdx.y * rows + row, (float)(s * scale));
    }
  }
}

// reduce_rows_{f32,bf16,f16}: output s·rows + r = op over x[r·n + k] for k
// in split s's range (all of [0, n) when gridDim.y = 1), into part (float)
// or out (see the top); sums are multiplied by scale (Attrs.Scalar for
// mean, else 1). n = 0 gives the sum's 0 and the max's −inf. Row layout:
// blockDim = (bx, by), bx a multiple of 32, bx·by ≤ 1024; each threadIdx.y
// group reduces one row.
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(1024) reduce_rows_##S(                    \
      const T* x, T* out, float* part, i64 rows, i64 n, i64 op, double scale) {          \
    reduce_rows_t(x, out, part, rows, n, op, scale);                                     \
  }
FOR_FLOATS(K)
#undef K

template <typename TX, typename TY>
__device__ __forceinline__ void reduce_mid_t(const TX* __restrict__ x, TY* __restrict__ out,
                                             float* __restrict__ part, i64 outer, i64 n,
                                             i64 inner, i64 op, double scale) {
  __shared__ double sd[1024];
  __shared__ float sf[1024];
  i64 lo, hi;
  split_range(n, blockIdx.z, gridDim.z, &lo, &hi);
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  for (i64 j0 = (i64)blockIdx.x * blockDim.x; j0 < inner; j0 += (i64)gridDim.x * blockDim.x) {
    const i64 j = j0 + threadIdx.x;
    const bool live = j < inner;
    for (i64 o = blockIdx.y; o < outer; o += gridDim.y) {
      const TX* p = x + o * n * inner + j;
      const i64 dst = ((i64)blockIdx.z * outer + o) * inner + j;
      if (op == R_MAX) {
        float m = neg_inf_f();
        if (live) {
#pragma unroll 4
          for (i64 k = lo + threadIdx.y; k < hi; k += blockDim.y) m = go_max(m, (float)p[k * inner]);
        }
        sf[t] = m;
        __syncthreads();
        if (live && threadIdx.y == 0) {
          for (unsigned r = 1; r < blockDim.y; ++r) m = go_max(m, sf[r * blockDim.x + threadIdx.x]);
          reduce_put(out, part, dst, m);
        }
      } else {
        double s = 0;
        if (live) {
#pragma unroll 4
          for (i64 k = lo + threadIdx.y; k < hi; k += blockDim.y) s += (double)(float)p[k * inner];
        }
        sd[t] = s;
        __syncthreads();
        if (live && threadIdx.y == 0) {
          for (unsigned r = 1; r < blockDim.y; ++r) s += sd[r * blockDim.x + threadIdx.x];
          reduce_put(out, part, dst, (float)(s * scale));
        }
      }
      __syncthreads();  // shared memory is reused by the next output
    }
  }
}

// reduce_mid_{f32,bf16,f16}: output (s·outer + o)·inner + j = op over
// x[(o·n + k)·inner + j] for k in split s's range (gridDim.z splits), into
// part (float) or out. blockDim = (bx, by) with bx·by ≤ 1024: threadIdx.x
// runs along inner (coalesced), threadIdx.y strides over k, and the by
// partials meet in shared memory. Grid: x = ceil(inner/bx), y = min(outer,
// 65535), z = splits (both x and y loop, so smaller grids are correct too).
#define K(T, S)                                                                            \
  extern "C" __global__ void __launch_bounds__(1024) reduce_mid_##S(                       \
      const T* x, T* out, float* part, i64 outer, i64 n, i64 inner, i64 op, double scale) { \
    reduce_mid_t(x, out, part, outer, n, inner, op, scale);                                \
  }
FOR_FLOATS(K)
#undef K

// V8_TX threads of a block run along the columns, 8 each, and V8_TY lanes
// down the rows: a warp reads 4 rows' 128 contiguous bytes, and a block
// covers 64 columns, so even 768 outputs in 32 splits make 384 blocks.
#define V8_TX 8
#define V8_TY 32

template <typename T>
__device__ __forceinline__ void reduce_mid_v8_t(const T* __restrict__ x, T* __restrict__ out,
                                                float* __restrict__ part, i64 outer, i64 n,
                                                i64 inner, double scale) {
  __shared__ float sf[V8_TY][8][V8_TX];  // [row lane][column of the 8][threadIdx.x]
  i64 lo, hi;
  split_range(n, blockIdx.z, gridDim.z, &lo, &hi);
  const i64 packs = inner / 8;
  const unsigned t = threadIdx.y * V8_TX + threadIdx.x;
  for (i64 c0 = (i64)blockIdx.x * V8_TX; c0 < packs; c0 += (i64)gridDim.x * V8_TX) {
    const i64 c = c0 + threadIdx.x;  // this thread's 8 columns: 8c .. 8c + 7
    for (i64 o = blockIdx.y; o < outer; o += gridDim.y) {
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.f;
      if (c < packs) {
        const T* p = x + o * n * inner + c * 8;
#pragma unroll 4
        for (i64 k = lo + threadIdx.y; k < hi; k += V8_TY) {
          union {  // one 16-byte load, read as 8 values
            uint4 u;
            T e[8];
          } v;
          v.u = *(const uint4*)(p + k * inner);
#pragma unroll
          for (int u = 0; u < 8; ++u) acc[u] += (float)v.e[u];
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) sf[threadIdx.y][u][threadIdx.x] = acc[u];
      __syncthreads();
      // Thread t < 64 finishes column 8(c0 + t % V8_TX) + t / V8_TX over the
      // row lanes, in double.
      const i64 cc = c0 + t % V8_TX;
      if (t < 8 * V8_TX && cc < packs) {
        double s = 0;
        for (int r = 0; r < V8_TY; ++r) s += (double)sf[r][t / V8_TX][t % V8_TX];
        const i64 j = cc * 8 + t / V8_TX;
        reduce_put(out, part, ((i64)blockIdx.z * outer + o) * inner + j, (float)(s * scale));
      }
      __syncthreads();  // sf is reused by the next output
    }
  }
}

// reduce_mid_v8_{bf16,f16}: reduce_mid_*'s sum for 16-bit x with inner a
// multiple of 8 and x 16-byte aligned (the bias gradients of a
// transformer's linears): each thread reads 8 neighbouring columns in one
// 16-byte load and sums its rows in float, at most ceil(n/splits/V8_TY) of
// them (the host keeps that at 256 or fewer: a float sum of 256 16-bit
// values is off by a few float ulps, far below the 16-bit output's
// rounding); the row lanes then meet in double. blockDim = (V8_TX, V8_TY);
// grid x = ceil(inner/(8·V8_TX)), y = min(outer, 65535), z = splits (x and
// y loop). part and scale as reduce_mid_*.
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) reduce_mid_v8_##S(                       \
      const T* x, T* out, float* part, i64 outer, i64 n, i64 inner, double scale) {           \
    reduce_mid_v8_t(x, out, part, outer, n, inner, scale);                                   \
  }
FOR_HALVES(K)
#undef K

// reduce_splits_{f32,bf16,f16}: out[j] = op over the float partials
// part[s·nout + j], s < splits, of a split reduction, times scale for a
// sum (reduce_mid_* over [1, splits, nout] with float input). Tile layout
// as reduce_mid_*, grid = (ceil(nout/bx), 1, 1).
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(1024) reduce_splits_##S(                  \
      const float* part, T* out, i64 splits, i64 nout, i64 op, double scale) {           \
    reduce_mid_t(part, out, (float*)nullptr, (i64)1, splits, nout, op, scale);           \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ __forceinline__ void reduce_strided_body(const T* __restrict__ x, T* __restrict__ out,
                                                    float* __restrict__ part, const ReduceGeom& g,
                                                    i64 nout, i64 nred, i64 op, double scale) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  i64 lo, hi;
  split_range(nred, blockIdx.y, gridDim.y, &lo, &hi);
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < nout; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < nout;
    const T* p = x + (live ? offset_of<I>((I)row, g.kept_rank, g.kept_shape, g.kept_stride) : 0);
    if (op == R_MAX) {
      float m = neg_inf_f();
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x)
          m = go_max(m, (float)p[offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride)]);
      m = row_allreduce(m, MaxOp(), sf);
      if (live && threadIdx.x == 0) reduce_put(out, part, blockIdx.y * nout + row, m);
    } else {
      double s = 0;
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x)
          s += (double)(float)p[offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride)];
      s = row_allreduce(s, SumOp(), sd);
      if (live && threadIdx.x == 0) reduce_put(out, part, blockIdx.y * nout + row, (float)(s * scale));
    }
  }
}

// reduce_strided_{f32,bf16,f16}: as reduce_rows_* with output r's elements
// found through g: output r (row-major over g.kept_shape, nout in all)
// reads x[offset(r, kept) + offset(k, red)] for k < nred. Row layout as
// reduce_rows_*; gridDim.y splits.
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(1024) reduce_strided_##S(                     \
      const T* x, T* out, float* part, ReduceGeom g, i64 nout, i64 nred, i64 op, double scale) { \
    if (FITS32(nout) && FITS32(nred))                                                        \
      reduce_strided_body<unsigned>(x, out, part, g, nout, nred, op, scale);                 \
    else                                                                                     \
      reduce_strided_body<u64>(x, out, part, g, nout, nred, op, scale);                      \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ __forceinline__ void max_grad_body(const T* __restrict__ gr, const T* __restrict__ x,
                                              const T* __restrict__ y, T* __restrict__ out,
                                              const ReduceGeom& g, i64 nout, i64 nred) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < nout; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < nout;
    const i64 b = live ? offset_of<I>((I)row, g.kept_rank, g.kept_shape, g.kept_stride) : 0;
    const float m = live ? (float)y[row] : 0.f;
    double c = 0;  // ties; a double counts exactly and reuses SumOp
    if (live)
      for (i64 k = threadIdx.x; k < nred; k += blockDim.x)
        c += (float)x[b + offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride)] == m ? 1.0 : 0.0;
    c = row_allreduce(c, SumOp(), sd);
    if (live) {
      const float share = (float)gr[row] / (float)c;
      for (i64 k = threadIdx.x; k < nred; k += blockDim.x) {
        const i64 i = b + offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride);
        out[i] = (float)x[i] == m ? share : 0.f;
      }
    }
  }
}

// max_grad_{f32,bf16,f16}: the gradient of max: out (x's shape, contiguous)
// = g[r] / (number of ties) where x equals the maximum y[r] of its output r,
// else 0. g and y are contiguous over the kept axes (keepdim makes no
// difference to the layout). g describes x exactly as for
// reduce_strided_*, which covers every layout; the row layout is the same,
// and gridDim.y must be 1. Every element of out is written.
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(1024) max_grad_##S(                          \
      const T* gr, const T* x, const T* y, T* out, ReduceGeom g, i64 nout, i64 nred) {      \
    if (FITS32(nout) && FITS32(nred)) max_grad_body<unsigned>(gr, x, y, out, g, nout, nred); \
    else max_grad_body<u64>(gr, x, y, out, g, nout, nred);                                  \
  }
FOR_FLOATS(K)
#undef K
