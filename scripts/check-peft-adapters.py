#!/usr/bin/env python3
"""Checks batchfit's PEFT LoRA adapters against peft, in both directions.

Go → peft: a directory written by batchfit's hf tests,

    BATCHFIT_PEFT_CHECK=/tmp/peft-check go test ./hf -run TestWritePeftCheck -count=1
    # or, where there is no Go: CGO_ENABLED=0 go test -c -o hf.test ./hf (built elsewhere), then
    # BATCHFIT_PEFT_CHECK=/tmp/peft-check ./hf.test -test.run TestWritePeftCheck
    python3 scripts/check-peft-adapters.py /tmp/peft-check

holds base/ (hf.Save of a Llama in float32), adapter/ (hf.SaveAdapter: LoRA
r 4, alpha 8 on every linear layer but the head, random lora_B), merged/
(hf.Save of nn.MergeLoRA) and reference.safetensors (input_ids, labels,
batchfit's float32 CPU logits and loss). This script loads base/ with
transformers, the adapter with PeftModel.from_pretrained (no missing or
unexpected keys), and checks in float32 on the CPU:

  - peft's logits equal batchfit's within 1e-5 of their magnitude, and the
    loss (labels=, two of them -100) within 1e-5 relative;
  - merged/ loaded as a plain model gives the same logits within 1e-5 of
    their magnitude, and its weights equal peft's merge_and_unload() within
    1e-6 of each weight's magnitude.

peft → Go: with --make OUT it instead makes a PEFT adapter with random
lora_A and lora_B on the same base (r 4, alpha 8, q_proj and v_proj) and
saves it under OUT/peft-lora with reference.safetensors (input_ids,
logits_f64 from peft in float64), as scripts/make-reference-data.py's
make_peft does for hf/testdata/peft-lora-llama, which TestLoadPeftReference
reads.

Exits non-zero on any failure. The tolerances are float32 sums taken in
another order (batchfit's packed q/k/v product, its fused attention).
"""
import copy
import os
import pathlib
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TOL = 1e-5


def load_base(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(d):
    problems = []
    ref = load_file(str(d / "reference.safetensors"))
    ids, labels = ref["input_ids"], ref["labels"]
    base = load_base(d / "base")
    pm = PeftModel.from_pretrained(base, str(d / "adapter"), is_trainable=False).eval()
    sd = pm.state_dict()
    adapters = [k for k in sd if "lora_" in k]
    if not adapters:
        problems.append("peft loaded no lora_ weights")
    zero_b = [k for k in adapters if "lora_B" in k and not sd[k].abs().gt(0).any()]
    if zero_b:
        problems.append(f"{len(zero_b)} lora_B weights are zero (the check would prove nothing)")
    with torch.no_grad():
        out = pm(input_ids=ids, labels=labels)
    err = rel(ref["logits"], out.logits)
    lerr = abs(ref["loss"].item() - out.loss.item()) / abs(out.loss.item())
    print(f"adapter: {len(adapters)} lora tensors; logits error {err:.3g} of their scale, loss {ref['loss'].item():.6f} "
          f"vs peft {out.loss.item():.6f} ({lerr:.3g} relative)")
    if err > TOL:
        problems.append(f"logits differ by {err:.3g} of their scale (tolerance {TOL})")
    if lerr > TOL:
        problems.append(f"loss differs by {lerr:.3g} relative (tolerance {TOL})")

    merged = load_base(d / "merged")
    with torch.no_grad():
        lm = merged(input_ids=ids).logits
    merr = rel(lm, out.logits)
    print(f"merged: logits error {merr:.3g} of their scale")
    if merr > TOL:
        problems.append(f"merged logits differ by {merr:.3g} (tolerance {TOL})")
    folded = copy.deepcopy(pm).merge_and_unload().state_dict()
    ms = merged.state_dict()
    for name, w in folded.items():
        g = ms.get(name)
        if g is None or g.shape != w.shape:
            problems.append(f"merged weight {name} is missing or of another shape")
            continue
        e = rel(g, w) if w.abs().max() > 0 else g.abs().max().item()
        if e > 1e-6:
            problems.append(f"merged weight {name} differs from merge_and_unload by {e:.3g}")
    return problems


def make(out):
    torch.manual_seed(7)
    d = pathlib.Path(out) / "peft-lora"
    d.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(20261201)
    base = load_base(pathlib.Path(__file__).resolve().parent.parent / "hf" / "testdata" / "llama-gqa-untied-sharded")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    pm = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(d))
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        logits = copy.deepcopy(pm).double().eval()(input_ids=ids).logits
    save_file({"input_ids": ids.contiguous(), "logits_f64": logits.contiguous()}, str(d / "reference.safetensors"))
    print(f"made {d}: {sorted(os.listdir(d))}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--make":
        make(sys.argv[2])
        return 0
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problems = check(pathlib.Path(sys.argv[1]))
    for p in problems:
        print("FAIL:", p)
    print("OK" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
