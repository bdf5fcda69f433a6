#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Gemma 2 (issue #26's tests).

  hf_gemma2.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV --head-dim HD
                      --intermediate F --vocab V --max-positions T --attn-softcap A --final-softcap S
                      --query-scalar Q --window W [--eps E] [--seed S] [--std X]
                      [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random Gemma2ForCausalLM (transformers 4.44.2, attn_implementation
      "eager": the soft-capping is only in eager), every parameter perturbed:
      matrices and the embedding N(0, X) (X large enough that the attention
      scores and the logits exceed their caps), RMSNorm weights N(0, 0.1)
      (Gemma's norms compute x * (1 + w)); saved with save_pretrained(DIR).
      With --batch, REF gets 'logits', 'loss' (mean cross-entropy of the
      logits against the batch's targets, no shift), 'grad.<name>' for every
      parameter, and 'uncapped_absmax' (max |logit| before the final cap, so
      the test can see that the cap bites).

  hf_gemma2.py logits --model DIR --batch BATCH.safetensors --out OUT.safetensors
                      [--prompt "ID ..." --generate-model DIR2 --max-new-tokens N]
      from_pretrained(DIR) (eager attention; exit 1 unless every tensor
      loads cleanly) and its fp32 'logits' of BATCH's inputs into OUT; with
      --prompt, then prints model.generate's greedy continuation of the ids
      from DIR2 (without a KV cache: 4.44's HybridCache needs a newer torch;
      one python start for both).

Offline, in the repo's .venv (transformers 4.44.2).
"""
import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402


def make_config(a):
    return Gemma2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        head_dim=a.head_dim, max_position_embeddings=a.max_positions, rms_norm_eps=a.eps,
                        rope_theta=10000.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        attn_logit_softcapping=a.attn_softcap, final_logit_softcapping=a.final_softcap,
                        query_pre_attn_scalar=a.query_scalar, sliding_window=a.window,
                        attn_implementation="eager", torch_dtype="float32",
                        bos_token_id=None, eos_token_id=None)  # no end token: generate runs its whole length


def cmd_random(a):
    torch.manual_seed(a.seed)
    model = Gemma2ForCausalLM(make_config(a))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.1 if name.endswith("norm.weight") else a.std
            p.copy_(std * torch.randn_like(p))
    model.save_pretrained(a.out, safe_serialization=True)
    if a.batch:
        batch = load_file(a.batch)
        inputs, targets = batch["inputs"].to(torch.long), batch["targets"].to(torch.long)
        model.train()  # no dropout (attention_dropout 0); train() only enables the autograd path
        out = model(inputs, use_cache=False, output_hidden_states=True)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        with torch.no_grad():  # the last hidden state is the final norm's output
            uncapped = out.hidden_states[-1] @ model.model.embed_tokens.weight.T
        ref = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1),
               "uncapped_absmax": uncapped.abs().max().reshape(1)}
        for name, p in model.named_parameters():
            ref["grad." + name] = p.grad.detach().float().contiguous()
        save_file(ref, a.out_ref)
    return 0


def load_clean(path):
    hf_logging.set_verbosity_error()
    model, info = Gemma2ForCausalLM.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                                    torch_dtype=torch.float32, attn_implementation="eager")
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"from_pretrained({path}) did not load cleanly: {problems}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    return model


def cmd_logits(a):
    model = load_clean(a.model)
    with torch.no_grad():
        logits = model(load_file(a.batch)["inputs"].to(torch.long), use_cache=False).logits
    save_file({"logits": logits.float().contiguous()}, a.out)
    if a.prompt:
        gen = load_clean(a.generate_model)
        ids = torch.tensor([[int(t) for t in a.prompt.split()]], dtype=torch.long)
        # Without a cache: 4.44's Gemma 2 cache (HybridCache) needs torch._dynamo, which the
        # test venv's torch 1.13 lacks; greedy decoding recomputing every step is the same function.
        gen.generation_config.cache_implementation = None
        with torch.no_grad():
            out = gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                               min_new_tokens=a.max_new_tokens, do_sample=False, use_cache=False, pad_token_id=0)
        print(" ".join(str(int(t)) for t in out[0].tolist()))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rd = sub.add_parser("random")
    rd.add_argument("--out", required=True)
    for k in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab", "max-positions",
              "window"):
        rd.add_argument("--" + k, type=int, required=True)
    for k in ("attn-softcap", "final-softcap", "query-scalar"):
        rd.add_argument("--" + k, type=float, required=True)
    rd.add_argument("--eps", type=float, default=1e-6)
    rd.add_argument("--std", type=float, default=0.3)
    rd.add_argument("--seed", type=int, default=0)
    rd.add_argument("--batch")
    rd.add_argument("--out-ref")
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--batch", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--prompt", default="")
    lg.add_argument("--generate-model")
    lg.add_argument("--max-new-tokens", type=int, default=0)
    a = ap.parse_args(argv)
    return {"random": cmd_random, "logits": cmd_logits}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
