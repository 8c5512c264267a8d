// batchnorm_check: batchnorm.cu's channels-last kernels run on the host
// emulation of emu.h against a float64 reference, for float32, bfloat16
// and float16: the vector path (batch_norm_rows_nhwc_vec_*, then
// batch_norm_coef / batch_norm_grad_coef over its row chunks, then
// batch_norm_nhwc_vec_* / batch_norm_grad_x_nhwc_vec_*) and the scalar
// path (batch_norm_rows_nhwc_*, the same per-channel kernels over n rows,
// batch_norm_nhwc_* / batch_norm_grad_x_nhwc_*), with exec/cuda's launch
// geometry (batchnorm.go: bnVecGeometry, ppt, rows) and with forced
// positions a thread (1, 3, 32) and grids smaller than the row chunks.
// Checked: y in training and evaluation mode, dx, the weight gradient
// Σg·x̂ and the bias gradient Σg (batch_norm_grad_coef's dw and db), and
// batch_norm_moments over NCHW row sums (batch_norm_rows_*). Channel
// counts cover one channel group (c = V), groups that fill no power of two
// (c = 24, 40), several tiles (c = 2048) and a last tile partly empty
// (c = 520). Tolerances: every output rounds once from double (the 16-bit
// maps' float32 arithmetic adds ~2⁻²³ of |x·scale| + |shift|), so one ulp
// of its dtype relative plus 1e-5 of the largest |value| (float32: 2⁻²²
// relative); the statistics' float32 partial sums are far below that.
// bn_emu.cc is batchnorm.cu as prep.py makes it; see run.
#include "bn_emu.cc"
#include "bufs.h"

#include <algorithm>
#include <random>
#include <string>

static int fails = 0;

static void check(const char* what, const std::string& name, const std::vector<double>& want, const Buf& got,
                  double rtol, double atolRel) {
  double big = 0;
  for (double w : want) big = std::max(big, std::fabs(w));
  const double atol = atolRel * big + 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get((i64)i);
    const double diff = std::fabs(g - want[i]);
    if (!(diff <= atol + rtol * std::fabs(want[i]))) {
      printf("FAIL %s %s element %zu: got %.9g, want %.9g\n", name.c_str(), what, i, g, want[i]);
      ++fails;
      return;
    }
  }
}

// Geometry is batchnorm.go's bnVecGeom.
struct Geometry {
  i64 v, groups, bx, by, tiles;
};
static const i64 kBlocks = 528, kPPT = 32, kUnroll = 4;
static Geometry geometry(DT dt, i64 c) {
  Geometry q;
  q.v = 16 / dtSize[dt];
  q.groups = c / q.v;
  q.bx = 1;
  while (q.bx < q.groups && q.bx < 32) q.bx *= 2;
  q.tiles = (q.groups + q.bx - 1) / q.bx;
  q.by = 256 / q.bx;
  return q;
}
static i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }
static i64 pptOf(const Geometry& q, i64 p) {
  return std::min<i64>(std::max<i64>(cdiv(p * q.tiles, q.by * kBlocks), 1), kPPT);
}

// Typed entry points, overloaded on a null T* (the dtype's tag), taking
// the device arrays as void*.
#define WRAP(T, S)                                                                                      \
  static void rows_vec(T*, const void* x, const void* g, double* part, i64 P, i64 c, i64 ppt) {         \
    batch_norm_rows_nhwc_vec_##S((const T*)x, (const T*)g, part, P, c, ppt);                            \
  }                                                                                                     \
  static void rows_nhwc(T*, const void* x, const void* g, double* part, i64 n, i64 hw, i64 c) {        \
    batch_norm_rows_nhwc_##S((const T*)x, (const T*)g, part, n, hw, c);                                 \
  }                                                                                                     \
  static void rows_nchw(T*, const void* x, const void* g, double* part, i64 rows, i64 inner) {         \
    batch_norm_rows_##S((const T*)x, (const T*)g, part, rows, inner);                                   \
  }                                                                                                     \
  static void map_vec(T*, const void* x, const double* coef, void* y, i64 P, i64 c) {                  \
    batch_norm_nhwc_vec_##S((const T*)x, coef, (T*)y, P, c);                                            \
  }                                                                                                     \
  static void map_nhwc(T*, const void* x, const double* coef, void* y, i64 total, i64 c) {             \
    batch_norm_nhwc_##S((const T*)x, coef, (T*)y, total, c);                                            \
  }                                                                                                     \
  static void dx_vec(T*, const void* g, const void* x, const double* coef, void* dx, i64 P, i64 c) {   \
    batch_norm_grad_x_nhwc_vec_##S((const T*)g, (const T*)x, coef, (T*)dx, P, c);                       \
  }                                                                                                     \
  static void dx_nhwc(T*, const void* g, const void* x, const double* coef, void* dx, i64 total, i64 c) { \
    batch_norm_grad_x_nhwc_##S((const T*)g, (const T*)x, coef, (T*)dx, total, c);                       \
  }
FOR_FLOATS(WRAP)
#undef WRAP
#define CALL(fn, ...)                              \
  do {                                             \
    if (dt == F32) fn((float*)nullptr, __VA_ARGS__); \
    else if (dt == BF16) fn((bf16*)nullptr, __VA_ARGS__); \
    else fn((f16*)nullptr, __VA_ARGS__);           \
  } while (0)

// run_case: n images of hw positions and c channels, channels last.
// vec picks the path; ppt > 0 forces the positions a thread (vector path),
// gridCap caps the sums' grid.
static void run_case(DT dt, i64 n, i64 hw, i64 c, bool vec, i64 ppt, i64 gridCap, std::mt19937& rng) {
  std::uniform_real_distribution<float> U(-1, 1);
  const i64 P = n * hw, total = P * c;
  Buf x(dt, total), g(dt, total), y(dt, total), ye(dt, total), dx(dt, total);
  Buf dw(dt, c), db(dt, c);
  std::vector<double> X(total), G(total), W(c), B(c), RM(c), RV(c);
  float *w = (float*)emu_alloc(4 * c), *b = (float*)emu_alloc(4 * c), *rm = (float*)emu_alloc(4 * c),
        *rv = (float*)emu_alloc(4 * c);
  for (i64 i = 0; i < total; ++i) {
    const i64 k = i % c;
    // A channel-dependent offset and scale, as activations have.
    X[i] = rnd(dt, U(rng) * (1 + 0.5f * (float)(k % 3)) + 2.0f * (float)(k % 5) - 3 + (k == 1 ? 3.0f : 0.0f));
    G[i] = rnd(dt, U(rng) + 0.25f * (float)(k % 4));
    x.set(i, (float)X[i]);
    g.set(i, (float)G[i]);
  }
  for (i64 k = 0; k < c; ++k) {
    w[k] = 0.5f + U(rng);
    b[k] = U(rng);
    rm[k] = U(rng);
    rv[k] = 0.5f + 0.5f * (U(rng) + 1);
    W[k] = w[k];
    B[k] = b[k];
    RM[k] = rm[k];
    RV[k] = rv[k];
  }
  const double eps = 1e-5;
  // The float64 reference, two passes per channel.
  std::vector<double> mean(c, 0), var(c, 0), ry(total), rye(total), rdx(total), rdw(c, 0), rdb(c, 0);
  for (i64 i = 0; i < total; ++i) mean[i % c] += X[i];
  for (i64 k = 0; k < c; ++k) mean[k] /= (double)P;
  for (i64 i = 0; i < total; ++i) var[i % c] += (X[i] - mean[i % c]) * (X[i] - mean[i % c]);
  for (i64 k = 0; k < c; ++k) var[k] /= (double)P;
  for (i64 i = 0; i < total; ++i) {
    const i64 k = i % c;
    const double rstd = 1 / std::sqrt(var[k] + eps), xh = (X[i] - mean[k]) * rstd;
    ry[i] = xh * W[k] + B[k];
    rye[i] = (X[i] - RM[k]) / std::sqrt(RV[k] + eps) * W[k] + B[k];
    rdw[k] += G[i] * xh;
    rdb[k] += G[i];
  }
  for (i64 i = 0; i < total; ++i) {
    const i64 k = i % c;
    const double rstd = 1 / std::sqrt(var[k] + eps), xh = (X[i] - mean[k]) * rstd;
    rdx[i] = rstd * W[k] * (G[i] - rdb[k] / (double)P - xh * rdw[k] / (double)P);
  }

  const Geometry q = geometry(dt, c);
  if (vec && (c % q.v != 0)) return;
  if (ppt <= 0) ppt = pptOf(q, P);
  const i64 rows = vec ? cdiv(P, q.by * ppt) : n;
  double* part = (double*)emu_alloc(32 * std::max<i64>(rows * c, 1));
  double* coef = (double*)emu_alloc(24 * c);
  const dim3u vblock = {(unsigned)q.bx, (unsigned)q.by, 1};
  const unsigned chGrid = (unsigned)cdiv(c, 8);
  auto sums = [&](const void* gp) {
    if (vec) {
      if (rows == 0) return;
      const unsigned grid = (unsigned)std::min<i64>(rows, gridCap);
      emu_launch3({grid, (unsigned)q.tiles, 1}, vblock, [&] { CALL(rows_vec, x.p, gp, part, P, c, ppt); });
    } else {
      emu_launch3({(unsigned)cdiv(c, 32), (unsigned)std::min<i64>(n, gridCap), 1}, {32, 16, 1},
                  [&] { CALL(rows_nhwc, x.p, gp, part, n, hw, c); });
    }
  };
  auto map = [&](Buf& out) {
    if (vec) {
      const unsigned grid = (unsigned)std::min<i64>(cdiv(P, q.by * kUnroll), gridCap);
      emu_launch3({grid, (unsigned)q.tiles, 1}, vblock, [&] { CALL(map_vec, x.p, coef, out.p, P, c); });
    } else {
      emu_launch(std::min<i64>(cdiv(total, 256), gridCap), 256, [&] { CALL(map_nhwc, x.p, coef, out.p, total, c); });
    }
  };
  // Training: statistics, the map.
  sums(nullptr);
  emu_launch3({chGrid, 1, 1}, {32, 8, 1}, [&] {
    batch_norm_coef(part, w, b, nullptr, nullptr, 0, coef, rows, c, P, eps);
  });
  map(y);
  // Evaluation: the running statistics, the same map.
  emu_launch3({chGrid, 1, 1}, {32, 8, 1}, [&] { batch_norm_coef(part, w, b, rm, rv, 0, coef, rows, c, P, eps); });
  map(ye);
  // The input gradient with its companions' Σg·x̂ and Σg.
  sums(g.p);
  const long long odt = dt == F32 ? 0 : dt == BF16 ? 1 : 2;
  emu_launch3({chGrid, 1, 1}, {32, 8, 1}, [&] {
    batch_norm_grad_coef(part, w, nullptr, nullptr, 0, coef, dw.p, odt, db.p, odt, rows, c, P, eps);
  });
  if (vec) {
    const unsigned grid = (unsigned)std::min<i64>(cdiv(P, q.by * kUnroll), gridCap);
    emu_launch3({grid, (unsigned)q.tiles, 1}, vblock, [&] { CALL(dx_vec, g.p, x.p, coef, dx.p, P, c); });
  } else {
    emu_launch(std::min<i64>(cdiv(total, 256), gridCap), 256, [&] { CALL(dx_nhwc, g.p, x.p, coef, dx.p, total, c); });
  }

  const double ulp = dt == F32 ? 1.0 / (1 << 22) : dt == BF16 ? 1.0 / (1 << 8) : 1.0 / (1 << 11);
  const std::string name = std::string(dtName[dt]) + (vec ? " vec" : " scalar") + " n=" + std::to_string(n) +
                           " hw=" + std::to_string(hw) + " c=" + std::to_string(c) + " ppt=" + std::to_string(ppt) +
                           " rows=" + std::to_string(rows) + " cap=" + std::to_string(gridCap);
  check("y", name, ry, y, ulp, 1e-5);
  check("y (evaluation)", name, rye, ye, ulp, 1e-5);
  check("dx", name, rdx, dx, ulp, 1e-5);
  check("dw", name, rdw, dw, ulp, 1e-5);
  check("db", name, rdb, db, ulp, 1e-5);
}

// moments_case: batch_norm_stats over NCHW x [n, c, inner]: batch_norm_rows
// then batch_norm_moments over n rows.
static void moments_case(DT dt, i64 n, i64 c, i64 inner, std::mt19937& rng) {
  std::uniform_real_distribution<float> U(-1, 1);
  const i64 total = n * c * inner;
  Buf x(dt, total), out(dt, 2 * c);
  std::vector<double> X(total), want(2 * c, 0);
  for (i64 i = 0; i < total; ++i) {
    X[i] = rnd(dt, U(rng) + (float)(i / inner % c % 4));
    x.set(i, (float)X[i]);
  }
  const double m = (double)(n * inner);
  for (i64 i = 0; i < total; ++i) want[i / inner % c] += X[i] / m;
  for (i64 i = 0; i < total; ++i) {
    const double d = X[i] - want[i / inner % c];
    want[c + i / inner % c] += d * d / (m - 1);
  }
  double* part = (double*)emu_alloc(32 * n * c);
  const i64 rows = n * c;
  const unsigned bx = inner <= 256 ? 32 : 128, by = inner <= 256 ? 8 : 2;
  emu_launch3({(unsigned)cdiv(rows, by), 1, 1}, {bx, by, 1}, [&] { CALL(rows_nchw, x.p, nullptr, part, rows, inner); });
  const long long odt = dt == F32 ? 0 : dt == BF16 ? 1 : 2;
  emu_launch3({(unsigned)cdiv(c, 8), 1, 1}, {32, 8, 1}, [&] { batch_norm_moments(part, out.p, odt, n, c, n * inner); });
  const double ulp = dt == F32 ? 1.0 / (1 << 22) : dt == BF16 ? 1.0 / (1 << 8) : 1.0 / (1 << 11);
  check("moments", std::string(dtName[dt]) + " n=" + std::to_string(n) + " c=" + std::to_string(c) + " inner=" +
        std::to_string(inner), want, out, ulp, 1e-6);
}

int main() {
  std::mt19937 rng(2027);
  struct Shape {
    i64 n, hw, c;
  };
  const Shape shapes[] = {{2, 49, 64}, {3, 7, 8}, {2, 9, 24}, {1, 13, 40}, {2, 5, 256}, {1, 3, 2048}, {2, 3, 520}, {1, 10, 5}, {4, 33, 12}};
  for (DT dt : {F32, BF16, F16})
    for (const Shape& s : shapes) {
      run_case(dt, s.n, s.hw, s.c, true, 0, 1 << 20, rng);
      run_case(dt, s.n, s.hw, s.c, false, 0, 1 << 20, rng);
    }
  // Forced positions a thread, and grids that loop over the chunks.
  for (DT dt : {F32, BF16}) {
    run_case(dt, 3, 100, 64, true, 1, 1 << 20, rng);
    run_case(dt, 3, 100, 64, true, 3, 2, rng);
    run_case(dt, 4, 400, 64, true, 32, 1, rng);
    run_case(dt, 2, 50, 256, true, 5, 3, rng);
  }
  for (DT dt : {F32, BF16, F16}) moments_case(dt, 3, 5, 17, rng);
  printf("%d failures\n", fails);
  return fails != 0;
}
