// optim.cu: the optimizer updates of optim/optim.go, one thread per element
// and many parameters per launch.
//
// The arithmetic runs in double, as optim.go does, with products and sums
// through __dmul_rn / __dadd_rn / __dsub_rn so the compiler cannot fuse them
// into FMAs: given the same inputs and scalars the results equal optim.go's
// bit for bit (for a Go build that does not fuse either, as amd64 by
// default). Cost is nothing next to the memory traffic. Scalars that
// optim.go computes once per step (the bias corrections) come precomputed.
#include "common.cuh"

__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

// The optimizers' kernels update many parameters in one launch
// (PyTorch's multi-tensor apply): up to OPTIM_TENSORS parameters are listed
// by value in the parameter buffer (no device table to allocate), each
// with its gradient and state slots. Parameter t of a launch is p[t], its
// gradient g[t] and state s0[t], s1[t], elements off[t] to off[t+1] − 1 of
// the launch's flat range [0, off[count]). A thread finds the tensor of its
// first index by binary search; its indices grow, so after that the
// tensor index only moves forward. The struct is 2568 bytes, with the
// scalars 2640: well under the 4 KiB kernel parameter limit.
#define OPTIM_TENSORS 64
struct OptimList {
  float* p[OPTIM_TENSORS];
  const float* g[OPTIM_TENSORS];
  float* s0[OPTIM_TENSORS];  // SGD: the momentum buffer (null without momentum); Adam: m
  float* s1[OPTIM_TENSORS];  // Adam: v; SGD: unused
  i64 off[OPTIM_TENSORS + 1];
};

// optim_first is the tensor of this thread's first index of a grid-stride
// loop over [0, off[count]): the largest t < count with off[t] ≤ i, so an
// empty tensor (off[t] = off[t+1]) is never chosen; 0 when the thread has
// no index.
__device__ __forceinline__ int optim_first(const OptimList& l, i64 count) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= l.off[count]) return 0;
  int lo = 0, hi = (int)count - 1;  // off[lo] ≤ i < off[hi + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (l.off[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// sgd_multi_f32: SGD with momentum, dampening, Nesterov and L2 weight decay
// (torch.optim.SGD), for the count ≤ OPTIM_TENSORS parameters of l: each
// element of parameter p, gradient g and momentum buffer b = s0 (null when
// momentum = 0):
//   g ← g + wd·p;  b ← first ? g : μ·b + (1−τ)·g;  g ← nesterov ? g + μ·b : b;
//   p ← p − lr·g.
// first ≠ 0 on the optimizer's first step (optim.SGD's steps == 0). 1-D
// blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
sgd_multi_f32(OptimList l, i64 count, double lr, double momentum, double dampening, double wd,
              i64 nesterov, i64 first) {
  const double damp = 1.0 - dampening;
  int t = optim_first(l, count);
  GRID_LOOP(i, l.off[count]) {
    while (i >= l.off[t + 1]) ++t;
    const i64 j = i - l.off[t];
    float* p = l.p[t] + j;
    const double w = (double)*p;
    double gr = add_rn((double)l.g[t][j], mul_rn(wd, w));
    if (momentum != 0.0) {
      float* buf = l.s0[t] + j;
      double b = gr;
      if (!first) b = add_rn(mul_rn(momentum, (double)*buf), mul_rn(damp, gr));
      *buf = (float)b;
      gr = nesterov ? add_rn(gr, mul_rn(momentum, b)) : b;
    }
    *p = (float)sub_rn(w, mul_rn(lr, gr));
  }
}

// adam_multi_f32: Adam (decoupled = 0: L2 decay added to the gradient,
// torch.optim.Adam) or AdamW (decoupled ≠ 0: p ← p·(1 − lr·wd) first), for
// the count ≤ OPTIM_TENSORS parameters of l: each element of parameter p,
// gradient g and moments m = s0, v = s1:
//   m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;
//   p ← p − lr·(m/c1) / (√(v/c2) + eps)
// with c1 = 1 − β₁ᵗ and c2 = 1 − β₂ᵗ for step t (1-based), computed by the
// caller as optim.go does (math.Pow in float64). 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
adam_multi_f32(OptimList l, i64 count, double lr, double beta1, double beta2, double eps, double wd,
               double c1, double c2, i64 decoupled) {
  const double decay = sub_rn(1.0, mul_rn(lr, wd));
  const double b1c = 1.0 - beta1, b2c = 1.0 - beta2;
  int t = optim_first(l, count);
  GRID_LOOP(i, l.off[count]) {
    while (i >= l.off[t + 1]) ++t;
    const i64 j = i - l.off[t];
    float* p = l.p[t] + j;
    float* m = l.s0[t] + j;
    float* v = l.s1[t] + j;
    double w = (double)*p;
    double gr = (double)l.g[t][j];
    if (decoupled) w = mul_rn(w, decay);
    else gr = add_rn(gr, mul_rn(wd, w));
    const double mi = add_rn(mul_rn(beta1, (double)*m), mul_rn(b1c, gr));
    const double vi = add_rn(mul_rn(beta2, (double)*v), mul_rn(mul_rn(b2c, gr), gr));
    *m = (float)mi;
    *v = (float)vi;
    *p = (float)sub_rn(w, mul_rn(lr, mi / c1) / (add_rn(sqrt(vi / c2), eps)));
  }
}

// grad_unscale_f32: dynamic loss scaling's unscale and inf/NaN check
// (PyTorch's _amp_foreach_non_finite_check_and_unscale_), over up to
// UNSCALE_TENSORS float32 tensors in one launch. The tensors are listed
// by value in the parameter buffer (no device table to allocate): tensor t
// is p[t] with elements off[t] to off[t+1] − 1 of the launch's flat range
// [0, off[count]). Every element becomes g·inv, one float32 product (exact
// when inv is a power of two and the result is normal), and *found is set
// to 1.0f when any result is inf or NaN: a value that was one, or overflowed.
// Nothing clears *found: the caller zeroes it once per step, before the
// first launch, and reads it once after the last. A thread's indices grow,
// so its tensor index t only moves forward. 1-D blocks, any grid.
#define UNSCALE_TENSORS 64
struct UnscaleList {
  float* p[UNSCALE_TENSORS];
  i64 off[UNSCALE_TENSORS + 1];
};
extern "C" __global__ void __launch_bounds__(256)
grad_unscale_f32(UnscaleList l, i64 count, float inv, float* __restrict__ found) {
  const i64 n = l.off[count];
  unsigned bad = 0;
  i64 t = 0;
  GRID_LOOP(i, n) {
    while (i >= l.off[t + 1]) ++t;
    float* g = l.p[t] + (i - l.off[t]);
    const float v = *g * inv;
    *g = v;
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;  // exponent all ones: inf or NaN
  }
  if (bad) *found = 1.0f;
}
