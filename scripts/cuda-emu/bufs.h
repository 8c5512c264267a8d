// bufs.h: what the kernel checks (layernorm_check, batchnorm_check) share:
// the three float dtypes, rounding a float to one, and a device array of
// one. Included after the prepared kernel file, whose bf16, f16 and
// emu_alloc it uses.
#pragma once

#include <algorithm>

enum DT { F32, BF16, F16 };
static const char* dtName[] = {"float32", "bfloat16", "float16"};
static const int dtSize[] = {4, 2, 2};

// rnd rounds x to dt's precision, as a store of dt does.
static float rnd(DT dt, float x) {
  if (dt == BF16) return emu_bf(bf16_bits(x));
  if (dt == F16) return emu_h(emu_to_h(x));
  return x;
}

// Buf is a device array of dt holding n values.
struct Buf {
  DT dt;
  i64 n;
  void* p;
  Buf(DT dt, i64 n) : dt(dt), n(n), p(emu_alloc(std::max<i64>(n, 1) * dtSize[dt])) {}
  void set(i64 i, float v) {
    if (dt == F32) ((float*)p)[i] = v;
    else if (dt == BF16) ((bf16*)p)[i] = v;
    else ((unsigned short*)p)[i] = emu_to_h(v);
  }
  float get(i64 i) const {
    if (dt == F32) return ((float*)p)[i];
    if (dt == BF16) return (float)((bf16*)p)[i];
    return emu_h(((unsigned short*)p)[i]);
  }
};
