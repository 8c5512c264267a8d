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
    """A throughput record's step in ms, or None: its median step, or
    torch's pipelined mean step (a loop that does not wait for each step)
    when that is faster."""
    if not r or not r.get("median_step_seconds"):
        return None
    s = r["median_step_seconds"]
    if r.get("pipelined_step_seconds"):
        s = min(s, r["pipelined_step_seconds"])
    return s * 1e3


def per_second(r):
    """Samples a second at ms(r)."""
    return r["batch"] / ms(r) * 1e3 if ms(r) and r.get("batch") else r.get("samples_per_second")


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
TORCH_MODEL = {"gpt-written": "gpt", "gpt-unpacked": "gpt", "llama-written": "llama"}
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
                  + (f"  torch {r.get('torch')} CUDA {r.get('cuda')} configs {','.join(r.get('configs', ['fp32'])) or 'none'}"
                     if "torch" in r else "")
                  + (f"  cap {r.get('cap_gib')} GiB: {','.join(r.get('cap_configs') or [])}" if r.get("cap_gib") else ""))
        if r.get("kind") == "error" or r.get("error"):
            what = " ".join(str(r[k]) for k in ("kind", "model", "config", "tool", "recompute_mode")
                            if r.get(k) and (k != "kind" or r[k] == "cap"))
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

    caps = [r for r in go + th if r.get("kind") == "cap" or (r.get("kind") == "error" and r.get("tool") == "cap")]
    if models or not caps:
        throughput_tables(go, go_failed, gt, st, tt, terr, models)
    time_to_batch(go, th, caps)
    tightness(go)
    if caps:
        cap_table(go, th, go_failed)


def throughput_tables(go, go_failed, gt, st, tt, terr, models):
    print("\nThroughput, headline (median ms/step of the timed steps, each from its start to the next's, host batch uploaded every step):")
    prec = sorted({r.get("precision") or ("tf32" if r.get("tf32") else "fp32") for r in go if r.get("kind") == "throughput"})
    print(f"  batchfit executor: the program compiled once, precision {', '.join(prec) or '-'}; batchfit Session: the graph built again")
    print("  every step (Session.Step with autodiff and the plan cache), as a training loop runs it.")
    for c in TORCH_CONFIGS:
        print(f"  torch {c}: {ABOUT[c]}")
    print("  torch: the faster of its median step waiting for each step (loss.item(), synchronize) and its mean step in a")
    print("  loop that does not wait (losses read after the last step).")
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
                     cell(g, gfail, ms, "{:,.2f}"), cell(g, gfail, per_second, "{:,.0f}"),
                     cell(se, go_failed and not se, ms, "{:,.2f}"),
                     cell(t["bf16"], tf["bf16"], ms, "{:,.2f}"),
                     cell(t["bf16"], tf["bf16"], per_second, "{:,.0f}"),
                     cell(t["compile"], tf["compile"], ms, "{:,.2f}"),
                     cell(t["compile"], tf["compile"], per_second, "{:,.0f}"),
                     ratio(ms(t["bf16"]), ms(g)), ratio(ms(t["compile"]), ms(g)), ratio(ms(t["bf16"]), ms(se)),
                     cell(t["fp32"], tf["fp32"], ms, "{:,.2f}"), ratio(ms(t["fp32"]), ms(g)),
                     cell(t["bf16-written"], tf["bf16-written"], ms, "{:,.2f}"), ratio(ms(t["bf16-written"]), ms(g))])
    table(rows)
    comp = [(m, tt[(m, "compile")]) for m in models if (m, "compile") in tt]
    if comp:
        print("  torch.compile time (first step, excluded above): "
              + ", ".join(f"{m} {num(r.get('compile_seconds'), '{:.1f} s')}" for m, r in comp))
    hosts = [(m, st[m]) for m in models if m in st and st[m].get("median_host_seconds") is not None]
    if hosts:
        print("  batchfit Session host time per step (medians: the caller's graph build / Step's own work before the executor starts): "
              + ", ".join(f"{m} {num(1e6 * (r.get('median_build_seconds') or 0), '{:.0f}')} / "
                          f"{num(1e6 * r.get('median_host_seconds'), '{:.0f} µs')}" for m, r in hosts))
        print("  batchfit Session step parts (medians: the executor's run inside Step, against the executor's own step / "
              "Step's work after the run; Go GCs in the timed steps): "
              + ", ".join(f"{m} {num(1e3 * (r.get('median_execute_seconds') or 0), '{:.2f}')} ms against "
                          f"{num(ms(gt.get(m)), '{:.2f}')} / {num(1e6 * (r.get('median_after_seconds') or 0), '{:.0f} µs')}; "
                          f"{r.get('gcs', 0)} GCs" for m, r in hosts))
        def against(r, s, e):
            if r.get("over_paired"):
                return f"{100 * (r['over_paired'] - 1):+.2f} % (paired blocks of {r.get('interleave')})"
            return "-" if not e or not s else f"{100 * (s / e - 1):+.2f} %"
        print("  batchfit Session against the executor (median step; 'paired': the median over alternate blocks of each "
              "block's Session median over the executor's): "
              + ", ".join(f"{m} {against(r, ms(r), ms(gt.get(m)))}" for m, r in hosts))
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


def time_to_batch(go, th, caps):
    rows = [["model", "method", "batch found", "time", "notes"]]
    for r in go:
        if r.get("kind") == "maxbatch":
            note = f"{r.get('replays')} steps planned, budget {mib(r.get('budget'))}"
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
    if len(rows) == 1 and caps:
        return
    print("\nTime to a usable batch (the largest batch whose whole training step fits the card):")
    table(rows)


def tightness(go):
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


CAP_RUNS = (("gobench", "auto", "batchfit (planner's choice)"), ("gobench", "off", "batchfit (chunks only)"),
            ("torch", "bf16", "torch bf16 (accumulation)"), ("torch", "bf16-ckpt", "torch bf16 + checkpoint"))


def cap_table(go, th, go_failed):
    """A step of one batch within one memory cap,
    batchfit's plans beside PyTorch's gradient accumulation."""
    recs, failed = {}, set()
    for r in go:
        if r.get("kind") == "cap":
            recs[(r.get("model"), "gobench", r.get("recompute_mode"))] = r
    for r in th:
        if r.get("kind") == "cap":
            recs[(r.get("model"), "torch", r.get("config"))] = r
        elif r.get("kind") == "error" and r.get("tool") == "cap":
            failed.add((r.get("model"), "torch", r.get("config")))
    models = sorted({k[0] for k in recs} | {k[0] for k in failed} - {None})
    print("\nUnder a memory cap (gobench -cap, torch_bench --cap-gib): a training step of the batch, peak reserved within the cap.")
    print("  batchfit: batchfit.Session with Options.Budget = the cap (Overhead inside), the graph built again every step;")
    print("  planner's choice = Recompute auto (chunks and recomputation for the most predicted samples/s), chunks only = Recompute off.")
    print("  torch: the bf16 configuration under set_per_process_memory_fraction(cap), gradient accumulation over the fewest")
    print("  balanced micro-batches whose steps run (their largest is the largest micro-batch that runs); + checkpoint wraps")
    print("  every transformer block in torch.utils.checkpoint (use_reentrant=False). Peaks: the allocator's reserved bytes.")
    rows = [["model", "batch", "cap", "run", "samples/s", "ms/step", "chunks / micro-batches", "recompute",
             "peak reserved", "within cap", "predicted peak+ovh", "predicted samples/s", "first step / search"]]
    notes = []
    for m in models:
        for side, key, label in CAP_RUNS:
            r = recs.get((m, side, key))
            fail = (m, side, key) in failed or (side == "gobench" and go_failed and not r)
            if not r:
                rows.append([m, "-", "-", label, "failed" if fail else "not run"] + ["-"] * 8)
                continue
            if r.get("error"):
                rows.append([m, r.get("batch", "-"), mib(r.get("budget")), label, "failed"] + ["-"] * 8)
                continue
            if side == "gobench":
                cap, split, rec = r.get("budget"), chunks(r.get("chunk_sizes")), r.get("recompute", "-")
                pred = r["predicted_peak_reserved"] + r.get("overhead", 0) if r.get("predicted_peak_reserved") else None
                extra = [mib(pred), num(r.get("predicted_samples_per_second"), "{:,.1f}"),
                         num(r.get("first_step_seconds"), "{:.1f} s")]
                within = r.get("within_budget")
                if r.get("plan_changed"):
                    notes.append(f"{m} {label}: the plan changed between timed steps")
            else:
                cap, split = r.get("cap_bytes"), chunks(r.get("micro_batch_sizes"))
                rec = "every block" if r.get("config") == "bf16-ckpt" else "none"
                extra = ["-", "-", num(r.get("search_seconds"), "{:.1f} s")]
                within = r.get("within_cap")
                if r.get("timed_out_of_memory"):
                    notes.append(f"{m} {label}: timed steps ran out of memory in {r['timed_out_of_memory']} micro-batches first")
            rows.append([m, r.get("batch", "-"), mib(cap), label, num(r.get("samples_per_second"), "{:,.1f}"),
                         num(ms(r), "{:,.1f}"), split, rec, mib(r.get("max_memory_reserved", r.get("measured_peak_reserved"))),
                         yes(within)] + extra)
    table(rows)
    for m in models:
        got = {(side, key): recs.get((m, side, key)) for side, key, _ in CAP_RUNS}
        ok = {k: r for k, r in got.items() if r and not r.get("error") and r.get("samples_per_second")}
        batches = {r.get("batch") for r in ok.values()}
        caps = {r.get("budget") if side == "gobench" else r.get("cap_bytes") for (side, _), r in ok.items()}
        if len(batches) > 1 or len(caps) > 1:
            print(f"  WARNING: {m}: the runs differ in batch {sorted(batches)} or cap {sorted(caps)}: "
                  f"pass the same -cap/--cap-gib and -cap-batch/--cap-batch to both")
        prec = {r.get("precision") for (side, _), r in ok.items() if side == "gobench"}
        if prec and prec != {"bf16-mixed"}:
            print(f"  WARNING: {m}: batchfit ran precision {', '.join(sorted(map(str, prec)))}, torch bf16 autocast: "
                  f"pass -precision bf16-mixed to gobench")
        choice = ok.get(("gobench", "auto"))
        chunked = ok.get(("gobench", "off"))
        torch_best = max((r for (side, _), r in ok.items() if side == "torch"),
                         key=lambda r: r["samples_per_second"], default=None)
        parts = []
        if choice and chunked:
            q = choice["samples_per_second"] / chunked["samples_per_second"]
            parts.append(f"planner's choice / chunks only = {q:.3f} (>= 1: {yes(q >= 1)})")
            if choice.get("recompute") == "none" and choice.get("chunk_sizes") == chunked.get("chunk_sizes"):
                parts.append(f"the same plan ({chunks(choice.get('chunk_sizes'))}, no recomputation): "
                             f"that ratio is run-to-run noise")
        if choice and torch_best:
            q = choice["samples_per_second"] / torch_best["samples_per_second"]
            best = "bf16 + checkpoint" if torch_best.get("config") == "bf16-ckpt" else "bf16"
            parts.append(f"planner's choice / best torch ({best}) = {q:.3f} (>= 1.1: {yes(q >= 1.1)})")
            missing = [label for side, key, label in CAP_RUNS if side == "torch" and ("torch", key) not in ok]
            if missing:
                parts.append(f"best torch of those that ran, not {', '.join(missing)}")
        if parts:
            print(f"  {m}: " + "; ".join(parts))
    for n in notes:
        print(f"  NOTE: {n}")


if __name__ == "__main__":
    main()
