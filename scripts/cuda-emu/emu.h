// emu.h: host emulation of the CUDA features attention.cu uses, for
// checking warp-level fragment code without a GPU. Every CUDA thread of a
// block is a ucontext coroutine on one OS thread; __syncthreads and the
// warp collectives (shfl, mma.sync, ldmatrix) are barriers resolved by a
// scheduler that also detects divergent or mismatched collectives.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

struct dim3u {
  unsigned x, y, z;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct float4 {
  float x, y, z, w;
};

enum { ST_READY = 0, ST_WARP = 1, ST_BLOCK = 2, ST_DONE = 3 };
struct EmuCopy {
  void* dst;
  const void* src;
  bool valid;
};
struct EmuThread {
  ucontext_t ctx;
  dim3u tid;
  int state;
  int kind;
  char* stack;
  std::vector<EmuCopy> open;                 // cp.async copies not yet committed
  std::vector<std::vector<EmuCopy>> groups;  // committed groups, oldest first
};
// cp.async timing: 0 copies at the wait (as late as allowed), 1 at the
// issue (as early as possible). Run both: a read before the wait shows in
// the first, a write over data still being read in the second.
extern int emu_cp_early;
extern int emu_sched_mode;
extern EmuThread* emu_threads;
extern int emu_nthreads, emu_cur;
extern ucontext_t emu_sched;
extern dim3u emu_blockIdx, emu_blockDim, emu_gridDim;
extern char emu_smem_anchor[16];
#define threadIdx (emu_threads[emu_cur].tid)
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

inline void emu_fail(const char* msg) {
  fprintf(stderr, "EMU FAILURE: %s (block %u thread %d)\n", msg, emu_blockIdx.x, emu_cur);
  abort();
}

inline void emu_wait(int state, int kind) {
  EmuThread& t = emu_threads[emu_cur];
  t.state = state;
  t.kind = kind;
  swapcontext(&t.ctx, &emu_sched);
}
inline void __syncthreads() { emu_wait(ST_BLOCK, 0); }

inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline long long __double_as_longlong(double f) { long long u; memcpy(&u, &f, 8); return u; }
// Rounded arithmetic intrinsics: one IEEE operation each (the host build
// does not contract a·b + c: x86-64's default target has no FMA).
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

// Per-warp exchange buffers.
struct WarpBuf {
  unsigned long long v[32][8];
};
extern WarpBuf emu_wb[64];

// Warps are made of consecutive linear thread indices (x fastest), as on
// the GPU: emu_cur is the running thread's.
inline int emu_lane() { return emu_cur & 31; }
inline int emu_warp() { return emu_cur >> 5; }

enum { K_SHFL = 1, K_MMA_BF = 2, K_MMA_F16 = 3, K_LDSM = 4, K_LDSM_T = 5, K_POST = 100 };

template <typename V>
inline V __shfl_xor_sync(unsigned mask, V v, int m) {
  if (mask != 0xffffffffu) emu_fail("partial mask");
  WarpBuf& b = emu_wb[emu_warp()];
  static_assert(sizeof(V) <= 8, "shfl");
  unsigned long long x = 0;
  memcpy(&x, &v, sizeof(V));
  b.v[emu_lane()][0] = x;
  emu_wait(ST_WARP, K_SHFL);
  V r;
  memcpy(&r, &b.v[emu_lane() ^ m][0], sizeof(V));
  emu_wait(ST_WARP, K_SHFL + K_POST);
  return r;
}

inline float emu_bf(unsigned short u) { return __uint_as_float((unsigned)u << 16); }
inline float emu_h(unsigned short u) {
  _Float16 h;
  memcpy(&h, &u, 2);
  return (float)h;
}
inline unsigned short emu_to_h(float f) {
  _Float16 h = (_Float16)f;
  unsigned short u;
  memcpy(&u, &h, 2);
  return u;
}

// mma.m16n8k16 row.col, f32 accumulate: A 16×16, B 16×8 (k × n), C 16×8.
inline void emu_mma(float* c, const unsigned* a, const unsigned* bb, bool bf) {
  WarpBuf& b = emu_wb[emu_warp()];
  const int lane = emu_lane();
  for (int i = 0; i < 4; ++i) b.v[lane][i] = a[i];
  b.v[lane][4] = bb[0];
  b.v[lane][5] = bb[1];
  emu_wait(ST_WARP, bf ? K_MMA_BF : K_MMA_F16);
  float A[16][16], B[16][8];
  auto cv = [&](unsigned short u) { return bf ? emu_bf(u) : emu_h(u); };
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    const unsigned long long* r = b.v[L];
    auto put = [&](float* p0, float* p1, unsigned long long x) {
      *p0 = cv((unsigned short)(x & 0xffff));
      *p1 = cv((unsigned short)((x >> 16) & 0xffff));
    };
    put(&A[g][2 * t], &A[g][2 * t + 1], r[0]);
    put(&A[g + 8][2 * t], &A[g + 8][2 * t + 1], r[1]);
    put(&A[g][2 * t + 8], &A[g][2 * t + 9], r[2]);
    put(&A[g + 8][2 * t + 8], &A[g + 8][2 * t + 9], r[3]);
    put(&B[2 * t][g], &B[2 * t + 1][g], r[4]);
    put(&B[2 * t + 8][g], &B[2 * t + 9][g], r[5]);
  }
  const int g = lane >> 2, t = lane & 3;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    double s = 0;
    for (int k = 0; k < 16; ++k) s += (double)A[rows[e]][k] * (double)B[k][cols[e]];
    c[e] = (float)((double)c[e] + s);
  }
  emu_wait(ST_WARP, (bf ? K_MMA_BF : K_MMA_F16) + K_POST);
}

inline unsigned emu_smem_addr(const void* p) {
  return (unsigned)((uintptr_t)p - (uintptr_t)emu_smem_anchor);
}
inline const unsigned short* emu_smem_ptr(unsigned a) {
  return reinterpret_cast<const unsigned short*>(emu_smem_anchor + (intptr_t)(int)a);
}

// ldmatrix.m8n8.x4(.trans).b16
inline void emu_ldsm4(unsigned* r, unsigned addr, bool trans) {
  WarpBuf& b = emu_wb[emu_warp()];
  const int lane = emu_lane();
  b.v[lane][0] = addr;
  emu_wait(ST_WARP, trans ? K_LDSM_T : K_LDSM);
  const int g = lane >> 2, t = lane & 3;
  for (int m = 0; m < 4; ++m) {
    const unsigned short* row[8];
    for (int i = 0; i < 8; ++i) {
      const unsigned a = (unsigned)b.v[8 * m + i][0];
      if (a % 16) emu_fail("ldmatrix row address not 16-byte aligned");
      row[i] = emu_smem_ptr(a);
    }
    unsigned lo, hi;
    if (trans) {
      lo = row[2 * t][g];
      hi = row[2 * t + 1][g];
    } else {
      lo = row[g][2 * t];
      hi = row[g][2 * t + 1];
    }
    r[m] = lo | (hi << 16);
  }
  emu_wait(ST_WARP, (trans ? K_LDSM_T : K_LDSM) + K_POST);
}

// Launch: run f for every thread of every block. emu_launch3 takes a 2-D
// grid and a 2-D block (z must be 1); emu_launch is its 1-D form.
void emu_launch3(dim3u grid, dim3u block, std::function<void()> f);
inline void emu_launch(unsigned grid, unsigned block, std::function<void()> f) {
  emu_launch3({grid, 1, 1}, {block, 1, 1}, f);
}

// Device buffers with a guard page right after the end.
void* emu_alloc(size_t bytes);

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline void atomicMin(unsigned long long* a, unsigned long long v) { if (v < *a) *a = v; }

inline void emu_do_copy(const EmuCopy& c) {
  if (c.valid) memcpy(c.dst, c.src, 16);
  else memset(c.dst, 0, 16);
}
inline void emu_cp_async16(unsigned dst, const void* src, bool valid) {
  if (dst % 16) emu_fail("cp.async shared address not 16-byte aligned");
  if (valid && (uintptr_t)src % 16) emu_fail("cp.async global address not 16-byte aligned");
  EmuCopy c{(void*)emu_smem_ptr(dst), src, valid};
  if (emu_cp_early) emu_do_copy(c);
  else emu_threads[emu_cur].open.push_back(c);
}
inline void emu_cp_commit() {
  EmuThread& t = emu_threads[emu_cur];
  t.groups.push_back(t.open);
  t.open.clear();
}
inline void emu_cp_wait(int n) {
  EmuThread& t = emu_threads[emu_cur];
  while ((int)t.groups.size() > n) {
    for (const EmuCopy& c : t.groups.front()) emu_do_copy(c);
    t.groups.erase(t.groups.begin());
  }
}
