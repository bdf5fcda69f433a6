#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Qwen3-MoE (issue #28's tests).

  hf_qwen3_moe.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV --head-dim HD
                         --intermediate F --experts E --top-k K --expert-intermediate FE
                         --vocab V --max-positions T [--norm-topk] [--aux-coef A] [--tie] [--seed S]
                         [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random Qwen3MoeForCausalLM (every layer sparse: decoder_sparse_step 1,
      no mlp_only_layers; qk-norm; heads HD wide) saved with
      save_pretrained(DIR, safe_serialization=True): every parameter
      perturbed (RMSNorm gains, q_norm/k_norm included, around 1; the
      router's rows at 10x the experts' scale). With --batch: REF as
      hf_mixtral.py's ('loss' with A times the model's aux_loss, from a
      forward with output_router_logits=True; that term as 'aux_term').

  hf_qwen3_moe.py logits|generate ...    as hf_llama.py's.

Offline, in .venv-hf-next (transformers 4.51.3 on torch 2.5.1: 4.44 has no
Qwen3-MoE); tests/support/hf_reference.cpp picks that python for this script.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (sets the offline environment first)
import torch  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402


def cmd_random(a):
    torch.manual_seed(a.seed)
    cfg = Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         head_dim=a.head_dim, max_position_embeddings=a.max_positions, rms_norm_eps=1e-6,
                         rope_theta=1e6, tie_word_embeddings=a.tie, use_sliding_window=False, hidden_act="silu",
                         attention_bias=False, num_experts=a.experts, num_experts_per_tok=a.top_k,
                         moe_intermediate_size=a.expert_intermediate, norm_topk_prob=a.norm_topk,
                         decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                         router_aux_loss_coef=a.aux_coef, torch_dtype="float32")
    model = Qwen3MoeForCausalLM(cfg)
    hf_llama.perturb(model, {"mlp.gate.weight": 1.0})
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
    ap = hf_llama.random_parser(__doc__, ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate",
                                          "experts", "top-k", "expert-intermediate", "vocab", "max-positions"))
    ap.add_argument("--norm-topk", action="store_true")
    ap.add_argument("--aux-coef", type=float, default=0.02)
    return cmd_random(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
