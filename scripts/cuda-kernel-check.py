"""Device check of exec/cuda/kernels: NVRTC-compiled through CuPy, launched
with cuLaunchKernel and a packed argument array (as the Go side will), and
compared with independent float64 NumPy references.

Run on the GPU machine from the repository root (CuPy, NumPy and SciPy are
installed there):  python3 scripts/cuda-kernel-check.py [--bench] [--big]
It stands in for the executor conformance suite until exec/cuda runs graphs;
then internal/conformance.RunAll covers the kernels from Go."""
import ctypes, math, re, struct, sys, time
import numpy as np
import cupy as cp
from scipy.special import erf, erfc

K = 'exec/cuda/kernels'
f32, f64, i64 = np.float32, np.float64, np.int64
rng = np.random.default_rng(7)
FAILS, PASSES = [], [0]


VARIANT = [None]  # replacement for '__launch_bounds__(1024, 1)' when benchmarking variants


def inline(name):
    """kernels/<name> with each #include "x.cuh" replaced by that header's
    text, expanded the same way (as exec/cuda's Source does for NVRTC)."""
    out = []
    for l in open(f'{K}/{name}').read().splitlines(keepends=True):
        m = re.fullmatch(r'\s*#include "([a-z0-9_]+\.cuh)"\s*', l)
        out.append(inline(m.group(1)) if m else l)
    return ''.join(out)


def opcodes():
    """The op codes of kernels/opcodes.cuh (generated from exec/cuda), by
    C name, so this check passes codes by name and never drifts."""
    text = open(f'{K}/opcodes.cuh').read()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r'^\s*([A-Z][A-Z0-9_]*) = (\d+)', text, re.M)}


OP = opcodes()


def source(name):
    src = inline(name)
    if VARIANT[0] is not None:
        src = src.replace('__launch_bounds__(1024, 1)', VARIANT[0])
    return src


MODS = {}


def fn(file, name):
    if (file, VARIANT[0]) not in MODS:
        MODS[(file, VARIANT[0])] = cp.RawModule(code=source(file), options=('-default-device', '--std=c++17'))
    file = (file, VARIANT[0])
    k = MODS[file].get_function(name)
    return getattr(k, 'kernel', k)  # CuPy 14 wraps the Function


def P(a): return ctypes.c_uint64(0 if a is None else a.data.ptr)
def L(x): return ctypes.c_int64(int(x))
def U(x): return ctypes.c_uint64(int(x))
def D(x): return ctypes.c_double(float(x))
def F(x): return ctypes.c_float(float(x))
def S(b): return ctypes.create_string_buffer(b, len(b))


def conv(a):
    if a is None or isinstance(a, cp.ndarray):
        return P(a)
    return a


def launch(file, name, grid, block, *args):
    f = fn(file, name)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    hold = [conv(a) for a in args]
    ptrs = (ctypes.c_void_p * max(1, len(hold)))(*[ctypes.addressof(h) for h in hold])
    cp.cuda.driver.launchKernel(f.ptr, *grid, *block, 0, 0, ctypes.addressof(ptrs), 0)
    cp.cuda.Device().synchronize()


def flat(n, bs=256):
    return (max(1, min(-(-n // bs), 1 << 20)),), (bs,)


def pad8(v, fill):
    v = list(v)
    assert len(v) <= 8
    return v + [fill] * (8 - len(v))


def strided(shape, stride):
    return S(struct.pack('<q8q8q', len(shape), *pad8(shape, 1), *pad8(stride, 0)))


def strided2(shape, sa, sb):
    return S(struct.pack('<q8q8q8q', len(shape), *pad8(shape, 1), *pad8(sa, 0), *pad8(sb, 0)))


def rgeom(ks, kst, rs, rst):
    return S(struct.pack('<q8q8qq8q8q', len(ks), *pad8(ks, 1), *pad8(kst, 0), len(rs), *pad8(rs, 1), *pad8(rst, 0)))


def window(*v):
    assert len(v) == 14
    return S(struct.pack('<14q', *v))


def cstrides(shape):
    s, acc = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        s[i] = acc
        acc *= shape[i]
    return s


def operand_strides(shape, out):
    own, s, lead = cstrides(shape), [0] * len(out), len(out) - len(shape)
    for i, d in enumerate(shape):
        s[lead + i] = own[i] if d == out[lead + i] else 0
    return s


def record(name, ok, detail=''):
    if ok:
        PASSES[0] += 1
    else:
        FAILS.append(name)
        print('FAIL', name, detail)


def same_bits(name, got, want):
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)
    want = np.asarray(want)
    if got.dtype == f32 or want.dtype == f32:
        got, want = got.astype(f32), want.astype(f32)
        gn, wn = np.isnan(got), np.isnan(want)
        ok = np.array_equal(gn, wn) and np.array_equal(got.view(np.uint32)[~gn], want.view(np.uint32)[~wn])
    else:
        ok = np.array_equal(got, want)
    bad = ''
    if not ok:
        d = np.nonzero(~((got == want) | (np.isnan(got.astype(f64)) & np.isnan(want.astype(f64)))))
        bad = f'{len(d[0])} differ; first at {[x[0] for x in d]}: got {got[tuple(x[0] for x in d)]} want {want[tuple(x[0] for x in d)]}'
    record(name, ok, bad)


def close(name, got, want, rtol, atol):
    got = (cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)).astype(f64)
    want = np.asarray(want, f64)
    nan_ok = np.array_equal(np.isnan(got), np.isnan(want))
    m = ~np.isnan(want)
    with np.errstate(invalid='ignore'):
        diff = np.where(got[m] == want[m], 0.0, np.abs(got[m] - want[m]))
    err = np.nan_to_num(diff, nan=np.inf) - (atol + rtol * np.abs(np.nan_to_num(want[m])))
    ok = nan_ok and got.shape == want.shape and (err.size == 0 or err.max() <= 0)
    record(name, ok, '' if ok else f'nan_ok={nan_ok} worst excess {err.max() if err.size else 0:.3g} at {np.argmax(err) if err.size else -1}')


def gomax(a, b):
    a, b = np.asarray(a), np.asarray(b)
    eq = np.where(np.signbit(a), b, a)
    r = np.where(a > b, a, b)
    r = np.where(a == b, eq, r)
    r = np.where(np.isnan(b), b, r)
    return np.where(np.isnan(a), a, r)


def dev(a):
    return cp.asarray(np.ascontiguousarray(a))


# ---------------------------------------------------------------- elementwise
def test_elementwise():
    E = 'elementwise.cu'
    n = 10007
    x = (rng.standard_normal(n) * 3).astype(f32)
    x[:6] = [0, -0.0, np.nan, 1e-30, -12, 12]
    xp = (np.abs(x) + 0.1).astype(f32)
    xp[2] = np.nan
    x64 = x.astype(f64)
    xp64 = xp.astype(f64)
    c = math.sqrt(2 / math.pi)
    with np.errstate(all='ignore'):
        cases = [  # op, input, ref, exact
            ('U_NEG', x, -x64, True), ('U_EXP', x, np.exp(x64), False), ('U_LOG', xp, np.log(xp64), False),
            ('U_SQRT', xp, np.sqrt(xp64), True), ('U_ABS', x, np.abs(x64), True), ('U_TANH', x, np.tanh(x64), False),
            ('U_SIGMOID', x, 1 / (1 + np.exp(-x64)), False), ('U_RELU', x, np.where(x64 < 0, 0, x64), True),
            ('U_GELU', x, 0.5 * x64 * erfc(-x64 / math.sqrt(2)), False),
            ('U_GELU_TANH', x, 0.5 * x64 * (1 + np.tanh(c * (x64 + 0.044715 * x64 ** 3))), False),
            ('U_SIGN', x, np.sign(x64), True), ('U_SILU', x, x64 / (1 + np.exp(-x64)), False)]
    for op, inp, ref, exact in cases:
        y = cp.empty(n, f32)
        g, b = flat(n)
        launch(E, 'unary_f32', g, b, dev(inp), y, L(n), L(OP[op]))
        if exact:
            if op == 'U_SIGN':
                ref = np.where(x64 == 0, x64, ref)  # sign keeps ±0
            same_bits(f'unary {op}', y, ref.astype(f32))
        else:
            close(f'unary {op}', y, ref, 3e-6, 1e-12 if op.startswith('U_GELU') else 1e-37)
    # scalar ops, s not representable in float32: double math rounded once
    s = 0.1
    for op, ref in [('S_ADD_SCALAR', x64 + s), ('S_SUB_SCALAR', x64 - s), ('S_RSUB_SCALAR', s - x64),
                    ('S_MUL_SCALAR', x64 * s), ('S_DIV_SCALAR', x64 / s),
                    ('S_RDIV_SCALAR', np.divide(s, x64, where=x64 != 0, out=np.full(n, np.inf) * np.where(np.signbit(x64), -1, 1))),
                    ('S_MAXIMUM_SCALAR', gomax(x64, s))]:
        y = cp.empty(n, f32)
        g, b = flat(n)
        launch(E, 'scalar_f32', g, b, dev(x), y, L(n), L(OP[op]), D(s))
        same_bits(f'scalar {op}', y, ref.astype(f32))
    y = cp.empty(n, f32)
    launch(E, 'scalar_f32', *flat(n), dev(xp), y, L(n), L(OP['S_POW_SCALAR']), D(1.7))
    close('scalar pow', y, xp64 ** 1.7, 1.2e-7, 0)
    y = cp.empty(n, f32)
    launch(E, 'scalar_f32', *flat(n), dev(x), y, L(n), L(OP['S_MAXIMUM_SCALAR']), D(0.0))
    same_bits('scalar maximum 0', y, gomax(x64, 0.0).astype(f32))
    # binary, contiguous
    a = (rng.standard_normal(n) * 2).astype(f32)
    bb = (rng.standard_normal(n) * 2).astype(f32)
    a[:4] = [np.nan, 1, -0.0, 0.0]
    bb[:4] = [1, np.nan, 0.0, -0.0]
    bb[10:20] = a[10:20]
    with np.errstate(all='ignore'):
        for op, ref in [('B_ADD', a + bb), ('B_SUB', a - bb), ('B_MUL', a * bb), ('B_DIV', a / bb), ('B_MAXIMUM', gomax(a, bb))]:
            y = cp.empty(n, f32)
            launch(E, 'binary_f32', *flat(n), dev(a), dev(bb), y, L(n), L(OP[op]))
            same_bits(f'binary {op}', y, ref)
    ap = np.abs(a) + 0.5
    y = cp.empty(n, f32)
    launch(E, 'binary_f32', *flat(n), dev(ap), dev(bb), y, L(n), L(OP['B_POW']))
    close('binary pow', y, ap.astype(f64) ** bb.astype(f64), 1.2e-7, 0)
    # broadcasting
    A = rng.standard_normal((4, 1, 5)).astype(f32)
    B = rng.standard_normal((3, 1)).astype(f32)
    out = [4, 3, 5]
    geo = strided2(out, operand_strides([4, 1, 5], out), operand_strides([3, 1], out))
    for op, ref in [('B_ADD', A + B), ('B_SUB', A - B), ('B_DIV', A / B), ('B_MAXIMUM', gomax(A, B))]:
        y = cp.empty(out, f32)
        launch(E, 'binary_bcast_f32', *flat(60), dev(A), dev(B), y, L(60), L(OP[op]), geo)
        same_bits(f'bcast {op}', y, ref.astype(f32))
    # scalar against tensor: rank-0 operand
    y = cp.empty(out, f32)
    launch(E, 'binary_bcast_f32', (1,), (32,), dev(A), dev(np.array([2.5], f32)), y, L(60), L(OP['B_MUL']),
           strided2(out, operand_strides([4, 1, 5], out), [0, 0, 0]))
    same_bits('bcast scalar', y, np.broadcast_to(A * f32(2.5), out))
    # gradients
    g = rng.standard_normal(n).astype(f32)
    yv = np.where(x < 0, 0, x).astype(f32)
    o = cp.empty(n, f32)
    launch(E, 'relu_grad_f32', *flat(n), dev(g), dev(yv), o, L(n))
    same_bits('relu_grad', o, np.where(yv > 0, g, f32(0)))
    xs = x.copy()
    xs[2] = 0.3
    x6 = xs.astype(f64)
    cdf = 0.5 * erfc(-x6 / math.sqrt(2))
    pdf = np.exp(-0.5 * x6 * x6) / math.sqrt(2 * math.pi)
    o = cp.empty(n, f32)
    launch(E, 'gelu_grad_f32', *flat(n), dev(g), dev(xs), o, L(n), L(0))
    close('gelu_grad erf', o, g * (cdf + x6 * pdf), 3e-6, 3e-7)
    t = np.tanh(c * (x6 + 0.044715 * x6 ** 3))
    d = 0.5 * (1 + t) + 0.5 * x6 * (1 - t * t) * c * (1 + 3 * 0.044715 * x6 * x6)
    o = cp.empty(n, f32)
    launch(E, 'gelu_grad_f32', *flat(n), dev(g), dev(xs), o, L(n), L(1))
    close('gelu_grad tanh', o, g * d, 3e-6, 3e-7)
    s6 = 1 / (1 + np.exp(-x6))
    o = cp.empty(n, f32)
    launch(E, 'unary_grad_f32', *flat(n), dev(g), dev(xs), o, L(n), L(OP['U_SILU']))
    close('unary_grad silu', o, g * (s6 + x6 * s6 * (1 - s6)), 3e-6, 3e-7)
    xi = rng.integers(-2, 3, n).astype(f32)
    o = cp.empty(n, f32)
    launch(E, 'maximum_scalar_grad_f32', *flat(n), dev(g), dev(xi), o, L(n), F(1.0))
    share = np.where(xi > 1, 1, np.where(xi == 1, 0.5, 0)).astype(f32)
    same_bits('maximum_scalar_grad', o, share * g)
    Ai = rng.integers(0, 3, (4, 1, 5)).astype(f32)
    Bi = rng.integers(0, 3, (3, 1)).astype(f32)
    G = rng.standard_normal(out).astype(f32)
    geo = strided2(out, operand_strides([4, 1, 5], out), operand_strides([3, 1], out))
    for which in (0, 1):
        p_, q_ = np.broadcast_to(Ai, out), np.broadcast_to(Bi, out)
        if which:
            p_, q_ = q_, p_
        o = cp.empty(out, f32)
        launch(E, 'maximum_grad_f32', *flat(60), dev(G), dev(Ai), dev(Bi), o, L(60), L(which), geo)
        same_bits(f'maximum_grad {which}', o, np.where(p_ > q_, 1, np.where(p_ == q_, 0.5, 0)).astype(f32) * G)
    X = rng.standard_normal((2, 3, 5)).astype(f32)
    o = cp.empty((2, 3, 5), f32)
    launch(E, 'causal_mask_f32', *flat(30), dev(X), o, L(30), L(3), L(5), F(-np.inf))
    ref = X.copy()
    for i in range(3):
        for j in range(5):
            if j > i + 5 - 3:
                ref[:, i, j] = -np.inf
    same_bits('causal_mask', o, ref)
    bias = rng.standard_normal(6).astype(f32)
    o = cp.empty((3, 6, 7), f32)
    launch(E, 'bias_fill_f32', *flat(126), o, dev(bias), L(3), L(6), L(7))
    same_bits('bias_fill', o, np.broadcast_to(bias[None, :, None], (3, 6, 7)))


# ---------------------------------------------------------------- reduce
def test_reduce():
    R = 'reduce.cu'
    for rows, n, blocks in [(37, 1000, [(32, 8), (128, 2), (256, 1), (1024, 1)]), (5000, 7, [(32, 8)]), (3, 100000, [(1024, 1)])]:
        x = rng.standard_normal((rows, n)).astype(f32)
        x[1, 3] = np.nan
        xs = x.astype(f64)
        for bx, by in blocks:
            o = cp.empty(rows, f32)
            launch(R, 'reduce_rows_f32', (-(-rows // by),), (bx, by), dev(x), o, None, L(rows), L(n), L(OP['R_SUM']), D(1.0 / n))
            close(f'reduce_rows mean {rows}x{n} {bx}x{by}', o, xs.sum(1) / n, 2e-7, 1e-9)
            o = cp.empty(rows, f32)
            launch(R, 'reduce_rows_f32', (min(3, -(-rows // by)),), (bx, by), dev(x), o, None, L(rows), L(n), L(OP['R_MAX']), D(1.0))
            same_bits(f'reduce_rows max {rows}x{n} {bx}x{by}', o, x.max(1))
        for op, ref in [(OP['R_SUM'], xs.sum(1)), (OP['R_MAX'], x.max(1))]:
            splits = 4
            part = cp.empty((splits, rows), f32)
            launch(R, 'reduce_rows_f32', (-(-rows // 8), splits), (32, 8), dev(x), None, part, L(rows), L(n), L(op), D(1.0))
            o = cp.empty(rows, f32)
            launch(R, 'reduce_splits_f32', (-(-rows // 32), 1, 1), (32, 8), part, o, L(splits), L(rows), L(op), D(1.0))
            close(f'reduce_rows split op{op} {rows}x{n}', o, ref, 3e-7, 1e-4)
    for outer, n, inner in [(3, 500, 70), (1, 20000, 64), (70000, 3, 2)]:
        x = rng.standard_normal((outer, n, inner)).astype(f32)
        xs = x.astype(f64)
        for splits in (1, 5):
            for op, ref in [(OP['R_SUM'], xs.sum(1) * 0.5), (OP['R_MAX'], x.max(1))]:
                part = cp.empty((splits, outer, inner), f32)
                launch(R, 'reduce_mid_f32', (-(-inner // 32), min(outer, 65535), splits), (32, 8), dev(x),
                       *((part, None) if splits == 1 else (None, part)),
                       L(outer), L(n), L(inner), L(op), D(0.5 if splits == 1 else 1.0))
                if splits == 1:
                    o = part
                else:
                    o = cp.empty((outer, inner), f32)
                    launch(R, 'reduce_splits_f32', (-(-(outer * inner) // 32), 1, 1), (32, 8), part, o, L(splits),
                           L(outer * inner), L(op), D(0.5))
                close(f'reduce_mid op{op} {outer}x{n}x{inner} s{splits}', o.reshape(outer, inner), ref, 3e-7, 1e-6 if splits == 1 else 1e-4)
    x = rng.standard_normal((3, 4, 5, 6)).astype(f32)
    geo = rgeom([4, 6], [30, 1], [3, 5], [120, 6])
    for splits in (1, 2):
        for op, ref in [(OP['R_SUM'], x.astype(f64).sum((0, 2))), (OP['R_MAX'], x.max((0, 2)))]:
            part = cp.empty((splits, 24), f32)
            launch(R, 'reduce_strided_f32', (3, splits), (32, 8), dev(x), *((part, None) if splits == 1 else (None, part)),
                   geo, L(24), L(15), L(op), D(1.0))
            if splits == 1:
                o = part
            else:
                o = cp.empty(24, f32)
                launch(R, 'reduce_splits_f32', (1, 1, 1), (32, 8), part, o, L(splits), L(24), L(op), D(1.0))
            close(f'reduce_strided op{op} s{splits}', o.reshape(4, 6), ref, 3e-7, 1e-5)
    # max_grad: integer data for ties
    xi = rng.integers(0, 4, (3, 4, 5, 6)).astype(f32)
    y = xi.max((0, 2))
    g = rng.standard_normal((4, 6)).astype(f32)
    o = cp.empty(xi.shape, f32)
    launch(R, 'max_grad_f32', (2,), (32, 8), dev(g), dev(xi), dev(y), o, geo, L(24), L(15))
    yb = y[None, :, None, :]
    cnt = (xi == yb).sum((0, 2)).astype(f32)
    same_bits('max_grad strided', o, np.where(xi == yb, (g / cnt)[None, :, None, :], f32(0)))
    xr = rng.integers(0, 5, (10, 50)).astype(f32)
    yr = xr.max(1)
    gr = rng.standard_normal(10).astype(f32)
    o = cp.empty(xr.shape, f32)
    launch(R, 'max_grad_f32', (10,), (64, 1), dev(gr), dev(xr), dev(yr), o, rgeom([10], [50], [50], [1]), L(10), L(50))
    cnt = (xr == yr[:, None]).sum(1).astype(f32)
    same_bits('max_grad rows', o, np.where(xr == yr[:, None], (gr / cnt)[:, None], f32(0)))


# ---------------------------------------------------------------- softmax
def softmax64(x, axis):
    m = x.max(axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis, keepdims=True), x - m - np.log(e.sum(axis, keepdims=True))


def test_softmax():
    Sm = 'softmax.cu'
    for rows, n, blk in [(33, 1000, (256, 1)), (100, 10, (32, 8)), (7, 3000, (1024, 1)), (64, 200, (64, 4))]:
        x = (rng.standard_normal((rows, n)) * 3).astype(f32)
        x[0, n // 2:] = -np.inf
        sm, lsm = softmax64(x.astype(f64), 1)
        for lg, ref, atol in [(0, sm, 1e-12), (1, lsm, 3e-6)]:
            y = cp.empty((rows, n), f32)
            launch(Sm, 'softmax_rows_f32', (-(-rows // blk[1]),), blk, dev(x), y, L(rows), L(n), L(lg))
            close(f'softmax_rows log{lg} {rows}x{n}', y, ref, 2e-6, atol)
            g = rng.standard_normal((rows, n)).astype(f32)
            yh = cp.asnumpy(y)
            with np.errstate(invalid='ignore'):
                y6, g6 = yh.astype(f64), g.astype(f64)
                gref = g6 - np.exp(y6) * g6.sum(1, keepdims=True) if lg else y6 * (g6 - (g6 * y6).sum(1, keepdims=True))
            o = cp.empty((rows, n), f32)
            launch(Sm, 'softmax_grad_rows_f32', (-(-rows // blk[1]),), blk, dev(g), y, o, L(rows), L(n), L(lg))
            close(f'softmax_grad_rows log{lg} {rows}x{n}', o, gref, 2e-6, 1e-6 if lg else 1e-9)
    outer, n, inner = 3, 50, 70
    x = (rng.standard_normal((outer, n, inner)) * 3).astype(f32)
    sm, lsm = softmax64(x.astype(f64), 1)
    for lg, ref, atol in [(0, sm, 1e-12), (1, lsm, 3e-6)]:
        y = cp.empty(x.shape, f32)
        launch(Sm, 'softmax_cols_f32', *flat(outer * inner, 64), dev(x), y, L(outer), L(n), L(inner), L(lg))
        close(f'softmax_cols log{lg}', y, ref, 2e-6, atol)
        g = rng.standard_normal(x.shape).astype(f32)
        y6, g6 = cp.asnumpy(y).astype(f64), g.astype(f64)
        gref = g6 - np.exp(y6) * g6.sum(1, keepdims=True) if lg else y6 * (g6 - (g6 * y6).sum(1, keepdims=True))
        o = cp.empty(x.shape, f32)
        launch(Sm, 'softmax_grad_cols_f32', *flat(outer * inner, 64), dev(g), y, o, L(outer), L(n), L(inner), L(lg))
        close(f'softmax_grad_cols log{lg}', o, gref, 2e-6, 1e-6 if lg else 1e-9)


# ---------------------------------------------------------------- layer norm
def test_layernorm():
    LN = 'layernorm.cu'
    eps = 1e-5
    for rows, d, blk in [(37, 300, (128, 2)), (9, 5000, (1024, 1)), (300, 16, (32, 8))]:
        x = (rng.standard_normal((rows, d)) * 2 + 3).astype(f32)
        w = rng.standard_normal(d).astype(f32)
        b = rng.standard_normal(d).astype(f32)
        x6 = x.astype(f64)
        mean = x6.mean(1, keepdims=True)
        rstd = 1 / np.sqrt(((x6 - mean) ** 2).mean(1, keepdims=True) + eps)
        xh = (x6 - mean) * rstd
        grid = (-(-rows // blk[1]),)
        for ww, bw, ref in [(w, b, xh * w + b), (None, None, xh), (w, None, xh * w)]:
            y = cp.empty(x.shape, f32)
            launch(LN, 'layer_norm_f32', grid, blk, dev(x), None if ww is None else dev(ww), None if bw is None else dev(bw),
                   y, L(rows), L(d), D(eps))
            close(f'layer_norm {rows}x{d} w{ww is not None} b{bw is not None}', y, ref, 3e-7, 1e-9)
        g = rng.standard_normal((rows, d)).astype(f32)
        for ww in (w, None):
            gh = g.astype(f64) * (ww.astype(f64) if ww is not None else 1)
            ref = rstd * (gh - gh.mean(1, keepdims=True) - xh * (gh * xh).mean(1, keepdims=True))
            o = cp.empty(x.shape, f32)
            launch(LN, 'layer_norm_grad_x_f32', grid, blk, dev(g), dev(x), None if ww is None else dev(ww), o, L(rows), L(d), D(eps))
            close(f'layer_norm_grad_x {rows}x{d} w{ww is not None}', o, ref, 3e-6, 1e-6)
        stats = cp.empty(2 * rows, f64)
        launch(LN, 'layer_norm_stats_f32', grid, blk, dev(x), stats, L(rows), L(d), D(eps))
        st = cp.asnumpy(stats).reshape(rows, 2)
        close(f'layer_norm_stats {rows}x{d}', st, np.concatenate([mean, rstd], 1), 1e-12, 1e-12)
        ref = (g.astype(f64) * xh).sum(0)
        for splits in (1, 3):
            part = cp.empty((splits, d), f32)
            launch(LN, 'layer_norm_grad_w_f32', (-(-d // 32), splits), (32, 8), dev(g), dev(x), stats,
                   *((part, None) if splits == 1 else (None, part)), L(rows), L(d))
            if splits == 1:
                o = part
            else:
                o = cp.empty(d, f32)
                launch('reduce.cu', 'reduce_splits_f32', (-(-d // 32), 1, 1), (32, 8), part, o, L(splits), L(d), L(OP['R_SUM']), D(1.0))
            close(f'layer_norm_grad_w {rows}x{d} s{splits}', o.reshape(d), ref, 1e-6, 1e-6)


# ---------------------------------------------------------------- movement
def test_movement():
    M = 'movement.cu'
    x = rng.standard_normal((2, 3, 4, 5)).astype(f32)
    xi = rng.integers(-10**12, 10**12, (2, 3, 4, 5)).astype(i64)
    o = cp.empty(120, f32)
    launch(M, 'copy_f32', *flat(120), dev(x), o, L(120))
    same_bits('copy_f32', o, x.ravel())
    o = cp.empty(120, i64)
    launch(M, 'copy_i64', *flat(120), dev(xi), o, L(120))
    same_bits('copy_i64', o, xi.ravel())
    perm = (2, 0, 3, 1)
    xs = cstrides(x.shape)
    shape = [x.shape[p] for p in perm]
    geo = strided(shape, [xs[p] for p in perm])
    o = cp.empty(shape, f32)
    launch(M, 'gather_f32', *flat(120), dev(x), o, L(120), L(0), geo)
    same_bits('gather permute f32', o, np.transpose(x, perm))
    o = cp.empty(shape, i64)
    launch(M, 'gather_i64', (1,), (32,), dev(xi), o, L(120), L(0), geo)
    same_bits('gather permute i64', o, np.transpose(xi, perm))
    g = rng.standard_normal((3, 1)).astype(f32)
    o = cp.empty((2, 3, 4), f32)
    launch(M, 'gather_f32', *flat(24), dev(g), o, L(24), L(0), strided([2, 3, 4], operand_strides([3, 1], [2, 3, 4])))
    same_bits('gather expand', o, np.broadcast_to(g, (2, 3, 4)))
    # strided slice through gather: x[:, 1:3, ::2, 1]
    o = cp.empty((2, 2, 2), f32)
    launch(M, 'gather_f32', *flat(8), dev(x), o, L(8), L(1 * 20 + 1), strided([2, 2, 2], [60, 20, 10]))
    same_bits('gather slice', o, x[:, 1:3, ::2, 1])
    for (bt, r, c), grid in [((3, 37, 45), (2, 2, 3)), ((2, 100, 70), (1, 1, 1)), ((1, 1, 33), (2, 1, 1))]:
        t = rng.standard_normal((bt, r, c)).astype(f32)
        o = cp.empty((bt, c, r), f32)
        launch(M, 'transpose_f32', grid, (32, 8), dev(t), o, L(bt), L(r), L(c))
        same_bits(f'transpose_f32 {bt}x{r}x{c}', o, t.transpose(0, 2, 1))
        ti = rng.integers(-10**15, 10**15, (bt, r, c)).astype(i64)
        o = cp.empty((bt, c, r), i64)
        launch(M, 'transpose_i64', grid, (32, 4), dev(ti), o, L(bt), L(r), L(c))
        same_bits(f'transpose_i64 {bt}x{r}x{c}', o, ti.transpose(0, 2, 1))
    s = rng.standard_normal((4, 10, 3)).astype(f32)
    m = -(-(9 - 1) // 3)
    o = cp.empty((4, m, 3), f32)
    launch(M, 'slice_f32', *flat(4 * m * 3), dev(s), o, L(4), L(10), L(3), L(m), L(1), L(3))
    same_bits('slice_f32', o, s[:, 1:9:3])
    si = rng.integers(0, 100, (4, 10, 3)).astype(i64)
    o = cp.empty((4, m, 3), i64)
    launch(M, 'slice_i64', *flat(4 * m * 3), dev(si), o, L(4), L(10), L(3), L(m), L(1), L(3))
    same_bits('slice_i64', o, si[:, 1:9:3])
    gs = rng.standard_normal((4, m, 3)).astype(f32)
    o = cp.full((4, 10, 3), np.nan, f32)
    launch(M, 'slice_grad_f32', *flat(120), dev(gs), o, L(4), L(10), L(3), L(m), L(1), L(3))
    ref = np.zeros((4, 10, 3), f32)
    ref[:, 1:9:3] = gs
    same_bits('slice_grad', o, ref)
    a = rng.standard_normal((2, 3, 4)).astype(f32)
    b = rng.standard_normal((2, 5, 4)).astype(f32)
    o = cp.empty((2, 8, 4), f32)
    launch(M, 'copy2d_f32', *flat(24), dev(a), L(12), L(0), o, L(32), L(0), L(2), L(12))
    launch(M, 'copy2d_f32', *flat(40), dev(b), L(20), L(0), o, L(32), L(12), L(2), L(20))
    same_bits('copy2d concat', o, np.concatenate([a, b], 1))
    ai = rng.integers(0, 9, (2, 3, 4)).astype(i64)
    whole = cp.zeros((2, 6, 4), i64)
    launch(M, 'copy2d_i64', *flat(24), dev(ai), L(12), L(0), whole, L(24), L(2 * 4), L(2), L(12))
    ref = np.zeros((2, 6, 4), i64)
    ref[:, 2:5] = ai
    same_bits('copy2d place chunk i64', whole, ref)


# ---------------------------------------------------------------- index
def test_index():
    I = 'index.cu'
    V, Dd = 50, 16
    w = rng.standard_normal((V, Dd)).astype(f32)
    idx = rng.integers(0, V, (7, 3)).astype(i64)
    idx[0, 0] = idx[1, 1] = 4
    bad = cp.full(1, -1, i64)
    o = cp.empty((7, 3, Dd), f32)
    launch(I, 'embedding_f32', *flat(21 * Dd), dev(idx), dev(w), o, L(21), L(V), L(Dd), bad)
    same_bits('embedding', o, w[idx])
    record('embedding bad none', int(bad.get()[0]) == -1)
    g = rng.standard_normal((7, 3, Dd)).astype(f32)
    o = cp.zeros((V, Dd), f32)
    launch(I, 'embedding_grad_f32', *flat(21 * Dd), dev(g), dev(idx), o, L(21), L(V), L(Dd), bad)
    ref = np.zeros((V, Dd))
    np.add.at(ref, idx.ravel(), g.reshape(-1, Dd).astype(f64))
    close('embedding_grad', o, ref, 1e-6, 1e-6)
    idx2 = idx.ravel().copy()
    idx2[9], idx2[5] = 60, -1
    bad = cp.full(1, -1, i64)
    o = cp.empty((21, Dd), f32)
    launch(I, 'embedding_f32', *flat(21 * Dd), dev(idx2), dev(w), o, L(21), L(V), L(Dd), bad)
    record('embedding bad first', int(bad.get()[0]) == 5, str(bad.get()))
    bad = cp.full(1, -1, i64)
    o = cp.zeros((V, Dd), f32)
    launch(I, 'embedding_grad_f32', *flat(21 * Dd), dev(g), dev(idx2), o, L(21), L(V), L(Dd), bad)
    record('embedding_grad bad first', int(bad.get()[0]) == 5, str(bad.get()))


# ---------------------------------------------------------------- conv
def test_conv():
    C = 'conv.cu'
    n, c, h, w = 2, 3, 9, 8
    kh, kw, sh, sw, ph, pw, dh, dw = 3, 2, 2, 1, 1, 1, 2, 1
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    kk, howo = c * kh * kw, ho * wo
    x = rng.standard_normal((n, c, h, w)).astype(f32)
    col_img = kk * howo + 7  # padded image stride
    wd = window(n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
    col = cp.full(n * col_img, np.nan, f32)
    launch(C, 'im2col_f32', *flat(n * kk * howo), dev(x), col, wd, L(c * h * w), L(col_img))
    ref = np.zeros((n, kk, ho, wo), f32)
    for i in range(n):
        for ci in range(c):
            for ki in range(kh):
                for kj in range(kw):
                    for oh in range(ho):
                        for ow in range(wo):
                            ih, iw = oh * sh - ph + ki * dh, ow * sw - pw + kj * dw
                            if 0 <= ih < h and 0 <= iw < w:
                                ref[i, (ci * kh + ki) * kw + kj, oh, ow] = x[i, ci, ih, iw]
    got = cp.asnumpy(col).reshape(n, col_img)[:, :kk * howo].reshape(n, kk, ho, wo)
    same_bits('im2col', got, ref)
    cv = rng.standard_normal((n, col_img)).astype(f32)
    xo = cp.full((n, c, h, w), np.nan, f32)
    launch(C, 'col2im_f32', *flat(n * c * h * w), dev(cv), xo, wd, L(c * h * w), L(col_img))
    ref = np.zeros((n, c, h, w), f32)
    cvm = cv[:, :kk * howo].reshape(n, kk, ho, wo)
    for i in range(n):
        for ci in range(c):
            for ki in range(kh):
                for kj in range(kw):
                    for oh in range(ho):
                        for ow in range(wo):
                            ih, iw = oh * sh - ph + ki * dh, ow * sw - pw + kj * dw
                            if 0 <= ih < h and 0 <= iw < w:
                                ref[i, ci, ih, iw] = f32(ref[i, ci, ih, iw] + cvm[i, (ci * kh + ki) * kw + kj, oh, ow])
    same_bits('col2im', xo, ref)


# ---------------------------------------------------------------- pool
def pool_ref_windows(shape, k, s, p, d, ho, wo):
    n, c, h, w = shape
    for oh in range(ho):
        for ow in range(wo):
            taps = []
            for ki in range(k[0]):
                ih = oh * s[0] - p[0] + ki * d[0]
                if not 0 <= ih < h:
                    continue
                for kj in range(k[1]):
                    iw = ow * s[1] - p[1] + kj * d[1]
                    if 0 <= iw < w:
                        taps.append((ih, iw))
            yield oh, ow, taps


def test_pool():
    Pf = 'pool.cu'
    for shape, k, s, p, d in [((2, 3, 11, 10), (3, 3), (2, 2), (1, 1), (1, 1)),
                              ((1, 2, 11, 9), (2, 2), (1, 1), (1, 1), (2, 2)),
                              ((2, 2, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1))]:
        n, c, h, w = shape
        ho = (h + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
        wo = (w + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
        wd = window(n, c, h, w, k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1], ho, wo)
        x = rng.standard_normal(shape).astype(f32)
        x[0, 0, 2, 3] = np.nan
        y = cp.empty((n, c, ho, wo), f32)
        launch(Pf, 'max_pool2d_f32', *flat(n * c * ho * wo), dev(x), y, wd)
        ref = np.empty((n, c, ho, wo), f32)
        wins = list(pool_ref_windows(shape, k, s, p, d, ho, wo))
        for i in range(n):
            for ci in range(c):
                for oh, ow, taps in wins:
                    vals = [x[i, ci, a, b] for a, b in taps]
                    ref[i, ci, oh, ow] = np.nan if any(np.isnan(vals)) else max(vals)
        same_bits(f'max_pool2d {shape} k{k} d{d}', y, ref)
        xi = rng.integers(0, 3, shape).astype(f32)  # ties
        g = rng.standard_normal((n, c, ho, wo)).astype(f32)
        o = cp.full(shape, np.nan, f32)
        idx = cp.full((n, c, ho, wo), -7, np.int32)
        launch(Pf, 'max_pool2d_argmax_f32', *flat(idx.size), dev(xi), idx, wd)
        launch(Pf, 'max_pool2d_grad_f32', *flat(x.size), dev(g), idx, o, wd)
        ref = np.zeros(shape, f32)
        for i in range(n):
            for ci in range(c):
                for oh, ow, taps in wins:
                    best = None
                    for a, b in taps:
                        if best is None or xi[i, ci, a, b] > xi[i, ci, best[0], best[1]]:
                            best = (a, b)
                    if best is not None:
                        ref[i, ci, best[0], best[1]] = f32(ref[i, ci, best[0], best[1]] + g[i, ci, oh, ow])
        same_bits(f'max_pool2d_grad {shape} k{k} d{d}', o, ref)
    for shape, k, s, p in [((2, 3, 11, 10), (3, 2), (2, 2), (1, 1)), ((1, 2, 7, 7), (3, 3), (1, 1), (1, 1))]:
        n, c, h, w = shape
        ho = (h + 2 * p[0] - (k[0] - 1) - 1) // s[0] + 1
        wo = (w + 2 * p[1] - (k[1] - 1) - 1) // s[1] + 1
        wd = window(n, c, h, w, k[0], k[1], s[0], s[1], p[0], p[1], 1, 1, ho, wo)
        x = rng.standard_normal(shape).astype(f32)
        y = cp.empty((n, c, ho, wo), f32)
        launch(Pf, 'avg_pool2d_f32', *flat(n * c * ho * wo), dev(x), y, wd)
        wins = list(pool_ref_windows(shape, k, s, p, (1, 1), ho, wo))
        ref = np.empty((n, c, ho, wo), f32)
        for i in range(n):
            for ci in range(c):
                for oh, ow, taps in wins:
                    acc = 0.0
                    for a, b in taps:
                        acc += float(x[i, ci, a, b])
                    ref[i, ci, oh, ow] = f32(acc * (1.0 / (k[0] * k[1])))
        same_bits(f'avg_pool2d {shape}', y, ref)
        g = rng.standard_normal((n, c, ho, wo)).astype(f32)
        o = cp.full(shape, np.nan, f32)
        launch(Pf, 'avg_pool2d_grad_f32', *flat(x.size), dev(g), o, wd)
        inv = f32(1) / f32(k[0] * k[1])
        ref = np.zeros(shape, f32)
        for i in range(n):
            for ci in range(c):
                for oh, ow, taps in wins:
                    for a, b in taps:
                        ref[i, ci, a, b] = f32(ref[i, ci, a, b] + f32(g[i, ci, oh, ow] * inv))
        same_bits(f'avg_pool2d_grad {shape}', o, ref)


# ---------------------------------------------------------------- loss
def test_loss():
    Lf = 'loss.cu'
    # The last two rows are too long for registers (the online pass); the
    # very last is sorted ascending, so every thread's running max grows
    # at every element and its sum is rescaled each time.
    for N, Cn, blk, ascending in [(37, 10, (32, 8), False), (5, 5000, (512, 1), False),
                                  (7, 50257, (1024, 1), False), (5, 20000, (256, 1), True)]:
        x = (rng.standard_normal((N, Cn)) * 2).astype(f32)
        if ascending:
            x = np.sort(x * 4, axis=1)
        lab = rng.integers(0, Cn, N).astype(i64)
        x6 = x.astype(f64)
        m = x6.max(1, keepdims=True)
        lse = (m + np.log(np.exp(x6 - m).sum(1, keepdims=True)))[:, 0]
        rl = cp.empty(N, f64)
        bad = cp.full(1, -1, i64)
        launch(Lf, 'cross_entropy_rows_f32', (-(-N // blk[1]),), blk, dev(x), dev(lab), rl, L(N), L(Cn), L(Cn), bad)
        out = cp.empty(1, f32)
        launch(Lf, 'sum_f64_f32', (1,), (256,), rl, out, L(N), D(1.0 / N))
        close(f'cross_entropy {N}x{Cn}', out, [(lse - x6[np.arange(N), lab]).sum() / N], 1e-6, 0)
        record('cross_entropy bad none', int(bad.get()[0]) == -1)
        g = np.array([0.7], f32)
        o = cp.empty((N, Cn), f32)
        launch(Lf, 'cross_entropy_grad_f32', (-(-N // blk[1]),), blk, dev(g), dev(x), dev(lab), o, L(N), L(Cn), L(Cn), D(1.0 / N), bad)
        sm = np.exp(x6 - lse[:, None])
        sm[np.arange(N), lab] -= 1
        close(f'cross_entropy_grad {N}x{Cn}', o, 0.7 / N * sm, 2e-6, 1e-10)
        lab2 = lab.copy()
        lab2[3] = Cn
        bad = cp.full(1, -1, i64)
        launch(Lf, 'cross_entropy_rows_f32', (-(-N // blk[1]),), blk, dev(x), dev(lab2), rl, L(N), L(Cn), L(Cn), bad)
        record('cross_entropy bad label', int(bad.get()[0]) == 3, str(bad.get()))
    n = 100001
    pr = rng.standard_normal(n).astype(f32)
    tg = rng.standard_normal(n).astype(f32)
    part = cp.empty(8, f64)
    launch(Lf, 'mse_partial_f32', (8,), (256,), dev(pr), dev(tg), part, L(n))
    out = cp.empty(1, f32)
    launch(Lf, 'sum_f64_f32', (1,), (1024,), part, out, L(8), D(1.0 / n))
    close('mse', out, [((pr.astype(f64) - tg) ** 2).sum() / n], 1.2e-7, 0)
    g = np.array([1.3], f32)
    o = cp.empty(n, f32)
    launch(Lf, 'mse_grad_f32', *flat(n), dev(g), dev(pr), dev(tg), o, L(n), D(1.0 / n))
    same_bits('mse_grad', o, (2 * (1.0 / n) * f64(g[0]) * (pr - tg).astype(f64)).astype(f32))


# ---------------------------------------------------------------- dropout
def splitmix(x):
    x = x + np.uint64(0x9e3779b97f4a7c15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
    return x ^ (x >> np.uint64(31))


def test_dropout():
    outer, rows, inner, row_off = 2, 5, 7, 10
    seed, step, p = 12345, 7, 0.3
    x = rng.standard_normal((outer, rows, inner)).astype(f32)
    scale = f32(1 / (1 - p))
    y = cp.empty(x.shape, f32)
    launch('dropout.cu', 'dropout_f32', *flat(x.size), dev(x), y, L(outer), L(rows), L(inner), L(row_off),
           U(seed), U(step), D(p), F(scale))
    o, r, k = np.meshgrid(np.arange(outer), np.arange(rows), np.arange(inner), indexing='ij')
    row = (row_off + r).astype(np.uint64)
    elem = (o * inner + k).astype(np.uint64)
    with np.errstate(over='ignore'):
        h = splitmix(np.uint64(seed) ^ splitmix(np.uint64(step) ^ splitmix(row ^ splitmix(elem))))
    u = (h >> np.uint64(11)).astype(f64) * 2.0 ** -53
    same_bits('dropout', y, np.where(u >= p, x * scale, f32(0)))
    # a hand-checked value: DropoutKeep's hash for all-zero keys
    with np.errstate(over='ignore'):
        h0 = splitmix(np.uint64(0) ^ splitmix(np.uint64(0) ^ splitmix(np.uint64(0) ^ splitmix(np.uint64(0)))))
    print('dropout h(0,0,0,0) =', hex(int(h0)))


# ---------------------------------------------------------------- optim
OPTIM_TENSORS = 64  # optim.cu's OptimList


def optim_list(ps, gs, s0, s1):
    """optim.cu's OptimList (by value) over the device arrays ps with
    gradients gs and state slots s0, s1 (None: a null pointer); its count
    and flat size."""
    n = len(ps)
    assert n <= OPTIM_TENSORS
    def ptrs(v): return [0 if a is None else a.data.ptr for a in v] + [0] * (OPTIM_TENSORS - n)
    off = [0]
    for a in ps:
        off.append(off[-1] + a.size)
    off += [0] * (OPTIM_TENSORS - n)
    return S(struct.pack(f'<{4 * OPTIM_TENSORS}Q{OPTIM_TENSORS + 1}q', *ptrs(ps), *ptrs(gs), *ptrs(s0), *ptrs(s1), *off)), n, off[n]


def test_optim():
    O = 'optim.cu'
    # One launch over tensors of assorted sizes (an empty one among them;
    # the last two share a gradient), with a grid of one element a thread
    # and one of 3 blocks (a grid-stride loop crossing several tensors).
    sizes = [1, 3, 4099, 0, 13, 256, 257, 7, 1000, 5, 5]
    for grid in [None, 3]:
        shape = ((grid,), (256,)) if grid else None
        for mom, damp, wd, nest, first in [(0, 0, 0.01, 0, 1), (0.9, 0, 0, 0, 1), (0.9, 0.1, 0.01, 0, 0), (0.9, 0, 0.01, 1, 0)]:
            p = [rng.standard_normal(n).astype(f32) for n in sizes]
            g = [rng.standard_normal(n).astype(f32) for n in sizes]
            g[-1] = g[-2]
            buf = [rng.standard_normal(n).astype(f32) for n in sizes]
            lr = 0.05
            pd, bd = [dev(a) for a in p], [dev(a) for a in buf]
            gd = [dev(a) for a in g]
            gd[-1] = gd[-2]
            l, cnt, n = optim_list(pd, gd, bd if mom else [None] * len(sizes), [None] * len(sizes))
            launch(O, 'sgd_multi_f32', *(shape or flat(n)), l, L(cnt), D(lr), D(mom), D(damp), D(wd), L(nest), L(first))
            for t in range(len(sizes)):
                w, gr = p[t].astype(f64), g[t].astype(f64)
                gr = gr + wd * w
                bref = buf[t]
                if mom:
                    b = gr if first else mom * buf[t].astype(f64) + (1 - damp) * gr
                    bref = b.astype(f32)
                    gr = gr + mom * b if nest else b
                same_bits(f'sgd p[{t}] grid{grid} mom{mom} nest{nest} first{first}', pd[t], (w - lr * gr).astype(f32))
                same_bits(f'sgd buf[{t}] grid{grid} mom{mom} nest{nest} first{first}', bd[t], bref)
        for dec, wd in [(0, 0.0), (0, 0.01), (1, 0.01)]:
            p = [rng.standard_normal(n).astype(f32) for n in sizes]
            g = [rng.standard_normal(n).astype(f32) for n in sizes]
            g[-1] = g[-2]
            m = [(rng.standard_normal(n) * 0.1).astype(f32) for n in sizes]
            v = [(rng.random(n) * 0.01).astype(f32) for n in sizes]
            lr, b1, b2, eps, st = 1e-3, 0.9, 0.999, 1e-8, 3
            c1, c2 = 1 - math.pow(b1, st), 1 - math.pow(b2, st)
            pd, md, vd = [dev(a) for a in p], [dev(a) for a in m], [dev(a) for a in v]
            gd = [dev(a) for a in g]
            gd[-1] = gd[-2]
            l, cnt, n = optim_list(pd, gd, md, vd)
            launch(O, 'adam_multi_f32', *(shape or flat(n)), l, L(cnt), D(lr), D(b1), D(b2), D(eps), D(wd), D(c1), D(c2), L(dec))
            for t in range(len(sizes)):
                w, gr = p[t].astype(f64), g[t].astype(f64)
                if dec:
                    w = w * (1 - lr * wd)
                else:
                    gr = gr + wd * w
                mi = b1 * m[t].astype(f64) + (1 - b1) * gr
                vi = b2 * v[t].astype(f64) + (1 - b2) * gr * gr
                same_bits(f'adam m[{t}] grid{grid} dec{dec} wd{wd}', md[t], mi.astype(f32))
                same_bits(f'adam v[{t}] grid{grid} dec{dec} wd{wd}', vd[t], vi.astype(f32))
                same_bits(f'adam p[{t}] grid{grid} dec{dec} wd{wd}', pd[t], (w - lr * (mi / c1) / (np.sqrt(vi / c2) + eps)).astype(f32))


# ---------------------------------------------------------------- accumulate
def test_accumulate():
    A = 'accumulate.cu'
    n = 1000
    a = rng.standard_normal(n).astype(f32)
    b = rng.standard_normal(n).astype(f32)
    a[:4] = [np.nan, 1, -0.0, 0.0]
    b[:4] = [1, np.nan, 0.0, -0.0]
    d = dev(a)
    launch(A, 'accumulate_f32', *flat(n), d, dev(b), L(n))
    same_bits('accumulate', d, a + b)
    d = dev(a)
    launch(A, 'accumulate_max_f32', *flat(n), d, dev(b), L(n))
    same_bits('accumulate_max', d, gomax(a, b))
    d = cp.empty(n, f32)
    launch(A, 'fill_f32', *flat(n), d, L(n), F(-0.25))
    same_bits('fill_f32', d, np.full(n, -0.25, f32))
    d = cp.empty(n, i64)
    launch(A, 'fill_i64', *flat(n), d, L(n), L(-(2 ** 40)))
    same_bits('fill_i64', d, np.full(n, -(2 ** 40), i64))


# ---------------------------------------------------------------- attention
def attention64(q, k, v, g, mask, scale, causal):
    """float64 reference of attention.cu: o, lse, dq, dk|dv packed. A row
    with every key hidden gets o = 0, lse = -inf and zero gradients."""
    B, H, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    kk, vv = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    s = np.einsum('bhid,bhjd->bhij', q, kk) * scale
    if mask is not None:
        s = s + mask
    if causal:
        s = np.where(np.tril(np.ones((T, S), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    hidden = np.isneginf(m)
    with np.errstate(invalid='ignore'):
        e = np.where(hidden, 0.0, np.exp(s - np.where(hidden, 0.0, m)))
    l = e.sum(-1, keepdims=True)
    p = np.where(hidden, 0.0, e / np.where(hidden, 1.0, l))
    lse = np.where(hidden, -np.inf, m + np.log(np.where(hidden, 1.0, l)))[..., 0]
    o = p @ vv
    D = (g * o).sum(-1, keepdims=True)
    ds = p * (g @ vv.transpose(0, 1, 3, 2) - D)
    dq = scale * ds @ kk
    dk = (scale * ds.transpose(0, 1, 3, 2) @ q).reshape(B, Hkv, H // Hkv, S, d).sum(2)
    dv = (p.transpose(0, 1, 3, 2) @ g).reshape(B, Hkv, H // Hkv, S, d).sum(2)
    return o, lse, dq, np.concatenate([dk, dv], -1)


def attention_blocked(q, k, v, g, dm, ms, scale, causal, bq):
    """The float32 path as exec/cuda runs it (attention32.go): per block of
    bq query rows, the GEMMs (CuPy's, float32) around attention.cu's row
    kernels, on a [B·H, nq, ld] workspace with ld = S rounded up to 4."""
    A = 'attention.cu'
    B, H, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G, ld = H // Hkv, (S + 3) // 4 * 4
    kk, vv = cp.repeat(k, G, axis=1), cp.repeat(v, G, axis=1)
    o, lse = cp.zeros((B, H, T, d), f32), cp.empty((B, H, T), f32)
    dq, dk, dv = cp.zeros((B, H, T, d), f32), cp.zeros((B, H, S, d), f32), cp.zeros((B, H, S, d), f32)
    tail = lambda i0, n, nq: (L(B * H * nq), L(nq), L(n), L(ld), L(H), L(T))
    for i0 in range(0, T, bq):
        nq = min(bq, T - i0)
        n = min(S, i0 + nq) if causal else S
        sw = cp.full((B * H, nq, ld), np.nan, f32)
        sw[:, :, :n] = (scale * q[:, :, i0:i0 + nq] @ kk[:, :, :n].transpose(0, 1, 3, 2)).reshape(B * H, nq, n)
        launch(A, 'attention_rows_fwd_f32', *flat(32 * B * H * nq), sw, dm, lse, L(1), *tail(i0, n, nq),
               L(i0), *ms, L(causal), L(0))
        o[:, :, i0:i0 + nq] = sw[:, :, :n].reshape(B, H, nq, n) @ vv[:, :, :n]
    for i0 in range(0, T, bq):
        nq = min(bq, T - i0)
        n = min(S, i0 + nq) if causal else S
        sw, dw = cp.full((B * H, nq, ld), np.nan, f32), cp.full((B * H, nq, ld), np.nan, f32)
        sw[:, :, :n] = (scale * q[:, :, i0:i0 + nq] @ kk[:, :, :n].transpose(0, 1, 3, 2)).reshape(B * H, nq, n)
        dw[:, :, :n] = (g[:, :, i0:i0 + nq] @ vv[:, :, :n].transpose(0, 1, 3, 2)).reshape(B * H, nq, n)
        launch(A, 'attention_rows_bwd_f32', *flat(32 * B * H * nq), sw, dw, g, o, lse, dm, L(1), *tail(i0, n, nq),
               L(d), L(i0), *ms, F(scale), L(causal), L(0))
        p4, ds4 = sw[:, :, :n].reshape(B, H, nq, n), dw[:, :, :n].reshape(B, H, nq, n)
        dq[:, :, i0:i0 + nq] = ds4 @ kk[:, :, :n]
        dk[:, :, :n] += ds4.transpose(0, 1, 3, 2) @ q[:, :, i0:i0 + nq]
        dv[:, :, :n] += p4.transpose(0, 1, 3, 2) @ g[:, :, i0:i0 + nq]
    dk, dv = dk.reshape(B, Hkv, G, S, d).sum(2), dv.reshape(B, Hkv, G, S, d).sum(2)
    return o, lse, dq, cp.concatenate([dk, dv], -1)


def test_attention():
    for B, H, Hkv, T, S, d, causal, mk, bq in [(2, 2, 2, 1, 1, 8, 0, None, 128), (1, 4, 2, 17, 17, 64, 1, None, 128),
                                               (2, 2, 1, 70, 100, 128, 0, 'ts', 32), (2, 3, 1, 100, 70, 32, 1, 'b', 48),
                                               (1, 1, 1, 130, 130, 3, 1, 'ts', 64), (1, 2, 2, 65, 65, 128, 1, None, 16),
                                               (1, 2, 1, 300, 300, 64, 1, 'ts', 128), (1, 6, 2, 300, 257, 64, 0, None, 128)]:
        q = rng.uniform(-1, 1, (B, H, T, d)).astype(f32)
        k = rng.uniform(-1, 1, (B, Hkv, S, d)).astype(f32)
        v = rng.uniform(-1, 1, (B, Hkv, S, d)).astype(f32)
        g = rng.uniform(-1, 1, (B, H, T, d)).astype(f32)
        mask, ms = None, (0, 0, 0, 0)
        if mk == 'ts':  # [T, S] with hidden keys and a hidden first row
            mask = np.where(rng.uniform(size=(T, S)) < 0.2, -np.inf, rng.uniform(-2, 2, (T, S))).astype(f32)
            mask[0] = -np.inf
            ms = (0, 0, S, 1)
        elif mk == 'b':  # [B, 1, 1, S]
            mask = np.where(rng.uniform(size=(B, 1, 1, S)) < 0.25, -np.inf, rng.uniform(-2, 2, (B, 1, 1, S))).astype(f32)
            ms = (S, 0, 0, 1)
        scale = 1 / math.sqrt(d)
        o64, lse64, dq64, dkv64 = attention64(*(x.astype(f64) for x in (q, k, v, g)),
                                               None if mask is None else mask.astype(f64), scale, causal)
        o, lse, dq, dkv = attention_blocked(dev(q), dev(k), dev(v), dev(g), None if mask is None else dev(mask),
                                            tuple(L(x) for x in ms), scale, causal, bq)
        name = f'attention B{B} H{H} Hkv{Hkv} T{T} S{S} d{d} causal{causal} mask{mk} bq{bq}'
        close(name + ' o', o, o64, 1e-5, 1e-6)
        close(name + ' lse', lse, lse64, 1e-5, 1e-6)
        close(name + ' dq', dq, dq64, 1e-4, 1e-5)
        close(name + ' dk|dv', dkv, dkv64, 1e-4, 1e-5)


# ---------------------------------------------------------------- timings
def bench(label, nbytes, f, reps=20):
    f()
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        f()
    e.record()
    e.synchronize()
    ms = cp.cuda.get_elapsed_time(s, e) / reps
    print(f'  {label:48s} {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:8.0f} GB/s')


def rawlaunch(file, name, grid, block, *args):
    f = fn(file, name)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    hold = [conv(a) for a in args]
    ptrs = (ctypes.c_void_p * len(hold))(*[ctypes.addressof(h) for h in hold])
    return lambda hold=hold, ptrs=ptrs: cp.cuda.driver.launchKernel(f.ptr, *grid, *block, 0, 0, ctypes.addressof(ptrs), 0)


def timings():
    print('timings (device-to-device copy reference first):')
    n = 1 << 26
    x = cp.random.standard_normal(n, dtype=f32)
    y = cp.empty_like(x)
    bench('cupy copy 256 MiB', 8 * n, lambda: y.__setitem__(slice(None), x))
    bench('unary gelu 256 MiB', 8 * n, rawlaunch('elementwise.cu', 'unary_f32', (1 << 16,), (256,), x, y, L(n), L(8)))
    bench('binary add 256 MiB', 12 * n, rawlaunch('elementwise.cu', 'binary_f32', (1 << 16,), (256,), x, x, y, L(n), L(0)))
    rows, c = 16384, 4096
    bench(f'softmax_rows {rows}x{c}', 8 * n, rawlaunch('softmax.cu', 'softmax_rows_f32', (rows,), (256, 1), x, y, L(rows), L(c), L(0)))
    bench(f'layer_norm {rows}x{c}', 8 * n, rawlaunch('layernorm.cu', 'layer_norm_f32', (rows,), (256, 1), x, None, None, y, L(rows), L(c), D(1e-5)))
    bench(f'reduce_rows sum {rows}x{c}', 4 * n, rawlaunch('reduce.cu', 'reduce_rows_f32', (rows,), (256, 1), x, y, None, L(rows), L(c), L(OP['R_SUM']), D(1)))
    bench('reduce_rows sum 1x64M, 1024 splits', 4 * n, rawlaunch('reduce.cu', 'reduce_rows_f32', (1, 1024), (1024, 1), x, None, y, L(1), L(n), L(0), D(1)))
    bench('reduce_mid sum [1, 1M, 64], 264 splits', 4 * n, rawlaunch('reduce.cu', 'reduce_mid_f32', (2, 1, 264), (32, 8), x, None, y, L(1), L(1 << 20), L(64), L(0), D(1)))
    bench('reduce_mid sum [1, 1M, 64], no split', 4 * n, rawlaunch('reduce.cu', 'reduce_mid_f32', (2, 1, 1), (32, 8), x, y, None, L(1), L(1 << 20), L(64), L(0), D(1)))
    bench('transpose 8192x8192', 8 * n, rawlaunch('movement.cu', 'transpose_f32', (256, 256, 1), (32, 8), x, y, L(1), L(8192), L(8192)))
    bench('gather transpose 8192x8192', 8 * n, rawlaunch('movement.cu', 'gather_f32', (1 << 16,), (256,), x, y, L(n), L(0), strided([8192, 8192], [1, 8192])))
    l1, k1, _ = optim_list([y], [x], [x], [x])
    bench('adam_multi 64M, one tensor', 28 * n, rawlaunch('optim.cu', 'adam_multi_f32', (1 << 16,), (256,), l1, L(k1), D(1e-3), D(.9), D(.999), D(1e-8), D(0.01), D(.1), D(.01), L(1)))
    py, px = ([a[i * (n // 64):(i + 1) * (n // 64)] for i in range(64)] for a in (y, x))
    l64, c64, _ = optim_list(py, px, px, px)
    bench('adam_multi 64M, 64 tensors', 28 * n, rawlaunch('optim.cu', 'adam_multi_f32', (1 << 16,), (256,), l64, L(c64), D(1e-3), D(.9), D(.999), D(1e-8), D(0.01), D(.1), D(.01), L(1)))
    nb, ch, hw = 64, 64, 128
    wd = window(nb, ch, hw, hw, 3, 3, 2, 2, 1, 1, 1, 1, 64, 64)
    bench('max_pool2d 3x3 s2 [64,64,128,128]', 4 * n * 1.25, rawlaunch('pool.cu', 'max_pool2d_f32', (1 << 16,), (256,), x, y, wd))
    idx = cp.zeros(n // 4, np.int32)
    bench('max_pool2d_argmax 3x3 s2', 4 * n * 1.5, rawlaunch('pool.cu', 'max_pool2d_argmax_f32', (1 << 16,), (256,), x, idx, wd))
    bench('max_pool2d_grad 3x3 s2 (after argmax)', 4 * n * 1.5, rawlaunch('pool.cu', 'max_pool2d_grad_f32', (1 << 16,), (256,), x[:n // 4], idx, y, wd))
    bench('avg_pool2d_grad 3x3 s2', 4 * n * 1.25, rawlaunch('pool.cu', 'avg_pool2d_grad_f32', (1 << 16,), (256,), x[:n // 4], y, wd))
    wd = window(8, 64, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 64, 64)  # col: 8·576·4096 = 18.9M floats
    bench('im2col 3x3 s1 [8,64,64,64]', 4 * 8 * 64 * 4096 * 10, rawlaunch('conv.cu', 'im2col_f32', (1 << 16,), (256,), x, y, wd, L(64 * 4096), L(576 * 4096)))
    bench('col2im 3x3 s1 [8,64,64,64]', 4 * 8 * 64 * 4096 * 10, rawlaunch('conv.cu', 'col2im_f32', (1 << 16,), (256,), x, y, wd, L(64 * 4096), L(576 * 4096)))
    for rows, c, blk in [(1 << 19, 128, (32, 8)), (1 << 16, 1024, (256, 1)), (1 << 12, 16384, (1024, 1))]:
        bench(f'softmax_rows {rows}x{c} {blk}', 8 * rows * c, rawlaunch('softmax.cu', 'softmax_rows_f32', (rows // blk[1],), blk, x, y, L(rows), L(c), L(0)))
        bench(f'softmax_grad_rows {rows}x{c} {blk}', 12 * rows * c, rawlaunch('softmax.cu', 'softmax_grad_rows_f32', (rows // blk[1],), blk, x, x, y, L(rows), L(c), L(0)))
        bench(f'layer_norm {rows}x{c} {blk}', 8 * rows * c, rawlaunch('layernorm.cu', 'layer_norm_f32', (rows // blk[1],), blk, x, x[:c], x[:c], y, L(rows), L(c), D(1e-5)))
        bench(f'layer_norm_grad_x {rows}x{c} {blk}', 12 * rows * c, rawlaunch('layernorm.cu', 'layer_norm_grad_x_f32', (rows // blk[1],), blk, x, x, x[:c], y, L(rows), L(c), D(1e-5)))
    bench('cross_entropy_rows 65536x1000', 4 * 65536 * 1000, rawlaunch('loss.cu', 'cross_entropy_rows_f32', (65536 // 2,), (128, 2), x, cp.zeros(65536, i64), y, L(65536), L(1000), L(1000), None))
    bench('dropout 64M', 8 * n, rawlaunch('dropout.cu', 'dropout_f32', (1 << 16,), (256,), x, y, L(1), L(1), L(n), L(0), U(1), U(2), D(0.1), F(1 / 0.9)))
    bench('binary_bcast add [8192,8192]+[8192]', 8 * n, rawlaunch('elementwise.cu', 'binary_bcast_f32', (1 << 16,), (256,), x, x, y, L(n), L(0), strided2([8192, 8192], [8192, 1], [0, 1])))


def big():
    """The 64-bit index paths: tensors of more than 2^31 elements."""
    rows, inner = (1 << 25) + 1, 64
    n = rows * inner
    assert n > 2 ** 31
    b = rng.standard_normal(inner).astype(f32)
    bd = dev(b)
    out = cp.empty(n, f32)
    launch('movement.cu', 'gather_f32', (1 << 16,), (256,), bd, out, L(n), L(0), strided([rows, inner], [0, 1]))
    tail = cp.asnumpy(out[-3 * inner:]).reshape(3, inner)
    same_bits('big gather expand', tail, np.broadcast_to(b, (3, inner)))
    a = out  # a[r, j] = b[j]
    y = cp.empty(n, f32)
    launch('elementwise.cu', 'binary_bcast_f32', (1 << 16,), (256,), a, bd, y, L(n), L(0),
           strided2([rows, inner], [inner, 1], [0, 1]))
    same_bits('big bcast add', cp.asnumpy(y[-2 * inner:]).reshape(2, inner), np.broadcast_to(b + b, (2, inner)))
    red = cp.empty(rows, f32)
    launch('reduce.cu', 'reduce_strided_f32', (1 << 14,), (64, 4), y, red, None, rgeom([rows], [inner], [inner], [1]), L(rows), L(inner), L(0), D(1.0))
    same_bits('big reduce_strided', cp.asnumpy(red[-4:]), np.full(4, (b + b).astype(f64).sum(), f64).astype(f32))
    del y
    x = out
    x[-inner:] = cp.asarray(rng.standard_normal(inner).astype(f32))
    yd = cp.empty(n, f32)
    seed, step, p, row_off = 99, 3, 0.25, 5
    launch('dropout.cu', 'dropout_f32', (1 << 16,), (256,), x, yd, L(1), L(rows), L(inner), L(row_off), U(seed), U(step), D(p), F(f32(1 / (1 - p))))
    r = np.uint64(row_off + rows - 1)
    k = np.arange(inner, dtype=np.uint64)
    with np.errstate(over='ignore'):
        h = splitmix(np.uint64(seed) ^ splitmix(np.uint64(step) ^ splitmix(r ^ splitmix(k))))
    u = (h >> np.uint64(11)).astype(f64) * 2.0 ** -53
    xl = cp.asnumpy(x[-inner:])
    same_bits('big dropout', cp.asnumpy(yd[-inner:]), np.where(u >= p, xl * f32(1 / (1 - p)), f32(0)))
    acc = cp.zeros(n, f32)
    launch('accumulate.cu', 'accumulate_f32', (1 << 16,), (256,), acc, yd, L(n))
    same_bits('big accumulate', cp.asnumpy(acc[-inner:]), cp.asnumpy(yd[-inner:]))


def variants():
    n = 1 << 26
    x = cp.random.standard_normal(n, dtype=f32)
    y = cp.empty_like(x)
    for v in ['__launch_bounds__(1024, 1)', '__launch_bounds__(1024)', '', '__launch_bounds__(1024, 2)']:
        VARIANT[0] = v
        print('variant', repr(v))
        l1, k1, _ = optim_list([y], [x], [x], [x])
        bench('adam_multi 64M', 28 * n, rawlaunch('optim.cu', 'adam_multi_f32', (1 << 16,), (256,), l1, L(k1), D(1e-3), D(.9), D(.999), D(1e-8), D(0.01), D(.1), D(.01), L(1)))
        bench('unary gelu', 8 * n, rawlaunch('elementwise.cu', 'unary_f32', (1 << 16,), (256,), x, y, L(n), L(8)))
        for rows, c, blk in [(1 << 19, 128, (32, 8)), (1 << 16, 1024, (256, 1)), (1 << 14, 4096, (256, 1)), (1 << 14, 4096, (512, 1))]:
            if v == '' and blk[0] * blk[1] > 256:
                continue
            bench(f'softmax_rows {rows}x{c} {blk}', 8 * rows * c, rawlaunch('softmax.cu', 'softmax_rows_f32', (rows // blk[1],), blk, x, y, L(rows), L(c), L(0)))
            bench(f'softmax_grad_rows {rows}x{c} {blk}', 12 * rows * c, rawlaunch('softmax.cu', 'softmax_grad_rows_f32', (rows // blk[1],), blk, x, x, y, L(rows), L(c), L(0)))
            bench(f'layer_norm {rows}x{c} {blk}', 8 * rows * c, rawlaunch('layernorm.cu', 'layer_norm_f32', (rows // blk[1],), blk, x, x[:c], x[:c], y, L(rows), L(c), D(1e-5)))
    VARIANT[0] = None


if __name__ == '__main__':
    if '--big' in sys.argv:
        big()
        print(f'{PASSES[0]} passed, {len(FAILS)} failed: {FAILS}')
        sys.exit(0)
    if '--variants' in sys.argv:
        variants()
        sys.exit(0)
    print(cp.cuda.runtime.getDeviceProperties(0)['name'], 'nvrtc', cp.cuda.nvrtc.getVersion())
    for t in [test_elementwise, test_reduce, test_softmax, test_layernorm, test_movement, test_index, test_conv,
              test_pool, test_loss, test_dropout, test_optim, test_accumulate, test_attention]:
        try:
            t()
        except Exception as e:  # report and go on
            import traceback
            traceback.print_exc()
            FAILS.append(t.__name__ + ' raised')
    print(f'{PASSES[0]} passed, {len(FAILS)} failed: {FAILS}')
    if '--bench' in sys.argv:
        timings()
