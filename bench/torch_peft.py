"""transformers + peft LoRA fine-tuning steps, the PyTorch side of
gobench's -llama-lora records (bench/README.md).

    python3 bench/torch_peft.py [--llama-config llama3-8b] [--rank 16]
        [--seqs 2048,4096] [--batch 1] [--ckpt both|on|off] [--steps 10]

LlamaForCausalLM of torch_bench.py's shape, randomly initialised on the
device in bfloat16 (peft's bf16-base recipe: the frozen base is stored in
bf16), LoRA of --rank (alpha 2·rank, dropout 0) on q,k,v,o_proj
(peft.get_peft_model), SDPA attention, bf16 autocast, fused AdamW over the
adapters, the model's own labels= loss. Each (seq, checkpointing) pair
runs --warmup steps and then --steps timed ones, each synchronised; one
JSON record per pair, to stdout and $OUT/torch_peft.json: the median step,
tokens/s and torch.cuda.max_memory_reserved. A pair that runs out of
memory records the error and the next one runs.
"""
import argparse
import json
import os
import statistics
import time

import torch

import torch_bench  # the shapes and configuration spelling

OUT = os.environ.get("OUT")
_sink = open(os.path.join(OUT, "torch_peft.json"), "w") if OUT else None


def emit(rec):
    line = json.dumps(rec)
    print(line, flush=True)
    if _sink:
        _sink.write(line + "\n")
        _sink.flush()


def run(a, seq, ckpt):
    import peft
    import transformers
    cfg = torch_bench.llama_config(a.llama_config, 0, "sdpa")
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of the base on the way
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lc = peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lc)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # get_peft_model keeps the adapters in float32 (autocast_adapter_dtype)
        p.data = p.data.float()
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    vocab = cfg.vocab_size
    g = torch.Generator(device="cuda").manual_seed(1)
    tok = torch.randint(0, vocab, (a.batch, seq), device="cuda", generator=g)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tok, labels=tok).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return dict(median_step_seconds=med, median_ms_per_step=med * 1e3, tokens_per_second=a.batch * seq / med,
                step_seconds=times, last_loss=loss.item(), max_memory_reserved=torch.cuda.max_memory_reserved(),
                max_memory_allocated=torch.cuda.max_memory_allocated(),
                trainable_params=sum(p.numel() for p in trainable), peft=peft.__version__,
                transformers=transformers.__version__)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-config", default="llama3-8b", choices=sorted(torch_bench.LLAMA_SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seqs", default="2048")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ckpt", default="both", choices=["both", "on", "off"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    ckpts = {"both": [True, False], "on": [True], "off": [False]}[a.ckpt]
    for seq in [int(s) for s in a.seqs.split(",")]:
        for ckpt in ckpts:
            rec = dict(kind="peft", model="llama", llama_config=a.llama_config, rank=a.rank, batch=a.batch, seq=seq,
                       gradient_checkpointing=ckpt, torch=torch.__version__)
            try:
                rec.update(run(a, seq, ckpt))
            except torch.OutOfMemoryError as e:
                rec.update(error=f"out of memory: {str(e)[:200]}")
            emit(rec)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
