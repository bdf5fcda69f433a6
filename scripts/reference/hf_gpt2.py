#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's GPT-2 interop (tests/test_interop.cpp).

  hf_gpt2.py logits --model DIR --batch BATCH.safetensors --out OUT.safetensors
      GPT2LMHeadModel.from_pretrained(DIR, local_files_only=True) on the int32
      'inputs' (B,T) of BATCH; writes 'logits' (B,T,V) F32. Fails (exit 1)
      when from_pretrained reports a missing, unexpected or mis-shaped
      tensor, since transformers would otherwise only warn and initialise
      the missing ones at random; and when the LM head is not tied to wte.

  hf_gpt2.py random --out DIR --n-layer L --n-head H --n-embd C --vocab V
                    --n-positions T --seed S [--batch BATCH.safetensors --logits OUT.safetensors]
                    [--max-shard-size 50KB]
      A random GPT2LMHeadModel (every parameter perturbed, so biases and
      LayerNorms are not at their trivial init) written with
      save_pretrained(DIR, safe_serialization=True); with --batch, also its
      logits on BATCH.

  hf_gpt2.py generate --model DIR --prompt "ID ID ..." --max-new-tokens N
                      [--threads K --repeat R]
      Greedy GPT2LMHeadModel.generate (use_cache=True, do_sample=False) from
      the token ids of --prompt; prints prompt + continuation as ids on one
      line, and on stderr "tokens/s X" (the best of R timed runs with K torch
      threads): the peer of `trainrun generate` in tests and benchmarks.

Runs offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE) with the repo's .venv
python, which has transformers (pinned in scripts/install-deps.sh) and sees
Debian's torch 1.13 through --system-site-packages.
"""
import argparse
import os
import sys

# Offline before transformers is imported: it reads these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402


def load_batch(path):
    t = load_file(path)
    return t["inputs"].to(torch.long)


def cmd_logits(a):
    hf_logging.set_verbosity_error()
    model, info = GPT2LMHeadModel.from_pretrained(a.model, local_files_only=True, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"from_pretrained({a.model}) did not load cleanly: {problems}", file=sys.stderr)
        return 1
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        print("lm_head.weight is not tied to transformer.wte.weight", file=sys.stderr)
        return 1
    model.eval()
    with torch.no_grad():
        logits = model(load_batch(a.batch)).logits
    save_file({"logits": logits.to(torch.float32).contiguous()}, a.out)
    return 0


def cmd_random(a):
    torch.manual_seed(a.seed)
    cfg = GPT2Config(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, vocab_size=a.vocab,
                     n_positions=a.n_positions, activation_function="gelu_new",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # LayerNorm gains around 1, everything else a visible random value.
            base = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size=a.max_shard_size)
    if a.batch:
        model.eval()
        with torch.no_grad():
            logits = model(load_batch(a.batch)).logits
        save_file({"logits": logits.to(torch.float32).contiguous()}, a.logits)
    return 0


def cmd_generate(a):
    import time
    hf_logging.set_verbosity_error()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = GPT2LMHeadModel.from_pretrained(a.model, local_files_only=True)
    model.eval()
    ids = torch.tensor([[int(t) for t in a.prompt.split()]], dtype=torch.long)
    best = None
    for _ in range(max(1, a.repeat)):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                                 min_new_tokens=a.max_new_tokens, do_sample=False, use_cache=True,
                                 pad_token_id=0)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    print(" ".join(str(int(t)) for t in out[0].tolist()))
    print(f"tokens/s {a.max_new_tokens / best:.2f}", file=sys.stderr)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--batch", required=True)
    lg.add_argument("--out", required=True)
    rd = sub.add_parser("random")
    rd.add_argument("--out", required=True)
    rd.add_argument("--n-layer", type=int, required=True)
    rd.add_argument("--n-head", type=int, required=True)
    rd.add_argument("--n-embd", type=int, required=True)
    rd.add_argument("--vocab", type=int, required=True)
    rd.add_argument("--n-positions", type=int, required=True)
    rd.add_argument("--seed", type=int, default=0)
    rd.add_argument("--max-shard-size", default="10GB")
    rd.add_argument("--batch")
    rd.add_argument("--logits")
    gn = sub.add_parser("generate")
    gn.add_argument("--model", required=True)
    gn.add_argument("--prompt", required=True)
    gn.add_argument("--max-new-tokens", type=int, required=True)
    gn.add_argument("--threads", type=int, default=0)
    gn.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args(argv)
    return {"logits": cmd_logits, "random": cmd_random, "generate": cmd_generate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
