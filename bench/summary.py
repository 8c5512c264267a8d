#!/usr/bin/env python3
"""Side-by-side summary of gobench.json and torch_bench.json (bench/run-gpu).

The headline compares batchfit with the strongest PyTorch a user would run
(bf16 autocast + TF32 + SDPA + fused optimizer, eager and torch.compile);
PyTorch FP32 with attention written out is an extra column at the right.
Entries missing from either side print "not run", failed ones "failed".
"""
import json
import os
import sys


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def mib(n):
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def num(x, fmt="{:,.2f}"):
    return "-" if x is None else fmt.format(x)


def chunks(sizes):
    """Chunk sizes as runs of equal sizes: [16, 16, 15] -> "2 × 16 + 1 × 15"."""
    if not sizes:
        return "-"
    runs = []
    for n in sizes:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    return " + ".join(f"{k} × {n}" for k, n in runs)


def yes(ok):
    return "-" if ok is None else ("yes" if ok else "NO")


def table(rows):
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
        if j == 0:
            print("  ".join("-" * x for x in w))


def ms(r):
    """A throughput record's median step in ms, or None."""
    if not r or not r.get("median_step_seconds"):
        return None
    return r["median_step_seconds"] * 1e3


def cell(r, failed, value, fmt):
    """value(r) formatted, or "failed" / "not run" when there is none."""
    v = value(r) if r else None
    if v is not None:
        return fmt.format(v)
    if failed or (r and r.get("error")):
        return "failed"
    return "-" if r else "not run"


def ratio(torch_ms, bf_ms):
    """torch time / batchfit time, with the direction spelt out."""
    if not torch_ms or not bf_ms:
        return "-"
    q = torch_ms / bf_ms
    if q < 1:
        return f"{q:.3f} (batchfit {bf_ms / torch_ms:.2f}x slower)"
    return f"{q:.3f} (batchfit {q:.2f}x faster)"


TORCH_CONFIGS = ("bf16", "compile", "fp32", "bf16-written")
# gobench models timed against another model's torch rows: batchfit's GPT
# with attention written out is the same network as torch's "gpt".
TORCH_MODEL = {"gpt-written": "gpt"}
ABOUT = {
    "bf16": "eager, bf16 autocast + TF32 + SDPA (is_causal) + fused Adam/AdamW, channels_last + cudnn.benchmark (conv)",
    "compile": "torch.compile (model and loss) of bf16; compile time excluded from the steps",
    "fp32": "eager FP32, TF32 off, attention written out (the weak baseline: an extra column, never the headline)",
    "bf16-written": "bf16 with the attention written out instead of SDPA (an extra column)",
}


def main():
    go, th = load(sys.argv[1]), load(sys.argv[2])
    go_failed = False
    for r in go + th:
        side = "gobench" if r in go else "torch"
        if r.get("kind") == "device":
            print(f"device: {r.get('device')}  free {mib(r.get('device_free'))} of {mib(r.get('device_total'))}"
                  + (f"  torch {r.get('torch')} CUDA {r.get('cuda')} configs {','.join(r.get('configs') or ['fp32'])}"
                     if "torch" in r else ""))
        if r.get("kind") == "error" or r.get("error"):
            what = " ".join(str(r[k]) for k in ("model", "config", "tool") if r.get(k))
            print(f"ERROR ({side}) {what}: {r.get('error')}")
            if side == "gobench" and not r.get("model"):
                go_failed = True
    gt = {r.get("model"): r for r in go if r.get("kind") == "throughput"}
    st = {r.get("model"): r for r in go if r.get("kind") == "session"}
    # Records from before --configs have no config: they are fp32.
    tt = {(r.get("model"), r.get("config", "fp32")): r for r in th if r.get("kind") == "throughput"}
    terr = {(r.get("model"), r.get("config", "fp32")) for r in th if r.get("kind") == "error" and not r.get("tool")}
    models = sorted(({m for m in gt} | {m for m in st} | {m for m, _ in tt} | {m for m, _ in terr}) - {None})
    for m in models:
        g = gt.get(m) or st.get(m) or {}
        for c in TORCH_CONFIGS:
            t = tt.get((TORCH_MODEL.get(m, m), c))
            if g and t and (g.get("batch") != t.get("batch") or (g.get("seq") or 0) != (t.get("seq") or 0)):
                print(f"WARNING: {m} shapes differ: gobench batch {g.get('batch')} seq {g.get('seq')}, "
                      f"torch {c} batch {t.get('batch')} seq {t.get('seq')}: pass the same -gpt-seq/--gpt-seq, "
                      f"-*-batch/--*-batch to both")

    for (m, c), r in sorted(tt.items(), key=lambda kv: str(kv[0])):
        impl = str(r.get("optimizer_impl", ""))
        if c != "fp32" and "failed" in impl:
            print(f"WARNING: torch {m} {c} ran without the fused optimizer: {impl}")

    print("\nThroughput, headline (median ms/step of the timed steps, each synchronised, host batch uploaded every step):")
    prec = sorted({r.get("precision") or ("tf32" if r.get("tf32") else "fp32") for r in go if r.get("kind") == "throughput"})
    print(f"  batchfit executor: the program compiled once, precision {', '.join(prec) or '-'}; batchfit Session: the graph built again")
    print("  every step (Session.Step with autodiff and the plan cache), as a training loop runs it.")
    for c in TORCH_CONFIGS:
        print(f"  torch {c}: {ABOUT[c]}")
    print("  'torch X / batchfit' is torch's time over batchfit's: below 1 batchfit is slower (by batchfit ms / torch ms).")
    rows = [["model", "batch", "seq", "batchfit ms", "batchfit samples/s", "bf Session ms",
             "torch bf16 ms", "torch bf16 samples/s", "torch compile ms", "torch compile samples/s",
             "torch bf16 / batchfit", "torch compile / batchfit", "torch bf16 / Session",
             "torch fp32 ms (extra)", "torch fp32 / batchfit (extra)",
             "torch bf16-written ms (extra)", "torch bf16-written / batchfit (extra)"]]
    for m in models:
        g, se = gt.get(m), st.get(m)
        gfail = go_failed and not g
        t = {c: tt.get((TORCH_MODEL.get(m, m), c)) for c in TORCH_CONFIGS}
        tf = {c: (TORCH_MODEL.get(m, m), c) in terr for c in TORCH_CONFIGS}
        anyr = g or se or next((x for x in t.values() if x), None) or {}
        rows.append([m, anyr.get("batch", "-"), anyr.get("seq") or "-",
                     cell(g, gfail, ms, "{:,.2f}"), cell(g, gfail, lambda r: r.get("samples_per_second"), "{:,.0f}"),
                     cell(se, go_failed and not se, ms, "{:,.2f}"),
                     cell(t["bf16"], tf["bf16"], ms, "{:,.2f}"),
                     cell(t["bf16"], tf["bf16"], lambda r: r.get("samples_per_second"), "{:,.0f}"),
                     cell(t["compile"], tf["compile"], ms, "{:,.2f}"),
                     cell(t["compile"], tf["compile"], lambda r: r.get("samples_per_second"), "{:,.0f}"),
                     ratio(ms(t["bf16"]), ms(g)), ratio(ms(t["compile"]), ms(g)), ratio(ms(t["bf16"]), ms(se)),
                     cell(t["fp32"], tf["fp32"], ms, "{:,.2f}"), ratio(ms(t["fp32"]), ms(g)),
                     cell(t["bf16-written"], tf["bf16-written"], ms, "{:,.2f}"), ratio(ms(t["bf16-written"]), ms(g))])
    table(rows)
    comp = [(m, tt[(m, "compile")]) for m in models if (m, "compile") in tt]
    if comp:
        print("  torch.compile time (first step, excluded above): "
              + ", ".join(f"{m} {num(r.get('compile_seconds'), '{:.1f} s')}" for m, r in comp))
    plans = [(m, gt[m]) for m in models if m in gt and gt[m].get("plan_seconds") is not None]
    if plans:
        print("  batchfit plan time (graph build, autodiff, compile, planner.Make): "
              + ", ".join(f"{m} {num(r.get('plan_seconds'), '{:.3f} s')}" for m, r in plans))

    print("\nPeak memory (batchfit: planner's prediction + Overhead vs its allocator, device = cuMemGetInfo used;")
    print(" torch: max_memory_reserved / max_memory_allocated over the steps, compile's own peak excluded):")
    rows = [["model", "bf predicted+ovh", "bf measured reserved", "error", "bf device used",
             "torch bf16 reserved", "torch bf16 allocated", "torch compile reserved", "torch compile allocated",
             "torch fp32 reserved (extra)", "torch fp32 allocated (extra)",
             "torch bf16-written reserved (extra)", "torch bf16-written allocated (extra)"]]
    for m in models:
        g = gt.get(m) or {}
        pred = g["predicted_peak_reserved"] + g.get("overhead", 0) if g.get("predicted_peak_reserved") else None
        meas = g.get("measured_peak_reserved")
        row = [m, mib(pred), mib(meas), f"{meas - pred:+,} B" if pred is not None and meas is not None else "-",
               mib(g.get("device_used_peak"))]
        for c in TORCH_CONFIGS:
            t, f = tt.get((m, c)), (m, c) in terr
            row += [cell(t, f, lambda r: r.get("max_memory_reserved"), "{}"),
                    cell(t, f, lambda r: r.get("max_memory_allocated"), "{}")]
            for k in (-2, -1):
                if row[k].isdigit():
                    row[k] = mib(int(row[k]))
        rows.append(row)
    table(rows)
    print("\nTime to a usable batch (the largest batch whose whole training step fits the card):")
    rows = [["model", "method", "batch found", "time", "notes"]]
    for r in go:
        if r.get("kind") == "maxbatch":
            note = f"{r.get('replays')} replays, budget {mib(r.get('budget'))}"
            if r.get("verified"):
                note += (f"; step run at it: {r.get('verify_seconds', 0):.1f} s, peak reserved {mib(r.get('measured_peak_reserved'))}"
                         f" (predicted {mib(r.get('predicted_peak_reserved', 0) + r.get('overhead', 0))}),"
                         f" free left {mib(r.get('verify_free_left'))}")
            rows.append([r.get("model"), "batchfit planner", r.get("batch"), num(r.get("search_seconds"), "{:.3f} s"), note])
    for r in th:
        if r.get("kind") == "largest":
            rows.append([r.get("model"), f"torch {r.get('config')} exact search", r.get("batch"),
                         num(r.get("search_seconds"), "{:.1f} s"),
                         f"free {mib(r.get('device_free'))}, {len(r.get('tried') or [])} trial steps from {r.get('start')}"])
    for r in th:
        if r.get("kind") == "finder":
            note = f"free {mib(r.get('device_free'))}"
            if "tried" in r:
                note += f", {len(r['tried'])} tries from {r['start']}"
            else:
                note += f", init {r.get('init')}, max_trials {r.get('max_trials')}"
            rows.append([r.get("model"), r.get("tool"), r.get("batch"), num(r.get("search_seconds"), "{:.1f} s"), note])
    table(rows)
    tight = [r for r in go if r.get("kind") == "tightness"]
    if tight:
        print("\nTightness (gobench -budget: a batch too large for the budget, planned in chunks and run in them;"
              " the next larger chunk size simulated):")
        rows = [["model", "batch", "budget", "chunks", "bf predicted+ovh", "bf measured reserved", "error",
                 "within budget", "next larger", "next needs+ovh", "next over budget", "step time"]]
        for r in tight:
            ovh, budget = r.get("overhead", 0), r.get("budget")
            pred = r["predicted_peak_reserved"] + ovh if "predicted_peak_reserved" in r else None
            meas = r.get("measured_peak_reserved")
            nxt = r["next_peak_reserved"] + ovh if "next_peak_reserved" in r else None
            rows.append([r.get("model"), r.get("batch"), mib(budget), chunks(r.get("chunk_sizes")), mib(pred), mib(meas),
                         f"{meas - pred:+,} B" if pred is not None and meas is not None else "-",
                         yes(meas <= budget if meas is not None and budget else None),
                         chunks(r.get("next_chunk_sizes")) if r.get("next_chunks") else
                         "none (whole batch fits)" if r.get("chunks") == 1 else "-",
                         mib(nxt),
                         yes(nxt > budget and r.get("next_out_of_memory", False) if nxt is not None and budget else None),
                         num(r.get("verify_seconds"), "{:.1f} s")])
        table(rows)


if __name__ == "__main__":
    main()
