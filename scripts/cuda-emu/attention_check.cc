// attention_check: attention.cu's tensor-core kernels (attention_fwd_mma,
// attention_grad_dot, attention_grad_q_mma, attention_grad_kv_mma), run on
// the host emulation of emu.h, against a float64 reference, with the GPU
// tests' tolerances (rtol one 16-bit ulp, atol 2u of each output's largest
// magnitude, 1e-6 absolute). att_emu.cc is attention.cu as prep.py makes
// it; see run.
#include "att_emu.cc"
#define HAVE_BWD 1

#include <algorithm>
#include <random>
#include <string>

typedef unsigned short u16;

struct Case;
static void run_bwd(const struct Case& c, bool bf, void* q, void* k, void* v, void* g, void* o, float* lse, float* Dd,
                    void* dq, void* dkv, float scale);

static bool g_bf = true;  // bfloat16 or float16
static float rnd16(float x) { return g_bf ? emu_bf(bf16_bits(x)) : emu_h(emu_to_h(x)); }
static u16 bits(float x) { return g_bf ? bf16_bits(x) : emu_to_h(x); }
static float val(u16 u) { return g_bf ? emu_bf(u) : emu_h(u); }

struct Case {
  int B, H, Hkv, T, S, D;
  bool causal;
};

struct Ref {
  std::vector<float> q, k, v, g, o, lse, dq, dk, dv, Dd;
};

static void reference(const Case& c, Ref& r, float scale) {
  const int B = c.B, H = c.H, Hkv = c.Hkv, T = c.T, S = c.S, D = c.D, grp = H / Hkv;
  r.o.assign((size_t)B * H * T * D, 0);
  r.lse.assign((size_t)B * H * T, 0);
  r.dq.assign((size_t)B * H * T * D, 0);
  r.dk.assign((size_t)B * Hkv * S * D, 0);
  r.dv.assign((size_t)B * Hkv * S * D, 0);
  r.Dd.assign((size_t)B * H * T, 0);
  std::vector<double> s(S), p(S);
  std::vector<double> dk((size_t)B * Hkv * S * D, 0), dv((size_t)B * Hkv * S * D, 0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / grp;
      const float* Q = &r.q[((size_t)(b * H + h) * T) * D];
      const float* G = &r.g[((size_t)(b * H + h) * T) * D];
      const float* K = &r.k[((size_t)(b * Hkv + hk) * S) * D];
      const float* V = &r.v[((size_t)(b * Hkv + hk) * S) * D];
      for (int i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int j = 0; j < S; ++j) {
          double x = 0;
          for (int e = 0; e < D; ++e) x += (double)Q[i * D + e] * K[j * D + e];
          x *= (double)scale;
          if (c.causal && j > i) x = -INFINITY;
          s[j] = x;
          m = std::max(m, x);
        }
        double l = 0;
        for (int j = 0; j < S; ++j) l += (p[j] = (s[j] == -INFINITY ? 0 : exp(s[j] - m)));
        const double lse = l > 0 ? m + log(l) : -INFINITY;
        const size_t row = (size_t)(b * H + h) * T + i;
        r.lse[row] = (float)lse;
        for (int e = 0; e < D; ++e) {
          double acc = 0;
          for (int j = 0; j < S; ++j) acc += p[j] * V[j * D + e];
          r.o[row * D + e] = rnd16(l > 0 ? (float)(acc / l) : 0.f);
        }
        double Dd = 0;
        for (int e = 0; e < D; ++e) Dd += (double)G[i * D + e] * r.o[row * D + e];
        r.Dd[row] = (float)Dd;
        // backward with the float32 lse the kernels get
        for (int e = 0; e < D; ++e) r.dq[row * D + e] = 0;
        std::vector<double> dq(D, 0);
        for (int j = 0; j < S; ++j) {
          if (s[j] == -INFINITY || lse == -INFINITY) continue;
          const double P = exp(s[j] - (double)r.lse[row]);
          double dp = 0;
          for (int e = 0; e < D; ++e) dp += (double)G[i * D + e] * V[j * D + e];
          const double ds = P * (dp - Dd);
          const size_t kr = ((size_t)(b * Hkv + hk) * S + j) * D;
          for (int e = 0; e < D; ++e) {
            dq[e] += ds * K[j * D + e];
            dk[kr + e] += ds * Q[i * D + e] * scale;
            dv[kr + e] += P * G[i * D + e];
          }
        }
        for (int e = 0; e < D; ++e) r.dq[row * D + e] = (float)(dq[e] * scale);
      }
    }
  for (size_t x = 0; x < dk.size(); ++x) {
    r.dk[x] = (float)dk[x];
    r.dv[x] = (float)dv[x];
  }
}

static int fails = 0;
// compare got (16-bit bits or float) with want; tol rtol·|w| + atol·max|w|.
static double compare(const char* what, const Case& c, const std::vector<float>& got,
                      const std::vector<float>& want, double rtol, double atol) {
  double m = 0;
  for (float w : want)
    if (std::isfinite(w)) m = std::max(m, (double)fabs(w));
  double worst = 0;
  size_t bad = 0, first = (size_t)-1;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i], g = got[i];
    if (std::isnan(g)) { ++bad; if (first == (size_t)-1) first = i; continue; }
    if (std::isinf(w)) { if (w != g) { ++bad; if (first == (size_t)-1) first = i; } continue; }
    const double d = fabs(g - w);
    if (m > 0) worst = std::max(worst, d / m);
    if (d > rtol * fabs(w) + atol * m + 1e-6) { ++bad; if (first == (size_t)-1) first = i; }
  }
  printf("  %-4s worst %.3g%s", what, worst, bad ? " FAIL" : "");
  if (bad) {
    printf(" (%zu bad, first [%zu] want %g got %g)", bad, first, want[first], got[first]);
    ++fails;
  }
  printf("\n");
  return worst;
}

template <typename P>
static P* upload16(const std::vector<float>& x) {
  u16* p = (u16*)emu_alloc(x.size() * 2 + 2);
  for (size_t i = 0; i < x.size(); ++i) p[i] = bits(x[i]);
  return (P*)p;
}
static std::vector<float> down16(const void* p, size_t n) {
  std::vector<float> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = val(((const u16*)p)[i]);
  return r;
}

typedef void (*FwdFn)(const void*, const void*, const void*, void*, float*, i64, i64, i64, i64, float, i64);

static void run_case(const Case& c, bool bf, const std::string& which) {
  g_bf = bf;
  std::mt19937_64 rng(c.T * 131 + c.S * 7 + c.D + c.causal);
  std::uniform_real_distribution<float> uni(-1, 1);
  Ref r;
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (auto& y : x) y = rnd16(uni(rng));
  };
  fill(r.q, (size_t)c.B * c.H * c.T * c.D);
  fill(r.k, (size_t)c.B * c.Hkv * c.S * c.D);
  fill(r.v, (size_t)c.B * c.Hkv * c.S * c.D);
  fill(r.g, (size_t)c.B * c.H * c.T * c.D);
  const float scale = 1.f / sqrtf((float)c.D);
  reference(c, r, scale);
  printf("%s B%d H%d Hkv%d T%d S%d d%d causal%d %s\n", which.c_str(), c.B, c.H, c.Hkv, c.T, c.S, c.D, c.causal,
         bf ? "bf16" : "f16");
  const double rtol = bf ? 1.0 / 128 : 1.0 / 1024, atol = bf ? 8e-3 : 1e-3;
  void* q = upload16<void>(r.q);
  void* k = upload16<void>(r.k);
  void* v = upload16<void>(r.v);
  void* g = upload16<void>(r.g);
  void* o = upload16<void>(r.o);
  const size_t nq = r.q.size(), nk = r.k.size(), rows = r.lse.size();
  float* lse = (float*)emu_alloc(rows * 4);
  memcpy(lse, r.lse.data(), rows * 4);
  const unsigned qtiles = (c.T + 63) / 64;
  if (which == "fwd") {
    void* o2 = emu_alloc(nq * 2);
    float* lse2 = (float*)emu_alloc(rows * 4);
    emu_launch(c.B * c.H * qtiles, 128, [&] {
      if (bf) {
        if (c.D == 64) attention_fwd_mma_d64_bf16((bf16*)q, (bf16*)k, (bf16*)v, (bf16*)o2, lse2, c.H, c.Hkv, c.T, c.S, scale, c.causal);
        else attention_fwd_mma_d128_bf16((bf16*)q, (bf16*)k, (bf16*)v, (bf16*)o2, lse2, c.H, c.Hkv, c.T, c.S, scale, c.causal);
      } else {
        if (c.D == 64) attention_fwd_mma_d64_f16((f16*)q, (f16*)k, (f16*)v, (f16*)o2, lse2, c.H, c.Hkv, c.T, c.S, scale, c.causal);
        else attention_fwd_mma_d128_f16((f16*)q, (f16*)k, (f16*)v, (f16*)o2, lse2, c.H, c.Hkv, c.T, c.S, scale, c.causal);
      }
    });
    compare("o", c, down16(o2, nq), r.o, rtol, atol);
    compare("lse", c, std::vector<float>(lse2, lse2 + rows), r.lse, 1e-4, 1e-4);
  }
#ifdef HAVE_BWD
  if (which == "bwd") {
    // dot
    float* Dd = (float*)emu_alloc(rows * 4);
    void* dq = emu_alloc(nq * 2);
    void* dkv = emu_alloc(nk * 4);
    run_bwd(c, bf, q, k, v, g, o, lse, Dd, dq, dkv, scale);
    compare("D", c, std::vector<float>(Dd, Dd + rows), r.Dd, 1e-4, 1e-5);
    compare("dq", c, down16(dq, nq), r.dq, rtol, atol);
    std::vector<float> all = down16(dkv, nk * 2), dk(nk), dv(nk);
    for (size_t x = 0; x < nk / c.D; ++x)
      for (int e = 0; e < c.D; ++e) {
        dk[x * c.D + e] = all[x * 2 * c.D + e];
        dv[x * c.D + e] = all[x * 2 * c.D + c.D + e];
      }
    compare("dk", c, dk, r.dk, rtol, atol);
    compare("dv", c, dv, r.dv, rtol, atol);
  }
#endif
}

int main(int argc, char** argv) {
  std::string which = argc > 1 ? argv[1] : "fwd";
  std::vector<Case> cases;
  int big = argc > 2 ? atoi(argv[2]) : 0;
  for (int d : {64, 128})
    for (int causal : {0, 1})
      for (auto ts : std::vector<std::pair<int, int>>{{1, 1}, {17, 17}, {64, 64}, {17, 100}, {100, 17}, {65, 130}}) {
        cases.push_back({2, 4, 2, ts.first, ts.second, d, (bool)causal});
      }
  if (big) {
    for (int d : {64, 128})
      for (int causal : {0, 1}) cases.push_back({1, 3, 1, 300, 257, d, (bool)causal});
  }
  for (auto& c : cases) {
    run_case(c, true, which);
    if (c.T == 17 || c.T == 65) run_case(c, false, which);
  }
  printf("%d failures\n", fails);
  return fails != 0;
}

static void run_bwd(const Case& c, bool bf, void* q, void* k, void* v, void* g, void* o, float* lse, float* Dd,
                    void* dq, void* dkv, float scale) {
  const i64 rows = (i64)c.B * c.H * c.T;
  const unsigned dblocks = (unsigned)std::min<i64>((rows * 8 + 255) / 256, 3);  // small grid: grid-stride path
  emu_launch(dblocks, 256, [&] {
    if (bf) attention_grad_dot_bf16((bf16*)g, (bf16*)o, Dd, rows, c.D);
    else attention_grad_dot_f16((f16*)g, (f16*)o, Dd, rows, c.D);
  });
  const unsigned qtiles = (c.T + 63) / 64, ktiles = (c.S + 63) / 64;
  emu_launch(c.B * c.H * qtiles, 128, [&] {
    if (bf) {
      if (c.D == 64) attention_grad_q_mma_d64_bf16((bf16*)g, (bf16*)q, (bf16*)k, (bf16*)v, (bf16*)o, lse, (bf16*)dq, c.H, c.Hkv, c.T, c.S, scale, c.causal);
      else attention_grad_q_mma_d128_bf16((bf16*)g, (bf16*)q, (bf16*)k, (bf16*)v, (bf16*)o, lse, (bf16*)dq, c.H, c.Hkv, c.T, c.S, scale, c.causal);
    } else {
      if (c.D == 64) attention_grad_q_mma_d64_f16((f16*)g, (f16*)q, (f16*)k, (f16*)v, (f16*)o, lse, (f16*)dq, c.H, c.Hkv, c.T, c.S, scale, c.causal);
      else attention_grad_q_mma_d128_f16((f16*)g, (f16*)q, (f16*)k, (f16*)v, (f16*)o, lse, (f16*)dq, c.H, c.Hkv, c.T, c.S, scale, c.causal);
    }
  });
  emu_launch(c.B * c.Hkv * ktiles, 128, [&] {
    if (bf) {
      if (c.D == 64) attention_grad_kv_mma_d64_bf16((bf16*)g, (bf16*)q, (bf16*)k, (bf16*)v, lse, Dd, (bf16*)dkv, c.H, c.Hkv, c.T, c.S, scale, c.causal);
      else attention_grad_kv_mma_d128_bf16((bf16*)g, (bf16*)q, (bf16*)k, (bf16*)v, lse, Dd, (bf16*)dkv, c.H, c.Hkv, c.T, c.S, scale, c.causal);
    } else {
      if (c.D == 64) attention_grad_kv_mma_d64_f16((f16*)g, (f16*)q, (f16*)k, (f16*)v, lse, Dd, (f16*)dkv, c.H, c.Hkv, c.T, c.S, scale, c.causal);
      else attention_grad_kv_mma_d128_f16((f16*)g, (f16*)q, (f16*)k, (f16*)v, lse, Dd, (f16*)dkv, c.H, c.Hkv, c.T, c.S, scale, c.causal);
    }
  });
}
