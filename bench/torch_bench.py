#!/usr/bin/env python3
"""PyTorch eager side of bench/run-gpu: the models gobench runs, at the same
shapes, in FP32 (TF32 off), with the same optimizers; steps/s and
torch.cuda.max_memory_reserved; then the time Lightning's BatchSizeFinder
(binsearch) and accelerate's find_executable_batch_size take to find a
usable batch. JSON lines to stdout and $OUT/torch_bench.json.
"""
import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")
DEV = "cuda"
OUT = os.environ.get("OUT")
_sink = open(os.path.join(OUT, "torch_bench.json"), "w") if OUT else None


def emit(rec):
    line = json.dumps(rec)
    print(line, flush=True)
    if _sink:
        _sink.write(line + "\n")
        _sink.flush()


# Models: the same as gobench's (nn.MLP and models.GPT).

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    # Causal self-attention written out (q·kᵀ, mask, softmax, ·v) as
    # batchfit's models.GPT computes it: no fused SDPA kernel, so activations
    # are comparable.
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        h, hd = self.heads, c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, vocab=50257, context=1024, d=768, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.zeros(context, d))
        self.h = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0, 0.02)
            elif "ln" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, tok):
        t = tok.shape[1]
        x = self.wte(tok) + self.wpe[:t]
        x = self.ln_f(self.h(x))
        return x @ self.wte.weight.t()  # tied head, as models.GPT


class Spec:
    def __init__(self, name, batch, seq, make, opt, opt_name, data):
        self.name, self.batch, self.seq, self.make, self.opt, self.opt_name, self.data = \
            name, batch, seq, make, opt, opt_name, data


def specs(a):
    def mlp_data(n, device):
        return torch.randn(n, 784, device=device), torch.randint(0, 10, (n,), device=device)

    def gpt_data(n, device):
        return (torch.randint(0, 50257, (n, a.gpt_seq), device=device),
                torch.randint(0, 50257, (n, a.gpt_seq), device=device))

    return {
        "mlp": Spec("mlp", a.mlp_batch, 0, MLP, lambda ps: torch.optim.Adam(ps, lr=1e-3), "adam(lr=1e-3)", mlp_data),
        "gpt": Spec("gpt", a.gpt_batch, a.gpt_seq, lambda: GPT(a.gpt_layers),
                    lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.01), "adamw(lr=3e-4, wd=0.01)", gpt_data),
    }


def loss_of(name, model, x, y):
    out = model(x)
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def step(s, model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_of(s.name, model, x, y)
    loss.backward()
    opt.step()
    return loss


def free_cuda():
    gc.collect()
    torch.cuda.empty_cache()


def throughput(s, a):
    rec = {"kind": "throughput", "model": s.name, "batch": s.batch, "seq": s.seq, "optimizer": s.opt_name,
           "warmup": a.warmup, "steps": a.steps}
    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1)
    model = s.make().to(DEV)
    rec["params"] = sum(p.numel() for p in model.parameters())
    opt = s.opt(model.parameters())
    # Four host batches, cycled and uploaded every step, as gobench feeds them.
    batches = [s.data(s.batch, "cpu") for _ in range(4)]
    times = []
    used_peak = 0
    for i in range(a.warmup + a.steps):
        x, y = batches[i % 4]
        t0 = time.perf_counter()
        loss = step(s, model, opt, x.to(DEV), y.to(DEV))
        l = loss.item()  # downloads the loss, as gobench does
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i == 0:
            rec["first_loss"] = l
        rec["last_loss"] = l
        free, total = torch.cuda.mem_get_info()
        used_peak = max(used_peak, total - free)
        if i >= a.warmup:
            times.append(dt)
    if a.profile > 0:
        profile(s, a, model, opt, batches)
    med = statistics.median(times)
    rec.update(step_seconds=times, median_step_seconds=med, steps_per_second=1 / med,
               samples_per_second=s.batch / med, max_memory_reserved=torch.cuda.max_memory_reserved(),
               max_memory_allocated=torch.cuda.max_memory_allocated(), device_used_peak=used_peak)
    del model, opt, batches
    free_cuda()
    return rec


def profile(s, a, model, opt, batches):
    """Profiles a.profile more steps with torch.profiler and prints the CUDA
    time per kernel to stderr, to set beside gobench -profile."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(a.profile):
            x, y = batches[i % 4]
            step(s, model, opt, x.to(DEV), y.to(DEV)).item()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"== torch profile {s.name}: {a.profile} steps, CUDA kernels {total / a.profile / 1e3:.3f} ms/step",
          file=sys.stderr)
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:40]:
        print(f"  {e.self_device_time_total / a.profile / 1e3:9.3f} ms/step {e.count // a.profile:5d}/step  {e.key[:110]}",
              file=sys.stderr)
    ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")]
    ops.sort(key=lambda e: -e.device_time_total)
    print(f"== torch profile {s.name}: aten ops by CUDA time", file=sys.stderr)
    for e in ops[:30]:
        print(f"  {e.device_time_total / a.profile / 1e3:9.3f} ms/step {e.count // a.profile:5d}/step  {e.key}",
              file=sys.stderr)


# "Time to a usable batch".

def lightning_finder(s, a):
    rec = {"kind": "finder", "tool": "lightning BatchSizeFinder(mode=binsearch)", "model": s.name, "seq": s.seq}
    try:
        import lightning.pytorch as L
        from lightning.pytorch.tuner import Tuner
        rec["version"] = L.__version__
    except ImportError:
        import pytorch_lightning as L
        from pytorch_lightning.tuner import Tuner
        rec["version"] = L.__version__

    class Sizes(torch.utils.data.Dataset):
        # Each item is the batch size; the batch is drawn on the GPU in
        # training_step, so no host data loader limits the search. The
        # length is huge so that Lightning's "batch size ≥ dataset length"
        # stop never triggers.
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return 1 << 40

        def __getitem__(self, i):
            return self.n

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = a.finder_init
            self.model = s.make()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Sizes(self.batch_size), batch_size=None)

        def training_step(self, n, _):
            x, y = s.data(int(n), self.device)
            return loss_of(s.name, self.model, x, y)

        def configure_optimizers(self):
            return s.opt(self.parameters())

    free_cuda()
    rec["device_free"] = torch.cuda.mem_get_info()[0]
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        torch.manual_seed(1)
        m = Module()
        trainer = L.Trainer(accelerator="gpu", devices=1, precision="32-true", max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=root)
        found = Tuner(trainer).scale_batch_size(m, mode="binsearch", init_val=a.finder_init,
                                                max_trials=a.finder_trials, steps_per_trial=3)
        rec["search_seconds"] = time.perf_counter() - t0
    rec.update(batch=found, init=a.finder_init, max_trials=a.finder_trials, steps_per_trial=3)
    del m, trainer
    free_cuda()
    return rec


def accelerate_finder(s, a, start):
    import accelerate
    from accelerate.utils import find_executable_batch_size
    rec = {"kind": "finder", "tool": "accelerate find_executable_batch_size", "model": s.name, "seq": s.seq,
           "version": accelerate.__version__, "start": start}
    free_cuda()
    rec["device_free"] = torch.cuda.mem_get_info()[0]
    tried = []
    t0 = time.perf_counter()
    torch.manual_seed(1)
    model = s.make().to(DEV)

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        tried.append(batch_size)
        opt = s.opt(model.parameters())
        for _ in range(3):
            x, y = s.data(batch_size, DEV)
            step(s, model, opt, x, y)
        torch.cuda.synchronize()
        return batch_size

    found = train()
    rec["search_seconds"] = time.perf_counter() - t0
    rec.update(batch=found, tried=tried)
    del model
    free_cuda()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mlp-batch", type=int, default=1024)
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--gpt-seq", type=int, default=256)
    ap.add_argument("--gpt-layers", type=int, default=12)
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps per model (torch.profiler, to stderr)")
    ap.add_argument("--finders", default="lightning,accelerate", help="comma list, or empty for none")
    ap.add_argument("--finder-init", type=int, default=2, help="Lightning's init_val")
    ap.add_argument("--finder-trials", type=int, default=25, help="Lightning's max_trials")
    ap.add_argument("--accelerate-start", default="mlp=2097152,gpt=1024",
                    help="starting_batch_size per model (it only shrinks from there)")
    a = ap.parse_args()
    free, total = torch.cuda.mem_get_info()
    emit({"kind": "device", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "cuda": torch.version.cuda, "device_total": total, "device_free": free,
          "tf32": torch.backends.cuda.matmul.allow_tf32})
    sp = specs(a)
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    starts = dict(kv.split("=") for kv in a.accelerate_start.split(","))
    jobs = [(n, lambda n=n: throughput(sp[n], a)) for n in names]
    finders = [f.strip() for f in a.finders.split(",") if f.strip()]
    for n in names:
        if "lightning" in finders:
            jobs.append((n, lambda n=n: lightning_finder(sp[n], a)))
        if "accelerate" in finders:
            jobs.append((n, lambda n=n: accelerate_finder(sp[n], a, int(starts[n]))))
    fail = 0
    for n, job in jobs:
        try:
            emit(job())
        except Exception as e:  # one failure should not hide the other results
            fail = 1
            traceback.print_exc()
            emit({"kind": "error", "model": n, "error": f"{type(e).__name__}: {e}"})
            free_cuda()
    return fail


if __name__ == "__main__":
    sys.exit(main())
