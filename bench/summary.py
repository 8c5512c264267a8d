#!/usr/bin/env python3
"""Side-by-side summary of gobench.json and torch_bench.json (bench/run-gpu)."""
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


def main():
    go, th = load(sys.argv[1]), load(sys.argv[2])
    for r in go + th:
        if r.get("kind") == "device":
            print(f"device: {r.get('device')}  free {mib(r.get('device_free'))} of {mib(r.get('device_total'))}"
                  + (f"  torch {r['torch']} CUDA {r['cuda']} tf32={r['tf32']}" if "torch" in r else ""))
        if r.get("kind") == "error" or r.get("error"):
            print(f"ERROR ({'gobench' if r in go else 'torch'}) {r.get('model', '')}: {r.get('error')}")
    gt = {r.get("model"): r for r in go if r.get("kind") == "throughput"}
    tt = {r.get("model"): r for r in th if r.get("kind") == "throughput"}
    st = {r.get("model"): r for r in go if r.get("kind") == "session"}
    # Models one side did not run (torch_bench.py has no conv) get "not run"
    # in that side's columns.
    gone = {m: "not run" for m in set(tt) - set(gt)}
    tone = {m: "not run" for m in set(gt) - set(tt)}
    print("\nThroughput (median of the timed steps, each synchronised; FP32, TF32 off on both):")
    print("(batchfit executor: the program compiled once; batchfit Session: the graph built again every step,")
    print(" Session.Step with autodiff and the plan cache, as a training loop runs it)")
    rows = [["model", "batch", "batchfit steps/s", "torch steps/s", "ratio bf/torch", "bf Session steps/s",
             "ratio Session/torch", "batchfit samples/s", "torch samples/s", "plan time"]]
    for m in sorted(set(gt) | set(tt)):
        g, t, se = gt.get(m, {}), tt.get(m, {}), st.get(m, {})
        gs, ts, ss = g.get("steps_per_second"), t.get("steps_per_second"), se.get("steps_per_second")
        rows.append([m, g.get("batch", t.get("batch")), gone.get(m) or num(gs), tone.get(m) or num(ts),
                     num(gs / ts if gs and ts else None, "{:.3f}"),
                     num(ss), num(ss / ts if ss and ts else None, "{:.3f}"),
                     gone.get(m) or num(g.get("samples_per_second"), "{:,.0f}"),
                     tone.get(m) or num(t.get("samples_per_second"), "{:,.0f}"),
                     num(g.get("plan_seconds"), "{:.3f} s")])
    table(rows)
    print("\nPeak memory (batchfit: planner's prediction + Overhead vs its allocator; device = cuMemGetInfo used):")
    rows = [["model", "bf predicted+ovh", "bf measured reserved", "error", "bf device used", "torch max_reserved",
             "torch device used"]]
    for m in sorted(set(gt) | set(tt)):
        g, t = gt.get(m, {}), tt.get(m, {})
        pred = g["predicted_peak_reserved"] + g.get("overhead", 0) if "predicted_peak_reserved" in g else None
        meas = g.get("measured_peak_reserved")
        rows.append([m, mib(pred), mib(meas), f"{meas - pred:+,} B" if pred is not None and meas is not None else "-",
                     mib(g.get("device_used_peak")), tone.get(m) or mib(t.get("max_memory_reserved")),
                     tone.get(m) or mib(t.get("device_used_peak"))])
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
