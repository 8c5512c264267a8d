// reduce.cu: sum, mean and max over axes, and max's gradient.
//
// Three layouts, chosen by the Go side after it drops size-1 axes and merges
// neighbouring axes that are both kept or both reduced:
//   reduce_rows_f32     [rows, n], reducing the last axis (contiguous rows)
//   reduce_mid_f32      [outer, n, inner], reducing the middle axis
//   reduce_strided_f32  anything else, through a ReduceGeom
// Sums accumulate in double (cheap next to the memory traffic on any GPU,
// and close to the CPU's float64 accumulation); max works in float, which
// is exact. The summation order is fixed by the launch configuration, so a
// given configuration gives reproducible results.
//
// Splitting: when there are few outputs and long reductions, a grid
// dimension (y for rows and strided, z for mid) splits each reduction into
// `splits` contiguous ranges and out holds [splits, outputs] partials; a
// second reduce_mid_f32 pass over [1, splits, outputs] combines them. Pass
// scale = 1 to the first pass of a mean and the real scale to the second.
#include "common.cuh"

// R_SUM and R_MAX come from opcodes.cuh (generated).

// split_range gives the part [lo, hi) of [0, n) that split s of `splits`
// covers.
__device__ __forceinline__ void split_range(i64 n, i64 s, i64 splits, i64* lo, i64* hi) {
  const i64 per = (n + splits - 1) / splits;
  *lo = imin(n, s * per);
  *hi = imin(n, *lo + per);
}

// reduce_rows_f32: out[s·rows + r] = op over x[r·n + k] for k in split s's
// range (all of [0, n) when gridDim.y = 1); sums are multiplied by scale
// (Attrs.Scalar for mean, else 1). Row layout: blockDim = (bx, by), bx a
// multiple of 32, bx·by ≤ 1024; each threadIdx.y group reduces one row.
extern "C" __global__ void __launch_bounds__(1024)
reduce_rows_f32(const float* __restrict__ x, float* __restrict__ out, i64 rows, i64 n, i64 op,
                double scale) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  i64 lo, hi;
  split_range(n, blockIdx.y, gridDim.y, &lo, &hi);
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const float* p = x + row * n;
    if (op == R_MAX) {
      float m = neg_inf_f();
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x) m = go_max(m, p[k]);
      m = row_allreduce(m, MaxOp(), sf);
      if (live && threadIdx.x == 0) out[blockIdx.y * rows + row] = m;
    } else {
      double s = 0;
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x) s += (double)p[k];
      s = row_allreduce(s, SumOp(), sd);
      if (live && threadIdx.x == 0) out[blockIdx.y * rows + row] = (float)(s * scale);
    }
  }
}

// reduce_mid_f32: out[(s·outer + o)·inner + j] = op over x[(o·n + k)·inner + j]
// for k in split s's range (gridDim.z splits). blockDim = (bx, by) with
// bx·by ≤ 1024: threadIdx.x runs along inner (coalesced), threadIdx.y
// strides over k, and the by partials meet in shared memory. Grid:
// x = ceil(inner/bx), y = min(outer, 65535), z = splits (both x and y
// loop, so smaller grids are correct too).
extern "C" __global__ void __launch_bounds__(1024)
reduce_mid_f32(const float* __restrict__ x, float* __restrict__ out, i64 outer, i64 n, i64 inner,
               i64 op, double scale) {
  __shared__ double sd[1024];
  __shared__ float sf[1024];
  i64 lo, hi;
  split_range(n, blockIdx.z, gridDim.z, &lo, &hi);
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  for (i64 j0 = (i64)blockIdx.x * blockDim.x; j0 < inner; j0 += (i64)gridDim.x * blockDim.x) {
    const i64 j = j0 + threadIdx.x;
    const bool live = j < inner;
    for (i64 o = blockIdx.y; o < outer; o += gridDim.y) {
      const float* p = x + o * n * inner + j;
      float* dst = out + ((i64)blockIdx.z * outer + o) * inner + j;
      if (op == R_MAX) {
        float m = neg_inf_f();
        if (live) {
#pragma unroll 4
          for (i64 k = lo + threadIdx.y; k < hi; k += blockDim.y) m = go_max(m, p[k * inner]);
        }
        sf[t] = m;
        __syncthreads();
        if (live && threadIdx.y == 0) {
          for (unsigned r = 1; r < blockDim.y; ++r) m = go_max(m, sf[r * blockDim.x + threadIdx.x]);
          *dst = m;
        }
      } else {
        double s = 0;
        if (live) {
#pragma unroll 4
          for (i64 k = lo + threadIdx.y; k < hi; k += blockDim.y) s += (double)p[k * inner];
        }
        sd[t] = s;
        __syncthreads();
        if (live && threadIdx.y == 0) {
          for (unsigned r = 1; r < blockDim.y; ++r) s += sd[r * blockDim.x + threadIdx.x];
          *dst = (float)(s * scale);
        }
      }
      __syncthreads();  // shared memory is reused by the next output
    }
  }
}

template <typename I>
__device__ __forceinline__ void reduce_strided_body(const float* __restrict__ x,
                                                    float* __restrict__ out, const ReduceGeom& g,
                                                    i64 nout, i64 nred, i64 op, double scale) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  i64 lo, hi;
  split_range(nred, blockIdx.y, gridDim.y, &lo, &hi);
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < nout; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < nout;
    const float* p =
        x + (live ? offset_of<I>((I)row, g.kept_rank, g.kept_shape, g.kept_stride) : 0);
    if (op == R_MAX) {
      float m = neg_inf_f();
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x)
          m = go_max(m, p[offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride)]);
      m = row_allreduce(m, MaxOp(), sf);
      if (live && threadIdx.x == 0) out[blockIdx.y * nout + row] = m;
    } else {
      double s = 0;
      if (live)
        for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x)
          s += (double)p[offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride)];
      s = row_allreduce(s, SumOp(), sd);
      if (live && threadIdx.x == 0) out[blockIdx.y * nout + row] = (float)(s * scale);
    }
  }
}

// reduce_strided_f32: as reduce_rows_f32 with output r's elements found
// through g: output r (row-major over g.kept_shape, nout in all) reads
// x[offset(r, kept) + offset(k, red)] for k < nred. Row layout as
// reduce_rows_f32; gridDim.y splits.
extern "C" __global__ void __launch_bounds__(1024)
reduce_strided_f32(const float* x, float* out, ReduceGeom g, i64 nout, i64 nred, i64 op,
                   double scale) {
  if (FITS32(nout) && FITS32(nred)) reduce_strided_body<unsigned>(x, out, g, nout, nred, op, scale);
  else reduce_strided_body<u64>(x, out, g, nout, nred, op, scale);
}

template <typename I>
__device__ __forceinline__ void max_grad_body(const float* __restrict__ gr,
                                              const float* __restrict__ x,
                                              const float* __restrict__ y, float* __restrict__ out,
                                              const ReduceGeom& g, i64 nout, i64 nred) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < nout; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < nout;
    const i64 b = live ? offset_of<I>((I)row, g.kept_rank, g.kept_shape, g.kept_stride) : 0;
    const float m = live ? y[row] : 0.f;
    double c = 0;  // ties; a double counts exactly and reuses SumOp
    if (live)
      for (i64 k = threadIdx.x; k < nred; k += blockDim.x)
        c += x[b + offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride)] == m ? 1.0 : 0.0;
    c = row_allreduce(c, SumOp(), sd);
    if (live) {
      const float share = gr[row] / (float)c;
      for (i64 k = threadIdx.x; k < nred; k += blockDim.x) {
        const i64 i = b + offset_of<I>((I)k, g.red_rank, g.red_shape, g.red_stride);
        out[i] = x[i] == m ? share : 0.f;
      }
    }
  }
}

// max_grad_f32: the gradient of max: out (x's shape, contiguous) =
// g[r] / (number of ties) where x equals the maximum y[r] of its output r,
// else 0. g and y are contiguous over the kept axes (keepdim makes no
// difference to the layout). g describes x exactly as for
// reduce_strided_f32, which covers every layout; the row layout is the same,
// and gridDim.y must be 1. Every element of out is written.
extern "C" __global__ void __launch_bounds__(1024)
max_grad_f32(const float* gr, const float* x, const float* y, float* out, ReduceGeom g, i64 nout,
             i64 nred) {
  if (FITS32(nout) && FITS32(nred)) max_grad_body<unsigned>(gr, x, y, out, g, nout, nred);
  else max_grad_body<u64>(gr, x, y, out, g, nout, nred);
}
