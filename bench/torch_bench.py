#!/usr/bin/env python3
"""PyTorch side of bench/run-gpu: the models gobench runs (mlp, gpt, conv), at
the same shapes, with the same optimizers, in each configuration of
--configs:

  fp32     FP32, TF32 off, attention written out (q·kᵀ, mask, softmax, ·v),
           the optimizer's default (foreach) implementation: the weak
           baseline, an extra column only;
  bf16     what a user runs: bf16 autocast, TF32 on, F.scaled_dot_product_attention
           (is_causal=True), fused Adam/AdamW (fused=True), channels_last and
           cudnn.benchmark for the conv net;
  compile  torch.compile of the bf16 configuration (model and loss); the
           compile (the first step) is timed apart and excluded;
  bf16-written  bf16 with the attention written out (q·kᵀ, mask, softmax,
           ·v) instead of SDPA: autocast's eager baseline for a model
           without a fused attention op (an extra column).

Per model and configuration: the median of the timed steps (each
synchronised), steps/s, samples/s, torch.cuda.max_memory_reserved and
max_memory_allocated, and pipelined_step_seconds: the mean step of the same
steps run again without waiting for each (the losses read after the last),
which summary.py uses when it is the faster. Then, in FP32, the time Lightning's BatchSizeFinder
(binsearch) and accelerate's find_executable_batch_size take to find a usable
batch (--finders "" skips them). JSON lines to stdout and
$OUT/torch_bench.json. A configuration that fails emits an error record and
the run goes on.
"""
import argparse
import gc
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

CONFIGS = ("fp32", "bf16", "compile", "bf16-written")


def set_precision(fast):
    """TF32 (and cuDNN's autotuner) on for the bf16 and compile
    configurations, off for fp32 and the finders. The legacy flags (what
    this script always set, and torch 2.11 takes, with a deprecation
    warning); the fp32_precision API where they fail."""
    try:
        torch.backends.cuda.matmul.allow_tf32 = fast
        torch.backends.cudnn.allow_tf32 = fast
        torch.set_float32_matmul_precision("high" if fast else "highest")
    except Exception as e:
        print(f"torch_bench: legacy TF32 flags failed ({type(e).__name__}: {e}); using fp32_precision",
              file=sys.stderr)
        p = "tf32" if fast else "ieee"
        torch.backends.cuda.matmul.fp32_precision = p
        torch.backends.cudnn.conv.fp32_precision = p
    torch.backends.cudnn.benchmark = fast


def matmul_precision():
    try:
        return torch.get_float32_matmul_precision()
    except Exception as e:
        return f"unknown ({type(e).__name__})"


set_precision(False)
DEV = "cuda"
OUT = os.environ.get("OUT")
_sink = None  # $OUT/torch_bench.json, opened by the first record (importing this file writes nothing)


def emit(rec):
    global _sink
    if OUT and _sink is None:
        _sink = open(os.path.join(OUT, "torch_bench.json"), "w")
    line = json.dumps(rec)
    print(line, flush=True)
    if _sink:
        _sink.write(line + "\n")
        _sink.flush()


# Models: the same as gobench's (nn.MLP, models.GPT, models.NewConvNet with
# models.CIFAR10()).

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    # models.NewConvNet(opt, models.CIFAR10()): per stage conv 3×3 (padding
    # 1, bias) → ReLU → max-pool 2×2, widths 32, 64, 128 over 3×32×32
    # images, then flatten and linear 128·4·4 → 10.
    def __init__(self, channels=3, size=32, widths=(32, 64, 128), classes=10):
        super().__init__()
        mods, c = [], channels
        for w in widths:
            mods += [nn.Conv2d(c, w, 3, padding=1, bias=True), nn.ReLU(), nn.MaxPool2d(2)]
            c = w
            size //= 2
        mods += [nn.Flatten(), nn.Linear(c * size * size, classes)]
        self.net = nn.Sequential(*mods)

    def forward(self, x):
        return self.net(x)


class Bottleneck(nn.Module):
    # torchvision's Bottleneck (v1.5: the stride on the 3×3 conv), as
    # models.newBottleneck: 1×1 → 3×3 → 1×1 convs without bias, each
    # followed by batch norm, ReLU after the first two and after the sum
    # with the shortcut (a 1×1 conv + batch norm where the shape changes).
    def __init__(self, cin, planes, stride):
        super().__init__()
        out = 4 * planes
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        s = x if self.downsample is None else self.downsample(x)
        return F.relu(y + s)


class ResNet50(nn.Module):
    # torchvision.models.resnet50's layout (models.ResNet50(1000) in
    # batchfit): stem conv 7×7/2 + batch norm + ReLU + max-pool 3×3/2,
    # stages of 3, 4, 6, 3 Bottlenecks, global average pool, linear.
    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, cin = [], 64
        for i, n in enumerate((3, 4, 6, 3)):
            planes = 64 << i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, planes, 2 if (i > 0 and j == 0) else 1))
                cin = 4 * planes
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Attention(nn.Module):
    # Causal self-attention. With sdpa False it is written out (q·kᵀ, mask,
    # softmax, ·v) as batchfit's models.GPT computes it, so activations are
    # comparable (the fp32 configuration); with sdpa True it is
    # F.scaled_dot_product_attention(is_causal=True), the fused (flash)
    # kernel a user runs.
    def __init__(self, d, heads, sdpa):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        h, hd = self.heads, c // self.heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            mask = torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, d, heads, sdpa):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, sdpa)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers, vocab=50257, context=1024, d=768, heads=12, sdpa=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.zeros(context, d))
        self.h = nn.Sequential(*[Block(d, heads, sdpa) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        # Set by the cap's bf16-ckpt configuration: each block's activations
        # are recomputed in backward (torch.utils.checkpoint, non-reentrant).
        self.checkpoint_blocks = False
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
        if self.checkpoint_blocks and torch.is_grad_enabled():
            for block in self.h:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        else:
            x = self.h(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.t()  # tied head, as models.GPT


# Llama: transformers.LlamaForCausalLM from a LlamaConfig of the shape
# gobench's -llama-config names (models.Llama32_1B, Llama3_8B, LlamaTiny),
# randomly initialised (no download), with attn_implementation "sdpa" (the
# bf16 and compile configurations) or "eager" (fp32, bf16-written).
LLAMA_SHAPES = {
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=True,
                        rope=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope=dict(rope_type="default", rope_theta=500000.0)),
    # The two shapes of the written-out Llama's comparison (gobench's
    # llama-written): 0.8B, 16 layers of 2048 with 16 query and 4 key/value
    # heads of 128; and 8 layers of 1024 with 16 heads of 64 (multi-head).
    "llama-0.8b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, rope=dict(rope_type="default", rope_theta=10000.0)),
    "llama-8x1024": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=16, head_dim=64, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope=dict(rope_type="default", rope_theta=10000.0)),
    "llama-tiny": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
                       tie_word_embeddings=True,
                       rope=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=16)),
}


def llama_config(name, layers, attn):
    """transformers.LlamaConfig of shape name (layers > 0 overrides the
    count), rope settings spelled as the installed transformers reads them:
    rope_parameters from version 5, rope_theta and rope_scaling before."""
    import transformers
    shape = dict(LLAMA_SHAPES[name])
    rope = dict(shape.pop("rope"))
    if layers > 0:
        shape["num_hidden_layers"] = layers
    shape.update(attention_bias=False, mlp_bias=False, initializer_range=0.02, use_cache=False)
    if int(transformers.__version__.split(".")[0]) >= 5:
        shape["rope_parameters"] = rope
    else:
        shape["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            shape["rope_scaling"] = rope
    cfg = transformers.LlamaConfig(**shape)
    cfg._attn_implementation = attn
    return cfg


def make_llama(a, sdpa):
    import transformers
    cfg = llama_config(a.llama_config, a.llama_layers, "sdpa" if sdpa else "eager")
    with torch.device(DEV):  # initialise on the device: 1.2B normal draws on the host take a while
        model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def llama_rope_check(model):
    """The smallest inverse frequency the model rotates with, for the
    record: llama3 scaling (factor 32) makes Llama 3.2's
    500000^(−62/64)/32 ≈ 9.5e-8, the default 500000^(−62/64) ≈ 3.0e-6,
    so a rope setting the config silently dropped shows."""
    emb = getattr(model.model, "rotary_emb", None)
    inv = getattr(emb, "inv_freq", None)
    return float(inv.min()) if inv is not None else None


class WithLoss(nn.Module):
    """The model and its mean cross-entropy in one module, so that
    torch.compile sees the loss too (as nanoGPT's forward returns it). The
    llama's is LlamaForCausalLM's own labels= loss (labels shifted inside,
    ignore_index −100), labels being the tokens, as Hugging Face users
    train."""

    def __init__(self, name, model, loss_chunk=0):
        super().__init__()
        self.name = name
        self.model = model
        self.loss_chunk = loss_chunk  # llama: > 0 is chunked_causal_lm_loss's tokens per chunk

    def forward(self, x, y):
        if self.name == "llama":
            if self.loss_chunk > 0:
                h = self.model.model(input_ids=x).last_hidden_state
                return chunked_causal_lm_loss(h, self.model.lm_head.weight, y, self.loss_chunk)
            return self.model(input_ids=x, labels=y).loss
        out = self.model(x)
        if self.name == "gpt":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return F.cross_entropy(out, y)


def chunked_causal_lm_loss(h, w, y, chunk):
    """The causal LM loss (targets y shifted by one, as labels= shifts them)
    over token chunks, each chunk's head product and cross-entropy under
    torch.utils.checkpoint: its logits live only while it runs, forward and
    again in backward, the chunked cross-entropy a PyTorch user writes to
    keep a 128K-vocabulary model's logits out of memory (batchfit's fused
    loss does the same in its kernels)."""
    from torch.utils.checkpoint import checkpoint
    h = h[:, :-1].reshape(-1, h.shape[-1])
    t = y[:, 1:].reshape(-1)

    def part(hh, tt):
        return F.cross_entropy((hh @ w.t()).float(), tt, reduction="sum")

    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        total = total + checkpoint(part, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
    return total / t.numel()


class Spec:
    def __init__(self, name, batch, seq, make, opt, opt_name, data):
        # make(sdpa) builds the model; opt(params, fused) its optimizer.
        self.name, self.batch, self.seq, self.make, self.opt, self.opt_name, self.data = \
            name, batch, seq, make, opt, opt_name, data


def adam(ps, fused=False):
    return torch.optim.Adam(ps, lr=1e-3, fused=True) if fused else torch.optim.Adam(ps, lr=1e-3)


def adamw(ps, fused=False):
    if fused:
        return torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.01, fused=True)
    return torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.01)


def specs(a):
    def mlp_data(n, device):
        return torch.randn(n, 784, device=device), torch.randint(0, 10, (n,), device=device)

    def gpt_data(n, device):
        return (torch.randint(0, 50257, (n, a.gpt_seq), device=device),
                torch.randint(0, 50257, (n, a.gpt_seq), device=device))

    def conv_data(n, device):
        return torch.randn(n, 3, 32, 32, device=device), torch.randint(0, 10, (n,), device=device)

    def llama_data(n, device):
        # labels = the tokens: LlamaForCausalLM shifts them (gobench's
        # labels are the same tokens, shifted on the host).
        tok = torch.randint(0, LLAMA_SHAPES[a.llama_config]["vocab_size"], (n, a.llama_seq), device=device)
        return tok, tok.clone()

    def resnet_data(n, device):
        return (torch.randn(n, 3, a.resnet_size, a.resnet_size, device=device),
                torch.randint(0, 1000, (n,), device=device))

    return {
        "mlp": Spec("mlp", a.mlp_batch, 0, lambda sdpa=False: MLP(), adam, "adam(lr=1e-3)", mlp_data),
        "gpt": Spec("gpt", a.gpt_batch, a.gpt_seq, lambda sdpa=False: GPT(a.gpt_layers, sdpa=sdpa),
                    adamw, "adamw(lr=3e-4, wd=0.01)", gpt_data),
        "conv": Spec("conv", a.conv_batch, 0, lambda sdpa=False: ConvNet(), adam, "adam(lr=1e-3)", conv_data),
        "resnet50": Spec("resnet50", a.resnet_batch, 0, lambda sdpa=False: ResNet50(), adam, "adam(lr=1e-3)",
                         resnet_data),
        "llama": Spec("llama", a.llama_batch, a.llama_seq, lambda sdpa=False: make_llama(a, sdpa), adamw,
                      "adamw(lr=3e-4, wd=0.01)", llama_data),
    }


def loss_of(name, model, x, y):
    # The finders' loss: FP32, attention written out.
    return WithLoss(name, model)(x, y)


def step(s, model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_of(s.name, model, x, y)
    loss.backward()
    opt.step()
    return loss


def free_cuda():
    gc.collect()
    torch.cuda.empty_cache()


class Budget(Exception):
    pass


def _alarm(signum, frame):
    raise Budget("compile budget exceeded")


# Conv nets: channels_last in the fast configurations.
CONV_MODELS = ("conv", "resnet50")


class Config:
    """One configuration of --configs: how the model is built, what runs in
    each step, and how it is timed."""

    def __init__(self, name):
        if name not in CONFIGS:
            raise ValueError(f"unknown config {name!r} (want one of {', '.join(CONFIGS)})")
        self.name = name
        self.fast = name != "fp32"  # bf16 autocast, TF32, SDPA, fused optimizer, channels_last
        self.sdpa = name in ("bf16", "compile")
        self.compiled = name == "compile"

    def describe(self, s):
        attention = None
        if s.name == "gpt":
            attention = "sdpa(is_causal=True)" if self.sdpa else "written out"
        elif s.name == "llama":
            attention = 'attn_implementation="sdpa"' if self.sdpa else 'attn_implementation="eager"'
        d = {"tf32": self.fast, "autocast": "bfloat16" if self.fast else None, "attention": attention,
             "fused_optimizer": self.fast, "cudnn_benchmark": self.fast,
             "channels_last": self.fast and s.name in CONV_MODELS, "compiled": self.compiled}
        return {k: v for k, v in d.items() if v is not None}


def make_runner(s, cfg, a, rec):
    """Builds the model and optimizer for cfg and returns (model, opt,
    run(x_host, y_host) -> loss tensor) where run does one whole step:
    upload, zero_grad, forward and loss, backward, optimizer step."""
    set_precision(cfg.fast)
    torch.manual_seed(1)
    model = s.make(sdpa=cfg.sdpa)
    mf = torch.channels_last if cfg.fast and s.name in CONV_MODELS else None
    model = model.to(DEV)
    if mf is not None:
        model = model.to(memory_format=mf)
    rec["params"] = sum(p.numel() for p in model.parameters())
    if s.name == "llama":
        import transformers
        rec.update(transformers=transformers.__version__, llama_config=a.llama_config,
                   llama_layers=model.config.num_hidden_layers, rope_min_inv_freq=llama_rope_check(model),
                   attn_implementation=getattr(model.config, "_attn_implementation", None))
    if cfg.fast:
        try:
            opt = s.opt(model.parameters(), fused=True)
            rec["optimizer_impl"] = "fused"
        except Exception as e:  # fused needs CUDA float params; should not happen
            opt = s.opt(model.parameters())
            rec["optimizer_impl"] = f"foreach (fused failed: {type(e).__name__}: {e})"
    else:
        opt = s.opt(model.parameters())
        rec["optimizer_impl"] = "default (foreach)"
    chunk = a.llama_loss_chunk if s.name == "llama" else 0
    if chunk > 0:
        rec["loss"] = f"chunked cross-entropy, {chunk} tokens a chunk, each checkpointed"
    fn = WithLoss(s.name, model, chunk)
    if cfg.compiled:
        kw = {} if a.compile_mode == "default" else {"mode": a.compile_mode}
        fn = torch.compile(fn, **kw)
        rec["compile_mode"] = a.compile_mode

    def run(x, y):
        x, y = x.to(DEV), y.to(DEV)
        if mf is not None:
            x = x.contiguous(memory_format=mf)
        opt.zero_grad(set_to_none=True)
        if cfg.fast:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = fn(x, y)
        else:
            loss = fn(x, y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, run


def throughput(s, cfg, a):
    rec = {"kind": "throughput", "model": s.name, "config": cfg.name, "batch": s.batch, "seq": s.seq,
           "optimizer": s.opt_name, "warmup": a.warmup, "steps": a.steps}
    rec.update(cfg.describe(s))
    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    model, opt, run = make_runner(s, cfg, a, rec)
    rec["float32_matmul_precision"] = matmul_precision()
    # Four host batches, cycled and uploaded every step, as gobench feeds them.
    torch.manual_seed(2)
    batches = [s.data(s.batch, "cpu") for _ in range(4)]
    if cfg.compiled:
        # The first call compiles forward and backward: timed apart, under
        # an alarm of --compile-budget seconds, and left out of the peaks.
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(max(1, int(a.compile_budget)))
        t0 = time.perf_counter()
        try:
            x, y = batches[0]
            rec["first_loss"] = run(x, y).item()
            torch.cuda.synchronize()
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        rec["compile_seconds"] = time.perf_counter() - t0
        rec["compile_max_memory_reserved"] = torch.cuda.max_memory_reserved()
        rec["compile_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    used_peak = 0
    for i in range(a.warmup + a.steps):
        x, y = batches[i % 4]
        t0 = time.perf_counter()
        loss = run(x, y)
        l = loss.item()  # downloads the loss, as gobench does
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i == 0 and "first_loss" not in rec:
            rec["first_loss"] = l
        rec["last_loss"] = l
        free, total = torch.cuda.mem_get_info()
        used_peak = max(used_peak, total - free)
        if i >= a.warmup:
            times.append(dt)
    # The same steps again as a loop that does not wait for each one (it
    # reads the losses after the last): the host queues the next step while
    # the GPU runs this one, as a loop that logs now and then does. Its
    # mean step, end to end; the headline takes the faster of the two.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending = []
    for i in range(a.steps):
        x, y = batches[i % 4]
        pending.append(run(x, y).detach())
    torch.cuda.synchronize()
    rec["pipelined_step_seconds"] = (time.perf_counter() - t0) / max(1, a.steps)
    rec["last_loss"] = pending[-1].item() if pending else rec.get("last_loss")
    del pending
    if a.profile > 0:
        profile(s, cfg, a, run, batches)
    med = statistics.median(times)
    rec.update(step_seconds=times, median_step_seconds=med, median_ms_per_step=med * 1e3, steps_per_second=1 / med,
               samples_per_second=s.batch / med, max_memory_reserved=torch.cuda.max_memory_reserved(),
               max_memory_allocated=torch.cuda.max_memory_allocated(), device_used_peak=used_peak)
    del model, opt, run, batches
    free_cuda()
    return rec


def profile(s, cfg, a, run, batches):
    """Profiles a.profile more steps with torch.profiler and prints the CUDA
    time per kernel to stderr, to set beside gobench -profile."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(a.profile):
            x, y = batches[i % 4]
            run(x, y).item()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"== torch profile {s.name} {cfg.name}: {a.profile} steps, CUDA kernels {total / a.profile / 1e3:.3f} ms/step",
          file=sys.stderr)
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:40]:
        print(f"  {e.self_device_time_total / a.profile / 1e3:9.3f} ms/step {e.count // a.profile:5d}/step  {e.key[:110]}",
              file=sys.stderr)
    ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")]
    ops.sort(key=lambda e: -e.device_time_total)
    print(f"== torch profile {s.name} {cfg.name}: aten ops by CUDA time", file=sys.stderr)
    for e in ops[:30]:
        print(f"  {e.device_time_total / a.profile / 1e3:9.3f} ms/step {e.count // a.profile:5d}/step  {e.key}",
              file=sys.stderr)


# "Time to a usable batch".

def lightning_finder(s, a):
    set_precision(False)
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
    set_precision(False)
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
    model = None  # the closure's cell: freed before free_cuda
    free_cuda()
    return rec


def largest_batch(s, cfg, a, start):
    """The largest batch whose whole training step runs in configuration cfg
    (eager only): doubling from start until a step fails with out of memory,
    then a binary search between the last batch that ran and the first that
    did not, one step per trial on device-generated data. The trial search
    PyTorch users run by hand, made exact, for the planner to stand next to."""
    if cfg.compiled:
        raise ValueError("largest: eager configurations only (torch.compile recompiles per batch)")
    rec = {"kind": "largest", "model": s.name, "seq": s.seq, "config": cfg.name, "start": start}
    rec.update(cfg.describe(s))
    free_cuda()
    rec["device_free"] = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    model, opt, run = make_runner(s, cfg, a, rec)
    tried = []

    def fits(b):
        ok = True
        try:
            x, y = s.data(b, DEV)
            run(x, y)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            ok = False
        x = y = None
        opt.zero_grad(set_to_none=True)
        free_cuda()
        tried.append((b, ok))
        return ok

    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    rec.update(batch=lo, tried=tried, search_seconds=time.perf_counter() - t0)
    model = opt = run = None
    free_cuda()
    return rec


# Under a memory cap (beside gobench -cap):
# what a PyTorch user does when a batch does not fit, gradient accumulation
# at the largest micro-batch that runs, with or without activation
# checkpointing.

CAP_CONFIGS = ("bf16", "bf16-ckpt")


def balanced(n, k):
    """n samples in k micro-batches whose sizes differ by at most one,
    larger ones first (as batchfit's chunks): balanced(32, 3) = [11, 11, 10]."""
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def fewer_samples(n, k):
    """The fewest micro-batches above k whose largest is smaller than
    k's, or None when k's are single samples."""
    m = balanced(n, k)[0]
    if m <= 1:
        return None
    return -(-n // (m - 1))


def is_oom(e):
    """Whether e is the device running out of memory: the caching
    allocator's OutOfMemoryError, or a library's CUDA out-of-memory error."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def cap_run(s, name, a):
    """A training step of the cap batch (--cap-batch, or the model's batch)
    under a cap of --cap-gib GiB on the caching allocator
    (set_per_process_memory_fraction), in configuration name: bf16 (the
    bf16 configuration: autocast, TF32, SDPA, fused optimizer) or
    bf16-ckpt (the same with torch.utils.checkpoint around every
    transformer block; GPT only). The fewest micro-batches k whose step
    runs under the cap is found by trial (k = 1, 2, 4, ... until two whole
    accumulation steps run, then bisection between the last k that failed
    and the first that ran), the micro-batches balanced as batchfit's
    chunks (their largest is then the largest micro-batch that runs:
    any larger needs fewer micro-batches). Then --warmup and --steps timed
    steps of gradient accumulation over those k micro-batches, each
    micro-batch's mean loss scaled by its size / batch, so the gradient is
    the whole batch's mean, one optimizer step per step."""
    if name not in CAP_CONFIGS:
        raise ValueError(f"unknown cap config {name!r} (want one of {', '.join(CAP_CONFIGS)})")
    ckpt = name == "bf16-ckpt"
    if ckpt and s.name != "gpt":
        raise ValueError(f"bf16-ckpt checkpoints transformer blocks: gpt only, not {s.name}")
    n = a.cap_batch if a.cap_batch > 0 else s.batch
    cfg = Config("bf16")
    rec = {"kind": "cap", "model": s.name, "config": name, "batch": n, "seq": s.seq, "optimizer": s.opt_name,
           "warmup": a.warmup, "steps": a.steps}
    rec.update(cfg.describe(s))
    rec["checkpoint"] = ("every transformer block: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)"
                         if ckpt else "none")
    free_cuda()
    total = torch.cuda.mem_get_info()[1]
    cap = int(a.cap_gib * 2**30)
    if cap <= 0 or cap > total:
        raise ValueError(f"--cap-gib {a.cap_gib}: want more than 0 and at most the card's {total / 2**30:.2f} GiB")
    rec.update(cap_bytes=cap, cap_gib=a.cap_gib, device_total=total, memory_fraction=cap / total,
               reserved_before=torch.cuda.memory_reserved())
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        return cap_measure(s, cfg, ckpt, n, cap, a, rec)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def cap_measure(s, cfg, ckpt, n, cap, a, rec):
    set_precision(True)
    torch.manual_seed(1)
    model = s.make(sdpa=True)
    if ckpt:
        model.checkpoint_blocks = True
    mf = torch.channels_last if s.name in CONV_MODELS else None
    model = model.to(DEV)
    if mf is not None:
        model = model.to(memory_format=mf)
    rec["params"] = sum(p.numel() for p in model.parameters())
    try:
        opt = s.opt(model.parameters(), fused=True)
        rec["optimizer_impl"] = "fused"
    except Exception as e:  # fused needs CUDA float params; should not happen
        opt = s.opt(model.parameters())
        rec["optimizer_impl"] = f"foreach (fused failed: {type(e).__name__}: {e})"
    rec["float32_matmul_precision"] = matmul_precision()
    fn = WithLoss(s.name, model)
    # Four host batches of n, cycled, each micro-batch uploaded as it runs.
    torch.manual_seed(2)
    batches = [s.data(n, "cpu") for _ in range(4)]

    def step(xb, yb, sizes):
        # One optimizer step over the micro-batches of sizes; returns the
        # whole batch's mean loss (a device tensor).
        opt.zero_grad(set_to_none=True)
        total, start = None, 0
        for size in sizes:
            x, y = xb[start:start + size].to(DEV), yb[start:start + size].to(DEV)
            if mf is not None:
                x = x.contiguous(memory_format=mf)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                loss = fn(x, y)
            part = loss.float() * (size / n)
            part.backward()
            total = part.detach() if total is None else total + part.detach()
            start += size
        opt.step()
        return total

    def clean(oom):
        # After a trial: gradients dropped; after an out-of-memory error
        # also the optimizer state (an error inside its first step could
        # leave it half made; the next trial's steps make it again).
        opt.zero_grad(set_to_none=True)
        if oom:
            opt.state.clear()
        free_cuda()

    tried = []

    def fits(k):
        # Two whole steps, so the second runs with the optimizer state made.
        sizes = balanced(n, k)
        ok = True
        try:
            for i in range(2):
                xb, yb = batches[i % 4]
                step(xb, yb, sizes).item()
            torch.cuda.synchronize()
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_oom(e):
                raise
            ok = False
        clean(not ok)
        tried.append({"micro_batches": k, "micro_batch": sizes[0], "ok": ok})
        print(f"torch_bench: cap {s.name} {rec['config']}: {k} micro-batches of up to {sizes[0]}: "
              f"{'runs' if ok else 'out of memory'}", file=sys.stderr)
        return ok

    t0 = time.perf_counter()
    lo, k = 0, 1  # lo: the most micro-batches known not to run (0: none tried)
    while not fits(k):
        lo = k
        if k >= n:
            raise RuntimeError(f"{s.name} {rec['config']}: micro-batches of one sample do not run "
                               f"under the cap of {cap / 2**30:.2f} GiB")
        k = min(2 * k, n)
    hi = k  # runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    k = hi
    rec.update(search_seconds=time.perf_counter() - t0, tried=tried)

    # The timed steps; should one run out of memory after all (the search
    # ran two steps per trial), the next smaller micro-batch is timed
    # instead, and the record says so.
    while True:
        sizes = balanced(n, k)
        free_cuda()
        torch.cuda.reset_peak_memory_stats()
        times, used_peak, losses = [], 0, []
        ok = True
        try:
            for i in range(a.warmup + a.steps):
                xb, yb = batches[i % 4]
                t0 = time.perf_counter()
                l = step(xb, yb, sizes).item()  # downloads the loss, as gobench does
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                losses.append(l)
                free, total = torch.cuda.mem_get_info()
                used_peak = max(used_peak, total - free)
                if i >= a.warmup:
                    times.append(dt)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            ok = False
        if ok:
            break
        clean(True)
        rec.setdefault("timed_out_of_memory", []).append(k)
        print(f"torch_bench: cap {s.name} {rec['config']}: a timed step in {k} micro-batches ran out of memory",
              file=sys.stderr)
        k = fewer_samples(n, k)
        if k is None:
            raise RuntimeError(f"{s.name} {rec['config']}: timed steps of one-sample micro-batches ran out of memory")
    med = statistics.median(times)
    reserved = torch.cuda.max_memory_reserved()
    rec.update(micro_batch=sizes[0], micro_batches=len(sizes), micro_batch_sizes=sizes,
               first_loss=losses[0], last_loss=losses[-1],
               step_seconds=times, median_step_seconds=med, median_ms_per_step=med * 1e3,
               steps_per_second=1 / med, samples_per_second=n / med,
               max_memory_reserved=reserved, max_memory_allocated=torch.cuda.max_memory_allocated(),
               device_used_peak=used_peak, within_cap=reserved <= cap)
    print(f"torch_bench: cap {s.name} {rec['config']}: batch {n} in {len(sizes)} micro-batches of up to {sizes[0]}, "
          f"{n / med:.1f} samples/s, peak reserved {reserved / 2**20:.0f} MiB of {cap / 2**20:.0f} MiB", file=sys.stderr)
    model = opt = fn = batches = None
    free_cuda()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,conv", help="comma list of mlp, gpt, conv, resnet50, llama")
    ap.add_argument("--configs", default="fp32,bf16,compile",
                    help="comma list of fp32 (TF32 off, attention written out: the weak extra column), "
                         "bf16 (autocast bf16, TF32, SDPA, fused optimizer, channels_last for conv), "
                         "compile (torch.compile of bf16), bf16-written (bf16 with attention written out)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mlp-batch", type=int, default=1024)
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--gpt-seq", type=int, default=256, help="as gobench's -gpt-seq (default 256)")
    ap.add_argument("--gpt-layers", type=int, default=12)
    ap.add_argument("--conv-batch", type=int, default=256)
    ap.add_argument("--resnet-batch", type=int, default=64)
    ap.add_argument("--resnet-size", type=int, default=224, help="ResNet-50 image height and width")
    ap.add_argument("--llama-config", default="llama3.2-1b", choices=sorted(LLAMA_SHAPES),
                    help="the llama model's shape, as gobench's -llama-config")
    ap.add_argument("--llama-layers", type=int, default=0, help="its decoder layers (0: the shape's)")
    ap.add_argument("--llama-seq", type=int, default=2048, help="as gobench's -llama-seq")
    ap.add_argument("--llama-batch", type=int, default=4, help="as gobench's -llama-batch")
    ap.add_argument("--llama-loss-chunk", type=int, default=0,
                    help="the llama's loss as chunked_causal_lm_loss with this many tokens a chunk (0: labels=, whole logits)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default, reduce-overhead, max-autotune, ...")
    ap.add_argument("--compile-budget", type=float, default=300,
                    help="seconds the first (compiling) step may take before it is abandoned with an error record")
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps per model (torch.profiler, to stderr)")
    ap.add_argument("--finders", default="lightning,accelerate", help="comma list, or empty for none")
    ap.add_argument("--largest", default="", help="comma list of models whose largest whole batch is searched "
                                                 "exactly (doubling, then bisection) in each of --largest-configs")
    ap.add_argument("--largest-configs", default="bf16", help="eager configurations for --largest")
    ap.add_argument("--largest-start", default="mlp=65536,gpt=16,conv=4096,llama=8", help="first batch tried per model")
    ap.add_argument("--cap-gib", type=float, default=0,
                    help="time each model of --models in each of --cap-configs under this many GiB "
                         "(set_per_process_memory_fraction), by gradient accumulation at the largest micro-batch "
                         "that runs (the cap records, beside gobench -cap); 0: off")
    ap.add_argument("--cap-batch", type=int, default=0,
                    help="the batch of --cap-gib's steps (0: each model's timed batch, --gpt-batch, ...)")
    ap.add_argument("--cap-configs", default="bf16,bf16-ckpt",
                    help="comma list of bf16 (the bf16 configuration) and bf16-ckpt (the same with "
                         "torch.utils.checkpoint around every transformer block; gpt only, skipped for other models)")
    ap.add_argument("--finder-models", default="mlp,gpt", help="models the finders run on (of --models)")
    ap.add_argument("--finder-init", type=int, default=2, help="Lightning's init_val")
    ap.add_argument("--finder-trials", type=int, default=25, help="Lightning's max_trials")
    ap.add_argument("--accelerate-start", default="mlp=2097152,gpt=1024,conv=262144,llama=64",
                    help="starting_batch_size per model (it only shrinks from there)")
    a = ap.parse_args()
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    cap_configs = [c.strip() for c in a.cap_configs.split(",") if c.strip()] if a.cap_gib > 0 else []
    free, total = torch.cuda.mem_get_info()
    dev = {"kind": "device", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device_total": total, "device_free": free,
           "tf32": False, "configs": configs,
           "bf16_supported": torch.cuda.is_bf16_supported()}
    if cap_configs:
        dev.update(cap_gib=a.cap_gib, cap_configs=cap_configs)
    emit(dev)
    sp = specs(a)
    starts = dict(kv.split("=") for kv in a.accelerate_start.split(",") if "=" in kv)
    jobs = []
    for n in names:
        for c in configs:
            jobs.append(({"model": n, "config": c}, lambda n=n, c=c: throughput(sp[n], Config(c), a)))
    for n in names:
        for c in cap_configs:
            if c == "bf16-ckpt" and n != "gpt":
                print(f"torch_bench: cap {n} bf16-ckpt skipped: it checkpoints transformer blocks (gpt only)",
                      file=sys.stderr)
                continue
            jobs.append(({"model": n, "config": c, "tool": "cap"}, lambda n=n, c=c: cap_run(sp[n], c, a)))
    finders = [f.strip() for f in a.finders.split(",") if f.strip() and f.strip() not in ('""', "''", "none")]
    for f in finders:
        if f not in ("lightning", "accelerate"):
            print(f"torch_bench: unknown finder {f!r} ignored (want lightning, accelerate)", file=sys.stderr)
    lstarts = dict(kv.split("=") for kv in a.largest_start.split(",") if "=" in kv)
    for n in [m.strip() for m in a.largest.split(",") if m.strip()]:
        for c in [c.strip() for c in a.largest_configs.split(",") if c.strip()]:
            jobs.append(({"model": n, "config": c, "tool": "largest"},
                         lambda n=n, c=c: largest_batch(sp[n], Config(c), a, int(lstarts.get(n, 16)))))
    fnames = [n for n in names if n in {m.strip() for m in a.finder_models.split(",")}]
    for n in fnames:
        if "lightning" in finders:
            jobs.append(({"model": n, "tool": "lightning"}, lambda n=n: lightning_finder(sp[n], a)))
        if "accelerate" in finders:
            jobs.append(({"model": n, "tool": "accelerate"}, lambda n=n: accelerate_finder(sp[n], a, int(starts[n]))))
    fail = 0
    for what, job in jobs:
        t0 = time.perf_counter()
        try:
            if what.get("model") not in sp:
                raise ValueError(f"unknown model {what.get('model')!r} (want mlp, gpt, conv, resnet50 or llama)")
            emit(job())
        except BaseException as e:  # one failure should not hide the other results
            if isinstance(e, KeyboardInterrupt):
                raise
            fail = 1
            traceback.print_exc()
            emit(dict(kind="error", **what, error=f"{type(e).__name__}: {e}"[:2000],
                      seconds=time.perf_counter() - t0))
        finally:
            if what.get("config") == "compile":
                try:
                    torch._dynamo.reset()
                except Exception:
                    traceback.print_exc()
            try:
                free_cuda()
            except Exception:
                traceback.print_exc()
    return fail


if __name__ == "__main__":
    sys.exit(main())
