#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's head_dim and Qwen3 (issue #26's tests).

  hf_qwen3.py random --family llama-head-dim|qwen3 --out DIR --layers L --hidden C --heads NH
                     --kv-heads NKV --head-dim HD --intermediate F --vocab V --max-positions T
                     [--rope-theta X] [--tie] [--eps E] [--seed S]
                     [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random model (every parameter perturbed, RMSNorm gains around 1)
      saved with save_pretrained(DIR); with --batch, REF gets 'logits',
      'loss' and 'grad.<name>' for every parameter, as hf_llama.py's random.
      llama-head-dim: a Llama whose heads are HD wide, not C/NH. transformers
        4.44's LlamaAttention refuses that (it was added in 4.45), so the
        model is 4.44's MistralForCausalLM with no sliding window, which is
        the same function with the same tensor names and does read head_dim;
        config.json is then rewritten as the LlamaConfig a newer transformers
        saves (model_type llama, head_dim).
      qwen3: Qwen3ForCausalLM (transformers >= 4.51: the hf-next venv).

  hf_qwen3.py logits --family F --model DIR --batch BATCH.safetensors --out OUT.safetensors
                     [--prompt "ID ..." --generate-model DIR2 --max-new-tokens N]
  hf_qwen3.py generate --family F --model DIR --prompt "ID ID ..." --max-new-tokens N
      As hf_llama.py's, through the family's class (from_pretrained must
      load cleanly); logits with --prompt then prints generate's output for
      DIR2 (one python start for both).

Offline. llama-head-dim runs in the repo's .venv (transformers 4.44.2);
qwen3 in .venv-hf-next (scripts/install-deps.sh --test).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402


def family_classes(family):
    if family == "llama-head-dim":
        from transformers import MistralConfig, MistralForCausalLM
        return MistralConfig, MistralForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3Config, Qwen3ForCausalLM


def make_config(a):
    cls, _ = family_classes(a.family)
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                  head_dim=a.head_dim, max_position_embeddings=a.max_positions, rms_norm_eps=a.eps,
                  rope_theta=a.rope_theta, tie_word_embeddings=a.tie, hidden_act="silu", torch_dtype="float32")
    if a.family == "llama-head-dim":
        return cls(sliding_window=None, **common)
    return cls(use_sliding_window=False, sliding_window=None, attention_bias=False, **common)


def as_llama_config(path):
    """The MistralConfig save_pretrained wrote, as the LlamaConfig (with head_dim) it computes."""
    p = os.path.join(path, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.pop("sliding_window", None)
    c.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False,
             rope_scaling=None, pretraining_tp=1)
    with open(p, "w") as f:
        json.dump(c, f, indent=2)


def load_clean(a, path):
    """from_pretrained of the family's class; exit 1 on missing/unexpected/mis-shaped tensors."""
    cfg_cls, model_cls = family_classes(a.family)
    hf_logging.set_verbosity_error()
    kw = {}
    if a.family == "llama-head-dim":
        # trainrun's Llama config.json, read by the class that has head_dim.
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        if c.get("model_type") != "llama":
            print(f"{path}: model_type {c.get('model_type')}, not llama", file=sys.stderr)
            sys.exit(1)
        keep = {k: v for k, v in c.items() if k not in ("model_type", "architectures", "rope_scaling", "mlp_bias",
                                                          "attention_bias", "pretraining_tp")}
        kw["config"] = cfg_cls(sliding_window=None, **keep)
    else:
        kw["attn_implementation"] = "eager"  # the reference path (sdpa's kernels differ in the last bits)
    model, info = model_cls.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                            torch_dtype=torch.float32, **kw)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"from_pretrained({path}) did not load cleanly: {problems}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    return model


def cmd_random(a):
    torch.manual_seed(a.seed)
    _, model_cls = family_classes(a.family)
    cfg = make_config(a)
    if a.family == "qwen3":
        cfg._attn_implementation = "eager"  # the reference path (sdpa's kernels differ in the last bits)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    model.save_pretrained(a.out, safe_serialization=True)
    if a.family == "llama-head-dim":
        as_llama_config(a.out)
    if a.batch:
        batch = load_file(a.batch)
        inputs, targets = batch["inputs"].to(torch.long), batch["targets"].to(torch.long)
        model.train()  # no dropout; train() only enables the autograd path
        logits = model(inputs).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        ref = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
        for name, p in model.named_parameters():
            ref["grad." + name] = p.grad.detach().float().contiguous()
        save_file(ref, a.out_ref)
    return 0


def cmd_logits(a):
    model = load_clean(a, a.model)
    with torch.no_grad():
        logits = model(load_file(a.batch)["inputs"].to(torch.long)).logits
    save_file({"logits": logits.float().contiguous()}, a.out)
    if a.prompt:  # one python start for both (torch 2.x imports slowly)
        return cmd_generate(a, load_clean(a, a.generate_model))
    return 0


def cmd_generate(a, model=None):
    model = model or load_clean(a, a.model)
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
    for k in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab", "max-positions"):
        rd.add_argument("--" + k, type=int, required=True)
    rd.add_argument("--rope-theta", type=float, default=1000000.0)
    rd.add_argument("--tie", action="store_true")
    rd.add_argument("--eps", type=float, default=1e-6)
    rd.add_argument("--seed", type=int, default=0)
    rd.add_argument("--batch")
    rd.add_argument("--out-ref")
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--batch", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--prompt", default="", help="then generate as the generate command does, from --generate-model")
    lg.add_argument("--generate-model")
    lg.add_argument("--max-new-tokens", type=int, default=0)
    gn = sub.add_parser("generate")
    gn.add_argument("--model", required=True)
    gn.add_argument("--prompt", required=True)
    gn.add_argument("--max-new-tokens", type=int, required=True)
    for p in (rd, lg, gn):
        p.add_argument("--family", choices=["llama-head-dim", "qwen3"], required=True)
    a = ap.parse_args(argv)
    return {"random": cmd_random, "logits": cmd_logits, "generate": cmd_generate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
