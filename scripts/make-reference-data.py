#!/usr/bin/env python3
"""Makes the reference files batchfit's CPU tests compare against, with the
PyTorch, transformers, tokenizers and peft of the machine it runs on (no
network: every model is made from a config with a fixed seed, never
downloaded).

    scripts/make-reference-data.py OUTDIR

writes under OUTDIR:

  hf/<name>/            tiny Hugging Face checkpoints (save_pretrained), each
                        with reference.safetensors: input_ids [2, 12] (I64),
                        labels (I64, some -100), logits_f64 (F64, the
                        model run in float64 on the CPU), logits_f32 (F32,
                        float32 on the CPU), loss_f64 (F64 scalar, HF's
                        shifted causal-LM loss), grad.<param> (F64) for a
                        few parameters from the float64 backward pass,
                        logits_bf16_autocast (F32, on the GPU under bf16
                        autocast, when a GPU is present), generate_prompt
                        and generate_ids (I64, greedy, float32)
  hf/configs/<name>.json real-shaped config.json files (transformers' own
                        spelling, and the older rope_theta + rope_scaling
                        one as <name>.legacy.json), params.json: their
                        parameter counts from transformers on the meta device
  hf/peft-lora-llama/   a PEFT LoRA adapter on hf/llama-gqa-untied with
                        random lora_B, and reference.safetensors
  tokenizer/            gpt2-style.json and llama3-style.json (byte-level BPE
                        trained on a generated corpus), cases.jsonl.gz: one
                        JSON object a line, {"text", "gpt2", "llama3",
                        "llama3_bos" (first 500 lines only), "gpt2_decoded"}
  optim/torch_reference.json  Adam, AdamW and SGD with a late-joining
                        parameter and two parameter groups; learning-rate
                        schedules of torch.optim.lr_scheduler and
                        transformers; clip_grad_norm_ cases. Non-finite
                        numbers are written as the strings "nan", "inf",
                        "-inf".
  VERSIONS.json         the library versions that made them
"""
import copy
import gzip
import json
import math
import os
import random
import shutil
import sys

import torch

OUT = sys.argv[1] if len(sys.argv) > 1 else "reference-data"
SEED = 20261201


def mkdir(*p):
    d = os.path.join(OUT, *p)
    os.makedirs(d, exist_ok=True)
    return d


def finite(x):
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
    return x


def tolist(t):
    return [finite(float(v)) for v in t.detach().double().flatten().tolist()]


def versions():
    import transformers
    import tokenizers
    import safetensors
    v = {"torch": torch.__version__, "transformers": transformers.__version__,
         "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
         "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import peft
        v["peft"] = peft.__version__
    except Exception as e:  # noqa: BLE001
        v["peft"] = f"unavailable: {e}"
    return v


# --- tiny checkpoints -------------------------------------------------------

def perturb(model, gen):
    """Every parameter random and non-zero (biases and norms too), so a test
    cannot pass on a zero or a one it failed to load."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def rope_kwargs(rope):
    """transformers 5 takes rope_parameters; it also reads the old names."""
    return {"rope_parameters": rope}


def tiny_configs():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5)
    return {
        "gpt2-tiny": GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, layer_norm_epsilon=1e-5),
        # GQA 4/2, tied, llama3 scaling whose bands cover every frequency
        # class at head dim 16 (theta 1e4, original 32: wavelengths 6.3
        # high, 19.9 smoothed, 62.8 and up scaled).
        "llama-gqa-tied-llama3": LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                             **rope_kwargs({"rope_type": "llama3", "rope_theta": 10000.0,
                                                            "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 32})),
        "llama-gqa-untied": LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False,
                                        **rope_kwargs({"rope_type": "default", "rope_theta": 10000.0})),
        # MQA, head_dim 32 ≠ hidden/heads, linear scaling; saved in bf16.
        "llama-mqa-linear-bf16": LlamaConfig(**common, num_key_value_heads=1, head_dim=32,
                                             tie_word_embeddings=False,
                                             **rope_kwargs({"rope_type": "linear", "rope_theta": 10000.0,
                                                            "factor": 2.0})),
        "qwen2-tiny": Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True,
                                  use_sliding_window=False,
                                  **rope_kwargs({"rope_type": "default", "rope_theta": 1000000.0})),
        "mistral-tiny": MistralConfig(**common, num_key_value_heads=2, tie_word_embeddings=False,
                                      sliding_window=None,
                                      **rope_kwargs({"rope_type": "default", "rope_theta": 1000000.0})),
    }


GRAD_PARAMS = {
    "gpt2": ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
             "transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.bias", "transformer.wpe.weight"],
    "llama": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
              "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.down_proj.weight",
              "model.layers.1.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.0.self_attn.q_proj.bias"],
}


def references(model, kind, vocab, gen, name):
    from safetensors.torch import save_file
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, 3] = -100
    labels[1, 7:9] = -100
    ref = {"input_ids": ids, "labels": labels}

    m64 = copy.deepcopy(model).double().eval()
    out = m64(input_ids=ids, labels=labels)
    out.loss.backward()
    ref["logits_f64"] = out.logits.detach().contiguous()
    ref["loss_f64"] = out.loss.detach().reshape(())
    params = dict(m64.named_parameters())
    for p in GRAD_PARAMS[kind]:
        if p in params and params[p].grad is not None:
            ref["grad." + p] = params[p].grad.detach().contiguous()

    m32 = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        o32 = m32(input_ids=ids, labels=labels)
    ref["logits_f32"] = o32.logits.contiguous()
    ref["loss_f32"] = o32.loss.reshape(())
    try:
        prompt = ids[:1, :4]
        g = m32.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones_like(prompt))
        ref["generate_prompt"] = prompt.contiguous()
        ref["generate_ids"] = g.contiguous()
    except Exception as e:  # noqa: BLE001
        print(f"{name}: generate failed: {type(e).__name__}: {e}", file=sys.stderr)
    if torch.cuda.is_available():
        mg = copy.deepcopy(model).float().cuda().eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            lg = mg(input_ids=ids.cuda()).logits
        ref["logits_bf16_autocast"] = lg.float().cpu().contiguous()
    return ref


def make_tiny(outdir):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    gen = torch.Generator().manual_seed(SEED)
    made = {}
    for name, cfg in tiny_configs().items():
        kind = "gpt2" if name.startswith("gpt2") else "llama"
        cfg._attn_implementation = "eager"
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        perturb(model, gen)
        if name.endswith("-bf16"):
            model = model.to(torch.bfloat16)
        d = os.path.join(outdir, name)
        model.save_pretrained(d)
        ref = references(model, kind, cfg.vocab_size, gen, name)
        save_file({k: v.clone().contiguous() for k, v in ref.items()}, os.path.join(d, "reference.safetensors"))
        made[name] = model
        if name == "llama-gqa-untied":
            sd = os.path.join(outdir, "llama-gqa-untied-sharded")
            model.save_pretrained(sd, max_shard_size="100KB")
        with open(os.path.join(d, "config.json")) as f:
            print(f"{name}: {json.load(f)}", file=sys.stderr)
        # The older spelling of the same config, as Hub files written by
        # transformers 4 carry it.
        legacy(os.path.join(d, "config.json"), os.path.join(d, "config.legacy.json"))
    return made


def legacy(src, dst):
    with open(src) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters", None)
    if rp is not None:
        rp = dict(rp)
        c["rope_theta"] = rp.pop("rope_theta", 10000.0)
        if rp.get("rope_type", "default") == "default":
            c["rope_scaling"] = None
        else:
            c["rope_scaling"] = rp
    if "dtype" in c:
        c["torch_dtype"] = c.pop("dtype")
    c["transformers_version"] = "4.45.0"
    with open(dst, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def make_peft(outdir, base):
    try:
        from peft import LoraConfig, get_peft_model
    except Exception as e:  # noqa: BLE001
        print(f"peft unavailable: {e}", file=sys.stderr)
        return
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(SEED + 7)
    model = copy.deepcopy(base).float()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    d = os.path.join(outdir, "peft-lora-llama")
    pm.save_pretrained(d)
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=gen)
    p64 = copy.deepcopy(pm).double().eval()
    with torch.no_grad():
        logits = p64(input_ids=ids).logits
    save_file({"input_ids": ids.clone(), "logits_f64": logits.clone().contiguous()}, os.path.join(d, "reference.safetensors"))
    print(f"peft: {sorted(os.listdir(d))}", file=sys.stderr)


def make_real_configs(outdir):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfgs = {
        "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 bos_token_id=128000, eos_token_id=128001,
                                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "llama3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                                   rope_parameters=dict(llama3_rope)),
        "llama3.2-3b": LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                   num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                                   rope_parameters=dict(llama3_rope)),
        "mistral-7b": MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                    max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "qwen2-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen2-0.5b": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "gpt2": GPT2Config(),
    }
    counts = {}
    for name, cfg in cfgs.items():
        tmp = os.path.join(outdir, "_" + name)
        cfg.architectures = [{"gpt2": "GPT2LMHeadModel", "mistral-7b": "MistralForCausalLM"}.get(
            name, "Qwen2ForCausalLM" if name.startswith("qwen2") else "LlamaForCausalLM")]
        cfg.save_pretrained(tmp)
        os.replace(os.path.join(tmp, "config.json"), os.path.join(outdir, name + ".json"))
        shutil.rmtree(tmp)
        legacy(os.path.join(outdir, name + ".json"), os.path.join(outdir, name + ".legacy.json"))
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg)
        counts[name] = {"parameters": sum(p.numel() for p in m.parameters()),
                        "names": len(dict(m.named_parameters())),
                        "state_dict_keys": sorted(m.state_dict().keys())[:64]}
        print(f"{name}: {counts[name]['parameters']:,} parameters", file=sys.stderr)
    with open(os.path.join(outdir, "params.json"), "w") as f:
        json.dump(counts, f, indent=1)


# --- tokenizers -------------------------------------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

UNICODE_WORDS = ["café", "naïve", "Ünïcödé", "façade", "señor", "straße", "Ωmega", "αβγδ", "Привет", "мир",
                 "日本語", "中文字符", "한국어", "مرحبا", "שלום", "नमस्ते", "ภาษาไทย", "😀", "🎉🎉", "👩‍💻",
                 "👍🏽", "🇫🇷", "e\u0301", "a\u0308o", "ﬁ", "№", "€100", "½", "∑x²", "→", "\u200b", "ｆｕｌｌ"]
SPACES = [" ", "  ", "   ", "\t", " \t ", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "    "]
PUNCT = [".", ",", "!", "?", ";", ":", "...", "--", "(", ")", "\"", "'", "[x]", "{}", "#", "@", "&&", "||", "=>"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ll"]


def corpus(rng, n):
    syl = ["ka", "lo", "mi", "ta", "ren", "sh", "the", "ing", "qu", "ox", "ple", "str", "ion", "a", "e", "in",
           "un", "re", "de", "pro", "ment", "ness", "er", "ly", "tion", "ab", "zy", "ph", "ch", "ck"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    words += ["the", "of", "and", "to", "in", "is", "that", "it", "for", "on", "The", "A", "I", "def", "return",
              "import", "func", "if", "else", "HTTP", "URL", "JSON", "don", "can", "won"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 18)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(words)
                if rng.random() < 0.1:
                    w = w.upper()
                elif rng.random() < 0.15:
                    w = w.capitalize()
                parts.append(w)
            elif r < 0.65:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            elif r < 0.73:
                parts.append(rng.choice(UNICODE_WORDS))
            elif r < 0.83:
                parts.append(rng.choice(PUNCT))
            elif r < 0.88:
                parts.append(rng.choice(CONTRACTIONS))
            else:
                parts.append(rng.choice(SPACES))
            sep = rng.random()
            parts.append(" " if sep < 0.8 else rng.choice(SPACES) if sep < 0.93 else "")
        out.append("".join(parts))
    return out


EDGE_CASES = ["", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n", "a  b", "  leading", "trailing  ", "it's",
              "IT'S", "don't", "We'll've", "12345678", "3.14159", "1,000,000", "x=1+2", "👩‍👩‍👧‍👦 family",
              "e\u0301e\u0301", "hello<|endoftext|>world", "<|endoftext|>", "a<|begin_of_text|>b",
              "tabs\t\tand\tspaces", "    indented code():\n        return 42\n", "ends with newline\n",
              "\u00a0nbsp\u00a0", "mixed日本語and English", "emoji😀😀😀", "   ", "\n \n \n", "''", "'s's's"]


def make_tokenizers(outdir):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    rng = random.Random(SEED)
    train = corpus(rng, 20000)
    test = EDGE_CASES + corpus(random.Random(SEED + 1), 12000)

    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.train_from_iterator(train, trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt2.add_special_tokens(["<|endoftext|>"])
    gpt2.save(os.path.join(outdir, "gpt2-style.json"))

    llama = Tokenizer(models.BPE(ignore_merges=True))
    llama.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    llama.decoder = decoders.ByteLevel()
    llama.train_from_iterator(train, trainers.BpeTrainer(vocab_size=2000, min_frequency=2, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    llama.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"])
    bos = llama.token_to_id("<|begin_of_text|>")
    llama.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    llama.save(os.path.join(outdir, "llama3-style.json"))

    with gzip.open(os.path.join(outdir, "cases.jsonl.gz"), "wt", encoding="utf-8") as f:
        for i, text in enumerate(test):
            g = gpt2.encode(text, add_special_tokens=False).ids
            rec = {"text": text, "gpt2": g, "llama3": llama.encode(text, add_special_tokens=False).ids,
                   "gpt2_decoded": gpt2.decode(g, skip_special_tokens=False)}
            if i < 500:
                rec["llama3_bos"] = llama.encode(text, add_special_tokens=True).ids
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"tokenizers: {len(test)} cases; vocab {gpt2.get_vocab_size()} / {llama.get_vocab_size()}",
          file=sys.stderr)


# --- optimizers, schedules, clipping ----------------------------------------

def optimizer_case(kind):
    gen = torch.Generator().manual_seed(SEED + {"Adam": 1, "AdamW": 2, "SGD": 3}[kind])
    sizes = [5, 3, 4]
    init = [torch.randn(n, generator=gen) for n in sizes]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    if kind == "SGD":
        groups = [{"params": [ps[0], ps[1]], "lr": 0.05, "momentum": 0.9, "dampening": 0.0, "nesterov": True,
                   "weight_decay": 0.01},
                  {"params": [ps[2]], "lr": 0.02, "momentum": 0.5, "dampening": 0.1, "nesterov": False,
                   "weight_decay": 0.0}]
        opt = torch.optim.SGD(groups, lr=0.05, foreach=False)
    else:
        groups = [{"params": [ps[0], ps[1]], "lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8},
                  {"params": [ps[2]], "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6}]
        opt = getattr(torch.optim, kind)(groups, foreach=False)
    late, first = 1, 4  # parameter 1 first has a gradient at step 4
    grads, after = [], []
    for step in range(1, 11):
        gs = []
        for i, p in enumerate(ps):
            if i == late and step < first:
                p.grad = None
                gs.append(None)
            else:
                g = torch.randn(p.shape, generator=gen)
                p.grad = g.clone()
                gs.append(tolist(g))
        opt.step()
        grads.append(gs)
        after.append([tolist(p) for p in ps])
    return {"optimizer": kind,
            "groups": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                       | {"params": [[id(q) for q in ps].index(id(p)) for p in g["params"]]} for g in opt.param_groups],
            "init": [tolist(t) for t in init], "late_param": late, "late_first_step": first,
            "grads": grads, "params_after": after}


def schedules():
    from torch.optim import lr_scheduler as S
    base, warm, total, floor = 6e-4, 10, 100, 6e-5

    def run(make, steps=120):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=base)
        sch = make(opt)
        lrs = []
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sch.step()
        return lrs

    out = {"base_lr": base, "warmup": warm, "total": total, "floor": floor, "note":
           "lrs[i] is the learning rate step i (from 0) runs with"}
    cases = {
        "constant": lambda o: S.LambdaLR(o, lambda s: 1.0),
        "linear_warmup": lambda o: S.LinearLR(o, start_factor=0.01, end_factor=1.0, total_iters=warm),
        "cosine": lambda o: S.CosineAnnealingLR(o, T_max=total, eta_min=floor),
        "warmup_cosine": lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.01, end_factor=1.0,
                                                                 total_iters=warm),
                                                      S.CosineAnnealingLR(o, T_max=total - warm, eta_min=floor)],
                                                  milestones=[warm]),
        "linear_decay": lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=total),
        "step": lambda o: S.StepLR(o, step_size=30, gamma=0.1),
    }
    try:
        import transformers as T
        cases["hf_cosine_with_warmup"] = lambda o: T.get_cosine_schedule_with_warmup(o, warm, total)
        cases["hf_linear_with_warmup"] = lambda o: T.get_linear_schedule_with_warmup(o, warm, total)
        cases["hf_constant_with_warmup"] = lambda o: T.get_constant_schedule_with_warmup(o, warm)
        if hasattr(T, "get_cosine_with_min_lr_schedule_with_warmup"):
            cases["hf_cosine_with_min_lr"] = lambda o: T.get_cosine_with_min_lr_schedule_with_warmup(
                o, warm, total, min_lr_rate=0.1)
        else:
            from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup as f
            cases["hf_cosine_with_min_lr"] = lambda o: f(o, warm, total, min_lr_rate=0.1)
    except Exception as e:  # noqa: BLE001
        print(f"transformers schedules: {e}", file=sys.stderr)
    out["cases"] = {name: run(make) for name, make in cases.items()}
    return out


def clipping():
    gen = torch.Generator().manual_seed(SEED + 9)
    base = [torch.randn(n, generator=gen) for n in (6, 2, 5)]
    cases = []
    for name, max_norm, norm_type, scale, poison in [
            ("l2_clipped", 1.0, 2.0, 1.0, None), ("l2_below", 100.0, 2.0, 1.0, None),
            ("inf_clipped", 0.5, float("inf"), 1.0, None), ("l2_small_grads", 1.0, 2.0, 1e-4, None),
            ("l2_nan", 1.0, 2.0, 1.0, float("nan")), ("l2_inf", 1.0, 2.0, 1.0, float("inf"))]:
        ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in base]
        for p, g in zip(ps, base):
            p.grad = (g * scale).clone()
        if poison is not None:
            ps[1].grad[0] = poison
        before = [tolist(p.grad) for p in ps]
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type, foreach=False)
        cases.append({"name": name, "max_norm": max_norm, "norm_type": finite(norm_type), "grads": before,
                      "total_norm": finite(float(total)), "clipped": [tolist(p.grad) for p in ps]})
    return cases


def make_optim(outdir):
    ref = {"adam": optimizer_case("Adam"), "adamw": optimizer_case("AdamW"), "sgd": optimizer_case("SGD"),
           "schedules": schedules(), "clip_grad_norm": clipping()}
    with open(os.path.join(outdir, "torch_reference.json"), "w") as f:
        json.dump(ref, f, indent=1, allow_nan=False)


def main():
    torch.manual_seed(SEED)
    steps = [("tokenizers", lambda: make_tokenizers(mkdir("tokenizer"))),
             ("optim", lambda: make_optim(mkdir("optim"))),
             ("configs", lambda: make_real_configs(mkdir("hf", "configs")))]
    failed = []
    for name, f in steps:
        try:
            f()
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            failed.append(name)
    try:
        made = make_tiny(mkdir("hf"))
        make_peft(mkdir("hf"), made["llama-gqa-untied"])
    except Exception:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        failed.append("checkpoints")
    with open(os.path.join(OUT, "VERSIONS.json"), "w") as f:
        json.dump(versions(), f, indent=1)
    print(f"failed: {failed}" if failed else "all made", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
