// loss.cu: cross_entropy and mse, forward and gradient. Every kernel is
// templated on its storage type and instantiated for float32, bfloat16 and
// float16 (FOR_FLOATS, common.cuh): logits, predictions, targets, mse's g
// and loss, and the gradients have that type, are read widened, and each
// output rounds once from the float the float32 kernel would store.
// cross_entropy's loss and the g its gradient reads are float32 whatever
// the logits' type (graph: a 16-bit cross_entropy computes in float32).
// Labels are int64.
//
// cross_entropy reads logits rows ld apart and scores their first c
// columns (c ≤ ld): with c < ld the columns past c, a padded linear's
// extra outputs (graph's Attrs.End), are never read and get exactly zero
// gradient.
//
// The forward losses reduce deterministically in two steps through a small
// double workspace: per-row (cross_entropy) or per-block (mse) partials,
// then sum_f64_* in a single block. Attrs.Scalar (1/N of the full batch
// for a mean, 1 for a sum) scales the total, so chunk results add up.
// Labels are checked as index.cu checks indices (see `bad` there).
#include "common.cuh"

// row_split visits a row p[0:c] with the block's threads: the elements
// before its first 16-byte boundary and after its last one one at a time,
// as scalar(k), and the 16-byte packs between as pack(k0, u), k0 the
// pack's first element and u its values, four packs per thread at a time,
// all four loaded before any is used, so that 64 bytes a thread are in
// flight (a long row is bound by memory latency, not bandwidth, with
// fewer). A row of 16-bit values with an odd length (a vocabulary of
// 50,257) starts at a different offset in each row; its packs still are
// whole 16-byte loads.
template <typename T, typename FS, typename FP>
__device__ __forceinline__ void row_split(const T* p, i64 c, FS scalar, FP pack) {
  constexpr int N = 16 / sizeof(T);
  const i64 head = imin((i64)(((16 - ((u64)p & 15)) & 15) / sizeof(T)), c);
  const i64 packs = (c - head) / N;
  const i64 b = blockDim.x;
  const Vec<T, N>* v = reinterpret_cast<const Vec<T, N>*>(p + head);
  for (i64 k = threadIdx.x; k < head; k += b) scalar(k);
  i64 q = threadIdx.x;
  for (; q + 3 * b < packs; q += 4 * b) {
    Vec<T, N> u[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) u[j] = v[q + j * b];
#pragma unroll
    for (int j = 0; j < 4; ++j) pack(head + (q + j * b) * N, u[j]);
  }
  for (; q < packs; q += b) pack(head + q * N, v[q]);
  for (i64 k = head + packs * N + threadIdx.x; k < c; k += b) scalar(k);
}

// row_lse_online gives a row's max and Σ exp(v − max) in one pass over
// memory, for rows too long for registers: each thread keeps a running max
// and a sum in double rescaled whenever the max grows, a pack at a time
// (its max first, then its terms summed in float, at most 8 of them, each
// at most 1), and the threads' sums are rescaled to the row's max before
// they are added. A NaN makes both NaN.
template <typename T>
__device__ __forceinline__ void row_lse_online(const T* p, i64 c, bool live, float* sf,
                                               double* sd, float* m, double* z) {
  constexpr int N = 16 / sizeof(T);
  float mx = neg_inf_f();
  double s = 0;
  auto grow = [&](float top) {  // top: the max of the values about to be added
    if (top > mx) {
      s *= (double)expf(mx - top);  // 0 while mx is −inf
      mx = top;
    } else if (top != top) {
      mx = top;
    }
  };
  if (live) {
    row_split(
        p, c,
        [&](i64 k) {
          const float x = (float)p[k];
          grow(x);
          s += (double)expf(x - mx);
        },
        [&](i64, const Vec<T, N>& u) {
          float x[N];
          float top = neg_inf_f();
#pragma unroll
          for (int e = 0; e < N; ++e) {
            x[e] = (float)u.v[e];
            top = go_max(top, x[e]);
          }
          grow(top);
          float t = 0;
#pragma unroll
          for (int e = 0; e < N; ++e) t += expf(x[e] - mx);
          s += (double)t;
        });
  }
  const float row_max = row_allreduce(mx, MaxOp(), sf);
  const double scaled = s == 0 ? 0.0 : s * (double)expf(mx - row_max);
  *z = row_allreduce(scaled, SumOp(), sd);
  *m = row_max;
}

// row_lse gives the row group's row p[0:c] max and Σ exp(v − max) in
// double (loading the row into v when C: two passes over registers; one
// online pass over memory otherwise); every thread of the block must call
// it.
template <bool C, typename T>
__device__ __forceinline__ void row_lse(const T* p, float (&v)[ROW_VPT], i64 c, bool live,
                                        float* sf, double* sd, float* m, double* z) {
  if (!C) {
    row_lse_online(p, c, live, sf, sd, m, z);
    return;
  }
  float mx = neg_inf_f();
  if (live)
    row_each<C>(c, [&](i64 k, int u) {
      v[u] = p[k];
      mx = go_max(mx, v[u]);
    });
  mx = row_allreduce(mx, MaxOp(), sf);
  double s = 0;
  if (live) row_each<C>(c, [&](i64 k, int u) { s += (double)expf(v[u] - mx); });
  *z = row_allreduce(s, SumOp(), sd);
  *m = mx;
}

// ce_write_grad writes a row's gradient q[0:ld] = s·(softmax(p[0:c]) −
// onehot(label)) from its max m and Σ exp(v − m) z, and 0 past c; label is
// in [0, c). Every thread of the row group calls it.
template <bool C, typename T>
__device__ __forceinline__ void ce_write_grad(const T* p, T* q, const float (&v)[ROW_VPT], i64 c,
                                              i64 ld, i64 label, float m, double z, double s) {
  constexpr int N = 16 / sizeof(T);
  for (i64 k = c + threadIdx.x; k < ld; k += blockDim.x) q[k] = 0.0f;  // padding: no class
  // s·softmax_j = exp(x_j − m)·(s/z), one float multiply per element;
  // the label's s·(softmax − 1) in double, as it may cancel.
  const float sz = (float)(s / z);
  auto grad = [&](i64 k, float x) -> float {
    const float e = expf(x - m);
    return k == label ? (float)((double)e * (s / z) - s) : e * sz;
  };
  if (C) {
    row_each<C>(c, [&](i64 k, int u) { q[k] = grad(k, v[u]); });
  } else if (((u64)p & 15) == ((u64)q & 15)) {  // logits and gradient rows share their packs
    row_split(
        p, c, [&](i64 k) { q[k] = grad(k, (float)p[k]); },
        [&](i64 k0, const Vec<T, N>& x) {
          Vec<T, N> r;
#pragma unroll
          for (int e = 0; e < N; ++e) r.v[e] = grad(k0 + e, (float)x.v[e]);
          *reinterpret_cast<Vec<T, N>*>(q + k0) = r;
        });
  } else {
    row_each<C>(c, [&](i64 k, int) { q[k] = grad(k, (float)p[k]); });
  }
}

// CE_IGNORE is graph.IgnoreLabel: a row so labelled has loss 0 and a zero
// gradient row.
#define CE_IGNORE (-100LL)

// cross_entropy_rows_body: each row's loss into loss[row]; with G also its
// gradient into gout (s the gradient's scale), from the same pass's max and
// sum, so the row is read from memory once more at most (for long rows,
// right after the first pass, from L2) instead of twice by a kernel of its
// own.
template <bool C, bool G, typename T>
__device__ __forceinline__ void cross_entropy_rows_body(const T* __restrict__ logits,
                                                        const i64* __restrict__ labels,
                                                        double* __restrict__ loss,
                                                        T* __restrict__ gout, i64 n, i64 c,
                                                        i64 ld, double s, u64* bad) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < n; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < n;
    const T* p = logits + row * ld;
    float v[ROW_VPT];
    float m;
    double z;
    row_lse<C>(p, v, c, live, sf, sd, &m, &z);
    if (!live) continue;
    const i64 label = labels[row];
    if (label == CE_IGNORE) {  // no part in the loss, zero gradient
      if (threadIdx.x == 0) loss[row] = 0;
      if (G)
        for (i64 k = threadIdx.x; k < ld; k += blockDim.x) gout[row * ld + k] = 0.0f;
      continue;
    }
    const bool ok = label >= 0 && label < c;
    if (threadIdx.x == 0) {
      if (ok) {
        loss[row] = (double)m + log(z) - (double)(float)p[label];
      } else {
        loss[row] = __longlong_as_double(0x7ff8000000000000LL);
        report_bad(bad, row);
      }
    }
    if (!G) continue;
    T* q = gout + row * ld;
    if (ok) {
      ce_write_grad<C>(p, q, v, c, ld, label, m, z, s);
    } else {
      for (i64 k = threadIdx.x; k < ld; k += blockDim.x) q[k] = k < c ? nan_f() : 0.0f;
    }
  }
}

// cross_entropy_rows_{f32,bf16,f16}: loss[r] = logsumexp(logits[r, :c]) −
// logits[r, label[r]] in double, for logits [n, ld] (rows ld apart, c ≤ ld
// classes each) and int64 labels [n]; a label outside [0, c) gives NaN and
// is reported in bad, a label of CE_IGNORE (−100) gives 0. Row
// layout: blockDim = (bx, by), bx a multiple of 32, bx·by ≤ 1024, any grid
// (rows of up to ROW_VPT·bx classes are read once). Then sum_f64_*(loss,
// out, n, Scalar) gives the loss.
#if PART(0)
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(1024, 1) cross_entropy_rows_##S(          \
      const T* logits, const i64* labels, double* loss, i64 n, i64 c, i64 ld, u64* bad) {\
    if (row_fits(c))                                                                     \
      cross_entropy_rows_body<true, false>(logits, labels, loss, (T*)nullptr, n, c, ld, 0, bad); \
    else cross_entropy_rows_body<false, false>(logits, labels, loss, (T*)nullptr, n, c, ld, 0, bad); \
  }
FOR_FLOATS(K)
#undef K
#endif

// cross_entropy_fused_{f32,bf16,f16}: cross_entropy_rows_* and, in the same
// pass, gout[r, j] = float(s·(softmax(logits[r, :c])_j − [j = label[r]]))
// for j < c and 0 for c ≤ j < ld, as cross_entropy_grad_* with s =
// Attrs.Scalar·g given in double (the executor runs it when the gradient's
// g is a constant, graph.CrossEntropyGradProducer). A row with a bad label
// is NaN in its first c gradient columns. Row layout as cross_entropy_rows_*.
#if PART(1)
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(1024, 1) cross_entropy_fused_##S(             \
      const T* logits, const i64* labels, double* loss, T* gout, i64 n, i64 c, i64 ld,       \
      double s, u64* bad) {                                                                  \
    if (row_fits(c)) cross_entropy_rows_body<true, true>(logits, labels, loss, gout, n, c, ld, s, bad); \
    else cross_entropy_rows_body<false, true>(logits, labels, loss, gout, n, c, ld, s, bad);            \
  }
FOR_FLOATS(K)
#undef K
#endif

// sum_f64_{f32,bf16,f16}: out[0] = float(Σ src[0:n] · scale), summed in
// double by one block (then rounded to out's type): launch exactly one
// block of blockDim.x threads, a multiple of 32 up to 1024 (blockDim.y = 1).
#if PART(0)
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(1024) sum_f64_##S(                            \
      const double* __restrict__ src, T* __restrict__ out, i64 n, double scale) {            \
    __shared__ double sd[32];                                                                \
    double s = 0;                                                                            \
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) s += src[k];                           \
    s = row_allreduce(s, SumOp(), sd);                                                       \
    if (threadIdx.x == 0) out[0] = (float)(s * scale);                                       \
  }
FOR_FLOATS(K)
#undef K
#endif

template <bool C, typename T>
__device__ __forceinline__ void cross_entropy_grad_body(const float* __restrict__ g,
                                                        const T* __restrict__ logits,
                                                        const i64* __restrict__ labels,
                                                        T* __restrict__ out, i64 n, i64 c,
                                                        i64 ld, double scalar, u64* bad) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  const double s = scalar * (double)g[0];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < n; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < n;
    const T* p = logits + row * ld;
    float v[ROW_VPT];
    float m;
    double z;
    row_lse<C>(p, v, c, live, sf, sd, &m, &z);
    if (!live) continue;
    T* q = out + row * ld;
    const i64 label = labels[row];
    if (label == CE_IGNORE) {
      for (i64 k = threadIdx.x; k < ld; k += blockDim.x) q[k] = 0.0f;
      continue;
    }
    if (label < 0 || label >= c) {
      for (i64 k = threadIdx.x; k < ld; k += blockDim.x) q[k] = k < c ? nan_f() : 0.0f;
      if (threadIdx.x == 0) report_bad(bad, row);
      continue;
    }
    ce_write_grad<C>(p, q, v, c, ld, label, m, z, s);
  }
}

// cross_entropy_grad_{f32,bf16,f16}: out[r, j] = float(s·(softmax(logits[r,
// :c])_j − [j = label[r]])) for j < c and 0 for c ≤ j < ld, with s =
// scalar·g[0] in double (g the upstream float32 scalar gradient, scalar =
// Attrs.Scalar); logits and out are [n, ld]. Row layout as
// cross_entropy_rows_*; a row with a label outside [0, c) is NaN in its
// first c columns and reported.
#if PART(1)
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(1024) cross_entropy_grad_##S(                   \
      const float* g, const T* logits, const i64* labels, T* out, i64 n, i64 c, i64 ld,        \
      double scalar, u64* bad) {                                                               \
    if (row_fits(c))                                                                           \
      cross_entropy_grad_body<true>(g, logits, labels, out, n, c, ld, scalar, bad);            \
    else cross_entropy_grad_body<false>(g, logits, labels, out, n, c, ld, scalar, bad);        \
  }
FOR_FLOATS(K)
#undef K
#endif

// mse_partial_{f32,bf16,f16}: partial[b] = Σ (pred − target)² in double over
// the elements that block b visits (a grid-stride loop over n). blockDim.x
// a multiple of 32 up to 1024, blockDim.y = 1; partial has gridDim.x
// entries. Then sum_f64_*(partial, out, gridDim.x, Scalar). The result is
// reproducible for a fixed grid.
#if PART(0)
#define K(T, S)                                                                         \
  extern "C" __global__ void __launch_bounds__(1024) mse_partial_##S(                   \
      const T* __restrict__ pred, const T* __restrict__ target,                         \
      double* __restrict__ partial, i64 n) {                                            \
    __shared__ double sd[32];                                                           \
    double s = 0;                                                                       \
    GRID_LOOP(i, n) {                                                                   \
      const double d = (double)(float)pred[i] - (double)(float)target[i];               \
      s += d * d;                                                                       \
    }                                                                                   \
    s = row_allreduce(s, SumOp(), sd);                                                  \
    if (threadIdx.x == 0) partial[blockIdx.x] = s;                                      \
  }
FOR_FLOATS(K)
#undef K
#endif

// mse_grad_{f32,bf16,f16}: out = float(2·scalar·g[0] · double(pred −
// target)), the difference taken in float as on the CPU. 1-D blocks, any
// grid.
#if PART(0)
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) mse_grad_##S(                        \
      const T* __restrict__ g, const T* __restrict__ pred, const T* __restrict__ target, \
      T* __restrict__ out, i64 n, double scalar) {                                       \
    const double s = 2.0 * scalar * (double)(float)g[0];                                 \
    GRID_LOOP(i, n) out[i] = (float)(s * (double)((float)pred[i] - (float)target[i]));   \
  }
FOR_FLOATS(K)
#undef K
#endif

// linear_ce_rows_body: linear_cross_entropy's pass over one chunk of
// logits l [n, ld] (rows ld apart, the first c columns classes): each
// row's loss times scale into loss[row], and with G the row's gradient
// s·(softmax − onehot) written over its logits in place (0 past c, a row
// of 0 for CE_IGNORE), s = s0·g·scale. Every thread reads the label's
// logit before the block synchronises, so none is overwritten first.
template <bool C, bool G, typename T>
__device__ __forceinline__ void linear_ce_rows_body(T* l, const i64* __restrict__ labels,
                                                    double* __restrict__ loss, i64 row0, i64 n,
                                                    i64 c, i64 ld, double s, double scale,
                                                    u64* bad) {
  __shared__ double sd[32];
  __shared__ float sf[32];
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < n; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool live = row < n;
    T* p = l + row * ld;
    float v[ROW_VPT];
    float m;
    double z;
    row_lse<C>(p, v, c, live, sf, sd, &m, &z);
    const i64 label = live ? labels[row0 + row] : CE_IGNORE;
    const bool ok = label >= 0 && label < c;
    const float at = ok ? (float)p[label] : 0.0f;
    __syncthreads();  // every thread holds the label's logit before any row is overwritten
    if (!live) continue;
    if (label == CE_IGNORE) {
      if (threadIdx.x == 0) loss[row] = 0;
      if (G)
        for (i64 k = threadIdx.x; k < ld; k += blockDim.x) p[k] = 0.0f;
      continue;
    }
    if (threadIdx.x == 0) {
      if (ok) {
        loss[row] = ((double)m + log(z) - (double)at) * scale;
      } else {
        loss[row] = __longlong_as_double(0x7ff8000000000000LL);
        report_bad(bad, row0 + row);
      }
    }
    if (!G) continue;
    if (ok) {
      ce_write_grad<C>(p, p, v, c, ld, label, m, z, s);
    } else {
      for (i64 k = threadIdx.x; k < ld; k += blockDim.x) p[k] = k < c ? nan_f() : 0.0f;
    }
  }
}

// linear_ce_rows_{f32,bf16,f16}: one chunk of linear_cross_entropy's
// logits l [n, ld] (rows row0 to row0 + n of h, c ≤ ld classes):
// loss[r] = scale·(logsumexp(l[r, :c]) − l[r, labels[row0 + r]]) in
// double (0 for CE_IGNORE; NaN and reported in bad for a label outside
// [0, c)), and with grads ≠ 0 the rows overwritten by their gradient
// float(s·(softmax − onehot)), 0 past c, s = s0·(g ? g[0] : 1)·scale,
// scale = (sc ? sc[0] : 1): g the upstream gradient and sc the op's scale
// input, float32 scalars on the device, or null. Row layout as
// cross_entropy_rows_*; a bad label is reported at its row of h, row0 +
// r. The executor then runs linear_ce_acc over the chunk's losses and the
// chunk's GEMMs (dh = l·W, dW += lᵀ·h), and after the last chunk
// sum_f64_f32(acc, out, 1, Attrs.Scalar).
#if PART(2)
#define K(T, S)                                                                                  \
  extern "C" __global__ void __launch_bounds__(1024, 1) linear_ce_rows_##S(                      \
      T* l, const i64* labels, double* loss, const float* g, const float* sc, i64 row0, i64 n,  \
      i64 c, i64 ld, double s0, i64 grads, u64* bad) {                                           \
    const double scale = sc ? (double)sc[0] : 1.0;                                               \
    const double s = s0 * (g ? (double)g[0] : 1.0) * scale;                                      \
    if (grads) {                                                                                 \
      if (row_fits(c)) linear_ce_rows_body<true, true>(l, labels, loss, row0, n, c, ld, s, scale, bad); \
      else linear_ce_rows_body<false, true>(l, labels, loss, row0, n, c, ld, s, scale, bad);           \
    } else if (row_fits(c)) {                                                                    \
      linear_ce_rows_body<true, false>(l, labels, loss, row0, n, c, ld, s, scale, bad);                \
    } else {                                                                                     \
      linear_ce_rows_body<false, false>(l, labels, loss, row0, n, c, ld, s, scale, bad);               \
    }                                                                                            \
  }
FOR_FLOATS(K)
#undef K
#endif

// linear_ce_acc: acc[0] = (first ? 0 : acc[0]) + Σ loss[0:n], summed in
// double by one block in a fixed order (so the chunks' total is
// reproducible): launch exactly one block of blockDim.x threads, a
// multiple of 32 up to 1024.
#if PART(0)
extern "C" __global__ void __launch_bounds__(1024) linear_ce_acc(const double* __restrict__ loss,
                                                                 double* __restrict__ acc, i64 n,
                                                                 i64 first) {
  __shared__ double sd[32];
  double s = 0;
  for (i64 k = threadIdx.x; k < n; k += blockDim.x) s += loss[k];
  s = row_allreduce(s, SumOp(), sd);
  if (threadIdx.x == 0) acc[0] = (first ? 0.0 : acc[0]) + s;
}
#endif
