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


def make_config(a):
    return Gemma2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        head_dim=a.head_dim, max_position_embeddings=a.max_positions, rms_norm_eps=a.eps,
                        rope_theta=10000.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                        attn_logit_softcapping=a.attn_softcap, final_logit_softcapping=a.final_softcap,
                        query_pre_attn_scalar=a.query_scalar, sliding_window=a.window,
                        attn_implementation="eager", torch_dtype="float32")


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
    a = ap.parse_args(argv)
    return {"random": cmd_random}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
