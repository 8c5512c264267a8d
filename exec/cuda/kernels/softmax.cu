// softmax.cu: softmax and log_softmax along one axis, and their gradients.
// Every kernel is templated on its storage type and instantiated for
// float32, bfloat16 and float16 (FOR_FLOATS, common.cuh): 16-bit values are
// read widened, and each output rounds once from the float the float32
// kernel would store.
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

template <bool C, typename T>
__device__ __forceinline__ void softmax_rows_body(const T* __restrict__ x, T* __restrict__ y,
                                                  i64 rows, i64 n, i64 logform) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < rows; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < rows;
    const T* p = x + row * n;
    T* q = y + row * n;
    float v[ROW_VPT];
    float m = neg_inf_f();
    if (live)
      row_each<C>(n, [&](i64 k, int u) {
        const float xv = p[k];
        if (C) v[u] = xv;
        m = go_max(m, xv);
      });
    m = row_allreduce(m, MaxOp(), sf);
    auto at = [&](i64 k, int u) { return C ? v[u] : (float)p[k]; };
    double s = 0;
    if (live) row_each<C>(n, [&](i64 k, int u) { s += (double)expf(at(k, u) - m); });
    s = row_allreduce(s, SumOp(), sd);
    if (!live) continue;
    if (logform) {
      const double lse = (double)m + log(s);
      row_each<C>(n, [&](i64 k, int u) { q[k] = (float)((double)at(k, u) - lse); });
    } else {
      const double inv = 1.0 / s;
      row_each<C>(n, [&](i64 k, int u) { q[k] = (float)((double)expf(at(k, u) - m) * inv); });
    }
  }
}

// softmax_rows_{f32,bf16,f16}: y[r, :] = softmax(x[r, :]) (log_softmax when
// logform ≠ 0) for rows×n contiguous x and y. Row layout: blockDim = (bx,
// by), bx a multiple of 32, bx·by ≤ 1024, one threadIdx.y group per row;
// any grid. Rows of up to ROW_VPT·bx elements are read once.
#define K(T, S)                                                                                   \
  extern "C" __global__ void __launch_bounds__(1024) softmax_rows_##S(const T* x, T* y, i64 rows, \
                                                                      i64 n, i64 logform) {       \
    if (row_fits(n)) softmax_rows_body<true>(x, y, rows, n, logform);                             \
    else softmax_rows_body<false>(x, y, rows, n, logform);                                        \
  }
FOR_FLOATS(K)
#undef K

template <typename T>
__device__ __forceinline__ void softmax_cols_t(const T* __restrict__ x, T* __restrict__ y,
                                               i64 outer, i64 n, i64 inner, i64 logform) {
  GRID_LOOP(t, outer * inner) {
    const i64 o = t / inner, j = t - o * inner;
    const T* p = x + o * n * inner + j;
    T* q = y + o * n * inner + j;
    float m = neg_inf_f();
    for (i64 k = 0; k < n; ++k) m = go_max(m, (float)p[k * inner]);
    double s = 0;
    for (i64 k = 0; k < n; ++k) s += (double)expf((float)p[k * inner] - m);
    if (logform) {
      const double lse = (double)m + log(s);
      for (i64 k = 0; k < n; ++k) q[k * inner] = (float)((double)(float)p[k * inner] - lse);
    } else {
      const double inv = 1.0 / s;
      for (i64 k = 0; k < n; ++k)
        q[k * inner] = (float)((double)expf((float)p[k * inner] - m) * inv);
    }
  }
}

// softmax_cols_{f32,bf16,f16}: softmax (log_softmax when logform ≠ 0) along
// the middle axis of contiguous [outer, n, inner] x into y. One thread per
// (outer, inner) line: 1-D blocks, any grid.
#define K(T, S)                                                                               \
  extern "C" __global__ void __launch_bounds__(256) softmax_cols_##S(                         \
      const T* x, T* y, i64 outer, i64 n, i64 inner, i64 logform) {                           \
    softmax_cols_t(x, y, outer, n, inner, logform);                                           \
  }
FOR_FLOATS(K)
#undef K

// The gradients: softmax y·(g − Σ g·y); log_softmax g − exp(y)·Σ g, with y
// the forward output.
__device__ __forceinline__ double softmax_grad_term(float g, float y, i64 logform) {
  return logform ? (double)g : (double)g * (double)y;
}

__device__ __forceinline__ float softmax_grad_out(float g, float y, double dot, i64 logform) {
  if (logform) return (float)((double)g - (double)expf(y) * dot);
  return (float)((double)y * ((double)g - dot));
}

template <bool C, typename T>
__device__ __forceinline__ void softmax_grad_rows_body(const T* __restrict__ g,
                                                       const T* __restrict__ y,
                                                       T* __restrict__ out, i64 rows, i64 n,
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
      out[off + k] = softmax_grad_out(C ? gv[u] : (float)g[off + k], C ? yv[u] : (float)y[off + k],
                                      dot, logform);
    });
  }
}

// softmax_grad_rows_{f32,bf16,f16}: out = the gradient of softmax
// (log_softmax when logform ≠ 0) for rows×n contiguous g, y, out. Row layout
// as softmax_rows_*.
#define K(T, S)                                                                   \
  extern "C" __global__ void __launch_bounds__(1024) softmax_grad_rows_##S(       \
      const T* g, const T* y, T* out, i64 rows, i64 n, i64 logform) {             \
    if (row_fits(n)) softmax_grad_rows_body<true>(g, y, out, rows, n, logform);   \
    else softmax_grad_rows_body<false>(g, y, out, rows, n, logform);              \
  }
FOR_FLOATS(K)
#undef K

template <typename T>
__device__ __forceinline__ void softmax_grad_cols_t(const T* __restrict__ g,
                                                    const T* __restrict__ y, T* __restrict__ out,
                                                    i64 outer, i64 n, i64 inner, i64 logform) {
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

// softmax_grad_cols_{f32,bf16,f16}: the gradient along the middle axis of
// contiguous [outer, n, inner] g, y, out; one thread per line as
// softmax_cols_*.
#define K(T, S)                                                                            \
  extern "C" __global__ void __launch_bounds__(256) softmax_grad_cols_##S(                 \
      const T* g, const T* y, T* out, i64 outer, i64 n, i64 inner, i64 logform) {          \
    softmax_grad_cols_t(g, y, out, outer, n, inner, logform);                              \
  }
FOR_FLOATS(K)
#undef K
