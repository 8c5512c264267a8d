// optim.cu: the optimizer updates of optim/optim.go, one thread per element
// (Adam: per pack of ADAM_PACK) and many parameters per launch, and the
// gradient norm of clipping.
//
// The arithmetic runs in double, as optim.go does, with products and sums
// through __dmul_rn / __dadd_rn / __dsub_rn so the compiler cannot fuse them
// into FMAs: given the same inputs and scalars the results equal optim.go's
// bit for bit (for a Go build that does not fuse either, as amd64 by
// default). Cost is nothing next to the memory traffic.
//
// Every number that changes from step to step (the learning rate of each
// group under a schedule, each parameter's bias corrections or fresh flag,
// the clip factor) is read from device scalars, never passed by value:
// the launches' arguments are addresses and counts, so a CUDA graph
// captured once replays every later step (exec/cuda/graphs.go). The host
// writes the scalars each step with optim_scalars_f64, outside the graph;
// the norm kernels write the clip factor inside it. The scalars are float64
// words at sc (planner.OptimizerScalarBytes):
//   sc[0] max norm (clipping), sc[1] the gradient norm, sc[2] the clip
//   factor (a float32 value), sc[3] unused;
//   group k's hyperparameters at sc[OPTIM_HEADER + 8k]:
//     Adam: lr, beta1, beta2, eps, weight decay, AdamW's decay 1 − lr·wd;
//     SGD:  lr, momentum, dampening, weight decay, nesterov (0 or 1);
//   parameter i's words at sc[params_at + 2i]: Adam c1 = 1 − β₁ᵗ,
//     c2 = 1 − β₂ᵗ for its own step t; SGD: fresh (1: its momentum buffer
//     starts from the gradient);
//   the norm kernels' partial results after them.
#include "common.cuh"

__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

#define OPTIM_HEADER 4
#define OPTIM_GROUP_WORDS 8

// The optimizers' kernels update many parameters in one launch
// (PyTorch's multi-tensor apply): up to OPTIM_TENSORS parameters are listed
// by value in the parameter buffer (no device table to allocate), each
// with its gradient, state slots and group. Parameter t of a launch is
// p[t], its gradient g[t] and state s0[t], s1[t], elements off[t] to
// off[t+1] − 1 of the launch's flat range [0, off[count]); its group is
// grp[t] and it is the step's parameter idx[t]. A thread finds the
// tensor of its first index by binary search; its indices grow, so after
// that the tensor index only moves forward. The struct is 3080 bytes, with
// the other arguments 3120: under the 4 KiB kernel parameter limit.
#define OPTIM_TENSORS 64
struct OptimList {
  float* p[OPTIM_TENSORS];
  const float* g[OPTIM_TENSORS];
  float* s0[OPTIM_TENSORS];  // SGD: the momentum buffer (null without momentum); Adam: m
  float* s1[OPTIM_TENSORS];  // Adam: v; SGD: unused
  i64 off[OPTIM_TENSORS + 1];
  int grp[OPTIM_TENSORS];
  int idx[OPTIM_TENSORS];
};

// optim_first is the tensor of index i, a thread's first of a grid-stride
// loop over [0, off[count]): the largest t < count with off[t] ≤ i, so an
// empty tensor (off[t] = off[t+1]) is never chosen; 0 when i is past the
// end.
__device__ __forceinline__ int optim_first(const OptimList& l, i64 count, i64 i) {
  if (i >= l.off[count]) return 0;
  int lo = 0, hi = (int)count - 1;  // off[lo] ≤ i < off[hi + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (l.off[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// clip_grad is gradient element g as the update reads it: times the clip
// factor in float32 (PyTorch's grad.mul_(clip_coef)) when clipping.
__device__ __forceinline__ double clip_grad(float g, i64 clip, float coef) {
  return clip ? (double)__fmul_rn(g, coef) : (double)g;
}

// sgd_multi_f32: SGD with momentum, dampening, Nesterov and L2 weight decay
// (torch.optim.SGD), for the count ≤ OPTIM_TENSORS parameters of l: each
// element of parameter p, gradient g and momentum buffer b = s0 (null when
// its group's momentum = 0), with its group's lr, μ, τ, wd, nesterov and
// its fresh flag from sc:
//   g ← g·coef (clip ≠ 0); g ← g + wd·p;
//   b ← fresh ? g : μ·b + (1−τ)·g;  g ← nesterov ? g + μ·b : b;  p ← p − lr·g.
// 1-D blocks, any grid.
extern "C" __global__ void __launch_bounds__(256)
sgd_multi_f32(OptimList l, i64 count, const double* __restrict__ sc, i64 params_at, i64 clip) {
  const float coef = clip ? (float)sc[2] : 1.0f;
  int t = optim_first(l, count, (i64)blockIdx.x * blockDim.x + threadIdx.x);
  int at = -1;  // the tensor whose scalars are loaded
  double lr = 0, momentum = 0, damp = 0, wd = 0;
  bool nesterov = false, fresh = false;
  GRID_LOOP(i, l.off[count]) {
    while (i >= l.off[t + 1]) ++t;
    if (t != at) {
      at = t;
      const double* h = sc + OPTIM_HEADER + OPTIM_GROUP_WORDS * l.grp[t];
      lr = h[0], momentum = h[1], damp = 1.0 - h[2], wd = h[3], nesterov = h[4] != 0.0;
      fresh = sc[params_at + 2 * l.idx[t]] != 0.0;
    }
    const i64 j = i - l.off[t];
    float* p = l.p[t] + j;
    const double w = (double)*p;
    double gr = add_rn(clip_grad(l.g[t][j], clip, coef), mul_rn(wd, w));
    if (momentum != 0.0) {
      float* buf = l.s0[t] + j;
      double b = gr;
      if (!fresh) b = add_rn(mul_rn(momentum, (double)*buf), mul_rn(damp, gr));
      *buf = (float)b;
      gr = nesterov ? add_rn(gr, mul_rn(momentum, b)) : b;
    }
    *p = (float)sub_rn(w, mul_rn(lr, gr));
  }
}

// AdamScalars is one parameter's Adam hyperparameters and bias corrections
// as adam_multi_f32 reads them from sc.
struct AdamScalars {
  double lr, beta1, beta2, eps, wd, decay, b1c, b2c, c1, c2;
};
__device__ __forceinline__ AdamScalars adam_scalars(const OptimList& l, int t, const double* __restrict__ sc, i64 params_at) {
  const double* h = sc + OPTIM_HEADER + OPTIM_GROUP_WORDS * l.grp[t];
  const double* q = sc + params_at + 2 * l.idx[t];
  return AdamScalars{h[0], h[1], h[2], h[3], h[4], h[5], 1.0 - h[1], 1.0 - h[2], q[0], q[1]};
}

// adam_elem updates one element: parameter w, gradient g, moments m, v.
__device__ __forceinline__ void adam_elem(const AdamScalars& a, float& p, float g, float& m, float& v, i64 decoupled, i64 clip,
                                          float coef) {
  double w = (double)p;
  double gr = clip_grad(g, clip, coef);
  if (decoupled) w = mul_rn(w, a.decay);
  else gr = add_rn(gr, mul_rn(a.wd, w));
  const double mi = add_rn(mul_rn(a.beta1, (double)m), mul_rn(a.b1c, gr));
  const double vi = add_rn(mul_rn(a.beta2, (double)v), mul_rn(mul_rn(a.b2c, gr), gr));
  m = (float)mi;
  v = (float)vi;
  p = (float)sub_rn(w, mul_rn(a.lr, mi / a.c1) / (add_rn(sqrt(vi / a.c2), a.eps)));
}

// adam_multi_f32: Adam (decoupled = 0: L2 decay added to the gradient,
// torch.optim.Adam) or AdamW (decoupled ≠ 0: p ← p·decay first), for
// the count ≤ OPTIM_TENSORS parameters of l: each element of parameter p,
// gradient g and moments m = s0, v = s1, with its group's lr, β₁, β₂, eps,
// wd, decay and its own bias corrections c1, c2 from sc:
//   g ← g·coef (clip ≠ 0); m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;
//   p ← p − lr·(m/c1) / (√(v/c2) + eps)
// with c1 = 1 − β₁ᵗ and c2 = 1 − β₂ᵗ for the parameter's step t
// (1-based), computed by the host as optim.go does (math.Pow in float64).
// Thread q takes the ADAM_PACK elements from ADAM_PACK·q of the flat
// range: when they lie in one parameter and its four arrays are aligned to
// a pack there, as one vector access each (the update is memory-bound: 28
// bytes an element), otherwise one by one. 1-D blocks covering
// ⌈off[count]/ADAM_PACK⌉ threads (adamPack in optimizer.go), any grid.
#define ADAM_PACK 4
extern "C" __global__ void __launch_bounds__(256)
adam_multi_f32(OptimList l, i64 count, const double* __restrict__ sc, i64 params_at, i64 decoupled, i64 clip) {
  constexpr int N = ADAM_PACK;
  const float coef = clip ? (float)sc[2] : 1.0f;
  const i64 n = l.off[count];
  const i64 stride = (i64)gridDim.x * blockDim.x;
  int t = optim_first(l, count, N * ((i64)blockIdx.x * blockDim.x + threadIdx.x));
  int at = -1;  // the tensor whose scalars a holds
  AdamScalars a{};
  for (i64 i0 = N * ((i64)blockIdx.x * blockDim.x + threadIdx.x); i0 < n; i0 += N * stride) {
    while (i0 >= l.off[t + 1]) ++t;
    if (t != at) at = t, a = adam_scalars(l, t, sc, params_at);
    const i64 j = i0 - l.off[t];
    float* p = l.p[t] + j;
    const float* g = l.g[t] + j;
    float* m = l.s0[t] + j;
    float* v = l.s1[t] + j;
    if (i0 + N <= l.off[t + 1] && (((u64)p | (u64)g | (u64)m | (u64)v) & (sizeof(float) * N - 1)) == 0) {
      Vec<float, N> pv = ldv<N>(p, 0), mv = ldv<N>(m, 0), vv = ldv<N>(v, 0);
      const Vec<float, N> gv = ldv<N>(g, 0);
#pragma unroll
      for (int e = 0; e < N; ++e) adam_elem(a, pv.v[e], gv.v[e], mv.v[e], vv.v[e], decoupled, clip, coef);
      stv<N>(p, 0, pv), stv<N>(m, 0, mv), stv<N>(v, 0, vv);
      continue;
    }
    for (i64 i = i0; i < i0 + N && i < n; ++i) {
      while (i >= l.off[t + 1]) ++t;
      if (t != at) at = t, a = adam_scalars(l, t, sc, params_at);
      const i64 k = i - l.off[t];
      adam_elem(a, l.p[t][k], l.g[t][k], l.s0[t][k], l.s1[t][k], decoupled, clip, coef);
    }
  }
}

// optim_scalars_f64: dst[i] = v[i] for i < n ≤ OPTIM_SCALARS: how the host
// writes a step's scalars (the values by value in the parameter buffer,
// queued on the stream like any launch, so the host never waits). One
// launch per OPTIM_SCALARS words; 1-D blocks covering n.
#define OPTIM_SCALARS 480
struct ScalarList {
  double v[OPTIM_SCALARS];
};
extern "C" __global__ void __launch_bounds__(256)
optim_scalars_f64(ScalarList s, i64 n, double* __restrict__ dst) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = s.v[i];
}

// nan_max is the larger of a and b, NaN when either is (torch.max's
// propagation; fmax would drop the NaN).
__device__ __forceinline__ double nan_max(double a, double b) {
  if (a != a) return a;
  if (b != b) return b;
  return b > a ? b : a;
}

// block_reduce combines each thread's acc over a block of 256 threads in
// a fixed order (a tree in shared memory): the sum, or with inf the NaN-
// propagating max; thread 0 gets the result.
__device__ __forceinline__ double block_reduce(double acc, i64 inf) {
  __shared__ double s[256];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned h = 128; h > 0; h >>= 1) {
    if (threadIdx.x < h) {
      const double o = s[threadIdx.x + h];
      s[threadIdx.x] = inf ? nan_max(s[threadIdx.x], o) : add_rn(s[threadIdx.x], o);
    }
    __syncthreads();
  }
  return s[0];
}

// grad_norm_partial_f32: the first step of the gradients' global norm
// (clip_grad_norm_): block b of the launch writes part[b], the sum of the
// squares (inf = 0) or the largest magnitude (inf ≠ 0, NaN-propagating) of
// the elements of the count ≤ OPTIM_TENSORS gradients of l that its
// threads visit, in double. Launched with exactly OPTIM_NORM_BLOCKS blocks
// of 256 threads, so every partial is written and the order of the sums is
// fixed: the norm is the same bits every step, as a resumed run needs.
#define OPTIM_NORM_BLOCKS 256
extern "C" __global__ void __launch_bounds__(256)
grad_norm_partial_f32(OptimList l, i64 count, double* __restrict__ part, i64 inf) {
  double acc = 0;
  int t = optim_first(l, count, (i64)blockIdx.x * blockDim.x + threadIdx.x);
  GRID_LOOP(i, l.off[count]) {
    while (i >= l.off[t + 1]) ++t;
    const double v = (double)l.g[t][i - l.off[t]];
    acc = inf ? nan_max(acc, fabs(v)) : add_rn(acc, mul_rn(v, v));
  }
  const double r = block_reduce(acc, inf);
  if (threadIdx.x == 0) part[blockIdx.x] = r;
}

// grad_norm_finish: one block of 256 threads combines the n partials at
// part (in a fixed order) into the norm, √sum (inf = 0) or the max, and
// writes sc[1] = norm and sc[2] = the clip factor as PyTorch computes it
// in float32: min(1, max_norm · (1/(norm + 1e-6))), max_norm = sc[0]
// (a NaN norm gives NaN, an infinite one 0).
extern "C" __global__ void __launch_bounds__(256)
grad_norm_finish(double* __restrict__ sc, const double* __restrict__ part, i64 n, i64 inf) {
  double acc = 0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc = inf ? nan_max(acc, part[i]) : add_rn(acc, part[i]);
  const double r = block_reduce(acc, inf);
  if (threadIdx.x == 0) {
    const double norm = inf ? r : sqrt(r);
    const float rec = 1.0f / __fadd_rn((float)norm, 1e-6f);
    float c = __fmul_rn(rec, (float)sc[0]);
    if (c > 1.0f) c = 1.0f;
    sc[1] = norm;
    sc[2] = (double)c;
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
