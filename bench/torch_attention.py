#!/usr/bin/env python3
"""PyTorch's side of the attention kernel benchmark: F.scaled_dot_product_attention
(is_causal=True, bf16) at the shapes of exec/cuda's BenchmarkAttentionForward
and BenchmarkAttentionBackward, timed the way those time batchfit's kernels
(launches back to back, one synchronisation around the lot):

  fwd      [1, 16, 4096, d] for d in 64, 128, causal and not: the forward alone;
  fwdbwd   [8, 12, T, 64], T in 1024, 4096, causal: forward, then backward
           with a given output gradient (torch.autograd.grad), as a
           training step runs them;
  bwd      the backward alone, the forward's graph kept (retain_graph);
  gqa ...  grouped-query attention at Llama 3's shape, q [4, 32, 2048, 64]
           over k and v [4, 8, 2048, 64], causal, enable_gqa=True: fwd,
           bwd and fwdbwd as above (exec/cuda's BenchmarkAttentionGQA;
           bench/attention-gqa runs both and prints the ratios).

TFLOP/s count FlashAttention's matrix products, halved under causal:
4·B·H·T·S·d forward, 10·B·H·T·S·d backward, H the query heads (the Go
benchmarks' count).
The backend SDPA picked is printed (flash, efficient or cudnn, by
torch.backends.cuda.*_sdp_enabled and the kernel names in the profile).

  python3 bench/torch_attention.py [--iters 50] [--gqa]

--gqa runs the grouped-query cases only.

Prints one JSON line per case, with the median of --repeats timings of
--iters launches each.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def timed(fn, iters, repeats):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gqa", action="store_true", help="the grouped-query cases only")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, grad=False):
        return (torch.rand(*shape, device=dev, generator=gen, dtype=torch.float32) * 2 - 1).to(dt).requires_grad_(grad)

    cases = []
    gqa_kernels = gqa_cases(rnd, args, cases)
    if args.gqa:
        for c in cases:
            print(json.dumps(c))
        print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "sdpa_kernels": gqa_kernels}))
        return
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = rnd(1, 16, 4096, d), rnd(1, 16, 4096, d), rnd(1, 16, 4096, d)
            flops = 4.0 * 16 * 4096 * 4096 * d / (2 if causal else 1)
            with torch.no_grad():
                ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), args.iters, args.repeats)
            cases.append({"case": f"fwd d{d} causal{int(causal)}", "shape": [1, 16, 4096, d], "ms": ms,
                          "tflops": flops / ms / 1e9})
    for T in (1024, 4096):
        B, H, d = 8, 12, 64
        q, k, v, g = rnd(B, H, T, d, grad=True), rnd(B, H, T, d, grad=True), rnd(B, H, T, d, grad=True), rnd(B, H, T, d)
        fwd = 4.0 * B * H * T * T * d / 2
        bwd = 10.0 * B * H * T * T * d / 2

        def fwdbwd():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), g)

        ms = timed(fwdbwd, args.iters, args.repeats)
        cases.append({"case": f"fwdbwd T{T}", "shape": [B, H, T, d], "ms": ms, "tflops": (fwd + bwd) / ms / 1e9})
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ms = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True), args.iters, args.repeats)
        cases.append({"case": f"bwd T{T}", "shape": [B, H, T, d], "ms": ms, "tflops": bwd / ms / 1e9})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), g)
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if "attention" in e.name.lower() or "flash" in e.name.lower()
                      or "fmha" in e.name.lower() or "sdpa" in e.name.lower()})
    for c in cases:
        print(json.dumps(c))
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "sdpa_kernels": kernels[:6],
                      "gqa_sdpa_kernels": gqa_kernels}))


def attention_kernels(fn):
    """The attention kernels one call of fn launches (by the profiler's names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if "attention" in e.name.lower() or "flash" in e.name.lower()
                   or "fmha" in e.name.lower() or "sdpa" in e.name.lower()})[:6]


def gqa_cases(rnd, args, cases):
    """Grouped-query attention at [4, 32, 2048, 64] over 8 key/value heads,
    causal, enable_gqa=True: fwd, bwd, fwdbwd appended to cases; returns the
    kernels the forward and backward launch."""
    B, H, Hkv, T, d = 4, 32, 8, 2048, 64
    q, g = rnd(B, H, T, d, grad=True), rnd(B, H, T, d)
    k, v = rnd(B, Hkv, T, d, grad=True), rnd(B, Hkv, T, d, grad=True)
    fwd = 4.0 * B * H * T * T * d / 2
    bwd = 10.0 * B * H * T * T * d / 2
    shape = {"shape": [B, H, T, d], "kv_heads": Hkv, "causal": True}

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        ms = timed(attend, args.iters, args.repeats)
    cases.append({"case": "gqa fwd", **shape, "ms": ms, "tflops": fwd / ms / 1e9})

    def fwdbwd():
        torch.autograd.grad(attend(), (q, k, v), g)

    ms = timed(fwdbwd, args.iters, args.repeats)
    cases.append({"case": "gqa fwdbwd", **shape, "ms": ms, "tflops": (fwd + bwd) / ms / 1e9})
    o = attend()
    ms = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True), args.iters, args.repeats)
    cases.append({"case": "gqa bwd", **shape, "ms": ms, "tflops": bwd / ms / 1e9})
    return attention_kernels(fwdbwd)


if __name__ == "__main__":
    main()
