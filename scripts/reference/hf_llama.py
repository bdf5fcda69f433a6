#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Llama model (issue #13's tests).

  hf_llama.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV
                     --intermediate F --vocab V --max-positions T [--rope-theta X]
                     [--rope-scaling-factor F --low-freq-factor A --high-freq-factor B
                      --original-max-positions P] [--tie] [--eps E] [--seed S]
                     [--max-shard-size 50KB] [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random LlamaForCausalLM (every parameter perturbed, RMSNorm gains
      around 1) saved with save_pretrained(DIR, safe_serialization=True),
      sharded behind model.safetensors.index.json when --max-shard-size is
      small. With --batch (int32 'inputs' and 'targets', (B,T)): writes REF
      with 'logits' (B,T,V), 'loss' (mean cross-entropy over all targets,
      fp32) and 'grad.<name>' for every parameter (HF names), from one
      forward + backward in fp32.

  hf_llama.py logits --model DIR --batch BATCH.safetensors --out OUT.safetensors
      LlamaForCausalLM.from_pretrained(DIR) on BATCH's 'inputs'; 'logits'.
      Fails (exit 1) when from_pretrained reports missing, unexpected or
      mis-shaped tensors (it would otherwise only warn and init them).

  hf_llama.py generate --model DIR --prompt "ID ID ..." --max-new-tokens N
      Greedy generate (use_cache=True); prints prompt + continuation ids.

  hf_llama.py same-bf16 --fp32 DIR --bf16 DIR
      Both directories through from_pretrained (torch_dtype float32 and
      bfloat16; each must load cleanly): every parameter of the second must
      equal the first's rounded to bfloat16 by torch (round to nearest
      even), bit for bit. Prints the first mismatch and exits 1 otherwise.

Offline, with the repo's .venv python (transformers 4.44.2 on Debian's torch).
"""
import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402


def load_clean(path, dtype=torch.float32):
    hf_logging.set_verbosity_error()
    # The class config.json's model_type names: the other Llama-shaped
    # families' scripts (hf_qwen2.py, ...) reuse these commands.
    model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                       torch_dtype=dtype)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"from_pretrained({path}) did not load cleanly: {problems}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    return model


def cmd_random(a):
    torch.manual_seed(a.seed)
    scaling = None
    if a.rope_scaling_factor:
        scaling = {"rope_type": "llama3", "factor": a.rope_scaling_factor, "low_freq_factor": a.low_freq_factor,
                   "high_freq_factor": a.high_freq_factor,
                   "original_max_position_embeddings": a.original_max_positions}
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=a.max_positions, rms_norm_eps=a.eps, rope_theta=a.rope_theta,
                      rope_scaling=scaling, tie_word_embeddings=a.tie, attention_bias=False, mlp_bias=False,
                      hidden_act="silu", torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    perturb(model)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size=a.max_shard_size)
    if a.batch:
        write_reference(model, a.batch, a.out_ref)
    return 0


def perturb(model, scales=None):
    """Every parameter to base + scale * N(0, 1), drawn in named_parameters()
    order (so the seed decides the model): RMSNorm gains around 1, the rest
    around 0 at scale 0.1, and a parameter whose name ends in a key of
    `scales` at that key's scale (the MoE routers at 1.0: ten times the
    experts', so routing is decided by clear margins, not near-ties)."""
    scales = scales or {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            scale = next((v for suffix, v in scales.items() if name.endswith(suffix)), 0.1)
            p.copy_(base + scale * torch.randn_like(p))


def random_parser(doc, int_keys):
    """The `random` command's parser the families share: --out, the integer
    shape options in `int_keys` (all required), --tie, --seed, and --batch /
    --out-ref for write_reference. Each family adds its own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("cmd")
    ap.add_argument("--out", required=True)
    for k in int_keys:
        ap.add_argument("--" + k, type=int, required=True)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch")
    ap.add_argument("--out-ref")
    return ap


def write_reference(model, batch_path, out_ref, extra_loss=None, **forward_kwargs):
    """logits, the mean cross-entropy loss and every parameter's gradient
    (HF names) of one fp32 forward + backward on BATCH's inputs/targets.
    extra_loss(out) -> {name: scalar tensor}: terms added to the loss (the
    MoE families' router losses), each also saved under its name."""
    batch = load_file(batch_path)
    inputs, targets = batch["inputs"].to(torch.long), batch["targets"].to(torch.long)
    model.train()  # no dropout in Llama; train() only enables the autograd path
    out = model(inputs, **forward_kwargs)
    logits = out.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    extra = extra_loss(out) if extra_loss else {}
    for term in extra.values():
        loss = loss + term
    loss.backward()
    ref = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for name, term in extra.items():
        ref[name] = term.detach().float().reshape(1)
    for name, p in model.named_parameters():
        ref["grad." + name] = p.grad.detach().float().contiguous()
    save_file(ref, out_ref)


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


def cmd_generate_text(a):
    """Greedy text generation as `trainrun generate --top-k 1` does it: the
    prompt encoded by the model directory's tokenizer.json (its
    post-processor's BOS included), max_new_tokens without stopping at EOS,
    decoded with special tokens kept."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    model = load_clean(a.model)
    ids = torch.tensor([tok.encode(a.prompt).ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                             min_new_tokens=a.max_new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    sys.stdout.write(tok.decode(out[0].tolist(), skip_special_tokens=False))
    return 0


def cmd_generate_chat(a):
    """Greedy chat generation as `trainrun generate --chat --top-k 1` does it:
    apply_chat_template(add_generation_prompt=True) with the model directory's
    tokenizer (its tokenizer_config.json's chat_template), then generate,
    stopping at the --stop tokens and the generation config's eos; decoded
    with special tokens kept (the tokenizers library's decode, no clean-up)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    model = load_clean(a.model)
    msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}]
    ids = torch.tensor([tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)], dtype=torch.long)
    eos = model.generation_config.eos_token_id
    stops = [tok.convert_tokens_to_ids(t) for t in a.stop] + (eos if isinstance(eos, list) else [eos] if eos is not None else [])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=stops)
    sys.stdout.write(tok.backend_tokenizer.decode(out[0].tolist(), skip_special_tokens=False))
    return 0


def cmd_same_bf16(a):
    full = dict(load_clean(a.fp32).named_parameters())
    half = dict(load_clean(a.bf16, torch.bfloat16).named_parameters())
    if sorted(full) != sorted(half):
        print(f"different parameters: {sorted(set(full) ^ set(half))}", file=sys.stderr)
        return 1
    for name, p in full.items():
        q = half[name]
        if q.dtype != torch.bfloat16 or not torch.equal(p.detach().to(torch.bfloat16), q.detach()):
            print(f"{name}: {q.dtype}, not the fp32 export rounded to bfloat16", file=sys.stderr)
            return 1
    print(f"{len(full)} parameters equal")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rd = sub.add_parser("random")
    rd.add_argument("--out", required=True)
    for k in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "max-positions"):
        rd.add_argument("--" + k, type=int, required=True)
    rd.add_argument("--rope-theta", type=float, default=500000.0)
    rd.add_argument("--rope-scaling-factor", type=float, default=0.0)
    rd.add_argument("--low-freq-factor", type=float, default=1.0)
    rd.add_argument("--high-freq-factor", type=float, default=4.0)
    rd.add_argument("--original-max-positions", type=int, default=8192)
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
    gt = sub.add_parser("generate-text")
    gt.add_argument("--model", required=True)
    gt.add_argument("--prompt", required=True)
    gt.add_argument("--max-new-tokens", type=int, required=True)
    gc = sub.add_parser("generate-chat")
    gc.add_argument("--model", required=True)
    gc.add_argument("--prompt", required=True)
    gc.add_argument("--system", default="")
    gc.add_argument("--stop", nargs="*", default=[])
    gc.add_argument("--max-new-tokens", type=int, required=True)
    sb = sub.add_parser("same-bf16")
    sb.add_argument("--fp32", required=True)
    sb.add_argument("--bf16", required=True)
    a = ap.parse_args(argv)
    return {"random": cmd_random, "logits": cmd_logits, "generate": cmd_generate, "generate-text": cmd_generate_text,
            "generate-chat": cmd_generate_chat,
            "same-bf16": cmd_same_bf16}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
