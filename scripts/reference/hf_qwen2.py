#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Qwen2 (issue #26's tests).

  hf_qwen2.py random --out DIR --layers L --hidden C --heads NH --kv-heads NKV
                     --intermediate F --vocab V --max-positions T [--tie]
                     [--rope-theta X] [--eps E] [--seed S]
                     [--batch BATCH.safetensors --out-ref REF.safetensors]
      A random Qwen2ForCausalLM saved with save_pretrained(DIR,
      safe_serialization=True): every parameter perturbed (RMSNorm gains
      around 1, the q/k/v biases nonzero, so a dropped or misplaced bias
      shows). With --batch: REF as hf_llama.py's (logits, loss, grad.<name>).

  hf_qwen2.py logits|generate ...    as hf_llama.py's (from_pretrained picks
      Qwen2ForCausalLM from config.json's model_type).

Offline, with the repo's .venv python (transformers 4.44.2 on Debian's torch).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402  (sets the offline environment first)
import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402


def cmd_random(a):
    torch.manual_seed(a.seed)
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=a.max_positions, rms_norm_eps=a.eps, rope_theta=a.rope_theta,
                      tie_word_embeddings=a.tie, use_sliding_window=False, hidden_act="silu",
                      torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg)
    hf_llama.perturb(model)
    model.save_pretrained(a.out, safe_serialization=True)
    if a.batch:
        hf_llama.write_reference(model, a.batch, a.out_ref)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "random":
        return hf_llama.main(argv)
    ap = hf_llama.random_parser(__doc__, ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab",
                                          "max-positions"))
    ap.add_argument("--rope-theta", type=float, default=1000000.0)
    ap.add_argument("--eps", type=float, default=1e-6)
    return cmd_random(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
