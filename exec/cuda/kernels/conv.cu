// conv.cu: the unfold (im2col) and fold (col2im) around conv2d's GEMMs,
// which run on cuBLAS.
//
// The layouts are the CPU's (exec/cpu/conv.go): for one image's c
// channels, col is the [c·kh·kw, ho·wo] matrix whose row (ci, ki, kj) holds,
// for every output position, the input value that kernel tap sees (0 in the
// padding). The kernels handle n images at once with explicit image strides,
// so the Go side can unfold one image and group at a time or a whole batch
// for a strided-batched GEMM. For groups, point x at the group's first
// channel and pass c = C/groups with x_img = C·H·W. Both are instantiated
// for float32, bfloat16 and float16 (FOR_FLOATS): im2col copies values of
// its dtype (exactly), col2im sums float32 entries (the GEMM's float32
// output) and rounds each sum once into x of its dtype.
#include "common.cuh"

template <typename I, typename T>
__device__ void im2col_loop(const T* __restrict__ x, T* __restrict__ col, const Geom32& g,
                            i64 c, i64 x_img, i64 col_img, i64 col_row, i64 total) {
  const I howo = (I)g.ho * (I)g.wo, taps = (I)g.kh * (I)g.kw;
  const i64 plane = (i64)g.h * g.w;
  GRID_LOOP(t, total) {
    const I q = (I)t / howo;  // q = (img·c + ci)·kh·kw + ki·kw + kj
    const int pos = (int)((I)t - q * howo);
    const I pl = q / taps;  // pl = img·c + ci
    const int tap = (int)(q - pl * taps);
    const int ki = tap / g.kw, kj = tap - ki * g.kw;
    const int oh = pos / g.wo, ow = pos - oh * g.wo;
    const i64 img = (i64)pl / c, ci = (i64)pl - img * c;
    const int ih = oh * g.sh - g.ph + ki * g.dh;
    const int iw = ow * g.sw - g.pw + kj * g.dw;
    T v;
    v = 0.f;
    if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) v = x[img * x_img + ci * plane + ih * g.w + iw];
    col[img * col_img + ((i64)ci * (i64)taps + tap) * col_row + pos] = v;
  }
}

// im2col_{f32,bf16,f16}: for each of wd.n images (image i's channels at x
// + i·x_img, its matrix at col + i·col_img, in elements of the dtype),
// unfold wd.c channels of wd.h×wd.w into [c·kh·kw, ho·wo] with rows
// col_row elements apart: col_row = ho·wo and col_img ≥ c·kh·kw·ho·wo stack
// the images' matrices (conv2d), col_img = ho·wo and col_row = n·ho·wo
// put the images side by side in one [c·kh·kw, n·ho·wo] matrix
// (conv2d_grad_weight). Every col element of the n matrices is written.
// Plane arithmetic is 32-bit (see Geom32). 1-D blocks, any grid.
#define K(T, S)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) im2col_##S(const T* x, T* col, Window wd,     \
                                                               i64 x_img, i64 col_img,           \
                                                               i64 col_row) {                    \
    const Geom32 g = geom32(wd);                                                                 \
    const i64 total = wd.n * wd.c * wd.kh * wd.kw * wd.ho * wd.wo;                               \
    if (FITS32(total)) im2col_loop<unsigned>(x, col, g, wd.c, x_img, col_img, col_row, total);   \
    else im2col_loop<u64>(x, col, g, wd.c, x_img, col_img, col_row, total);                      \
  }
FOR_FLOATS(K)
#undef K

template <typename I, typename T>
__device__ void col2im_loop(const float* __restrict__ col, T* __restrict__ x, const Geom32& g,
                            i64 c, i64 x_img, i64 col_img, i64 total) {
  const I plane = (I)g.h * (I)g.w;
  const i64 howo = (i64)g.ho * g.wo;
  GRID_LOOP(t, total) {
    const I pl = (I)t / plane;  // pl = img·c + ci
    const int pos = (int)((I)t - pl * plane);
    const int ih = pos / g.w, iw = pos - ih * g.w;
    const i64 img = (i64)pl / c, ci = (i64)pl - img * c;
    const float* cm = col + img * col_img + ci * g.kh * g.kw * howo;
    int ohlo, ohhi, owlo, owhi;
    cover_range(ih, g.kh, g.sh, g.ph, g.dh, g.ho, &ohlo, &ohhi);
    cover_range(iw, g.kw, g.sw, g.pw, g.dw, g.wo, &owlo, &owhi);
    float acc = 0.f;
    // Descending outputs are ascending taps: the CPU's (ki, kj) order.
    for (int oh = ohhi; oh >= ohlo; --oh) {
      const int th = ih + g.ph - oh * g.sh;
      if (g.dh > 1 && th % g.dh != 0) continue;
      const int ki = th / g.dh;
      for (int ow = owhi; ow >= owlo; --ow) {
        const int tw = iw + g.pw - ow * g.sw;
        if (g.dw > 1 && tw % g.dw != 0) continue;
        const int kj = tw / g.dw;
        acc += cm[(i64)(ki * g.kw + kj) * howo + oh * g.wo + ow];
      }
    }
    x[img * x_img + (i64)pos + ci * (i64)plane] = acc;
  }
}

// col2im_{f32,bf16,f16}: the adjoint of im2col_*, as a gather: each input
// element x[img, ci, ih, iw] is set (not added to) to the sum of the col
// entries of the taps that saw it, taken in the CPU's order (ki, then kj,
// ascending), in float, so given the same col the result matches the CPU
// bit for bit. col is float32 whatever the suffix (the GEMM's float32
// output), x of the suffix's dtype, rounded once for 16-bit. Same
// arguments as im2col_* with x the output; no atomics, no fill.
#define K(T, S)                                                                               \
  extern "C" __global__ void __launch_bounds__(256) col2im_##S(const float* col, T* x, Window wd, \
                                                               i64 x_img, i64 col_img) {      \
    const Geom32 g = geom32(wd);                                                              \
    const i64 total = wd.n * wd.c * wd.h * wd.w;                                              \
    if (FITS32(total)) col2im_loop<unsigned>(col, x, g, wd.c, x_img, col_img, total);         \
    else col2im_loop<u64>(col, x, g, wd.c, x_img, col_img, total);                            \
  }
FOR_FLOATS(K)
#undef K

// regroup_{f32,bf16,f16}: dst[(r·t + i)·len + p] = src[i·src_img + r·len + p]
// for r < rows, i < t, p < len: t images' [rows, len] matrices (strided
// src_img apart) laid side by side as one [rows, t·len] matrix, for
// conv2d_grad_weight's one GEMM per tile over the images' positions (the
// upstream gradient's group of channels, and the input itself for a 1×1
// kernel). 16-byte packs when len and src_img are whole packs and both
// ends aligned; one thread per pack (any grid is correct).
template <typename I, typename T>
__device__ __forceinline__ void regroup_loop(const T* __restrict__ src, T* __restrict__ dst, I t,
                                             I rows, I len, i64 src_img) {
  constexpr int N = PackOf<T>::N;
  const i64 n = (i64)rows * t * len;
  if (len % N == 0 && src_img % N == 0 && aligned16(src, dst)) {
    const I lp = len / (I)N;
    VEC_LOOP(q, n, N) {
      const I pp = (I)q % lp, ri = (I)q / lp, i = ri % t, r = ri / t;
      stv<N>(dst, q, ldv<N>(src, (i64)i * (src_img / N) + (i64)r * lp + pp));
    }
    return;
  }
  GRID_LOOP(k, n) {
    const I p = (I)k % len, ri = (I)k / len, i = ri % t, r = ri / t;
    dst[k] = src[(i64)i * src_img + (i64)r * len + p];
  }
}
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) regroup_##S(const T* src, T* dst, i64 t,  \
                                                                i64 rows, i64 len,           \
                                                                i64 src_img) {               \
    if (FITS32(rows * t * len))                                                              \
      regroup_loop<unsigned>(src, dst, (unsigned)t, (unsigned)rows, (unsigned)len, src_img); \
    else                                                                                     \
      regroup_loop<u64>(src, dst, (u64)t, (u64)rows, (u64)len, src_img);                    \
  }
FOR_FLOATS(K)
#undef K
