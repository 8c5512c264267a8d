// elementwise.cu: unary, scalar and broadcasting binary ops, the
// elementwise gradients (relu, gelu, maximum), causal_mask, the bias
// broadcast used before a GEMM with beta = 1, and cast. Every kernel is
// templated on its storage type and instantiated for float32, bfloat16 and
// float16 (FOR_FLOATS, common.cuh): 16-bit values compute in float32 and
// round once when stored.
//
// Precision follows exec/cpu: scalar ops compute in double and round once,
// as the CPU does, so they match it bit for bit; +, −, ·, / of two float
// operands are single IEEE operations and match too; pow goes through
// double pow like the CPU's math.Pow. Transcendental unary ops use CUDA's
// accurate float functions (never fast-math intrinsics) and agree with the
// CPU's double evaluation to a few ulp.
#include "common.cuh"

// The op codes U_*, S_* and B_* and the X-macros UNARY_OPS, SCALAR_OPS and
// BINARY_OPS over them come from opcodes.cuh (generated): a dispatch switch
// names no code, so a new op needs only its case in the *_fn template.

#define SQRT1_2_F 0.70710678118654752f
#define SQRT_2_OVER_PI_F 0.79788456080286536f
#define INV_SQRT_2PI_F 0.39894228040143268f
#define GELU_C_F 0.044715f

// sigmoid never takes exp of a large positive number: 1/(1 + e^−v) for
// v ≥ 0, e^v/(1 + e^v) below, with one exp and no branch (the numerator
// selected), bit for bit the two-sided form.
__device__ __forceinline__ float sigmoid_f(float v) {
  const float t = expf(-fabsf(v));
  return (v >= 0.f ? 1.f : t) / (1.f + t);
}

template <int OP>
__device__ __forceinline__ float unary_fn(float v) {
  switch (OP) {
    case U_NEG: return -v;
    case U_EXP: return expf(v);
    case U_LOG: return logf(v);
    case U_SQRT: return sqrtf(v);
    case U_ABS: return fabsf(v);
    case U_TANH: return tanhf(v);
    case U_SIGMOID: return sigmoid_f(v);
    case U_RELU: return v < 0.f ? 0.f : v;  // NaN passes through
    // 1 + erf(z) = erfc(−z) keeps the small left tail accurate.
    case U_GELU: return 0.5f * v * erfcf(-v * SQRT1_2_F);
    // 0.5·(1 + tanh(u)) = 1 / (1 + e^(−2u)), again without cancellation.
    case U_GELU_TANH: {
      const float u = SQRT_2_OVER_PI_F * (v + GELU_C_F * v * v * v);
      return v / (1.f + expf(-2.f * u));
    }
    case U_SIGN: return v > 0.f ? 1.f : (v < 0.f ? -1.f : v);  // 0, −0, NaN stay
    case U_SILU: return v * sigmoid_f(v);
  }
  return v;
}

template <int OP, typename T>
__device__ void unary_loop(const T* __restrict__ x, T* __restrict__ y, i64 n) {
  map1(x, y, n, [](float v) { return unary_fn<OP>(v); });
}

// unary_{f32,bf16,f16}: y[i] = op(x[i]) for i < n.
template <typename T>
__device__ void unary_t(const T* x, T* y, i64 n, i64 op) {
#define CASE(OP) \
  case OP: unary_loop<OP>(x, y, n); break;
  switch (op) { UNARY_OPS(CASE) }
#undef CASE
}
#if PART(0)
#define K(T, S)                                                                        \
  extern "C" __global__ void __launch_bounds__(256) unary_##S(const T* x, T* y, i64 n, i64 op) { \
    unary_t(x, y, n, op);                                                              \
  }
FOR_FLOATS(K)
#undef K
#endif

template <int OP>
__device__ __forceinline__ double scalar_fn(double v, double s) {
  switch (OP) {
    case S_ADD_SCALAR: return v + s;
    case S_SUB_SCALAR: return v - s;
    case S_RSUB_SCALAR: return s - v;
    case S_MUL_SCALAR: return v * s;
    case S_DIV_SCALAR: return v / s;
    case S_RDIV_SCALAR: return s / v;
    case S_POW_SCALAR: return pow(v, s);
    case S_MAXIMUM_SCALAR: return go_max_d(v, s);
  }
  return v;
}

template <int OP, typename T>
__device__ void scalar_loop(const T* __restrict__ x, T* __restrict__ y, i64 n, double s) {
  map1(x, y, n, [s](float v) { return (float)scalar_fn<OP>((double)v, s); });
}

// scalar_{f32,bf16,f16}: y[i] = float(double(x[i]) ∘ s), s being
// Attrs.Scalar as given (a 16-bit result rounds that float once more).
template <typename T>
__device__ void scalar_t(const T* x, T* y, i64 n, i64 op, double s) {
#define CASE(OP) \
  case OP: scalar_loop<OP>(x, y, n, s); break;
  switch (op) { SCALAR_OPS(CASE) }
#undef CASE
}
#if PART(0)
#define K(T, S)                                                                                   \
  extern "C" __global__ void __launch_bounds__(256) scalar_##S(const T* x, T* y, i64 n, i64 op, double s) { \
    scalar_t(x, y, n, op, s);                                                                     \
  }
FOR_FLOATS(K)
#undef K
#endif

template <int OP>
__device__ __forceinline__ float binary_fn(float a, float b) {
  switch (OP) {
    case B_ADD: return a + b;
    case B_SUB: return a - b;
    case B_MUL: return a * b;
    case B_DIV: return a / b;
    case B_POW: return (float)pow((double)a, (double)b);
    case B_MAXIMUM: return go_max(a, b);
  }
  return a;
}

template <int OP, typename TA, typename TB, typename TY>
__device__ void binary_loop(const TA* __restrict__ a, const TB* __restrict__ b,
                            TY* __restrict__ y, i64 n) {
  map2(a, b, y, n, [](float u, float v) { return binary_fn<OP>(u, v); });
}

// binary_{f32,bf16,f16}: y[i] = a[i] ∘ b[i], all three contiguous with n
// elements; binary_{f32_bf16,bf16_f32,f32_f16,f16_f32} are the promoting
// forms (graph.Promote): a and b of the two dtypes named, y float32.
template <typename TA, typename TB, typename TY>
__device__ void binary_t(const TA* a, const TB* b, TY* y, i64 n, i64 op) {
#define CASE(OP) \
  case OP: binary_loop<OP>(a, b, y, n); break;
  switch (op) { BINARY_OPS(CASE) }
#undef CASE
}
#if PART(1)
#define K(TA, TB, TY, S)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) binary_##S(const TA* a, const TB* b, TY* y, \
                                                               i64 n, i64 op) {                 \
    binary_t(a, b, y, n, op);                                                                  \
  }
#define K1(T, S) K(T, T, T, S)
FOR_FLOATS(K1)
MIXED_FLOATS(K)
#undef K1
#undef K
#endif

template <int OP, typename I, typename TA, typename TB, typename TY>
__device__ void bcast_loop(const TA* __restrict__ a, const TB* __restrict__ b,
                           TY* __restrict__ y, i64 n, const Strided2& g) {
  GRID_LOOP(i, n) {
    i64 oa, ob;
    offset_of2<I>((I)i, g, &oa, &ob);
    y[i] = binary_fn<OP>((float)a[oa], (float)b[ob]);
  }
}

template <int OP, typename TA, typename TB, typename TY>
__device__ void bcast_dispatch(const TA* a, const TB* b, TY* y, i64 n, const Strided2& g) {
  if (FITS32(n)) bcast_loop<OP, unsigned>(a, b, y, n, g);
  else bcast_loop<OP, u64>(a, b, y, n, g);
}

// binary_bcast_{f32,bf16,f16} and the promoting forms as binary_*: y
// (contiguous, shape g.shape, n elements) = a ∘ b with NumPy broadcasting:
// a's element for position i is at offset Σ idx·g.sa.
template <typename TA, typename TB, typename TY>
__device__ void binary_bcast_t(const TA* a, const TB* b, TY* y, i64 n, i64 op, const Strided2& g) {
#define CASE(OP) \
  case OP: bcast_dispatch<OP>(a, b, y, n, g); break;
  switch (op) { BINARY_OPS(CASE) }
#undef CASE
}
#if PART(3)
#define K(TA, TB, TY, S)                                                                  \
  extern "C" __global__ void __launch_bounds__(256) binary_bcast_##S(                     \
      const TA* a, const TB* b, TY* y, i64 n, i64 op, Strided2 g) {                       \
    binary_bcast_t(a, b, y, n, op, g);                                                    \
  }
#define K1(T, S) K(T, T, T, S)
FOR_FLOATS(K1)
MIXED_FLOATS(K)
#undef K1
#undef K
#endif

// relu_grad_{f32,bf16,f16}: out = y > 0 ? g : 0, y being relu's output.
template <typename T>
__device__ void relu_grad_t(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ out, i64 n) {
  map2(g, y, out, n, [](float gv, float yv) { return yv > 0.f ? gv : 0.f; });
}
#if PART(2)
#define K(T, S)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) relu_grad_##S(const T* g, const T* y, T* out, \
                                                                  i64 n) {            \
    relu_grad_t(g, y, out, n);                                                        \
  }
FOR_FLOATS(K)
#undef K
#endif

// gelu_grad_{f32,bf16,f16}: out = g · gelu'(x), exact (approx = 0) or tanh form.
template <typename T>
__device__ void gelu_grad_t(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ out,
                            i64 n, i64 approx) {
  if (approx) {
    map2(g, x, out, n, [](float gv, float v) {
      const float u = SQRT_2_OVER_PI_F * (v + GELU_C_F * v * v * v);
      // With t = tanh(u): 0.5(1+t) = σ(2u) and 0.5(1−t²) = 2σ(2u)σ(−2u).
      const float sp = 1.f / (1.f + expf(-2.f * u));
      const float sm = 1.f / (1.f + expf(2.f * u));
      const float d = sp + 2.f * v * sp * sm * SQRT_2_OVER_PI_F * (1.f + 3.f * GELU_C_F * v * v);
      return gv * d;
    });
    return;
  }
  map2(g, x, out, n, [](float gv, float v) {
    const float cdf = 0.5f * erfcf(-v * SQRT1_2_F);
    const float pdf = expf(-0.5f * v * v) * INV_SQRT_2PI_F;
    return gv * (cdf + v * pdf);
  });
}
#if PART(2)
#define K(T, S)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) gelu_grad_##S(const T* g, const T* x, T* out, \
                                                                  i64 n, i64 approx) { \
    gelu_grad_t(g, x, out, n, approx);                                                \
  }
FOR_FLOATS(K)
#undef K
#endif

// unary_grad_fn<OP>(g, v) is g · op'(v) for the unary ops whose gradient
// op unary_grad_* computes from the forward input (those with a Grad in
// exec/cuda's unary codes); any other OP gives NaN, never a silent 0.
template <int OP>
__device__ __forceinline__ float unary_grad_fn(float gv, float v) {
  switch (OP) {
    case U_SILU: {  // s + v·s·(1 − s), s = sigmoid(v)
      const float s = sigmoid_f(v);
      return gv * (s * (1.f + v * (1.f - s)));
    }
  }
  return __int_as_float(0x7fc00000);
}

// unary_grad_{f32,bf16,f16}: out = g · op'(x), op a unary op code.
template <typename T>
__device__ void unary_grad_t(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ out,
                             i64 n, i64 op) {
#define CASE(OP) \
  case OP: map2(g, x, out, n, [](float gv, float v) { return unary_grad_fn<OP>(gv, v); }); break;
  switch (op) { UNARY_OPS(CASE) }
#undef CASE
}
#if PART(2)
#define K(T, S)                                                                        \
  extern "C" __global__ void __launch_bounds__(256) unary_grad_##S(const T* g, const T* x, T* out, \
                                                                   i64 n, i64 op) {    \
    unary_grad_t(g, x, out, n, op);                                                    \
  }
FOR_FLOATS(K)
#undef K
#endif

// maximum_share is ∂max(p, q)/∂p: 1 where p wins, ½ on a tie, else 0.
__device__ __forceinline__ float maximum_share(float p, float q) {
  return p > q ? 1.f : (p == q ? 0.5f : 0.f);
}

// maximum_scalar_grad_{f32,bf16,f16}: out = g · ∂max(x, s)/∂x with s = float(Scalar).
template <typename T>
__device__ void maximum_scalar_grad_t(const T* __restrict__ g, const T* __restrict__ x,
                                      T* __restrict__ out, i64 n, float s) {
  map2(g, x, out, n, [s](float gv, float v) { return maximum_share(v, s) * gv; });
}
#if PART(2)
#define K(T, S)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) maximum_scalar_grad_##S(             \
      const T* g, const T* x, T* out, i64 n, float s) {                                  \
    maximum_scalar_grad_t(g, x, out, n, s);                                              \
  }
FOR_FLOATS(K)
#undef K
#endif

template <typename I, typename T>
__device__ void maximum_grad_loop(const T* __restrict__ g, const T* __restrict__ a,
                                  const T* __restrict__ b, T* __restrict__ out, i64 n,
                                  i64 which, const Strided2& geo) {
  GRID_LOOP(i, n) {
    i64 oa, ob;
    offset_of2<I>((I)i, geo, &oa, &ob);
    float p = a[oa], q = b[ob];
    if (which == 1) {
      const float t = p;
      p = q;
      q = t;
    }
    out[i] = maximum_share(p, q) * (float)g[i];
  }
}

// maximum_grad_{f32,bf16,f16}: the gradient of maximum(a, b) for operand
// `which` (0: a, 1: b; Attrs.Axis) at the broadcast shape: out[i] = g[i] ·
// share, where a and b are read through geo's strides as in binary_bcast_*;
// g and out are contiguous over geo.shape.
#if PART(2)
#define K(T, S)                                                                              \
  extern "C" __global__ void __launch_bounds__(256) maximum_grad_##S(                        \
      const T* g, const T* a, const T* b, T* out, i64 n, i64 which, Strided2 geo) {          \
    if (FITS32(n)) maximum_grad_loop<unsigned>(g, a, b, out, n, which, geo);                 \
    else maximum_grad_loop<u64>(g, a, b, out, n, which, geo);                                \
  }
FOR_FLOATS(K)
#undef K
#endif

template <typename I, typename T>
__device__ __forceinline__ void causal_mask_loop(const T* __restrict__ x, T* __restrict__ y,
                                                 i64 n, I t, I s, float fill) {
  const i64 shift = (i64)s - (i64)t;
  constexpr int N = PackOf<T>::N;
  T f;
  f = fill;
  if ((i64)s % N == 0 && aligned16(x, y)) {
    // A pack never straddles a row: one division per pack, and a pack
    // wholly above the diagonal is written without being read (about half
    // of a causal score matrix).
    const I ps = s / (I)N;
    VEC_LOOP(q, n, N) {
      const I r = (I)q / ps;
      const i64 j0 = (i64)((I)q - r * ps) * N;
      const i64 last = (i64)(r % t) + shift;  // columns j > last are masked
      Vec<T, N> v;
      if (j0 > last) {
#pragma unroll
        for (int e = 0; e < N; ++e) v.v[e] = f;
      } else {
        v = ldv<N>(x, q);
        if (j0 + N - 1 > last) {
#pragma unroll
          for (int e = 0; e < N; ++e)
            if (j0 + e > last) v.v[e] = f;
        }
      }
      stv<N>(y, q, v);
    }
    return;
  }
  GRID_LOOP(k, n) {
    const I r = (I)k / s;
    const I j = (I)k - r * s;
    const I i = r % t;
    if ((i64)j > (i64)i + shift) y[k] = f;
    else y[k] = x[k];
  }
}

// causal_mask_{f32,bf16,f16}: y = x, except y[..., i, j] = fill where j > i
// + s − t, for x of shape [..., t, s] with n elements in all; launched with
// one thread per pack (any grid is correct).
#if PART(2)
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) causal_mask_##S(                           \
      const T* __restrict__ x, T* __restrict__ y, i64 n, i64 t, i64 s, float fill) {           \
    if (FITS32(n)) causal_mask_loop<unsigned>(x, y, n, (unsigned)t, (unsigned)s, fill);        \
    else causal_mask_loop<u64>(x, y, n, (u64)t, (u64)s, fill);                                 \
  }
FOR_FLOATS(K)
#undef K
#endif

// bias_fill_{f32,bf16,f16}: out[(o·c + k)·inner + i] = b[k] for out of shape
// [outer, c, inner]: linear's [rows, out] (inner = 1) and conv2d's
// [N, O, Ho·Wo]. A GEMM with beta = 1 then adds the product, as on the CPU,
// so the sum rounds once. 16-byte packs when a pack holds consecutive
// biases (inner = 1) or one channel's (inner a multiple of the pack);
// launched with one thread per pack (any grid is correct).
template <typename I, typename T>
__device__ __forceinline__ bool bias_fill_packs(T* __restrict__ out, const T* __restrict__ b, i64 n,
                                                I c, I inner) {
  constexpr int N = PackOf<T>::N;
  if (inner == 1 && c % N == 0 && aligned16(out, b)) {  // a pack is N consecutive biases
    const I cp = c / (I)N;
    VEC_LOOP(q, n, N) stv<N>(out, q, ldv<N>(b, (I)q % cp));
    return true;
  }
  if (inner % N == 0 && aligned16(out)) {  // a pack lies within one channel
    const I ip = inner / (I)N;
    VEC_LOOP(q, n, N) {
      Vec<T, N> r;
      const T v = b[((I)q / ip) % c];
#pragma unroll
      for (int e = 0; e < N; ++e) r.v[e] = v;
      stv<N>(out, q, r);
    }
    return true;
  }
  return false;
}

template <typename T>
__device__ void bias_fill_t(T* __restrict__ out, const T* __restrict__ b, i64 outer, i64 c, i64 inner) {
  const i64 n = outer * c * inner;
  if (FITS32(n) ? bias_fill_packs<unsigned>(out, b, n, (unsigned)c, (unsigned)inner)
                : bias_fill_packs<u64>(out, b, n, (u64)c, (u64)inner))
    return;
  if (FITS32(n)) {
    const unsigned ci = (unsigned)c, in = (unsigned)inner;
    GRID_LOOP(k, n) out[k] = b[((unsigned)k / in) % ci];
  } else {
    GRID_LOOP(k, n) out[k] = b[(k / inner) % c];
  }
}
#if PART(2)
#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) bias_fill_##S(T* out, const T* b, i64 outer, \
                                                                  i64 c, i64 inner) {          \
    bias_fill_t(out, b, outer, c, inner);                                                       \
  }
FOR_FLOATS(K)
#undef K
#endif

// cast_<from>_<to>: y[i] = x[i] converted between float dtypes, rounding to
// nearest even when the target is narrower (a copy when they agree).
template <typename TX, typename TY>
__device__ void cast_t(const TX* __restrict__ x, TY* __restrict__ y, i64 n) {
  map1(x, y, n, [](float v) { return v; });
}
#if PART(2)
#define K(TX, SX, TY, SY)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) cast_##SX##_##SY(const TX* x, TY* y, i64 n) { \
    cast_t(x, y, n);                                                                               \
  }
#define FROM(TX, SX) K(TX, SX, float, f32) K(TX, SX, bf16, bf16) K(TX, SX, f16, f16)
FOR_FLOATS(FROM)
#undef FROM
#undef K
#endif
