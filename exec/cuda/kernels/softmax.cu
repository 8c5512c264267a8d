// softmax.cu: softmax and log_softmax along one axis, and their gradients.
//
// The Go side views x as [outer, n, inner] around the axis. inner = 1 (the
// last axis, attention and classifiers) uses the *_rows kernels: one row
// group of threads per line, warp shuffles and shared memory. inner > 1 uses
// the *_cols kernels: one thread per line, consecutive threads on
// consecutive inner positions so every read is coalesced.
//
// As on the CPU the line's max is subtracted before exp; sums accumulate
// in double, exp runs in float (expf), and log-sum-exp and the final
// scaling run in double.
#include "common.cuh"

template <bool C>
__device__ __forceinline__ void softmax_rows_body(const float* __restrict__ x,
                                                  float* __restrict__ y, i64 rows, i64 n,
                                                  i64 logform) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const float* p = x + row * n;
    float* q = y + row * n;
    float v[ROW_VPT];
    float m = neg_inf_f();
    if (live)
      row_each<C>(n, [&](i64 k, int u) {
        const float xv = p[k];
        if (C) v[u] = xv;
        m = go_max(m, xv);
      });
    m = row_allreduce(m, MaxOp(), sf);
    double s = 0;
    if (live) row_each<C>(n, [&](i64 k, int u) { s += (double)expf((C ? v[u] : p[k]) - m); });
    s = row_allreduce(s, SumOp(), sd);
    if (!live) continue;
    if (logform) {
      const double lse = (double)m + log(s);
      row_each<C>(n, [&](i64 k, int u) { q[k] = (float)((double)(C ? v[u] : p[k]) - lse); });
    } else {
      const double inv = 1.0 / s;
      row_each<C>(n, [&](i64 k, int u) {
        q[k] = (float)((double)expf((C ? v[u] : p[k]) - m) * inv);
      });
    }
  }
}

// softmax_rows_f32: y[r, :] = softmax(x[r, :]) (log_softmax when logform ≠ 0)
// for rows×n contiguous x and y. Row layout: blockDim = (bx, by), bx a
// multiple of 32, bx·by ≤ 1024, one threadIdx.y group per row; any grid.
// Rows of up to ROW_VPT·bx elements are read once.
extern "C" __global__ void __launch_bounds__(1024)
softmax_rows_f32(const float* x, float* y, i64 rows, i64 n, i64 logform) {
  if (row_fits(n)) softmax_rows_body<true>(x, y, rows, n, logform);
  else softmax_rows_body<false>(x, y, rows, n, logform);
}

// softmax_cols_f32: softmax (log_softmax when logform ≠ 0) along the middle
// axis of contiguous [outer, n, inner] x into y. One thread per (outer,
// inner) line: 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
softmax_cols_f32(const float* __restrict__ x, float* __restrict__ y, i64 outer, i64 n, i64 inner,
                 i64 logform) {
  GRID_LOOP(t, outer * inner) {
    const i64 o = t / inner, j = t - o * inner;
    const float* p = x + o * n * inner + j;
    float* q = y + o * n * inner + j;
    float m = neg_inf_f();
    for (i64 k = 0; k < n; ++k) m = go_max(m, p[k * inner]);
    double s = 0;
    for (i64 k = 0; k < n; ++k) s += (double)expf(p[k * inner] - m);
    if (logform) {
      const double lse = (double)m + log(s);
      for (i64 k = 0; k < n; ++k) q[k * inner] = (float)((double)p[k * inner] - lse);
    } else {
      const double inv = 1.0 / s;
      for (i64 k = 0; k < n; ++k) q[k * inner] = (float)((double)expf(p[k * inner] - m) * inv);
    }
  }
}

// The gradients: softmax y·(g − Σ g·y); log_softmax g − exp(y)·Σ g, with y
// the forward output.
__device__ __forceinline__ double softmax_grad_term(float g, float y, i64 logform) {
  return logform ? (double)g : (double)g * (double)y;
}

__device__ __forceinline__ float softmax_grad_out(float g, float y, double dot, i64 logform) {
  if (logform) return (float)((double)g - (double)expf(y) * dot);
  return (float)((double)y * ((double)g - dot));
}

template <bool C>
__device__ __forceinline__ void softmax_grad_rows_body(const float* __restrict__ g,
                                                       const float* __restrict__ y,
                                                       float* __restrict__ out, i64 rows, i64 n,
                                                       i64 logform) {
  __shared__ double sd[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const i64 off = row * n;
    float gv[ROW_VPT], yv[ROW_VPT];
    double dot = 0;
    if (live)
      row_each<C>(n, [&](i64 k, int u) {
        const float a = g[off + k], b = y[off + k];
        if (C) {
          gv[u] = a;
          yv[u] = b;
        }
        dot += softmax_grad_term(a, b, logform);
      });
    dot = row_allreduce(dot, SumOp(), sd);
    if (!live) continue;
    row_each<C>(n, [&](i64 k, int u) {
      out[off + k] = softmax_grad_out(C ? gv[u] : g[off + k], C ? yv[u] : y[off + k], dot, logform);
    });
  }
}

// softmax_grad_rows_f32: out = the gradient of softmax (log_softmax when
// logform ≠ 0) for rows×n contiguous g, y, out. Row layout as
// softmax_rows_f32.
extern "C" __global__ void __launch_bounds__(1024)
softmax_grad_rows_f32(const float* g, const float* y, float* out, i64 rows, i64 n, i64 logform) {
  if (row_fits(n)) softmax_grad_rows_body<true>(g, y, out, rows, n, logform);
  else softmax_grad_rows_body<false>(g, y, out, rows, n, logform);
}

// softmax_grad_cols_f32: the gradient along the middle axis of contiguous
// [outer, n, inner] g, y, out; one thread per line as softmax_cols_f32.
extern "C" __global__ void __launch_bounds__(256)
softmax_grad_cols_f32(const float* __restrict__ g, const float* __restrict__ y,
                      float* __restrict__ out, i64 outer, i64 n, i64 inner, i64 logform) {
  GRID_LOOP(t, outer * inner) {
    const i64 o = t / inner, j = t - o * inner;
    const i64 off = o * n * inner + j;
    double dot = 0;
    for (i64 k = 0; k < n; ++k)
      dot += softmax_grad_term(g[off + k * inner], y[off + k * inner], logform);
    for (i64 k = 0; k < n; ++k)
      out[off + k * inner] = softmax_grad_out(g[off + k * inner], y[off + k * inner], dot, logform);
  }
}
