// optim_check: optim.cu's optimizer kernels run on the host emulation of
// emu.h. sgd_multi_f32 and adam_multi_f32 are held bit for bit to a
// transcription of optim/optim.go's updates (the same float64 operations
// in the same order; the reference reads each parameter's group and its
// own scalars as the Go side lays them out), over lists with an empty
// tensor, groups out of order, parameter indices with gaps, clipping on and
// off, fresh and continued momentum, a group without momentum (no buffer),
// Nesterov, Adam and AdamW, and grids smaller than the work.
// grad_norm_partial_f32 and grad_norm_finish are held to a float64 sum in
// order within 1e-13 relative (2-norm: only the order of the sums
// differs), exactly for the ∞-norm, NaN and inf propagation, and the clip
// factor to PyTorch's float32 formula from the norm they wrote.
// optim_scalars_f64 copies its words. optim_emu.cc is optim.cu as prep.py
// makes it; see run.
#include "optim_emu.cc"

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

static int fails = 0;

#define CHECK(cond, ...)         \
  do {                           \
    if (!(cond)) {               \
      printf("FAIL: " __VA_ARGS__); \
      printf("\n");              \
      ++fails;                   \
    }                            \
  } while (0)

static float* falloc(i64 n) { return (float*)emu_alloc(std::max<i64>(n, 1) * 4); }

// One parameter of a list: its data, gradient, state, group and index.
struct P {
  i64 n;
  int grp, idx;
  bool momentum;  // SGD: its group has momentum (a buffer)
  std::vector<float> p, g, m, v;
  float *dp, *dg, *dm, *dv;
};

static void upload(P& q) {
  q.dp = falloc(q.n), q.dg = falloc(q.n), q.dm = falloc(q.n), q.dv = falloc(q.n);
  for (i64 i = 0; i < q.n; ++i) q.dp[i] = q.p[i], q.dg[i] = q.g[i], q.dm[i] = q.m[i], q.dv[i] = q.v[i];
}

static OptimList listOf(std::vector<P>& ps, bool sgd) {
  OptimList l;
  memset(&l, 0, sizeof l);
  for (size_t t = 0; t < ps.size(); ++t) {
    l.p[t] = ps[t].dp, l.g[t] = ps[t].dg;
    l.s0[t] = sgd && !ps[t].momentum ? nullptr : ps[t].dm;
    l.s1[t] = sgd ? nullptr : ps[t].dv;
    l.off[t + 1] = l.off[t] + ps[t].n;
    l.grp[t] = ps[t].grp, l.idx[t] = ps[t].idx;
  }
  return l;
}

static std::vector<P> params(std::mt19937& rng, bool sgd) {
  std::uniform_real_distribution<float> U(-1, 1);
  // sizes, groups, indices (gaps: a parameter the launch does not hold)
  const i64 sizes[] = {5, 0, 300, 1, 37};
  const int grps[] = {1, 0, 0, 2, 1};
  const int idxs[] = {0, 1, 3, 7, 8};
  std::vector<P> ps;
  for (int t = 0; t < 5; ++t) {
    P q{sizes[t], grps[t], idxs[t], !sgd || grps[t] != 2};
    for (i64 i = 0; i < q.n; ++i) {
      q.p.push_back(U(rng)), q.g.push_back(U(rng) + 0.01f);
      q.m.push_back(0.1f * U(rng)), q.v.push_back(0.01f * std::fabs(U(rng)));
    }
    upload(q);
    ps.push_back(q);
  }
  return ps;
}

static double* scalars(i64 words) {
  double* sc = (double*)emu_alloc(words * 8);
  for (i64 i = 0; i < words; ++i) sc[i] = 0;
  return sc;
}

static const i64 PARAMS_AT = OPTIM_HEADER + OPTIM_GROUP_WORDS * 3;

static void check_adam(std::mt19937& rng, bool decoupled, bool clip, unsigned grid) {
  std::vector<P> ps = params(rng, false);
  double* sc = scalars(PARAMS_AT + 2 * 9);
  const double lr[] = {1e-2, 3e-3, 0.5}, b1[] = {0.9, 0.8, 0.5}, b2[] = {0.999, 0.99, 0.9}, eps[] = {1e-8, 1e-6, 1e-3},
               wd[] = {0.1, 0, 0.01};
  for (int k = 0; k < 3; ++k) {
    double* h = sc + OPTIM_HEADER + OPTIM_GROUP_WORDS * k;
    h[0] = lr[k], h[1] = b1[k], h[2] = b2[k], h[3] = eps[k], h[4] = wd[k], h[5] = 1 - lr[k] * wd[k];
  }
  for (int i = 0; i < 9; ++i) {
    const double t = 1 + i;  // each parameter its own step
    sc[PARAMS_AT + 2 * i] = 1 - std::pow(b1[i % 3], t), sc[PARAMS_AT + 2 * i + 1] = 1 - std::pow(b2[i % 3], t);
  }
  const float coef = 0.37f;
  sc[2] = coef;
  OptimList l = listOf(ps, false);
  const i64 count = (i64)ps.size();
  emu_launch(grid, 256, [&] { adam_multi_f32(l, count, sc, PARAMS_AT, decoupled, clip); });
  for (auto& q : ps) {
    const double* h = sc + OPTIM_HEADER + OPTIM_GROUP_WORDS * q.grp;
    const double c1 = sc[PARAMS_AT + 2 * q.idx], c2 = sc[PARAMS_AT + 2 * q.idx + 1];
    for (i64 i = 0; i < q.n; ++i) {
      double w = q.p[i], g = clip ? (double)(q.g[i] * coef) : (double)q.g[i];
      if (decoupled) w *= h[5];
      else g += h[4] * w;
      const double mi = h[1] * (double)q.m[i] + (1 - h[1]) * g;
      const double vi = h[2] * (double)q.v[i] + (1 - h[2]) * g * g;
      const float want = (float)(w - h[0] * (mi / c1) / (std::sqrt(vi / c2) + h[3]));
      CHECK(q.dp[i] == want && q.dm[i] == (float)mi && q.dv[i] == (float)vi,
            "adam decoupled=%d clip=%d grid=%u tensor idx %d element %ld: p %.9g want %.9g", decoupled, clip, grid, q.idx,
            (long)i, q.dp[i], want);
    }
  }
}

static void check_sgd(std::mt19937& rng, bool clip, unsigned grid) {
  std::vector<P> ps = params(rng, true);
  double* sc = scalars(PARAMS_AT + 2 * 9);
  const double lr[] = {0.05, 0.02, 0.1}, mom[] = {0.9, 0.5, 0}, damp[] = {0, 0.1, 0}, wd[] = {0.01, 0, 1e-3};
  const bool nest[] = {true, false, false};
  for (int k = 0; k < 3; ++k) {
    double* h = sc + OPTIM_HEADER + OPTIM_GROUP_WORDS * k;
    h[0] = lr[k], h[1] = mom[k], h[2] = damp[k], h[3] = wd[k], h[4] = nest[k] ? 1 : 0;
  }
  for (int i = 0; i < 9; ++i) sc[PARAMS_AT + 2 * i] = i % 2;  // fresh on odd indices
  const float coef = 0.61f;
  sc[2] = coef;
  OptimList l = listOf(ps, true);
  const i64 count = (i64)ps.size();
  emu_launch(grid, 256, [&] { sgd_multi_f32(l, count, sc, PARAMS_AT, clip); });
  for (auto& q : ps) {
    const double* h = sc + OPTIM_HEADER + OPTIM_GROUP_WORDS * q.grp;
    const bool fresh = sc[PARAMS_AT + 2 * q.idx] != 0;
    for (i64 i = 0; i < q.n; ++i) {
      const double w = q.p[i];
      double g = (clip ? (double)(q.g[i] * coef) : (double)q.g[i]) + h[3] * w;
      float buf = q.m[i];
      if (h[1] != 0) {
        double b = g;
        if (!fresh) b = h[1] * (double)q.m[i] + (1 - h[2]) * g;
        buf = (float)b;
        g = h[4] != 0 ? g + h[1] * b : b;
      }
      const float want = (float)(w - h[0] * g);
      CHECK(q.dp[i] == want && q.dm[i] == buf, "sgd clip=%d grid=%u tensor idx %d element %ld: p %.9g want %.9g", clip, grid,
            q.idx, (long)i, q.dp[i], want);
    }
  }
}

// partials runs grad_norm_partial_f32 over lists, OPTIM_NORM_BLOCKS
// blocks a launch as the executor launches it.
static double* partials(std::vector<OptimList>& lists, std::vector<i64>& counts, bool inf) {
  double* part = scalars(OPTIM_NORM_BLOCKS * (i64)lists.size());
  for (size_t li = 0; li < lists.size(); ++li) {
    double* pp = part + OPTIM_NORM_BLOCKS * li;
    emu_launch(OPTIM_NORM_BLOCKS, 256, [&] { grad_norm_partial_f32(lists[li], counts[li], pp, inf); });
  }
  return part;
}

// finish runs grad_norm_finish over n partials and returns the scalars.
static double* finish(double* part, i64 n, double maxNorm, bool inf) {
  double* sc = scalars(4);
  sc[0] = maxNorm;
  emu_launch(1, 256, [&] { grad_norm_finish(sc, part, n, inf); });
  return sc;
}

static float coefOf(double norm, double maxNorm) {
  const float r = 1.0f / ((float)norm + 1e-6f);
  float c = r * (float)maxNorm;
  return c > 1.0f ? 1.0f : c;
}

static void check_norm(std::mt19937& rng) {
  std::uniform_real_distribution<float> U(-1, 1);
  // two lists: 64 tensors of assorted sizes (one empty), then 3
  std::vector<std::vector<float>> gs;
  for (int t = 0; t < 67; ++t) {
    std::vector<float> g((t * 37) % 101);
    for (auto& x : g) x = U(rng);
    gs.push_back(g);
  }
  for (int poison = 0; poison < 3; ++poison) {  // none, a NaN, an inf
    std::vector<float*> dg;
    double sum = 0, mx = 0;
    bool nan = false;
    for (int t = 0; t < 67; ++t) {
      std::vector<float> g = gs[t];
      if (t == 40 && poison == 1) g[3] = std::numeric_limits<float>::quiet_NaN();
      if (t == 65 && poison == 2) g[1] = -std::numeric_limits<float>::infinity();
      float* d = falloc((i64)g.size());
      for (size_t i = 0; i < g.size(); ++i) {
        d[i] = g[i];
        sum += (double)g[i] * (double)g[i];
        nan |= std::isnan(g[i]);
        if (std::fabs((double)g[i]) > mx) mx = std::fabs((double)g[i]);
      }
      dg.push_back(d);
    }
    std::vector<OptimList> lists(2);
    std::vector<i64> counts = {64, 3};
    for (int li = 0; li < 2; ++li) {
      memset(&lists[li], 0, sizeof(OptimList));
      for (int t = 0; t < counts[li]; ++t) {
        const int k = li * 64 + t;
        lists[li].g[t] = dg[k];
        lists[li].off[t + 1] = lists[li].off[t] + (i64)gs[k].size();
      }
    }
    for (int inf = 0; inf < 2; ++inf) {
      const double want = nan ? NAN : inf ? mx : std::sqrt(sum);
      double* part = partials(lists, counts, inf);
      for (double maxNorm : {1.0, 1e9}) {
        double* sc = finish(part, OPTIM_NORM_BLOCKS * 2, maxNorm, inf);
        if (nan) {
          CHECK(std::isnan(sc[1]) && std::isnan(sc[2]), "poison %d inf %d: norm %g coef %g, want NaN", poison, inf, sc[1], sc[2]);
          continue;
        }
        if (std::isinf(want)) {
          CHECK(std::isinf(sc[1]) && sc[2] == 0, "poison %d inf %d: norm %g coef %g, want inf and 0", poison, inf, sc[1], sc[2]);
          continue;
        }
        const double tol = inf ? 0 : 1e-13 * want;
        CHECK(std::fabs(sc[1] - want) <= tol, "poison %d inf %d: norm %.17g, want %.17g", poison, inf, sc[1], want);
        CHECK(sc[2] == (double)coefOf(sc[1], maxNorm), "poison %d inf %d max %g: coef %.9g, want %.9g", poison, inf, maxNorm,
              sc[2], (double)coefOf(sc[1], maxNorm));
      }
    }
  }
}

static void check_scalars() {
  for (i64 n : {7, 480}) {
    ScalarList s;
    for (i64 i = 0; i < n; ++i) s.v[i] = 0.5 * (double)i - 3;
    double* dst = scalars(n + 1);
    dst[n] = 42;
    emu_launch((unsigned)((n + 255) / 256), 256, [&] { optim_scalars_f64(s, n, dst); });
    for (i64 i = 0; i < n; ++i) CHECK(dst[i] == s.v[i], "scalars n %ld word %ld: %g", (long)n, (long)i, dst[i]);
    CHECK(dst[n] == 42, "scalars n %ld wrote past n", (long)n);
  }
}

int main() {
  std::mt19937 rng(7);
  for (unsigned grid : {1u, 2u}) {
    for (int clip = 0; clip < 2; ++clip) {
      check_adam(rng, false, clip, grid);
      check_adam(rng, true, clip, grid);
      check_sgd(rng, clip, grid);
    }
  }
  check_norm(rng);
  check_scalars();
  if (fails) {
    printf("%d failures\n", fails);
    return 1;
  }
  printf("optim.cu: all cases pass\n");
  return 0;
}
