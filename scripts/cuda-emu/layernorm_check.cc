// layernorm_check: layernorm.cu's fused backward pass
// (layer_norm_grad_fused_* and layer_norm_grad_wb_*) run on the host
// emulation of emu.h against a float64 reference of dx, Σ g·x̂ and Σ g,
// for float32, bfloat16 and float16, with and without a weight, over
// shapes with d below, at and above a multiple of the block, rows that no
// grid divides, and grids smaller than the rows (the group loop and its
// loads ahead). dx is also held to layer_norm_grad_x_*, emulated the same
// way. Tolerances: dx rounds once from double, so one ulp of its dtype
// relative plus 1e-6 of the largest |dx| (float32: 2⁻²²); the sums add
// float partials of at most rows/groups rows each, so float32 is held to
// 1e-5 relative plus 1e-5 of the largest sum, 16-bit to one ulp plus that.
// ln_emu.cc is layernorm.cu as prep.py makes it; see run.
#include "ln_emu.cc"
#include "bufs.h"

#include <algorithm>
#include <random>
#include <string>

// The launch geometry of exec/cuda/norm.go (lnFusedBlock, lnFusedGroups)
// on a device that holds any grid at once.
static void geometry(i64 rows, i64 d, unsigned* bx, unsigned* by, i64* grid) {
  i64 x = ((d + 7) / 8 + 31) / 32 * 32;
  if (x < 32) x = 32;
  *bx = (unsigned)x;
  *by = (unsigned)std::max<i64>(128 / x, 1);
  *grid = std::max<i64>(std::min<i64>((rows + *by * 8 - 1) / (*by * 8), 1024 / *by), 1);
}

static int fails = 0;

static void check(const char* what, const std::string& name, const std::vector<double>& want,
                  const std::vector<float>& got, double rtol, double atolRel) {
  double big = 0;
  for (double w : want) big = std::max(big, std::fabs(w));
  const double atol = atolRel * big + 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = std::fabs((double)got[i] - want[i]);
    if (!(diff <= atol + rtol * std::fabs(want[i]))) {
      printf("FAIL %s %s element %zu: got %.9g, want %.9g\n", name.c_str(), what, i, got[i], want[i]);
      ++fails;
      return;
    }
  }
}

// run_case checks the fused pass; with residual it adds res to dx (as
// layer_norm_grad_x_add) and, in float32, writes the bfloat16 and float16
// copies of the sum, which must equal dx rounded exactly.
static void run_case(DT dt, i64 rows, i64 d, bool weight, i64 gridCap, bool wantW, bool wantB, std::mt19937& rng,
                     bool residual = false) {
  std::uniform_real_distribution<float> U(-1, 1);
  const i64 n = rows * d;
  Buf g(dt, n), x(dt, n), w(dt, d), dx(dt, n), dx0(dt, n), dw(dt, d), db(dt, d), res(dt, n), ob(BF16, n), oh(F16, n);
  for (i64 i = 0; i < n; ++i) res.set(i, rnd(dt, 2 * U(rng)));
  std::vector<double> G(n), X(n), W(d, 1.0);
  for (i64 i = 0; i < n; ++i) {
    // x has a per-row offset and scale, as activations do.
    const float r = (float)(i / d % 7) - 3;
    X[i] = rnd(dt, U(rng) * (1 + 0.5f * (float)(i / d % 3)) + r);
    G[i] = rnd(dt, U(rng));
    x.set(i, (float)X[i]);
    g.set(i, (float)G[i]);
  }
  if (weight)
    for (i64 k = 0; k < d; ++k) {
      W[k] = rnd(dt, 0.5f + U(rng));
      w.set(k, (float)W[k]);
    }
  const double eps = 1e-5;
  std::vector<double> rdx(n), rdw(d, 0), rdb(d, 0);
  for (i64 r = 0; r < rows; ++r) {
    const double* xr = &X[r * d];
    const double* gr = &G[r * d];
    double m = 0, q = 0;
    for (i64 k = 0; k < d; ++k) m += xr[k];
    m /= d;
    for (i64 k = 0; k < d; ++k) q += (xr[k] - m) * (xr[k] - m);
    const double rstd = 1 / std::sqrt(q / d + eps);
    double sg = 0, sgx = 0;
    for (i64 k = 0; k < d; ++k) {
      const double xh = (xr[k] - m) * rstd, gh = gr[k] * W[k];
      sg += gh;
      sgx += gh * xh;
      rdw[k] += gr[k] * xh;
      rdb[k] += gr[k];
    }
    sg /= d;
    sgx /= d;
    for (i64 k = 0; k < d; ++k) rdx[r * d + k] = rstd * (gr[k] * W[k] - sg - (xr[k] - m) * rstd * sgx);
  }

  unsigned bx, by;
  i64 grid;
  geometry(rows, d, &bx, &by, &grid);
  grid = std::min(grid, gridCap);
  const i64 groups = grid * by;
  float* part = (float*)emu_alloc(2 * groups * d * 4);
  void* wp = weight ? w.p : nullptr;
  void* rp = residual ? res.p : nullptr;
  bf16* obp = residual && dt == F32 ? (bf16*)ob.p : nullptr;
  f16* ohp = residual && dt == F32 ? (f16*)oh.p : nullptr;
  emu_launch3({(unsigned)grid, 1, 1}, {bx, by, 1}, [&] {
    if (dt == F32) layer_norm_grad_fused_f32((float*)g.p, (float*)x.p, (float*)wp, (float*)dx.p, part, rows, d, eps, (float*)rp, obp, ohp);
    else if (dt == BF16) layer_norm_grad_fused_bf16((bf16*)g.p, (bf16*)x.p, (bf16*)wp, (bf16*)dx.p, part, rows, d, eps, (bf16*)rp, obp, ohp);
    else layer_norm_grad_fused_f16((f16*)g.p, (f16*)x.p, (f16*)wp, (f16*)dx.p, part, rows, d, eps, (f16*)rp, obp, ohp);
  });
  void* dwp = wantW ? dw.p : nullptr;
  void* dbp = wantB ? db.p : nullptr;
  emu_launch3({(unsigned)((d + 31) / 32), 2, 1}, {32, 32, 1}, [&] {
    if (dt == F32) layer_norm_grad_wb_f32(part, (float*)dwp, (float*)dbp, groups, d);
    else if (dt == BF16) layer_norm_grad_wb_bf16(part, (bf16*)dwp, (bf16*)dbp, groups, d);
    else layer_norm_grad_wb_f16(part, (f16*)dwp, (f16*)dbp, groups, d);
  });
  // The unfused kernel, rowBlock's layout (exec/cuda/launch.go).
  const unsigned rbx = d <= 256 ? 32 : d <= 1024 ? 128 : d <= 2048 ? 256 : 512;
  const unsigned rby = d <= 256 ? 8 : d <= 1024 ? 2 : 1;
  emu_launch3({(unsigned)std::min<i64>((rows + rby - 1) / rby, 64), 1, 1}, {rbx, rby, 1}, [&] {
    if (dt == F32) layer_norm_grad_x_f32((float*)g.p, (float*)x.p, (float*)wp, (float*)dx0.p, rows, d, eps);
    else if (dt == BF16) layer_norm_grad_x_bf16((bf16*)g.p, (bf16*)x.p, (bf16*)wp, (bf16*)dx0.p, rows, d, eps);
    else layer_norm_grad_x_f16((f16*)g.p, (f16*)x.p, (f16*)wp, (f16*)dx0.p, rows, d, eps);
  });

  const double ulp = dt == F32 ? 1.0 / (1 << 22) : dt == BF16 ? 1.0 / (1 << 8) : 1.0 / (1 << 11);
  std::string name = std::string(dtName[dt]) + " rows=" + std::to_string(rows) + " d=" + std::to_string(d) +
                     (weight ? " w" : " no-w") + " grid=" + std::to_string(grid) + "x" + std::to_string(by) +
                     (residual ? " +res" : "");
  std::vector<float> got(n), got0(n), gw(d), gb(d);
  std::vector<double> dx0d(n);
  for (i64 i = 0; i < n; ++i) {
    got[i] = dx.get(i);
    got0[i] = dx0.get(i);
    dx0d[i] = got0[i];
  }
  if (residual) {
    // dx rounds, then res is added and the sum rounds: the reference
    // rounds where the kernel does, and dx's own rounding may differ by
    // an ulp of dx, which the sum carries (rtol 2 ulp, atol an ulp of
    // the largest sum).
    std::vector<double> want(n), want0(n);
    for (i64 i = 0; i < n; ++i) {
      want[i] = rnd(dt, rnd(dt, (float)rdx[i]) + res.get(i));
      want0[i] = rnd(dt, got0[i] + res.get(i));
    }
    check("dx + res", name, want, got, 2 * ulp, ulp);
    check("dx + res vs layer_norm_grad_x + res", name, want0, got, 2 * ulp, ulp);
    if (dt == F32)
      for (i64 i = 0; i < n; ++i)
        if (ob.get(i) != rnd(BF16, got[i]) || oh.get(i) != rnd(F16, got[i])) {
          if (fails++ < 20)
            printf("FAIL %s: 16-bit copies of %g are %g, %g; want %g, %g\n", name.c_str(), got[i], ob.get(i), oh.get(i),
                   rnd(BF16, got[i]), rnd(F16, got[i]));
        }
  } else {
    check("dx", name, rdx, got, ulp, 1e-6);
    check("dx vs layer_norm_grad_x", name, dx0d, got, ulp, 1e-6);
  }
  const double srt = dt == F32 ? 1e-5 : ulp;
  if (wantW) {
    for (i64 k = 0; k < d; ++k) gw[k] = dw.get(k);
    check("dw", name, rdw, gw, srt, 1e-5);
  }
  if (wantB) {
    for (i64 k = 0; k < d; ++k) gb[k] = db.get(k);
    check("db", name, rdb, gb, srt, 1e-5);
  }
}

// add_case checks add_layer_norm_<b>_<y> (the add with its companion
// layer norm) against a float64 reference: s = a + b in float, exactly,
// with b's rows broadcast over a's (brows dividing rows), and y the layer
// norm of s in double rounded once to y's dtype (one ulp of it relative
// plus 1e-6 of the largest |y|).
// With w4 the one-warp-a-row add_layer_norm_w4_* runs instead (d a
// multiple of 128, at most 1024), held to the same reference.
static void add_case(DT bt, DT yt, i64 rows, i64 brows, i64 d, bool affine, std::mt19937& rng, bool w4 = false) {
  std::uniform_real_distribution<float> u(-2, 2);
  const i64 n = rows * d;
  Buf a(F32, n), b(bt, brows * d), w(F32, d), bias(F32, d), sum(F32, n), y(yt, n);
  for (i64 i = 0; i < n; ++i) a.set(i, u(rng));
  for (i64 i = 0; i < brows * d; ++i) b.set(i, u(rng));
  for (i64 k = 0; k < d; ++k) {
    w.set(k, u(rng));
    bias.set(k, u(rng));
  }
  const double eps = 1e-5;
  std::vector<double> rs(n), ry(n);
  for (i64 r = 0; r < rows; ++r) {
    double m = 0, q = 0;
    for (i64 k = 0; k < d; ++k) {
      rs[r * d + k] = (float)(a.get(r * d + k) + b.get((r % brows) * d + k));
      m += rs[r * d + k];
    }
    m /= d;
    for (i64 k = 0; k < d; ++k) q += (rs[r * d + k] - m) * (rs[r * d + k] - m);
    const double rstd = 1 / std::sqrt(q / d + eps);
    for (i64 k = 0; k < d; ++k) {
      double v = (rs[r * d + k] - m) * rstd;
      if (affine) v = v * w.get(k) + bias.get(k);
      ry[r * d + k] = v;
    }
  }
  const unsigned rbx = d <= 256 ? 32 : d <= 1024 ? 128 : d <= 2048 ? 256 : 512;
  const unsigned rby = d <= 256 ? 8 : d <= 1024 ? 2 : 1;
  float* wp = affine ? (float*)w.p : nullptr;
  float* bp = affine ? (float*)bias.p : nullptr;
  if (w4)
    emu_launch3({(unsigned)std::min<i64>((rows + 7) / 8, 64), 1, 1}, {256, 1, 1}, [&] {
      if (bt == F32 && yt == F32) add_layer_norm_w4_f32_f32((float*)a.p, (float*)b.p, brows, wp, bp, (float*)sum.p, (float*)y.p, rows, d, eps);
      if (bt == F32 && yt == BF16) add_layer_norm_w4_f32_bf16((float*)a.p, (float*)b.p, brows, wp, bp, (float*)sum.p, (bf16*)y.p, rows, d, eps);
      if (bt == F32 && yt == F16) add_layer_norm_w4_f32_f16((float*)a.p, (float*)b.p, brows, wp, bp, (float*)sum.p, (f16*)y.p, rows, d, eps);
      if (bt == BF16 && yt == F32) add_layer_norm_w4_bf16_f32((float*)a.p, (bf16*)b.p, brows, wp, bp, (float*)sum.p, (float*)y.p, rows, d, eps);
      if (bt == BF16 && yt == BF16) add_layer_norm_w4_bf16_bf16((float*)a.p, (bf16*)b.p, brows, wp, bp, (float*)sum.p, (bf16*)y.p, rows, d, eps);
      if (bt == F16 && yt == F16) add_layer_norm_w4_f16_f16((float*)a.p, (f16*)b.p, brows, wp, bp, (float*)sum.p, (f16*)y.p, rows, d, eps);
    });
  else
    emu_launch3({(unsigned)std::min<i64>((rows + rby - 1) / rby, 64), 1, 1}, {rbx, rby, 1}, [&] {
      if (bt == F32 && yt == F32) add_layer_norm_f32_f32((float*)a.p, (float*)b.p, brows, wp, bp, (float*)sum.p, (float*)y.p, rows, d, eps);
      if (bt == F32 && yt == BF16) add_layer_norm_f32_bf16((float*)a.p, (float*)b.p, brows, wp, bp, (float*)sum.p, (bf16*)y.p, rows, d, eps);
      if (bt == F32 && yt == F16) add_layer_norm_f32_f16((float*)a.p, (float*)b.p, brows, wp, bp, (float*)sum.p, (f16*)y.p, rows, d, eps);
      if (bt == BF16 && yt == F32) add_layer_norm_bf16_f32((float*)a.p, (bf16*)b.p, brows, wp, bp, (float*)sum.p, (float*)y.p, rows, d, eps);
      if (bt == BF16 && yt == BF16) add_layer_norm_bf16_bf16((float*)a.p, (bf16*)b.p, brows, wp, bp, (float*)sum.p, (bf16*)y.p, rows, d, eps);
      if (bt == F16 && yt == F16) add_layer_norm_f16_f16((float*)a.p, (f16*)b.p, brows, wp, bp, (float*)sum.p, (f16*)y.p, rows, d, eps);
    });
  const double ulp = yt == F32 ? 1.0 / (1 << 22) : yt == BF16 ? 1.0 / (1 << 8) : 1.0 / (1 << 11);
  std::string name = std::string(w4 ? "add_layer_norm_w4 b=" : "add_layer_norm b=") + dtName[bt] + " y=" + dtName[yt] + " rows=" + std::to_string(rows) +
                     " brows=" + std::to_string(brows) + " d=" + std::to_string(d) + (affine ? " w" : " no-w");
  std::vector<float> gs(n), gy(n);
  for (i64 i = 0; i < n; ++i) {
    gs[i] = sum.get(i);
    gy[i] = y.get(i);
    if (gs[i] != (float)rs[i]) {
      if (fails++ < 20) printf("FAIL %s: s[%lld] = %g, want %g exactly\n", name.c_str(), (long long)i, gs[i], rs[i]);
    }
  }
  check("y", name, ry, gy, ulp, 1e-6);
}

int main() {
  std::mt19937 rng(2026);
  struct Shape {
    i64 rows, d, cap;
  };
  // cap limits the grid: 1, 2 and 3 make each group take many rows.
  const Shape shapes[] = {{1, 1, 512},   {1, 5, 512},    {3, 33, 512},  {7, 128, 512}, {37, 129, 512},
                          {50, 200, 3},  {9, 768, 512},  {40, 768, 2},  {5, 769, 512}, {6, 1000, 1},  {20, 260, 2}, {13, 520, 512},
                          {4, 1024, 512}, {3, 1600, 512}, {2, 2048, 512}, {300, 64, 512}, {257, 96, 512}};
  for (DT dt : {F32, BF16, F16})
    for (const Shape& s : shapes)
      for (int weight : {1, 0}) {
        if (dt != F32 && !weight && s.d > 200) continue;  // time: the emulation is slow
        run_case(dt, s.rows, s.d, weight, s.cap, true, true, rng);
      }
  run_case(F32, 20, 96, true, 512, true, false, rng);   // dw only
  run_case(BF16, 20, 96, true, 512, false, true, rng);  // db only
  // layer_norm_grad_x_add: res added; in float32 the 16-bit copies too.
  for (DT dt : {F32, BF16, F16})
    for (const Shape& s : {Shape{9, 768, 512}, Shape{40, 768, 2}, Shape{5, 769, 512}, Shape{37, 129, 512}})
      run_case(dt, s.rows, s.d, true, s.cap, true, true, rng, true);
  run_case(F32, 13, 520, false, 512, true, true, rng, true);
  // The add and its layer norm: rows kept in registers (d ≤ 8·bx) and
  // read back (d = 9000), b broadcast (brows < rows) or not.
  const i64 addShapes[][3] = {{5, 5, 64}, {12, 4, 768}, {7, 7, 33}, {3, 1, 9000}, {16, 8, 1024}};
  const DT addTypes[][2] = {{F32, F32}, {F32, BF16}, {F32, F16}, {BF16, F32}, {BF16, BF16}, {F16, F16}};
  for (const auto& sh : addShapes)
    for (const auto& ty : addTypes) add_case(ty[0], ty[1], sh[0], sh[1], sh[2], sh[0] != 7, rng);
  const i64 w4Shapes[][3] = {{5, 5, 128}, {12, 4, 768}, {19, 19, 1024}, {9, 1, 256}};
  for (const auto& sh : w4Shapes)
    for (const auto& ty : addTypes) add_case(ty[0], ty[1], sh[0], sh[1], sh[2], sh[0] != 19, rng, true);
  printf("%d failures\n", fails);
  return fails != 0;
}
