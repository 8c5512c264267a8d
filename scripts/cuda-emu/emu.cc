#include "emu.h"

EmuThread* emu_threads;
int emu_nthreads, emu_cur;
ucontext_t emu_sched;
dim3u emu_blockIdx, emu_blockDim, emu_gridDim;
char emu_smem_anchor[16];
WarpBuf emu_wb[64];
// EMU_SCHED: 0 (default) warps advance one collective at a time in turn;
// 1 each warp runs on to its next __syncthreads before the next moves
// (warp 0 first), 2 the same from the last warp.
int emu_sched_mode = getenv("EMU_SCHED") ? atoi(getenv("EMU_SCHED")) : 0;
int emu_cp_early = getenv("EMU_CP_EARLY") && getenv("EMU_CP_EARLY")[0] == '1';

static std::function<void()>* emu_fn;
static void emu_entry() {
  (*emu_fn)();
  EmuThread& t = emu_threads[emu_cur];
  if (!t.open.empty()) emu_fail("cp.async copies never committed");
  for (auto& g : t.groups)
    if (!g.empty()) emu_fail("cp.async copies never waited for");
  t.groups.clear();
  t.state = ST_DONE;
  // returning switches to uc_link (the scheduler)
}

static const size_t STACK = 256 << 10;

void emu_launch3(dim3u grid3, dim3u block3, std::function<void()> f) {
  const unsigned block = block3.x * block3.y;
  static std::vector<EmuThread> threads;
  if (threads.size() < block) {
    size_t old = threads.size();
    threads.resize(block);
    for (size_t i = old; i < block; ++i) threads[i].stack = (char*)malloc(STACK);
    // stacks of earlier entries are kept: resize moves the structs, stacks stay
  }
  emu_threads = threads.data();
  emu_nthreads = block;
  emu_fn = &f;
  emu_blockDim = {block3.x, block3.y, 1};
  emu_gridDim = {grid3.x, grid3.y, 1};
  for (unsigned bk = 0; bk < grid3.x * grid3.y; ++bk) {
    emu_blockIdx = {bk % grid3.x, bk / grid3.x, 0};
    for (unsigned t = 0; t < block; ++t) {
      EmuThread& th = threads[t];
      th.tid = {t % block3.x, t / block3.x, 0};
      th.state = ST_READY;
      th.kind = 0;
      th.open.clear();
      th.groups.clear();
      getcontext(&th.ctx);
      th.ctx.uc_stack.ss_sp = th.stack;
      th.ctx.uc_stack.ss_size = STACK;
      th.ctx.uc_link = &emu_sched;
      makecontext(&th.ctx, emu_entry, 0);
    }
    const unsigned nw = (block + 31) / 32;
    // releasable: every lane of warp w waits at one warp collective.
    auto releasable = [&](unsigned w) {
      int kind = -1;
      for (unsigned l = 0; l < 32; ++l) {
        if (w * 32 + l >= block) return false;
        const EmuThread& th = threads[w * 32 + l];
        if (th.state != ST_WARP || (kind >= 0 && th.kind != kind)) return false;
        kind = th.kind;
      }
      return true;
    };
    for (;;) {
      for (unsigned k = 0; k < nw; ++k) {
        const unsigned w = emu_sched_mode == 2 ? nw - 1 - k : k;
        for (;;) {
          for (unsigned t = w * 32; t < block && t < w * 32 + 32; ++t) {
            if (threads[t].state != ST_READY) continue;
            emu_cur = t;
            swapcontext(&emu_sched, &threads[t].ctx);
          }
          // Warp-serial modes run a warp on to its next __syncthreads (or
          // its end) before the next warp moves at all.
          if (emu_sched_mode == 0 || !releasable(w)) break;
          for (unsigned l = 0; l < 32; ++l) threads[w * 32 + l].state = ST_READY;
        }
      }
      bool released = false, alldone = true, anyblock = false, allblock = true;
      for (unsigned t = 0; t < block; ++t) {
        int s = threads[t].state;
        if (s != ST_DONE) alldone = false;
        if (s == ST_BLOCK) anyblock = true;
        if (s == ST_WARP) allblock = false;
      }
      if (alldone) break;
      // warps
      for (unsigned w = 0; w * 32 < block; ++w) {
        unsigned n = 0;
        int kind = -1;
        bool mismatch = false;
        for (unsigned l = 0; l < 32 && w * 32 + l < block; ++l) {
          EmuThread& th = threads[w * 32 + l];
          if (th.state == ST_WARP) {
            ++n;
            if (kind < 0) kind = th.kind;
            else if (kind != th.kind) mismatch = true;
          }
        }
        if (n == 32) {
          if (mismatch) { emu_cur = w * 32; emu_fail("mismatched warp collectives"); }
          for (unsigned l = 0; l < 32; ++l) threads[w * 32 + l].state = ST_READY;
          released = true;
        }
      }
      if (!released && anyblock && allblock) {
        for (unsigned t = 0; t < block; ++t)
          if (threads[t].state == ST_BLOCK) threads[t].state = ST_READY;
        released = true;
      }
      if (!released) {
        emu_cur = 0;
        for (unsigned t = 0; t < block; ++t) fprintf(stderr, "%d", threads[t].state);
        fprintf(stderr, "\n");
        emu_fail("deadlock (divergent collective or barrier)");
      }
    }
  }
}

void* emu_alloc(size_t bytes) {
  const size_t pg = 4096;
  size_t body = (bytes + 15) / 16 * 16;
  size_t pages = (body + pg - 1) / pg;
  char* m = (char*)mmap(nullptr, (pages + 2) * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  mprotect(m, pg, PROT_NONE);
  mprotect(m + (pages + 1) * pg, pg, PROT_NONE);
  char* p = m + (pages + 1) * pg - body;
  memset(p, 0xff, body);  // NaN-ish garbage
  return p;
}
