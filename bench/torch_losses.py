#!/usr/bin/env python3
"""Replays a batchfit training run in PyTorch and compares the losses.

    python3 bench/torch_losses.py DUMP [--device cuda] [--check 20]

DUMP is a directory written by `examples/transformer -dump DUMP` (format
batchfit-gpt-dump/1, described in examples/transformer's doc comment):
config.json, the initial parameters under params/ by their Hugging Face
GPT-2 names, every step's tokens and targets, the AdamW settings and
batchfit's per-step losses.

The script builds the same GPT as models.GPT computes it:
  - token embedding wte plus position embedding wpe (rows 0..T-1);
  - per block, pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x));
    LayerNorm eps from the dump (1e-5), elementwise affine;
  - attention: c_attn (Linear d→3d, bias) split into q, k, v along the last
    axis, heads [B, H, T, d/H]; written out as models.GPT writes it (not
    SDPA): q·kᵀ times 1/sqrt(d/H), causal mask (-inf above the diagonal),
    softmax over the last axis, ·v; heads concatenated, c_proj (Linear d→d,
    bias);
  - mlp: c_fc (Linear d→4d, bias), GELU (the dump's variant: "tanh" is
    GPT-2's tanh approximation, "erf" the exact one), c_proj (4d→d, bias);
  - ln_f, then the head tied to wte: logits = x·wteᵀ, no bias;
  - loss: mean cross-entropy over all batch×seq positions.
Linear weights are stored [out, in] (torch.nn.Linear's layout; Hugging
Face's Conv1D keeps the transpose), so they load into nn.Linear as they
are. Every parameter is loaded from the dump; state_dict keys must match its
names exactly (strict load).

It runs the dump's steps with torch.optim.AdamW (lr, betas, eps,
weight_decay from the dump; decay on every parameter, as batchfit's
optim.AdamW applies it; foreach=False) and the dump's precision:
  fp32        float32, TF32 off;
  tf32        float32 with TF32 matmuls;
  bf16-mixed  torch.autocast(device, dtype=torch.bfloat16) around forward
              and loss, float32 parameters, gradients and optimizer state,
              and cuBLAS's reduced-precision bf16 reductions off
              (batchfit accumulates bf16 GEMMs in float32);
  fp16-mixed  autocast to float16, no GradScaler (batchfit has no loss
              scaling yet).

Under a mixed policy the loss is F.cross_entropy(logits.float(), targets)
inside the autocast region: batchfit computes cross-entropy in float32 from
the 16-bit logits, while autocast's own F.cross_entropy of bfloat16 logits
on CUDA stores the log-softmax in bfloat16 (measured with torch 2.11: it
moves the loss by about 2e-4 at these sizes). That run ("torch") is the
comparison; a second run with autocast's F.cross_entropy ("torch·ac") is
printed and checked beside it.

It prints one row per step (step, batchfit's loss, then torch's loss,
|diff| and relative diff per torch run) and checks the first --check steps
(20 by default): |diff| <= atol + rtol·|torch loss|. Defaults by precision:
  fp32                   atol 0,    rtol 1e-5
  tf32, bf16/fp16-mixed  atol 2e-3, rtol 0
(why: bench/README.md, "Loss match"). --atol and --rtol override them.
Exit status 0 when every checked step agrees, 1 when one does not, 2 on a
usage or dump error.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FORMAT = "batchfit-gpt-dump/1"

# Defaults of --atol and --rtol by the dump's precision (bench/README.md,
# "Loss match", says why).
TOLERANCES = {
    "fp32": (0.0, 1e-5),
    "tf32": (2e-3, 0.0),
    "bf16-mixed": (2e-3, 0.0),
    "fp16-mixed": (2e-3, 0.0),
}

# The autocast dtype of the mixed policies.
HALF = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        h, hd = self.heads, c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.reshape(b, t, h, hd).permute(0, 2, 1, 3) for z in (q, k, v))
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = torch.matmul(att, v)
        return self.c_proj(y.permute(0, 2, 1, 3).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d, gelu):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)
        self.approximate = {"tanh": "tanh", "erf": "none"}[gelu]

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, d, heads, eps, gelu):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(d, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, m):
        super().__init__()
        d = m["dim"]
        self.wpe = nn.Embedding(m["context"], d)  # used as a table: rows 0..T-1
        self.wte = nn.Embedding(m["vocab"], d)
        self.h = nn.Sequential(*[Block(d, m["heads"], m["layer_norm_eps"], m["gelu"]) for _ in range(m["layers"])])
        self.ln_f = nn.LayerNorm(d, eps=m["layer_norm_eps"])

    def forward(self, tok):
        x = self.wte(tok) + self.wpe.weight[: tok.shape[1]]
        x = self.ln_f(self.h(x))
        return F.linear(x, self.wte.weight)  # tied head, no bias


def load(dump):
    with open(os.path.join(dump, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{dump}/config.json: format {cfg.get('format')!r}, want {FORMAT!r}")
    m = cfg["model"]
    if m.get("fused_attention"):
        print("torch_losses: the dump's model used the fused attention op; torch writes attention out "
              "(the same function)", file=sys.stderr)
    if not m.get("tied_head", False):
        raise ValueError("only the tied head of models.GPT is built here")
    o = cfg["optimizer"]
    if o["name"] != "adamw" or not o["decoupled"] or not o["decay_all_params"]:
        raise ValueError(f"optimizer {o}: only AdamW with decay on every parameter is replayed")
    params = {p["name"]: np.load(os.path.join(dump, p["file"])) for p in cfg["params"]}
    for p in cfg["params"]:
        if list(params[p["name"]].shape) != p["shape"]:
            raise ValueError(f"{p['file']}: shape {params[p['name']].shape}, config says {p['shape']}")
    tokens = np.load(os.path.join(dump, cfg["tokens"]))
    targets = np.load(os.path.join(dump, cfg["targets"]))
    losses = np.load(os.path.join(dump, cfg["losses"]["file"]))
    want = (cfg["steps"], cfg["batch"], cfg["seq"])
    if tokens.shape != want or targets.shape != want or losses.shape != (cfg["steps"],):
        raise ValueError(f"batches {tokens.shape}, {targets.shape} and losses {losses.shape} for {want}")
    return cfg, params, tokens, targets, losses


def set_tf32(on):
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def replay(cfg, params, tokens, targets, device, loss_in_autocast=False):
    """Trains the dump's steps in torch and returns the per-step losses.

    Under a mixed policy the loss is F.cross_entropy of the float32 logits
    (logits.float(): batchfit's cross_entropy is float32 class, computed
    from the bfloat16 logits), or with loss_in_autocast F.cross_entropy of
    the bfloat16 logits as autocast runs it (on CUDA, torch 2.11, its
    log-softmax is stored in bfloat16; see bench/README.md)."""
    policy = cfg["precision"]
    set_tf32(policy == "tf32")
    if device == "cuda" and hasattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    half = HALF.get(policy)

    model = GPT(cfg["model"])
    state = {k: torch.from_numpy(v.astype(np.float32)) for k, v in params.items()}
    model.load_state_dict(state, strict=True)
    model.to(device)
    o = cfg["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], foreach=False)
    out = []
    for step in range(len(tokens)):
        x = torch.from_numpy(tokens[step]).to(device)
        y = torch.from_numpy(targets[step]).to(device).reshape(-1)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=half or torch.bfloat16, enabled=half is not None):
            logits = model(x)
            logits = logits.reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(logits if loss_in_autocast else logits.float(), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="directory written by examples/transformer -dump")
    ap.add_argument("--device", default="cuda", help="torch device: cuda (the comparison) or cpu (a local check)")
    ap.add_argument("--check", type=int, default=20, help="check the first this many steps (default 20)")
    ap.add_argument("--atol", type=float, help="absolute tolerance (default by precision)")
    ap.add_argument("--rtol", type=float, help="relative tolerance, of |torch loss| (default by precision)")
    a = ap.parse_args()
    try:
        cfg, params, tokens, targets, ours = load(a.dump)
    except (OSError, ValueError, KeyError) as e:
        print(f"torch_losses: {a.dump}: {e}", file=sys.stderr)
        return 2
    policy = cfg["precision"]
    if policy not in TOLERANCES:
        print(f"torch_losses: precision {policy!r}: want one of {', '.join(TOLERANCES)}", file=sys.stderr)
        return 2
    atol, rtol = TOLERANCES[policy]
    atol = atol if a.atol is None else a.atol
    rtol = rtol if a.rtol is None else a.rtol
    if a.device == "cuda" and not torch.cuda.is_available():
        print("torch_losses: CUDA is not available (pass --device cpu for a local check)", file=sys.stderr)
        return 2

    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"== {a.dump}: {policy}, {cfg['steps']} steps, batch {cfg['batch']} × {cfg['seq']} tokens, "
          f"batchfit on {cfg['device']}")
    o = cfg["optimizer"]
    print(f"   torch {torch.__version__} on {dev}; AdamW lr {o['lr']}, betas ({o['beta1']}, {o['beta2']}), "
          f"eps {o['eps']}, weight decay {o['weight_decay']} on every parameter")
    runs = [("torch", replay(cfg, params, tokens, targets, a.device))]
    if policy in HALF:
        print(f"   torch: autocast to {HALF[policy]}, loss F.cross_entropy(logits.float()); "
              f"torch·ac: loss F.cross_entropy(logits) under autocast")
        runs.append(("torch·ac", replay(cfg, params, tokens, targets, a.device, loss_in_autocast=True)))

    check = min(a.check, len(ours))
    head = f"{'step':>5}  {'batchfit':>10}"
    for name, _ in runs:
        head += f"  {name:>10}  {'|diff|':>9}  {'rel':>9}"
    print(head)
    worst = {name: 0.0 for name, _ in runs}
    bad = set()
    for i, b in enumerate(ours):
        b = float(b)
        row, mark = f"{i + 1:5d}  {b:10.6f}", ""
        for name, theirs in runs:
            t = theirs[i]
            d = abs(b - t)
            rel = d / abs(t) if t else math.inf
            row += f"  {t:10.6f}  {d:9.2e}  {rel:9.2e}"
            if i < check:
                worst[name] = max(worst[name], d)
                if not d <= atol + rtol * abs(t):  # NaN fails
                    bad.add(i + 1)
                    mark = "  <-- out of tolerance"
        print(row + mark)
    for name, _ in runs:
        print(f"largest |diff| over the first {check} steps, batchfit against {name}: {worst[name]:.2e}")
    verdict = "ok" if not bad else f"FAIL at steps {sorted(bad)}"
    print(f"first {check} steps: |diff| <= {atol:g} + {rtol:g}·|torch|: {verdict}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
