// common.cuh: types and helpers shared by every kernel file.
//
// NVRTC compiles the .cu files with no include path: kernels.go's Source
// replaces the line #include "common.cuh" with this text, and this file's
// #include "opcodes.cuh" (the op codes, written by go generate from
// exec/cuda/internal/opcode) with that header's text. The guards keep
// sources valid when several are concatenated into one module. Only device
// builtins are used, so NVRTC needs no CUDA header either.
#ifndef BATCHFIT_COMMON_CUH
#define BATCHFIT_COMMON_CUH

#include "opcodes.cuh"

typedef long long i64;
typedef unsigned long long u64;

// Every integer scalar argument is 64-bit — i64 (Go int64), or u64 for
// dropout's keys: sizes may exceed 2^31 elements, and one width for all of
// them leaves the Go side one rule.

#define MAX_DIMS 8
#define FULL_MASK 0xffffffffu

// GRID_LOOP visits [0, n) with a grid-stride loop and 64-bit indices, so any
// grid covers any n.
#define GRID_LOOP(i, n)                                                        \
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);     \
       i += (i64)gridDim.x * blockDim.x)

// 16-bit float storage. Kernels compute in float32 and keep values of
// dtype bfloat16 or float16 in these types: reading one widens it exactly
// (operator float) and assigning a float rounds it to nearest, ties to even,
// as the host's half.BF16From and half.F16From do. So a kernel templated on
// its storage type T reads x[i] and writes y[i] = v whatever T is.
__device__ __forceinline__ unsigned short bf16_bits(float f) {
  const unsigned b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);  // quiet NaN
  return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
struct bf16 {
  unsigned short u;
  __device__ __forceinline__ operator float() const { return __uint_as_float((unsigned)u << 16); }
  __device__ __forceinline__ bf16& operator=(float f) {
    u = bf16_bits(f);
    return *this;
  }
};
struct f16 {
  unsigned short u;
  __device__ __forceinline__ operator float() const {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
    return f;
  }
  __device__ __forceinline__ f16& operator=(float f) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(u) : "f"(f));
    return *this;
  }
};

// PART(k) selects the kernels of part k of a file that NVRTC compiles in
// parts, one program each on its own thread (exec/cuda's kernelParts: the
// source with BATCHFIT_PART defined to k in front): a file's kernels
// instantiated under #if PART(k) compile only in part k. Without
// BATCHFIT_PART (a whole-file compile) every part is in.
#ifdef BATCHFIT_PART
#define PART(k) (BATCHFIT_PART == (k))
#else
#define PART(k) 1
#endif

// FOR_FLOATS(X) expands X(T, S) for every float storage type T and its
// kernel-name suffix S (exec/cuda's typed): a kernel templated on T is
// instantiated as name_f32, name_bf16 and name_f16 by
//   #define K(T, S) extern "C" __global__ void name_##S(const T* x, …) { name_t<T>(x, …); }
//   FOR_FLOATS(K)
#define FOR_FLOATS(X) X(float, f32) X(bf16, bf16) X(f16, f16)

// FOR_HALVES(X) expands X(T, S) for the 16-bit storage types only: kernels
// whose float32 instantiation another path replaced (attention.cu's plain
// kernels, float32 attention running on cuBLAS).
#define FOR_HALVES(X) X(bf16, bf16) X(f16, f16)

// MIXED_FLOATS(X) expands X(TA, TB, TY, S) for the promoting binary forms:
// operands of two float dtypes give a float32 result (graph.Promote).
#define MIXED_FLOATS(X)                                                 \
  X(float, bf16, float, f32_bf16) X(bf16, float, float, bf16_f32)       \
  X(float, f16, float, f32_f16) X(f16, float, float, f16_f32)           \
  X(bf16, f16, float, bf16_f16) X(f16, bf16, float, f16_bf16)

// Vector paths of the contiguous elementwise kernels: when every array is
// 16-byte aligned, thread t handles packs t, t + gridDim·blockDim, … of N
// elements, N = 16 bytes over the widest element (4 floats, 8 16-bit
// values), with one load per array and pack, and the n mod N last elements
// run one by one. Each element gets the same arithmetic as on the scalar
// path, so results do not depend on which ran. The executor launches these
// kernels with one thread per pack (any grid is correct).
#define VEC_LOOP(q, n, N)                                                            \
  for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < (i64)(n) / (N); \
       q += (i64)gridDim.x * blockDim.x)
#define VEC_TAIL(i, n, N)                                                              \
  for (i64 i = (i64)(n) - (i64)(n) % (N) + (i64)blockIdx.x * blockDim.x + threadIdx.x; \
       i < (i64)(n); i += (i64)gridDim.x * blockDim.x)

// Vec is N elements of T read or written as one access.
template <typename T, int N>
struct __align__(sizeof(T) * N) Vec {
  T v[N];
};

template <typename A, typename B = A, typename C = A>
struct PackOf {
  static constexpr int size = sizeof(A) > sizeof(B) ? (sizeof(A) > sizeof(C) ? sizeof(A) : sizeof(C))
                                                    : (sizeof(B) > sizeof(C) ? sizeof(B) : sizeof(C));
  static constexpr int N = 16 / size;  // elements per pack
};

__device__ __forceinline__ bool aligned16(const void* a, const void* b = nullptr,
                                          const void* c = nullptr) {
  return (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c) & 15) == 0;
}
template <int N, typename T>
__device__ __forceinline__ Vec<T, N> ldv(const T* p, i64 q) {
  return reinterpret_cast<const Vec<T, N>*>(p)[q];
}
template <int N, typename T>
__device__ __forceinline__ void stv(T* p, i64 q, const Vec<T, N>& v) {
  reinterpret_cast<Vec<T, N>*>(p)[q] = v;
}

__device__ __forceinline__ float4 ld4(const float* p, i64 q) {
  return reinterpret_cast<const float4*>(p)[q];
}
__device__ __forceinline__ void st4(float* p, i64 q, float4 v) { reinterpret_cast<float4*>(p)[q] = v; }

// map1 writes y[i] = f(x[i]) for i < n; map2 writes y[i] = f(a[i], b[i]).
// f takes and returns float; loads widen and stores round (bf16, f16).
template <typename TX, typename TY, typename F>
__device__ __forceinline__ void map1(const TX* __restrict__ x, TY* __restrict__ y, i64 n, F f) {
  constexpr int N = PackOf<TX, TY>::N;
  if (aligned16(x, y)) {
    VEC_LOOP(q, n, N) {
      const Vec<TX, N> u = ldv<N>(x, q);
      Vec<TY, N> r;
#pragma unroll
      for (int j = 0; j < N; ++j) r.v[j] = f((float)u.v[j]);
      stv<N>(y, q, r);
    }
    VEC_TAIL(i, n, N) y[i] = f((float)x[i]);
  } else {
    GRID_LOOP(i, n) y[i] = f((float)x[i]);
  }
}
template <typename TA, typename TB, typename TY, typename F>
__device__ __forceinline__ void map2(const TA* __restrict__ a, const TB* __restrict__ b,
                                     TY* __restrict__ y, i64 n, F f) {
  constexpr int N = PackOf<TA, TB, TY>::N;
  if (aligned16(a, b, y)) {
    VEC_LOOP(q, n, N) {
      const Vec<TA, N> u = ldv<N>(a, q);
      const Vec<TB, N> v = ldv<N>(b, q);
      Vec<TY, N> r;
#pragma unroll
      for (int j = 0; j < N; ++j) r.v[j] = f((float)u.v[j], (float)v.v[j]);
      stv<N>(y, q, r);
    }
    VEC_TAIL(i, n, N) y[i] = f((float)a[i], (float)b[i]);
  } else {
    GRID_LOOP(i, n) y[i] = f((float)a[i], (float)b[i]);
  }
}

// FITS32 reports whether every index below n fits an unsigned 32-bit
// integer, so index arithmetic (divisions above all) may run in 32 bits.
#define FITS32(n) ((i64)(n) <= 0x7fffffffLL)

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }

__device__ __forceinline__ float neg_inf_f() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fffffff); }

// go_max is Go's builtin max (and math.Max): a NaN operand wins and +0 beats
// -0. CUDA's fmaxf returns the other operand for NaN, so it is not used.
__device__ __forceinline__ float go_max(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return __float_as_int(a) < 0 ? b : a;
  return a > b ? a : b;
}

__device__ __forceinline__ double go_max_d(double a, double b) {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return __double_as_longlong(a) < 0 ? b : a;
  return a > b ? a : b;
}

// Strided describes a gather over an index space of rank ≤ MAX_DIMS axes:
// the element at row-major position i of shape lies at Σ idx_d·stride_d of
// the source (stride 0 on a broadcast axis). Passed by value; its Go mirror
// is struct{ Rank int64; Shape, Stride [8]int64 } (136 bytes).
struct Strided {
  i64 rank;
  i64 shape[MAX_DIMS];
  i64 stride[MAX_DIMS];
};

// Strided2 is Strided for two operands a and b read at the same position;
// Go mirror struct{ Rank int64; Shape, SA, SB [8]int64 } (200 bytes).
struct Strided2 {
  i64 rank;
  i64 shape[MAX_DIMS];
  i64 sa[MAX_DIMS];
  i64 sb[MAX_DIMS];
};

// ReduceGeom splits a reduction's input axes into kept axes (one output per
// position) and reduced axes (combined into it), each with the input's
// strides; Go mirror struct{ KeptRank int64; KeptShape, KeptStride [8]int64;
// RedRank int64; RedShape, RedStride [8]int64 } (272 bytes).
struct ReduceGeom {
  i64 kept_rank;
  i64 kept_shape[MAX_DIMS];
  i64 kept_stride[MAX_DIMS];
  i64 red_rank;
  i64 red_shape[MAX_DIMS];
  i64 red_stride[MAX_DIMS];
};

// Window is the geometry of a 2-D convolution or pooling over NCHW data:
// n images of c channels of h×w, a kh×kw kernel with stride, zero padding
// and dilation, and the ho×wo output. Go mirror: 14 int64 fields in this
// order (112 bytes).
struct Window {
  i64 n, c, h, w;
  i64 kh, kw;
  i64 sh, sw;
  i64 ph, pw;
  i64 dh, dw;
  i64 ho, wo;
};

// Geom32 is a Window in 32-bit integers for index arithmetic inside one
// plane, where 64-bit divisions would dominate: every extent, kernel,
// stride, padding and dilation, and h·w and ho·wo, must be below 2^31.
struct Geom32 {
  int h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo;
};

__device__ __forceinline__ Geom32 geom32(const Window& wd) {
  Geom32 g;
  g.h = (int)wd.h; g.w = (int)wd.w; g.kh = (int)wd.kh; g.kw = (int)wd.kw;
  g.sh = (int)wd.sh; g.sw = (int)wd.sw; g.ph = (int)wd.ph; g.pw = (int)wd.pw;
  g.dh = (int)wd.dh; g.dw = (int)wd.dw; g.ho = (int)wd.ho; g.wo = (int)wd.wo;
  return g;
}

// cover_range gives the outputs o in [*lo, *hi] (empty when *lo > *hi) whose
// window along one axis may cover input i: o·s − p + k·d = i for some
// 0 ≤ k < kn. With d > 1, o covers i only when d divides i + p − o·s (tap
// k = (i + p − o·s)/d); with d = 1 every o in the range does.
__device__ __forceinline__ void cover_range(int i, int kn, int s, int p, int d, int out_n,
                                            int* lo, int* hi) {
  const int first = i + p - (kn - 1) * d;  // smallest o·s
  *lo = first <= 0 ? 0 : (first + s - 1) / s;
  *hi = min((i + p) / s, out_n - 1);
}

// offset_of maps row-major position i of shape to Σ idx_d·stride_d. I is
// the index type: unsigned when the caller has checked FITS32, since 64-bit
// division costs several times more.
template <typename I>
__device__ __forceinline__ i64 offset_of(I i, i64 rank, const i64* shape,
                                         const i64* stride) {
  i64 off = 0;
  for (int d = (int)rank - 1; d >= 0; --d) {
    const I s = (I)shape[d];
    const I q = i / s;
    off += (i64)(i - q * s) * stride[d];
    i = q;
  }
  return off;
}

// offset_of2 is offset_of for two stride sets over one shape.
template <typename I>
__device__ __forceinline__ void offset_of2(I i, const Strided2& g, i64* oa,
                                           i64* ob) {
  i64 a = 0, b = 0;
  for (int d = (int)g.rank - 1; d >= 0; --d) {
    const I s = (I)g.shape[d];
    const I q = i / s;
    const i64 k = (i64)(i - q * s);
    a += k * g.sa[d];
    b += k * g.sb[d];
    i = q;
  }
  *oa = a;
  *ob = b;
}

// report_bad records position k of an out-of-range index or label in *bad
// (see index.cu) unless bad is null.
__device__ __forceinline__ void report_bad(u64* bad, i64 k) {
  if (bad) atomicMin(bad, (u64)k);
}

struct SumOp {
  __device__ __forceinline__ double operator()(double a, double b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return go_max(a, b); }
};

// warp_allreduce combines v over the 32 lanes of a warp; every lane gets the
// same result (the xor butterfly pairs operands symmetrically).
template <typename T, typename Op>
__device__ __forceinline__ T warp_allreduce(T v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// row_allreduce combines v over the blockDim.x threads that share threadIdx.y
// (one row group of a row kernel) and gives every one of them the result.
// blockDim.x must be a multiple of 32 with blockDim.x·blockDim.y ≤ 1024, and
// every thread of the block must call it: it synchronises the block when a
// row spans several warps. scratch is a __shared__ array of 32 elements.
template <typename T, typename Op>
__device__ __forceinline__ T row_allreduce(T v, Op op, T* scratch) {
  v = warp_allreduce(v, op);
  if (blockDim.x == 32) return v;
  const unsigned wpr = blockDim.x >> 5;  // warps per row
  const unsigned first = threadIdx.y * wpr;
  __syncthreads();  // earlier readers of scratch are done
  if ((threadIdx.x & 31) == 0) scratch[first + (threadIdx.x >> 5)] = v;
  __syncthreads();
  T r = scratch[first];
  for (unsigned k = 1; k < wpr; ++k) r = op(r, scratch[first + k]);
  return r;
}

// ROW_VPT is how many values per thread per array the row kernels keep in
// registers: a row of n ≤ ROW_VPT·blockDim.x elements is read from memory
// once, a longer one is re-read on each pass. Both paths do the same
// arithmetic in the same order, so results do not depend on which ran,
// except in loss.cu's row_lse, whose long-row path is one online pass.
#define ROW_VPT 8

// row_each calls f(k, u) for the elements k = threadIdx.x + u·blockDim.x < n
// of a row, u ascending. With CACHED the loop is unrolled, so f may index a
// register array with u; otherwise u is 0 and f must read memory.
template <bool CACHED, typename F>
__device__ __forceinline__ void row_each(i64 n, F f) {
  if (CACHED) {
#pragma unroll
    for (int u = 0; u < ROW_VPT; ++u) {
      const i64 k = threadIdx.x + (i64)u * blockDim.x;
      if (k < n) f(k, u);
    }
  } else {
    for (i64 k = threadIdx.x; k < n; k += blockDim.x) f(k, 0);
  }
}

// row_fits reports whether a row of n elements fits the registers of a row
// group (uniform across the block).
__device__ __forceinline__ bool row_fits(i64 n) { return n <= (i64)ROW_VPT * blockDim.x; }

#endif  // BATCHFIT_COMMON_CUH
