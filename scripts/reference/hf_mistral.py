#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Mistral (issue #26's tests).

  hf_mistral.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV
                       --intermediate F --vocab V --max-positions T --window W
                       [--head-dim D] [--rope-theta X] [--eps E] [--seed S]
                       [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random MistralForCausalLM (eager attention: transformers 4.44 masks
      the window there, keys t - W < j <= t) saved with save_pretrained(DIR,
      safe_serialization=True); every parameter perturbed (RMSNorm gains
      around 1). --window 0 writes sliding_window null (no window). With
      --batch: REF as hf_llama.py's (logits, loss, grad.<name>).

  hf_mistral.py logits|generate ...    as hf_llama.py's (from_pretrained picks
      MistralForCausalLM from config.json's model_type; on the venv's torch
      1.13 there is no SDPA, so it runs the eager attention too: checked).

Offline, with the repo's .venv python (transformers 4.44.2 on Debian's torch).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (sets the offline environment first)
import torch  # noqa: E402
from transformers import MistralConfig, MistralForCausalLM  # noqa: E402


def cmd_random(a):
    torch.manual_seed(a.seed)
    cfg = MistralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        head_dim=a.head_dim or None, max_position_embeddings=a.max_positions, rms_norm_eps=a.eps,
                        rope_theta=a.rope_theta, sliding_window=a.window or None, tie_word_embeddings=False,
                        hidden_act="silu", torch_dtype="float32", attn_implementation="eager")
    model = MistralForCausalLM(cfg)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    hf_llama.perturb(model)
    model.save_pretrained(a.out, safe_serialization=True)
    if a.batch:
        hf_llama.write_reference(model, a.batch, a.out_ref)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "random":
        # The other commands load through from_pretrained: eager is the only
        # attention torch 1.13 offers transformers 4.44 (SDPA needs torch >= 2.1.1).
        assert not hasattr(torch.nn.functional, "scaled_dot_product_attention"), \
            "this torch has SDPA: from_pretrained would not pick the eager attention the tests compare with"
        return hf_llama.main(argv)
    ap = hf_llama.random_parser(__doc__, ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab",
                                          "max-positions", "window"))
    ap.add_argument("--head-dim", type=int, default=0)
    ap.add_argument("--rope-theta", type=float, default=1000000.0)
    ap.add_argument("--eps", type=float, default=1e-5)
    return cmd_random(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
