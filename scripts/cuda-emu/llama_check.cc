// llama_check: the kernels of a Llama block run on the host emulation of
// emu.h against float64 references: rmsnorm.cu (rms_norm_*, the 16-bit
// rms_norm_f32_*, add_rms_norm_<b>_<y>, rms_norm_grad_* with
// layernorm.cu's layer_norm_grad_wb_* summing its partials), rotary.cu
// (rotary_*, both signs) and swiglu.cu (swiglu_*, swiglu_grad_*), for
// float32, bfloat16 and float16, on the vector path and the scalar one,
// with the launch geometry of exec/cuda's rmsnorm.go and rotary.go and
// grids smaller than the rows. Tolerances: an output rounds once from
// float32 arithmetic, so one ulp of its dtype relative plus 1e-6 of the
// largest |value| (float32: 1e-5 relative, the float sums' error); the
// weight gradient adds float partials of at most rows/groups rows each
// (float32: 1e-5 relative plus 1e-5 of the largest sum; 16-bit: an ulp
// plus that). The residual add and the 16-bit copies are held exactly to
// the rounding the kernel does. rms_emu.cc, ln_emu.cc, rot_emu.cc and
// swiglu_emu.cc are the kernel files as prep.py makes them; see run.
#include "rms_emu.cc"
#include "ln_emu.cc"
#include "rot_emu.cc"
#include "swiglu_emu.cc"
#include "bufs.h"

#include <random>
#include <string>

static int fails = 0;

static void check(const std::string& what, const std::vector<double>& want, const std::vector<float>& got, double rtol,
                  double atolRel) {
  double big = 0;
  for (double w : want) big = std::max(big, std::fabs(w));
  const double atol = atolRel * big + 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = std::fabs((double)got[i] - want[i]);
    if (!(diff <= atol + rtol * std::fabs(want[i]))) {
      printf("FAIL %s element %zu: got %.9g, want %.9g\n", what.c_str(), i, got[i], want[i]);
      ++fails;
      return;
    }
  }
}

static double ulpOf(DT dt) { return dt == F32 ? 1e-5 : dt == BF16 ? 1.0 / (1 << 8) : 1.0 / (1 << 11); }

static std::vector<float> all(const Buf& b) {
  std::vector<float> v(b.n);
  for (i64 i = 0; i < b.n; ++i) v[i] = b.get(i);
  return v;
}

// The geometry of exec/cuda/rmsnorm.go.
static void fwdBlock(i64 d, bool vec, unsigned* bx, unsigned* by) {
  if (!vec) {  // rowBlock
    *bx = d <= 256 ? 32 : d <= 1024 ? 128 : d <= 2048 ? 256 : d <= 4096 ? 512 : 1024;
    *by = d <= 256 ? 8 : d <= 1024 ? 2 : 1;
    return;
  }
  i64 x = ((d / 8 + 7) / 8 + 31) / 32 * 32;
  if (x < 32) x = 32;
  *bx = (unsigned)x;
  *by = (unsigned)std::max<i64>(256 / x, 1);
}
static void bwdBlock(i64 d, unsigned* bx, unsigned* by) {
  i64 x = ((d + 7) / 8 + 31) / 32 * 32;
  x = std::min<i64>(std::max<i64>(x, 32), 1024);
  *bx = (unsigned)x;
  *by = (unsigned)std::max<i64>(256 / x, 1);
}

// fill gives x a per-row offset and scale, as activations have.
static void fill(Buf& b, std::vector<double>& v, i64 d, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> U(lo, hi);
  v.resize(b.n);
  for (i64 i = 0; i < b.n; ++i) {
    const float s = d > 0 ? 1 + 0.5f * (float)(i / d % 3) : 1;
    v[i] = rnd(b.dt, U(rng) * s);
    b.set(i, (float)v[i]);
  }
}

// rms_fwd checks rms_norm_* (add false) or add_rms_norm_<b>_<y> (add
// true: x is a + b, b of dtype bt with brows rows) into y of dtype yt.
static void rms_fwd(DT xt, DT bt, DT yt, bool add, i64 rows, i64 brows, i64 d, bool weight, bool vec, i64 gridCap,
                    std::mt19937& rng) {
  const i64 n = rows * d;
  const double eps = 1e-6;
  Buf a(add ? F32 : xt, n), b(bt, brows * d), w(add ? F32 : xt, d), s(F32, n), y(yt, n);
  std::vector<double> A, B, W;
  fill(a, A, d, rng, -2, 2);
  fill(b, B, d, rng, -2, 2);
  fill(w, W, 0, rng, 0.5, 1.5);
  std::vector<double> rs(n), ry(n);
  for (i64 r = 0; r < rows; ++r) {
    double q = 0;
    for (i64 k = 0; k < d; ++k) {
      const double v = add ? (double)(float)(A[r * d + k] + B[(r % brows) * d + k]) : A[r * d + k];
      rs[r * d + k] = v;
      q += v * v;
    }
    const double rstd = 1 / std::sqrt(q / d + eps);
    for (i64 k = 0; k < d; ++k) ry[r * d + k] = rs[r * d + k] * rstd * (weight ? W[k] : 1);
  }
  unsigned bx, by;
  fwdBlock(d, vec, &bx, &by);
  const unsigned grid = (unsigned)std::min<i64>((rows + by - 1) / by, gridCap);
  void* wp = weight ? w.p : nullptr;
  const i64 v = vec;
  emu_launch3({grid, 1, 1}, {bx, by, 1}, [&] {
    if (!add) {
      if (xt == F32 && yt == F32) rms_norm_f32((float*)a.p, (float*)wp, (float*)y.p, rows, d, (float)eps, v);
      if (xt == F32 && yt == BF16) rms_norm_f32_bf16((float*)a.p, (float*)wp, (bf16*)y.p, rows, d, (float)eps, v);
      if (xt == F32 && yt == F16) rms_norm_f32_f16((float*)a.p, (float*)wp, (f16*)y.p, rows, d, (float)eps, v);
      if (xt == BF16 && yt == BF16) rms_norm_bf16((bf16*)a.p, (bf16*)wp, (bf16*)y.p, rows, d, (float)eps, v);
      if (xt == F16 && yt == F16) rms_norm_f16((f16*)a.p, (f16*)wp, (f16*)y.p, rows, d, (float)eps, v);
      return;
    }
    float* ap = (float*)a.p;
    float* sp = (float*)s.p;
    float* wf = (float*)wp;
#define ADD(TB, SB, TY, SY)                                                                                   \
  if (bt == SB && yt == SY) add_rms_norm_##TB##_##TY(ap, (TB*)b.p, brows, wf, sp, (TY*)y.p, rows, d, (float)eps, v);
    typedef float f32;
    ADD(f32, F32, f32, F32) ADD(f32, F32, bf16, BF16) ADD(f32, F32, f16, F16)
    ADD(bf16, BF16, f32, F32) ADD(bf16, BF16, bf16, BF16) ADD(bf16, BF16, f16, F16)
    ADD(f16, F16, f32, F32) ADD(f16, F16, bf16, BF16) ADD(f16, F16, f16, F16)
#undef ADD
  });
  std::string name = std::string(add ? "add_rms_norm b=" : "rms_norm x=") + dtName[add ? bt : xt] + " y=" + dtName[yt] +
                     " rows=" + std::to_string(rows) + " d=" + std::to_string(d) + (weight ? " w" : " no-w") +
                     (vec ? " vec" : " scalar") + " grid=" + std::to_string(grid);
  if (add) {
    std::vector<float> gs = all(s);
    for (i64 i = 0; i < n; ++i)
      if (gs[i] != (float)rs[i]) {
        if (fails++ < 20) printf("FAIL %s: s[%lld] = %g, want %g exactly\n", name.c_str(), (long long)i, gs[i], rs[i]);
        break;
      }
  }
  check(name + " y", ry, all(y), ulpOf(yt), 1e-6);
}

// rms_bwd checks rms_norm_grad_* and the weight gradient from its
// partials: dx (out), dx + res and its 16-bit copies (res), dw alone
// (noOut).
static void rms_bwd(DT dt, i64 rows, i64 d, bool weight, bool vec, i64 gridCap, bool res, bool noOut, std::mt19937& rng) {
  const i64 n = rows * d;
  const double eps = 1e-5;
  Buf g(dt, n), x(dt, n), w(dt, d), dx(dt, n), rb(dt, n), dw(dt, d), ob(BF16, n), oh(F16, n);
  std::vector<double> G, X, W, R;
  fill(g, G, d, rng, -1, 1);
  fill(x, X, d, rng, -2, 2);
  fill(w, W, 0, rng, 0.5, 1.5);
  fill(rb, R, d, rng, -1, 1);
  std::vector<double> rdx(n), rdw(d, 0);
  for (i64 r = 0; r < rows; ++r) {
    double q = 0, dot = 0;
    for (i64 k = 0; k < d; ++k) q += X[r * d + k] * X[r * d + k];
    const double rstd = 1 / std::sqrt(q / d + eps);
    for (i64 k = 0; k < d; ++k) dot += G[r * d + k] * (weight ? W[k] : 1) * X[r * d + k] * rstd;
    dot /= d;
    for (i64 k = 0; k < d; ++k) {
      const double xh = X[r * d + k] * rstd;
      rdx[r * d + k] = rstd * (G[r * d + k] * (weight ? W[k] : 1) - xh * dot);
      rdw[k] += G[r * d + k] * xh;
    }
  }
  unsigned bx, by;
  bwdBlock(d, &bx, &by);
  i64 grid = std::max<i64>(std::min<i64>((rows + by * 8 - 1) / (by * 8), 1024 / by), 1);
  grid = std::min(grid, gridCap);
  const i64 groups = grid * by;
  float* part = (float*)emu_alloc(groups * d * 4);
  void* wp = weight ? w.p : nullptr;
  void* op = noOut ? nullptr : dx.p;
  void* rp = res ? rb.p : nullptr;
  bf16* obp = res && dt == F32 ? (bf16*)ob.p : nullptr;
  f16* ohp = res && dt == F32 ? (f16*)oh.p : nullptr;
  const i64 v = vec;
  emu_launch3({(unsigned)grid, 1, 1}, {bx, by, 1}, [&] {
    if (dt == F32) rms_norm_grad_f32((float*)g.p, (float*)x.p, (float*)wp, (float*)op, part, rows, d, (float)eps, (float*)rp, obp, ohp, v);
    if (dt == BF16) rms_norm_grad_bf16((bf16*)g.p, (bf16*)x.p, (bf16*)wp, (bf16*)op, part, rows, d, (float)eps, (bf16*)rp, obp, ohp, v);
    if (dt == F16) rms_norm_grad_f16((f16*)g.p, (f16*)x.p, (f16*)wp, (f16*)op, part, rows, d, (float)eps, (f16*)rp, obp, ohp, v);
  });
  emu_launch3({(unsigned)((d + 31) / 32), 1, 1}, {32, 32, 1}, [&] {
    if (dt == F32) layer_norm_grad_wb_f32(part, (float*)dw.p, nullptr, groups, d);
    if (dt == BF16) layer_norm_grad_wb_bf16(part, (bf16*)dw.p, nullptr, groups, d);
    if (dt == F16) layer_norm_grad_wb_f16(part, (f16*)dw.p, nullptr, groups, d);
  });
  std::string name = std::string("rms_norm_grad ") + dtName[dt] + " rows=" + std::to_string(rows) + " d=" +
                     std::to_string(d) + (weight ? " w" : " no-w") + (vec ? " vec" : " scalar") + " grid=" +
                     std::to_string(grid) + "x" + std::to_string(by) + (res ? " +res" : "") + (noOut ? " dw only" : "");
  if (!noOut) {
    std::vector<float> got = all(dx);
    if (res) {
      // dx rounds, then res is added and the sum rounds: where dx's own
      // rounding differs by an ulp the sum carries it (2 ulp, plus an ulp
      // of the largest sum).
      std::vector<double> want(n);
      for (i64 i = 0; i < n; ++i) want[i] = rnd(dt, rnd(dt, (float)rdx[i]) + (float)R[i]);
      check(name + " dx + res", want, got, 2 * ulpOf(dt), ulpOf(dt));
      if (dt == F32)
        for (i64 i = 0; i < n; ++i)
          if (ob.get(i) != rnd(BF16, got[i]) || oh.get(i) != rnd(F16, got[i])) {
            if (fails++ < 20) printf("FAIL %s: 16-bit copies of %g are %g, %g\n", name.c_str(), got[i], ob.get(i), oh.get(i));
            break;
          }
    } else {
      check(name + " dx", rdx, got, ulpOf(dt), 1e-6);
    }
  }
  check(name + " dw", rdw, all(dw), dt == F32 ? 1e-5 : ulpOf(dt), 1e-5);
}

// rot checks rotary_* of x [b, t, n, d] rotating heads below end by
// sign·θ, with the table [t, d] of cos and sin per pair, or (full) the
// table [t, 2d] of cos then sin per element, each element its own angle:
// the pair (i, i + h) maps by [[c_i, −s_i], [s_{i+h}, c_{i+h}]], its
// transpose for sign −1.
static void rot(DT dt, i64 b, i64 t, i64 n, i64 d, i64 end, float sign, bool vec, i64 gridCap, std::mt19937& rng,
                bool full = false) {
  const i64 total = b * t * n * d, h = d / 2, w = full ? 2 * d : d;
  Buf x(dt, total), y(dt, total), cs(F32, t * w);
  std::vector<double> X, C(t * w);
  fill(x, X, d, rng, -2, 2);
  for (i64 p = 0; p < t; ++p) {
    if (full) {
      for (i64 k = 0; k < d; ++k) {
        const double th = (p + 1) * std::pow(10000.0, -2.0 * (k % h) / d) + 0.1 * k + (k >= h ? 0.3 : 0);
        C[p * w + k] = (float)std::cos(th);
        C[p * w + d + k] = (float)std::sin(th);
      }
      continue;
    }
    for (i64 i = 0; i < h; ++i) {
      const double th = (p + 1) * std::pow(10000.0, -2.0 * i / d) + 0.1 * i;
      C[p * w + i] = (float)std::cos(th);
      C[p * w + h + i] = (float)std::sin(th);
    }
  }
  for (i64 i = 0; i < t * w; ++i) cs.set(i, (float)C[i]);
  std::vector<double> want(total);
  for (i64 r = 0; r < b * t * n; ++r) {
    const double* tab = C.data() + r / n % t * w;
    for (i64 i = 0; i < h; ++i) {
      const double u = X[r * d + i], v = X[r * d + h + i];
      if (r % n >= end) {
        want[r * d + i] = u;
        want[r * d + h + i] = v;
        continue;
      }
      const double cl = tab[i], ch = full ? tab[h + i] : cl, sl = full ? tab[d + i] : tab[h + i],
                   sh = full ? tab[d + h + i] : sl;
      if (sign > 0) {
        want[r * d + i] = u * cl - v * sl;
        want[r * d + h + i] = v * ch + u * sh;
      } else {
        want[r * d + i] = u * cl + v * sh;
        want[r * d + h + i] = v * ch - u * sl;
      }
    }
  }
  const i64 work = vec ? b * t * ((n + 3) / 4) * (d / 16) : b * t * n * h;
  const unsigned grid = (unsigned)std::min<i64>(std::max<i64>((work + 255) / 256, 1), gridCap);
  emu_launch3({grid, 1, 1}, {256, 1, 1}, [&] {
    if (dt == F32) rotary_f32((float*)x.p, (float*)cs.p, (float*)y.p, b * t, t, n, d, w, end, sign, vec);
    if (dt == BF16) rotary_bf16((bf16*)x.p, (float*)cs.p, (bf16*)y.p, b * t, t, n, d, w, end, sign, vec);
    if (dt == F16) rotary_f16((f16*)x.p, (float*)cs.p, (f16*)y.p, b * t, t, n, d, w, end, sign, vec);
  });
  check(std::string("rotary ") + dtName[dt] + " [" + std::to_string(b) + ", " + std::to_string(t) + ", " +
            std::to_string(n) + ", " + std::to_string(d) + "] end=" + std::to_string(end) + " sign=" +
            std::to_string((int)sign) + (full ? " full" : "") + (vec ? " vec" : " scalar") + " grid=" +
            std::to_string(grid),
        want, all(y), ulpOf(dt), 1e-6);
}

// swi checks swiglu_* and swiglu_grad_* over n elements starting off
// elements into their arrays (off ≠ 0 takes the scalar path).
static void swi(DT dt, i64 n, i64 off, bool wantG, bool wantU, i64 gridCap, std::mt19937& rng) {
  Buf gate(dt, n + off), up(dt, n + off), g(dt, n + off), y(dt, n + off), dg(dt, n + off), du(dt, n + off);
  std::vector<double> A, B, G;
  fill(gate, A, 0, rng, -6, 6);
  fill(up, B, 0, rng, -2, 2);
  fill(g, G, 0, rng, -1, 1);
  std::vector<double> wy(n), wg(n), wu(n);
  for (i64 i = 0; i < n; ++i) {
    const double a = A[off + i], s = 1 / (1 + std::exp(-a));
    wy[i] = a * s * B[off + i];
    wg[i] = G[off + i] * B[off + i] * s * (1 + a * (1 - s));
    wu[i] = G[off + i] * a * s;
  }
  const int N = dt == F32 ? 4 : 8;
  const unsigned grid = (unsigned)std::min<i64>(std::max<i64>((n / N + 255) / 256, 1), gridCap);
  auto at = [&](const Buf& b) { return (char*)b.p + off * dtSize[dt]; };
  emu_launch3({grid, 1, 1}, {256, 1, 1}, [&] {
    if (dt == F32) swiglu_f32((float*)at(gate), (float*)at(up), (float*)at(y), n);
    if (dt == BF16) swiglu_bf16((bf16*)at(gate), (bf16*)at(up), (bf16*)at(y), n);
    if (dt == F16) swiglu_f16((f16*)at(gate), (f16*)at(up), (f16*)at(y), n);
  });
  void* dgp = wantG ? at(dg) : nullptr;
  void* dup = wantU ? at(du) : nullptr;
  emu_launch3({grid, 1, 1}, {256, 1, 1}, [&] {
    if (dt == F32) swiglu_grad_f32((float*)at(g), (float*)at(gate), (float*)at(up), (float*)dgp, (float*)dup, n);
    if (dt == BF16) swiglu_grad_bf16((bf16*)at(g), (bf16*)at(gate), (bf16*)at(up), (bf16*)dgp, (bf16*)dup, n);
    if (dt == F16) swiglu_grad_f16((f16*)at(g), (f16*)at(gate), (f16*)at(up), (f16*)dgp, (f16*)dup, n);
  });
  auto part = [&](const Buf& b) {
    std::vector<float> v(n);
    for (i64 i = 0; i < n; ++i) v[i] = b.get(off + i);
    return v;
  };
  std::string name = std::string("swiglu ") + dtName[dt] + " n=" + std::to_string(n) + " off=" + std::to_string(off) +
                     " grid=" + std::to_string(grid);
  check(name + " y", wy, part(y), ulpOf(dt), 1e-6);
  if (wantG) check(name + " d gate", wg, part(dg), ulpOf(dt), 1e-6);
  if (wantU) check(name + " d up", wu, part(du), ulpOf(dt), 1e-6);
}

int main() {
  std::mt19937 rng(2026);
  int cases = 0;
  // Forward: the vector path (d a multiple of 8, up to 8·8·bx), the
  // scalar one (any d; or forced), 16-bit outputs of float32, the add.
  struct S {
    i64 rows, d, cap;
  };
  for (DT dt : {F32, BF16, F16})
    for (S s : {S{1, 8, 64}, S{7, 64, 64}, S{37, 200, 3}, S{9, 2048, 64}, S{3, 4096, 2}, S{5, 13, 64}, S{300, 24, 2}})
      for (int weight : {1, 0}) {
        const bool vec = s.d % 8 == 0;
        rms_fwd(dt, F32, dt, false, s.rows, 1, s.d, weight, vec, s.cap, rng), ++cases;
        if (vec) rms_fwd(dt, F32, dt, false, s.rows, 1, s.d, weight, false, s.cap, rng), ++cases;
      }
  for (DT yt : {BF16, F16})
    for (S s : {S{9, 2048, 64}, S{5, 13, 64}}) rms_fwd(F32, F32, yt, false, s.rows, 1, s.d, true, s.d % 8 == 0, s.cap, rng), ++cases;
  for (DT bt : {F32, BF16, F16})
    for (DT yt : {F32, BF16, F16}) {
      for (S s : {S{9, 2048, 64}, S{12, 96, 2}, S{6, 21, 64}})
        for (i64 brows : {s.rows, (i64)3}) {
          if (s.rows % brows) continue;
          rms_fwd(F32, bt, yt, true, s.rows, brows, s.d, true, s.d % 8 == 0, s.cap, rng), ++cases;
        }
    }
  rms_fwd(F32, BF16, BF16, true, 9, 9, 2048, false, false, 64, rng), ++cases;  // the scalar add
  // Backward: vector and scalar paths, weight or not, grids that make
  // groups take many rows, the residual add with its 16-bit copies, dw
  // alone.
  for (DT dt : {F32, BF16, F16})
    for (S s : {S{1, 8, 512}, S{37, 64, 512}, S{50, 200, 3}, S{9, 2048, 512}, S{40, 768, 2}, S{5, 13, 512}, S{2, 4096, 512}})
      for (int weight : {1, 0}) {
        if (dt != F32 && !weight && s.d > 200) continue;  // time: the emulation is slow
        const bool vec = s.d % 8 == 0;
        rms_bwd(dt, s.rows, s.d, weight, vec, s.cap, false, false, rng), ++cases;
        if (vec && weight) rms_bwd(dt, s.rows, s.d, weight, false, s.cap, false, false, rng), ++cases;
      }
  for (DT dt : {F32, BF16, F16})
    for (S s : {S{9, 2048, 512}, S{40, 768, 2}, S{5, 13, 512}}) rms_bwd(dt, s.rows, s.d, true, s.d % 8 == 0, s.cap, true, false, rng), ++cases;
  rms_bwd(F32, 40, 768, true, true, 2, false, true, rng), ++cases;
  rms_bwd(BF16, 7, 13, true, false, 512, false, true, rng), ++cases;
  // Rotary: Llama's head dim 64 and 128, small ones, every head or the
  // packed projection's first ones, both signs, the scalar path.
  for (DT dt : {F32, BF16, F16}) {
    rot(dt, 2, 5, 12, 64, 10, 1, true, 64, rng), ++cases;
    rot(dt, 1, 7, 3, 128, 3, -1, true, 2, rng), ++cases;
    rot(dt, 3, 4, 6, 16, 4, 1, true, 64, rng), ++cases;
    rot(dt, 2, 5, 12, 64, 10, -1, false, 64, rng), ++cases;
    rot(dt, 2, 3, 5, 6, 2, 1, false, 1, rng), ++cases;
    rot(dt, 2, 5, 12, 64, 10, 1, true, 64, rng, true), ++cases;
    rot(dt, 1, 7, 3, 128, 3, -1, true, 2, rng, true), ++cases;
    rot(dt, 2, 5, 12, 64, 10, -1, false, 64, rng, true), ++cases;
    rot(dt, 2, 3, 5, 6, 2, 1, false, 1, rng, true), ++cases;
  }
  // SwiGLU: whole packs and a tail, unaligned starts, one gradient or both.
  for (DT dt : {F32, BF16, F16}) {
    swi(dt, 4099, 0, true, true, 64, rng), ++cases;
    swi(dt, 1000, 3, true, true, 2, rng), ++cases;
    swi(dt, 517, 0, true, false, 64, rng), ++cases;
    swi(dt, 517, 0, false, true, 64, rng), ++cases;
  }
  printf("%d cases, %d failures\n", cases, fails);
  return fails ? 1 : 0;
}
