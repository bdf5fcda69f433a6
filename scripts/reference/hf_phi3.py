#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Phi-3 model (issue #26's tests).

  hf_phi3.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV
                    --intermediate F --vocab V --max-positions T [--sliding-window W]
                    [--longrope ORIG] [--tie] [--eps E] [--rope-theta X] [--seed S] [--max-shard-size 20KB]
                    [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random Phi3ForCausalLM (eager attention, every parameter perturbed,
      RMSNorm gains around 1) saved with save_pretrained(DIR), fused
      self_attn.qkv_proj and mlp.gate_up_proj as transformers writes them.
      With --batch: REF holds 'logits', 'loss' and 'grad.<HF name>' (fp32),
      as hf_llama.py's. --longrope ORIG: rope_scaling {"type": "longrope"} with
      random short/long factors in [1, 4) and original_max_position_embeddings ORIG.

  hf_phi3.py logits --model DIR --batch BATCH.safetensors --out OUT.safetensors
  hf_phi3.py generate --model DIR --prompt "ID ID ..." --max-new-tokens N
      As hf_llama.py's, with Phi3ForCausalLM (from_pretrained must load cleanly).

Offline, with the repo's .venv python (transformers 4.44.2 on Debian's torch).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (sets the offline environment before torch/transformers load)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Phi3Config, Phi3ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402


def load_clean(path):
    hf_logging.set_verbosity_error()
    model, info = Phi3ForCausalLM.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                  torch_dtype=torch.float32, attn_implementation="eager")
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"from_pretrained({path}) did not load cleanly: {problems}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    return model


def cmd_random(a):
    torch.manual_seed(a.seed)
    scaling, orig = None, a.max_positions
    if a.longrope:
        half = a.hidden // a.heads // 2
        scaling = {"type": "longrope", "short_factor": (1 + 3 * torch.rand(half)).tolist(),
                   "long_factor": (1 + 3 * torch.rand(half)).tolist()}
        orig = a.longrope
    # pad/bos/eos None: Phi3Config's 32000 would be an embedding padding_idx past a tiny vocabulary.
    cfg = Phi3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                     num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                     max_position_embeddings=a.max_positions, original_max_position_embeddings=orig,
                     rms_norm_eps=a.eps, rope_theta=a.rope_theta, rope_scaling=scaling,
                     sliding_window=a.sliding_window or None, tie_word_embeddings=a.tie, hidden_act="silu",
                     pad_token_id=None, bos_token_id=None, eos_token_id=None, torch_dtype="float32",
                     attn_implementation="eager")
    model = Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size=a.max_shard_size)
    if a.batch:
        batch = load_file(a.batch)
        inputs, targets = batch["inputs"].to(torch.long), batch["targets"].to(torch.long)
        model.train()  # dropouts are 0: train() only enables the autograd path
        logits = model(inputs).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        ref = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
        for name, p in model.named_parameters():
            ref["grad." + name] = p.grad.detach().float().contiguous()
        save_file(ref, a.out_ref)
    return 0


def cmd_logits(a):
    model = load_clean(a.model)
    with torch.no_grad():
        logits = model(load_file(a.batch)["inputs"].to(torch.long)).logits
    save_file({"logits": logits.float().contiguous()}, a.out)
    return 0


def cmd_generate(a):
    model = load_clean(a.model)
    ids = torch.tensor([[int(t) for t in a.prompt.split()]], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                             min_new_tokens=a.max_new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    print(" ".join(str(int(t)) for t in out[0].tolist()))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rd = sub.add_parser("random")
    rd.add_argument("--out", required=True)
    for k in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "max-positions"):
        rd.add_argument("--" + k, type=int, required=True)
    rd.add_argument("--sliding-window", type=int, default=0)
    rd.add_argument("--longrope", type=int, default=0)
    rd.add_argument("--rope-theta", type=float, default=10000.0)
    rd.add_argument("--tie", action="store_true")
    rd.add_argument("--eps", type=float, default=1e-5)
    rd.add_argument("--seed", type=int, default=0)
    rd.add_argument("--max-shard-size", default="10GB")
    rd.add_argument("--batch")
    rd.add_argument("--out-ref")
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--batch", required=True)
    lg.add_argument("--out", required=True)
    gn = sub.add_parser("generate")
    gn.add_argument("--model", required=True)
    gn.add_argument("--prompt", required=True)
    gn.add_argument("--max-new-tokens", type=int, required=True)
    a = ap.parse_args(argv)
    return {"random": cmd_random, "logits": cmd_logits, "generate": cmd_generate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
