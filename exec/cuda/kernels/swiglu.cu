// swiglu.cu: y = silu(gate)·up (graph.OpSwiGLU) and its two gradients in
// one pass. silu(x) = x·σ(x), σ(x) = 1/(1 + e^−x) with the accurate expf;
// arithmetic in float32, each output rounded once into its storage type.
#include "common.cuh"

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// swiglu_{f32,bf16,f16}: y[i] = silu(gate[i])·up[i] for i < n (map2's
// vector path when the arrays are 16-byte aligned). Flat layout, one
// thread per pack.
#define K(T, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) swiglu_##S(const T* gate, const T* up, T* y, \
                                                               i64 n) {                        \
    map2(gate, up, y, n, [](float a, float b) { return a * sigmoid_f(a) * b; });                \
  }
FOR_FLOATS(K)
#undef K

// swiglu_grad_one computes element i's gradients: d gate = g·up·σ·(1 +
// gate·(1 − σ)) into dg, d up = g·silu(gate) into du (either may be null).
template <typename T>
__device__ __forceinline__ void swiglu_grad_one(float g, float a, float b, T* dg, T* du, i64 i) {
  const float s = sigmoid_f(a);
  if (dg) dg[i] = g * b * s * (1.0f + a * (1.0f - s));
  if (du) du[i] = g * a * s;
}

// swiglu_grad_{f32,bf16,f16}: from g, gate and up (n elements each) the
// gate's gradient into dg and up's into du, either null when not wanted:
// swiglu_grad with Axis 0 and its Axis 1 companion
// (graph.SwiGLUGradProducer) in one read of the three. The vector path
// (every array 16-byte aligned) reads and writes 16 bytes a pack. Flat
// layout, one thread per pack.
template <typename T>
__device__ __forceinline__ void swiglu_grad_t(const T* __restrict__ g, const T* __restrict__ a,
                                              const T* __restrict__ b, T* __restrict__ dg,
                                              T* __restrict__ du, i64 n) {
  constexpr int N = PackOf<T>::N;
  if (aligned16(g, a, b) && aligned16(dg, du)) {
    VEC_LOOP(q, n, N) {
      const Vec<T, N> gv = ldv<N>(g, q), av = ldv<N>(a, q), bv = ldv<N>(b, q);
      Vec<T, N> rg, ru;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float x = (float)av.v[j], s = sigmoid_f(x), gg = (float)gv.v[j];
        rg.v[j] = gg * (float)bv.v[j] * s * (1.0f + x * (1.0f - s));
        ru.v[j] = gg * x * s;
      }
      if (dg) stv<N>(dg, q, rg);
      if (du) stv<N>(du, q, ru);
    }
    VEC_TAIL(i, n, N) swiglu_grad_one((float)g[i], (float)a[i], (float)b[i], dg, du, i);
  } else {
    GRID_LOOP(i, n) swiglu_grad_one((float)g[i], (float)a[i], (float)b[i], dg, du, i);
  }
}

#define K(T, S)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) swiglu_grad_##S(                            \
      const T* g, const T* gate, const T* up, T* dg, T* du, i64 n) {                            \
    swiglu_grad_t(g, gate, up, dg, du, n);                                                      \
  }
FOR_FLOATS(K)
#undef K
