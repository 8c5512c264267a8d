#!/usr/bin/env python3
"""prep.py KERNELS_DIR FILE OUT: FILE with its headers inlined and every
inline-asm helper replaced by the emulator's version (emu.h)."""
import re
import sys

kdir, name, out = sys.argv[1:4]


def inline(n):
    res = []
    for l in open(f'{kdir}/{n}').read().splitlines(keepends=True):
        m = re.fullmatch(r'\s*#include "([a-z0-9_]+\.cuh)"\s*', l)
        res.append(inline(m.group(1)) if m else l)
    return ''.join(res)


src = inline(name)

# (regex of the definition's start, replacement)
REPL = [
    (r'struct f16 \{',
     'struct f16 { unsigned short u; operator float() const { return emu_h(u); } '
     'f16& operator=(float f) { u = emu_to_h(f); return *this; } };'),
    (r'template <>\s*__device__ __forceinline__ void mma16816<bf16>\(',
     'template <> inline void mma16816<bf16>(float* c, const unsigned* a, const unsigned* b) { emu_mma(c, a, b, true); }'),
    (r'template <>\s*__device__ __forceinline__ void mma16816<f16>\(',
     'template <> inline void mma16816<f16>(float* c, const unsigned* a, const unsigned* b) { emu_mma(c, a, b, false); }'),
    (r'__device__ __forceinline__ unsigned short bits16\(f16, float f\)',
     'inline unsigned short bits16(f16, float f) { return emu_to_h(f); }'),
    (r'__device__ __forceinline__ unsigned smem_addr\(',
     'inline unsigned smem_addr(const void* p) { return emu_smem_addr(p); }'),
    (r'__device__ __forceinline__ void ldsm4t\(',
     'inline void ldsm4t(unsigned* r, unsigned addr) { emu_ldsm4(r, addr, true); }'),
    (r'__device__ __forceinline__ void ldsm4\(',
     'inline void ldsm4(unsigned* r, unsigned addr) { emu_ldsm4(r, addr, false); }'),
    (r'__device__ __forceinline__ void cp_async16\(',
     'inline void cp_async16(unsigned dst, const void* src, bool valid) { emu_cp_async16(dst, src, valid); }'),
    (r'__device__ __forceinline__ void cp_async_commit\(\)',
     'inline void cp_async_commit() { emu_cp_commit(); }'),
    (r'template <int N>\s*__device__ __forceinline__ void cp_async_wait\(\)',
     'template <int N> inline void cp_async_wait() { emu_cp_wait(N); }'),
]


def remove_def(s, start_re, repl):
    m = re.search(start_re, s)
    if not m:
        return s, False
    i = s.index('{', m.end() - 1 if s[m.end() - 1] == '{' else m.end())
    depth = 0
    j = i
    while True:
        c = s[j]
        if c == '{':
            depth += 1
        elif c == '}':
            depth -= 1
            if depth == 0:
                break
        j += 1
    j += 1
    if s[j:j + 1] == ';':
        j += 1
    return s[:m.start()] + repl + s[j:], True


for rx, rp in REPL:
    src, ok = remove_def(src, rx, rp)
if re.search(r'\basm\b', src):
    for l in src.splitlines():
        if re.search(r'\basm\b', l):
            print('asm left:', l, file=sys.stderr)
    sys.exit(1)
open(out, 'w').write('#include "emu.h"\n' + src)
