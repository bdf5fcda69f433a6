#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Qwen2-MoE (issue #28's tests).

  hf_qwen2_moe.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV
                         --intermediate F --experts E --top-k K --expert-intermediate FE
                         --shared-intermediate FS --vocab V --max-positions T
                         [--norm-topk] [--aux-coef A] [--tie] [--seed S]
                         [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random Qwen2MoeForCausalLM (every layer sparse: decoder_sparse_step 1,
      no mlp_only_layers) saved with
      save_pretrained(DIR, safe_serialization=True): every parameter
      perturbed (RMSNorm gains around 1, the q/k/v biases nonzero, the
      router's rows at 10x the experts' scale). With --batch: REF as
      hf_mixtral.py's ('loss' with A times the model's aux_loss, from a
      forward with output_router_logits=True; that term as 'aux_term').
      config.json says output_router_logits false: transformers 4.44's
      Qwen2-MoE generate fails with it on (load_balancing_loss_func on the
      cached steps' router logits: "size of tensor a (2) must match ... (0)").

  hf_qwen2_moe.py logits|generate ...    as hf_llama.py's.

Offline, with the repo's .venv python (transformers 4.44.2 on Debian's torch).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (sets the offline environment first)
import torch  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402


def cmd_random(a):
    torch.manual_seed(a.seed)
    cfg = Qwen2MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         max_position_embeddings=a.max_positions, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=a.tie, use_sliding_window=False, hidden_act="silu",
                         num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_intermediate,
                         shared_expert_intermediate_size=a.shared_intermediate, norm_topk_prob=a.norm_topk,
                         decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                         router_aux_loss_coef=a.aux_coef, torch_dtype="float32")
    model = Qwen2MoeForCausalLM(cfg)
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
    ap = hf_llama.random_parser(__doc__, ("layers", "hidden", "heads", "kv-heads", "intermediate", "experts",
                                          "top-k", "expert-intermediate", "shared-intermediate", "vocab",
                                          "max-positions"))
    ap.add_argument("--norm-topk", action="store_true")
    ap.add_argument("--aux-coef", type=float, default=0.02)
    return cmd_random(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
