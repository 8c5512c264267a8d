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


def table(rows):
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
        if j == 0:
            print("  ".join("-" * x for x in w))


def main():
    go, th = load(sys.argv[1]), load(sys.argv[2])
    for r in go + th:
        if r["kind"] == "device":
            print(f"device: {r.get('device')}  free {mib(r.get('device_free'))} of {mib(r.get('device_total'))}"
                  + (f"  torch {r['torch']} CUDA {r['cuda']} tf32={r['tf32']}" if "torch" in r else ""))
        if r["kind"] == "error" or r.get("error"):
            print(f"ERROR ({'gobench' if r in go else 'torch'}) {r.get('model', '')}: {r.get('error')}")
    gt = {r["model"]: r for r in go if r["kind"] == "throughput"}
    tt = {r["model"]: r for r in th if r["kind"] == "throughput"}
    st = {r["model"]: r for r in go if r["kind"] == "session"}
    print("\nThroughput (median of the timed steps, each synchronised; FP32, TF32 off on both):")
    print("(batchfit executor: the program compiled once; batchfit Session: the graph built again every step,")
    print(" Session.Step with autodiff and the plan cache, as a training loop runs it)")
    rows = [["model", "batch", "batchfit steps/s", "torch steps/s", "ratio bf/torch", "bf Session steps/s",
             "ratio Session/torch", "batchfit samples/s", "torch samples/s", "plan time"]]
    for m in sorted(set(gt) | set(tt)):
        g, t, se = gt.get(m, {}), tt.get(m, {}), st.get(m, {})
        gs, ts, ss = g.get("steps_per_second"), t.get("steps_per_second"), se.get("steps_per_second")
        rows.append([m, g.get("batch", t.get("batch")), num(gs), num(ts), num(gs / ts if gs and ts else None, "{:.3f}"),
                     num(ss), num(ss / ts if ss and ts else None, "{:.3f}"),
                     num(g.get("samples_per_second"), "{:,.0f}"), num(t.get("samples_per_second"), "{:,.0f}"),
                     num(g.get("plan_seconds"), "{:.3f} s")])
    table(rows)
    print("\nPeak memory (batchfit: planner's prediction + Overhead vs its allocator; device = cuMemGetInfo used):")
    rows = [["model", "bf predicted+ovh", "bf measured reserved", "error", "bf device used", "torch max_reserved",
             "torch device used"]]
    for m in sorted(set(gt) | set(tt)):
        g, t = gt.get(m, {}), tt.get(m, {})
        pred = g.get("predicted_peak_reserved", 0) + g.get("overhead", 0) if g else None
        meas = g.get("measured_peak_reserved")
        rows.append([m, mib(pred), mib(meas), f"{meas - pred:+,} B" if pred is not None and meas is not None else "-",
                     mib(g.get("device_used_peak")), mib(t.get("max_memory_reserved")), mib(t.get("device_used_peak"))])
    table(rows)
    print("\nTime to a usable batch (the largest batch whose whole training step fits the card):")
    rows = [["model", "method", "batch found", "time", "notes"]]
    for r in go:
        if r["kind"] == "maxbatch":
            note = f"{r.get('replays')} replays, budget {mib(r.get('budget'))}"
            if r.get("verified"):
                note += (f"; step run at it: {r['verify_seconds']:.1f} s, peak reserved {mib(r.get('measured_peak_reserved'))}"
                         f" (predicted {mib(r.get('predicted_peak_reserved', 0) + r.get('overhead', 0))}),"
                         f" free left {mib(r.get('verify_free_left'))}")
            rows.append([r["model"], "batchfit planner", r.get("batch"), num(r.get("search_seconds"), "{:.3f} s"), note])
    for r in th:
        if r["kind"] == "finder":
            note = f"free {mib(r.get('device_free'))}"
            if "tried" in r:
                note += f", {len(r['tried'])} tries from {r['start']}"
            else:
                note += f", init {r.get('init')}, max_trials {r.get('max_trials')}"
            rows.append([r["model"], r["tool"], r.get("batch"), num(r.get("search_seconds"), "{:.1f} s"), note])
    table(rows)


if __name__ == "__main__":
    main()
