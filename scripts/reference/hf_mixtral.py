#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Mixtral (issue #28's tests).

  hf_mixtral.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV
                       --intermediate F --experts E --top-k K --vocab V
                       --max-positions T [--aux-coef A] [--tie] [--seed S]
                       [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random MixtralForCausalLM (output_router_logits=True,
      router_aux_loss_coef A) saved with save_pretrained(DIR,
      safe_serialization=True): every parameter perturbed (RMSNorm gains
      around 1; the router's rows at 10x the experts' scale, so routing is
      decided by clear margins, not ties). With --batch: REF as hf_llama.py's,
      whose 'loss' is the cross-entropy plus A times the model's aux_loss
      (load_balancing_loss_func over every layer's router logits), also
      saved as 'aux' (unscaled).

  hf_mixtral.py logits|generate ...    as hf_llama.py's.

Offline, with the repo's .venv python (transformers 4.44.2 on Debian's torch).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (sets the offline environment first)
import torch  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402


def cmd_random(a):
    torch.manual_seed(a.seed)
    cfg = MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        max_position_embeddings=a.max_positions, rms_norm_eps=1e-5, rope_theta=1e6,
                        tie_word_embeddings=a.tie, sliding_window=None, hidden_act="silu",
                        num_local_experts=a.experts, num_experts_per_tok=a.top_k, output_router_logits=True,
                        router_aux_loss_coef=a.aux_coef, router_jitter_noise=0.0, torch_dtype="float32")
    model = MixtralForCausalLM(cfg)
    hf_llama.perturb(model, {"block_sparse_moe.gate.weight": 1.0})
    model.save_pretrained(a.out, safe_serialization=True)
    if a.batch:
        hf_llama.write_reference(model, a.batch, a.out_ref,
                                 extra_loss=lambda out: {"aux_term": a.aux_coef * out.aux_loss},
                                 output_router_logits=True)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "random":
        return hf_llama.main(argv)
    ap = hf_llama.random_parser(__doc__, ("layers", "hidden", "heads", "kv-heads", "intermediate", "experts",
                                          "top-k", "vocab", "max-positions"))
    ap.add_argument("--aux-coef", type=float, default=0.02)
    return cmd_random(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
