#!/usr/bin/env python3
"""Checks that checkpoints written by batchfit's hf.Save load with
transformers' from_pretrained and equal the checkpoints they came from.

    BATCHFIT_HF_EXPORT=/tmp/hf-saves go test ./hf -run TestExportForFromPretrained -count=1
    BATCHFIT_HF_EXPORT=/tmp/hf-saves go test ./examples/finetune -run TestExportFinetuned -count=1
    python3 scripts/check-hf-saves.py /tmp/hf-saves

For each saved directory: no missing, unexpected or mismatched keys; the
config's sizes, tie and rope frequencies equal the source's; every weight
equal to the source's (exactly for float32 saves, to bfloat16 rounding for
bfloat16 saves of float32 weights); logits on random tokens within 1e-6 of
their scale (float32) or 2e-2 (bfloat16 rounding of the weights).

For each checkpoint examples/finetune trained and saved (finetuned-llama,
finetuned-gpt2), against what batchfit computed with it
(finetuned-NAME.reference.safetensors): logits within 1e-5 of their scale
(both float32, batchfit's on the CPU), the saved tokenizer.json's ids for
a text equal batchfit's, and transformers' greedy generate equal to
batchfit's. Exits non-zero on any failure.
"""
import pathlib
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

out = pathlib.Path(sys.argv[1])
testdata = pathlib.Path(__file__).resolve().parent.parent / "hf" / "testdata"
# saved directory -> (source checkpoint, weights rounded to bf16 by the save)
cases = {
    "gpt2-tiny-f32": ("gpt2-tiny", False),
    "gpt2-tiny-go-bf16": ("gpt2-tiny", True),
    "llama-gqa-tied-llama3-legacy": ("llama-gqa-tied-llama3", False),
    "llama-gqa-tied-llama3-go": ("llama-gqa-tied-llama3", False),
    "llama-mqa-linear-bf16": ("llama-mqa-linear-bf16", False),
    "llama-mqa-linear-go-f32": ("llama-mqa-linear-bf16", False),
    "qwen2-tiny-go": ("qwen2-tiny", False),
    "llama-gqa-untied-from-shards": ("llama-gqa-untied-sharded", False),
}


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


failures = []
torch.manual_seed(0)
for saved, (source, rounded) in cases.items():
    a, _ = load(testdata / source)
    b, info = load(out / saved)
    problems = []
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            problems.append(f"{k}: {info[k]}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "tie_word_embeddings", "n_embd", "n_layer", "n_head", "n_positions"):
        if getattr(a.config, key, None) != getattr(b.config, key, None):
            problems.append(f"config {key}: {getattr(a.config, key, None)} vs {getattr(b.config, key, None)}")
    ra = getattr(getattr(a, "model", None), "rotary_emb", None)
    rb = getattr(getattr(b, "model", None), "rotary_emb", None)
    if ra is not None and not torch.equal(ra.inv_freq, rb.inv_freq):
        problems.append("rope inv_freq differs")
    sa, sb = a.state_dict(), b.state_dict()
    for name, wa in sa.items():
        wb = sb.get(name)
        want = wa.to(torch.bfloat16).float() if rounded else wa
        if wb is None or wb.shape != wa.shape or not torch.equal(want, wb):
            problems.append(f"weight {name} differs")
    ids = torch.randint(0, a.config.vocab_size, (2, 16))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    err = ((la - lb).abs().max() / la.abs().max()).item()
    tol = 2e-2 if rounded else 1e-6
    if err > tol:
        problems.append(f"logits differ by {err:.3g} of their scale (tolerance {tol})")
    print(f"{saved}: logits error {err:.3g}; {'OK' if not problems else 'FAIL: ' + '; '.join(problems)}")
    if problems:
        failures.append(saved)
finetuned = ["finetuned-llama", "finetuned-gpt2"]
for saved in finetuned:
    ref_path = out / (saved + ".reference.safetensors")
    if not ref_path.exists():
        print(f"{saved}: FAIL: no {ref_path}; write it with "
              f"BATCHFIT_HF_EXPORT={out} go test ./examples/finetune -run TestExportFinetuned -count=1")
        failures.append(saved)
        continue
    ref = load_file(str(ref_path))
    with safe_open(str(ref_path), "pt") as f:
        text = f.metadata()["text"]
    model, info = load(out / saved)
    problems = [f"{k}: {info[k]}" for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)]
    with torch.no_grad():
        got = model(ref["input_ids"]).logits
    want = ref["logits_f32"]
    err = ((got - want).abs().max() / want.abs().max()).item()
    if err > 1e-5:
        problems.append(f"logits differ from batchfit's by {err:.3g} of their scale (tolerance 1e-5)")
    ids = Tokenizer.from_file(str(out / saved / "tokenizer.json")).encode(text).ids
    if ids != ref["text_ids"].tolist():
        problems.append(f"tokenizer ids {ids} differ from batchfit's {ref['text_ids'].tolist()}")
    prompt, want_gen = ref["generate_prompt"], ref["generate_ids"]
    with torch.no_grad():
        gen = model.generate(prompt, max_new_tokens=want_gen.shape[1] - prompt.shape[1], do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones_like(prompt))
    if not torch.equal(gen, want_gen):
        problems.append(f"generate gives {gen.tolist()}, batchfit {want_gen.tolist()}")
    print(f"{saved}: logits error {err:.3g}; {'OK' if not problems else 'FAIL: ' + '; '.join(problems)}")
    if problems:
        failures.append(saved)
total = len(cases) + len(finetuned)
print(f"{total - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
