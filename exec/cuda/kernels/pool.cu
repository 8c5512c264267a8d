// pool.cu: max_pool2d and avg_pool2d over NCHW data, and their gradients;
// the *_nhwc_* kernels the same over channels-last data (see the end).
//
// wd describes the input [n, c, h, w] and output [n, c, ho, wo] with the
// normalised attributes (stride defaulting to the kernel, dilation ≥ 1;
// avg_pool2d has dilation 1). Arithmetic inside a plane is 32-bit (see
// Geom32). The gradients are gathers — one thread per input element visits
// the windows that contain it in ascending output order — so they need no
// atomics or fill and add in the CPU's order. max_pool2d's gradient runs in
// two passes through an int32 workspace of argmax offsets, so each window is
// scanned once rather than once per input it covers. Every kernel is
// instantiated for float32, bfloat16 and float16 (FOR_FLOATS): values
// widen to float as they are read, and a 16-bit output rounds the float
// result once (max_pool2d and the argmax are exact in every dtype).
#include "common.cuh"

// max_of_window is the max of the window at (oh, ow) of plane p, padding
// skipped; a NaN tap makes it NaN, as on the CPU.
template <typename T>
__device__ __forceinline__ float max_of_window(const T* p, const Geom32& g, int oh, int ow,
                                               i64 es = 1) {
  float m = neg_inf_f();
  for (int ki = 0; ki < g.kh; ++ki) {
    const int ih = oh * g.sh - g.ph + ki * g.dh;
    if (ih < 0 || ih >= g.h) continue;
    for (int kj = 0; kj < g.kw; ++kj) {
      const int iw = ow * g.sw - g.pw + kj * g.dw;
      if (iw < 0 || iw >= g.w) continue;
      const float v = (float)p[(i64)(ih * g.w + iw) * es];
      if (v > m || v != v) m = v;
    }
  }
  return m;
}

// window_argmax is the CPU's rule: the first in-bounds tap, in row-major
// window order, whose value beats every earlier one (so the first of tied
// maxima wins and padding never does). Returns the plane offset, or −1.
template <typename T>
__device__ __forceinline__ int window_argmax(const T* p, const Geom32& g, int oh, int ow,
                                             i64 es = 1) {
  int best = -1;
  float bv = 0.f;
  for (int ki = 0; ki < g.kh; ++ki) {
    const int ih = oh * g.sh - g.ph + ki * g.dh;
    if (ih < 0 || ih >= g.h) continue;
    for (int kj = 0; kj < g.kw; ++kj) {
      const int iw = ow * g.sw - g.pw + kj * g.dw;
      if (iw < 0 || iw >= g.w) continue;
      const int i = ih * g.w + iw;
      const float v = (float)p[(i64)i * es];
      if (best < 0 || v > bv) {
        best = i;
        bv = v;
      }
    }
  }
  return best;
}

// For thread t over [planes, rows, cols] (cols innermost): the plane and
// the position within it, with I-typed divisions.
template <typename I>
__device__ __forceinline__ void split_plane(i64 t, int rows, int cols, i64* plane, int* r, int* c) {
  const I q = (I)t / (I)cols;
  *c = (int)((I)t - q * (I)cols);
  const I pl = q / (I)rows;
  *r = (int)(q - pl * (I)rows);
  *plane = (i64)pl;
}

template <typename I, typename T>
__device__ void max_pool_loop(const T* __restrict__ x, T* __restrict__ y, const Geom32& g,
                              i64 total) {
  GRID_LOOP(t, total) {
    i64 plane;
    int oh, ow;
    split_plane<I>(t, g.ho, g.wo, &plane, &oh, &ow);
    y[t] = max_of_window(x + plane * g.h * g.w, g, oh, ow);
  }
}

// max_pool2d_{f32,bf16,f16}: y = the max of each window; padding never
// wins (it is skipped) and a NaN in the window gives NaN. One thread per
// output, 1-D blocks, any grid.
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) max_pool2d_##S(const T* x, T* y, Window wd) { \
    const Geom32 g = geom32(wd);                                                               \
    const i64 total = wd.n * wd.c * wd.ho * wd.wo;                                             \
    if (FITS32(total)) max_pool_loop<unsigned>(x, y, g, total);                                \
    else max_pool_loop<u64>(x, y, g, total);                                                   \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void argmax_loop(const T* __restrict__ x, int* __restrict__ idx, const Geom32& g,
                            i64 total) {
  GRID_LOOP(t, total) {
    i64 plane;
    int oh, ow;
    split_plane<I>(t, g.ho, g.wo, &plane, &oh, &ow);
    idx[t] = window_argmax(x + plane * g.h * g.w, g, oh, ow);
  }
}

// max_pool2d_argmax_{f32,bf16,f16}: idx[n, c, oh, ow] = the offset within
// its h×w plane of the window's first maximum (window_argmax), −1 for a
// window of padding only: the first pass of max_pool2d's gradient. idx is
// an int32 workspace of n·c·ho·wo entries. One thread per output, 1-D
// blocks, any grid.
#define K(T, S)                                                                      \
  extern "C" __global__ void __launch_bounds__(256) max_pool2d_argmax_##S(const T* x, int* idx, \
                                                                          Window wd) { \
    const Geom32 g = geom32(wd);                                                     \
    const i64 total = wd.n * wd.c * wd.ho * wd.wo;                                   \
    if (FITS32(total)) argmax_loop<unsigned>(x, idx, g, total);                      \
    else argmax_loop<u64>(x, idx, g, total);                                         \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void max_pool_grad_loop(const T* __restrict__ gr, const int* __restrict__ idx,
                                   T* __restrict__ out, const Geom32& g, i64 total) {
  GRID_LOOP(t, total) {
    i64 plane;
    int ih, iw;
    split_plane<I>(t, g.h, g.w, &plane, &ih, &iw);
    const i64 ob = plane * g.ho * g.wo;
    const int self = ih * g.w + iw;
    int ohlo, ohhi, owlo, owhi;
    cover_range(ih, g.kh, g.sh, g.ph, g.dh, g.ho, &ohlo, &ohhi);
    cover_range(iw, g.kw, g.sw, g.pw, g.dw, g.wo, &owlo, &owhi);
    float acc = 0.f;
    for (int oh = ohlo; oh <= ohhi; ++oh)
      for (int ow = owlo; ow <= owhi; ++ow) {
        const i64 o = ob + oh * g.wo + ow;
        if (idx[o] == self) acc += (float)gr[o];
      }
    out[t] = acc;
  }
}

// max_pool2d_grad_{f32,bf16,f16}: out[n, c, ih, iw] = Σ g over the windows
// whose first maximum is this input element, idx coming from
// max_pool2d_argmax_* on the forward input x; the windows are taken in
// ascending order and summed in float, which is the CPU's sum exactly (a
// 16-bit out rounds it once). g and idx are [n, c, ho, wo], out [n, c, h,
// w]; every element of out is written. One thread per input element, 1-D
// blocks, any grid.
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(256) max_pool2d_grad_##S(const T* g, const int* idx, \
                                                                        T* out, Window wd) {  \
    const Geom32 gm = geom32(wd);                                                           \
    const i64 total = wd.n * wd.c * wd.h * wd.w;                                            \
    if (FITS32(total)) max_pool_grad_loop<unsigned>(g, idx, out, gm, total);                \
    else max_pool_grad_loop<u64>(g, idx, out, gm, total);                                   \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void avg_pool_loop(const T* __restrict__ x, T* __restrict__ y, const Geom32& g,
                              i64 total) {
  const double inv = 1.0 / (double)(g.kh * g.kw);
  GRID_LOOP(t, total) {
    i64 plane;
    int oh, ow;
    split_plane<I>(t, g.ho, g.wo, &plane, &oh, &ow);
    const T* p = x + plane * g.h * g.w;
    const int ih0 = oh * g.sh - g.ph, iw0 = ow * g.sw - g.pw;
    const int hlo = max(ih0, 0), hhi = min(ih0 + g.kh, g.h);
    const int wlo = max(iw0, 0), whi = min(iw0 + g.kw, g.w);
    double s = 0;
    for (int ih = hlo; ih < hhi; ++ih)
      for (int iw = wlo; iw < whi; ++iw) s += (double)(float)p[ih * g.w + iw];
    y[t] = (float)(s * inv);
  }
}

// avg_pool2d_{f32,bf16,f16}: y = float((Σ of the window's in-bounds
// values, in double, row-major) · (1/(kh·kw))): zero padding counts in the
// divisor (count_include_pad). Same order and precision as the CPU: bit for
// bit (a 16-bit y rounds that float once, as the CPU does). Dilation must
// be 1. One thread per output, 1-D blocks, any grid.
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) avg_pool2d_##S(const T* x, T* y, Window wd) { \
    const Geom32 g = geom32(wd);                                                             \
    const i64 total = wd.n * wd.c * wd.ho * wd.wo;                                           \
    if (FITS32(total)) avg_pool_loop<unsigned>(x, y, g, total);                              \
    else avg_pool_loop<u64>(x, y, g, total);                                                 \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void avg_pool_grad_loop(const T* __restrict__ gr, T* __restrict__ out,
                                   const Geom32& g, i64 total) {
  const float inv = 1.f / (float)(g.kh * g.kw);
  GRID_LOOP(t, total) {
    i64 plane;
    int ih, iw;
    split_plane<I>(t, g.h, g.w, &plane, &ih, &iw);
    const T* gp = gr + plane * g.ho * g.wo;
    int ohlo, ohhi, owlo, owhi;
    cover_range(ih, g.kh, g.sh, g.ph, 1, g.ho, &ohlo, &ohhi);
    cover_range(iw, g.kw, g.sw, g.pw, 1, g.wo, &owlo, &owhi);
    float acc = 0.f;
    for (int oh = ohlo; oh <= ohhi; ++oh)
      for (int ow = owlo; ow <= owhi; ++ow) acc += __fmul_rn((float)gp[oh * g.wo + ow], inv);
    out[t] = acc;
  }
}

// avg_pool2d_grad_{f32,bf16,f16}: out[n, c, ih, iw] = Σ over the windows
// containing it of g·(1/(kh·kw)), in float and ascending window order like
// the CPU (__fmul_rn keeps the product from fusing into the add): bit for
// bit (a 16-bit out rounds the sum once). g is [n, c, ho, wo], out [n, c,
// h, w]; every element written. Dilation must be 1. 1-D blocks, any grid.
#define K(T, S)                                                                             \
  extern "C" __global__ void __launch_bounds__(256) avg_pool2d_grad_##S(const T* g, T* out,   \
                                                                        Window wd) {        \
    const Geom32 gm = geom32(wd);                                                           \
    const i64 total = wd.n * wd.c * wd.h * wd.w;                                            \
    if (FITS32(total)) avg_pool_grad_loop<unsigned>(g, out, gm, total);                     \
    else avg_pool_grad_loop<u64>(g, out, gm, total);                                        \
  }
FOR_FLOATS(K)
#undef K

// Channels last (graph.Attrs.ChannelsLast): x [n, h, w, c], y [n, ho, wo,
// c]. The same windows, taps, orders and precision as the NCHW kernels
// above, so the results are the same values; threads run over the output
// (or, for the gradients, the input) in its own order, channels innermost,
// so neighbouring threads read neighbouring channels. A window's taps are
// c elements apart (the helpers' element stride). argmax offsets are
// plane offsets ih·w + iw as above.

// split_nhwc splits thread t over [n, rows, cols, c] into the image, the
// position and the channel.
template <typename I>
__device__ __forceinline__ void split_nhwc(i64 t, int rows, int cols, i64 c, i64* img, int* r,
                                           int* col, i64* ch) {
  const I q = (I)t / (I)c;
  *ch = (i64)((I)t - q * (I)c);
  split_plane<I>((i64)q, rows, cols, img, r, col);
}

template <typename I, typename T>
__device__ void max_pool_nhwc_loop(const T* __restrict__ x, T* __restrict__ y, const Geom32& g,
                                   i64 c, i64 total) {
  GRID_LOOP(t, total) {
    i64 img, ch;
    int oh, ow;
    split_nhwc<I>(t, g.ho, g.wo, c, &img, &oh, &ow, &ch);
    y[t] = max_of_window(x + img * g.h * g.w * c + ch, g, oh, ow, c);
  }
}

// max_pool2d_nhwc_{f32,bf16,f16}: max_pool2d over channels-last data.
#define K(T, S)                                                                        \
  extern "C" __global__ void __launch_bounds__(256) max_pool2d_nhwc_##S(const T* x, T* y, \
                                                                        Window wd) {   \
    const Geom32 g = geom32(wd);                                                       \
    const i64 total = wd.n * wd.c * wd.ho * wd.wo;                                     \
    if (FITS32(total)) max_pool_nhwc_loop<unsigned>(x, y, g, wd.c, total);             \
    else max_pool_nhwc_loop<u64>(x, y, g, wd.c, total);                                \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void argmax_nhwc_loop(const T* __restrict__ x, int* __restrict__ idx, const Geom32& g,
                                 i64 c, i64 total) {
  GRID_LOOP(t, total) {
    i64 img, ch;
    int oh, ow;
    split_nhwc<I>(t, g.ho, g.wo, c, &img, &oh, &ow, &ch);
    idx[t] = window_argmax(x + img * g.h * g.w * c + ch, g, oh, ow, c);
  }
}

// max_pool2d_argmax_nhwc_{f32,bf16,f16}: idx [n, ho, wo, c] of plane
// offsets, as max_pool2d_argmax_*.
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) max_pool2d_argmax_nhwc_##S(const T* x,    \
                                                                               int* idx,      \
                                                                               Window wd) {   \
    const Geom32 g = geom32(wd);                                                             \
    const i64 total = wd.n * wd.c * wd.ho * wd.wo;                                           \
    if (FITS32(total)) argmax_nhwc_loop<unsigned>(x, idx, g, wd.c, total);                   \
    else argmax_nhwc_loop<u64>(x, idx, g, wd.c, total);                                      \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void max_pool_grad_nhwc_loop(const T* __restrict__ gr, const int* __restrict__ idx,
                                        T* __restrict__ out, const Geom32& g, i64 c, i64 total) {
  GRID_LOOP(t, total) {
    i64 img, ch;
    int ih, iw;
    split_nhwc<I>(t, g.h, g.w, c, &img, &ih, &iw, &ch);
    const i64 ob = img * g.ho * g.wo;
    const int self = ih * g.w + iw;
    int ohlo, ohhi, owlo, owhi;
    cover_range(ih, g.kh, g.sh, g.ph, g.dh, g.ho, &ohlo, &ohhi);
    cover_range(iw, g.kw, g.sw, g.pw, g.dw, g.wo, &owlo, &owhi);
    float acc = 0.f;
    for (int oh = ohlo; oh <= ohhi; ++oh)
      for (int ow = owlo; ow <= owhi; ++ow) {
        const i64 o = (ob + oh * g.wo + ow) * c + ch;
        if (idx[o] == self) acc += (float)gr[o];
      }
    out[t] = acc;
  }
}

// max_pool2d_grad_nhwc_{f32,bf16,f16}: max_pool2d_grad over channels-last
// data (g and idx [n, ho, wo, c], out [n, h, w, c]).
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) max_pool2d_grad_nhwc_##S(const T* g,        \
                                                                             const int* idx,    \
                                                                             T* out, Window wd) { \
    const Geom32 gm = geom32(wd);                                                              \
    const i64 total = wd.n * wd.c * wd.h * wd.w;                                               \
    if (FITS32(total)) max_pool_grad_nhwc_loop<unsigned>(g, idx, out, gm, wd.c, total);        \
    else max_pool_grad_nhwc_loop<u64>(g, idx, out, gm, wd.c, total);                           \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void avg_pool_nhwc_loop(const T* __restrict__ x, T* __restrict__ y, const Geom32& g,
                                   i64 c, i64 total) {
  const double inv = 1.0 / (double)(g.kh * g.kw);
  GRID_LOOP(t, total) {
    i64 img, ch;
    int oh, ow;
    split_nhwc<I>(t, g.ho, g.wo, c, &img, &oh, &ow, &ch);
    const T* p = x + img * g.h * g.w * c + ch;
    const int ih0 = oh * g.sh - g.ph, iw0 = ow * g.sw - g.pw;
    const int hlo = max(ih0, 0), hhi = min(ih0 + g.kh, g.h);
    const int wlo = max(iw0, 0), whi = min(iw0 + g.kw, g.w);
    double s = 0;
    for (int ih = hlo; ih < hhi; ++ih)
      for (int iw = wlo; iw < whi; ++iw) s += (double)(float)p[(i64)(ih * g.w + iw) * c];
    y[t] = (float)(s * inv);
  }
}

// avg_pool2d_nhwc_{f32,bf16,f16}: avg_pool2d over channels-last data.
#define K(T, S)                                                                        \
  extern "C" __global__ void __launch_bounds__(256) avg_pool2d_nhwc_##S(const T* x, T* y, \
                                                                        Window wd) {   \
    const Geom32 g = geom32(wd);                                                       \
    const i64 total = wd.n * wd.c * wd.ho * wd.wo;                                     \
    if (FITS32(total)) avg_pool_nhwc_loop<unsigned>(x, y, g, wd.c, total);             \
    else avg_pool_nhwc_loop<u64>(x, y, g, wd.c, total);                                \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void avg_pool_grad_nhwc_loop(const T* __restrict__ gr, T* __restrict__ out,
                                        const Geom32& g, i64 c, i64 total) {
  const float inv = 1.f / (float)(g.kh * g.kw);
  GRID_LOOP(t, total) {
    i64 img, ch;
    int ih, iw;
    split_nhwc<I>(t, g.h, g.w, c, &img, &ih, &iw, &ch);
    const T* gp = gr + img * g.ho * g.wo * c + ch;
    int ohlo, ohhi, owlo, owhi;
    cover_range(ih, g.kh, g.sh, g.ph, 1, g.ho, &ohlo, &ohhi);
    cover_range(iw, g.kw, g.sw, g.pw, 1, g.wo, &owlo, &owhi);
    float acc = 0.f;
    for (int oh = ohlo; oh <= ohhi; ++oh)
      for (int ow = owlo; ow <= owhi; ++ow)
        acc += __fmul_rn((float)gp[(i64)(oh * g.wo + ow) * c], inv);
    out[t] = acc;
  }
}

// avg_pool2d_grad_nhwc_{f32,bf16,f16}: avg_pool2d_grad over channels-last
// data (g [n, ho, wo, c], out [n, h, w, c]).
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) avg_pool2d_grad_nhwc_##S(const T* g,      \
                                                                             T* out,          \
                                                                             Window wd) {     \
    const Geom32 gm = geom32(wd);                                                            \
    const i64 total = wd.n * wd.c * wd.h * wd.w;                                             \
    if (FITS32(total)) avg_pool_grad_nhwc_loop<unsigned>(g, out, gm, wd.c, total);           \
    else avg_pool_grad_nhwc_loop<u64>(g, out, gm, wd.c, total);                              \
  }
FOR_FLOATS(K)
#undef K
