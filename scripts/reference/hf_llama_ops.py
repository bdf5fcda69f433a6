#!/usr/bin/env python3
"""Hugging Face transformers as the peer of trainrun's Llama ops (tests/test_cpu_llama_ops.cpp).

  hf_llama_ops.py IN.json OUT.json

IN holds any of these keys (arrays are flat, row-major lists of numbers);
OUT gets the same keys with HF's results, computed in fp32 by the real
transformers modules (not re-derivations of them):

  "inv_freq":  [{"head_dim", "theta", "rope_scaling": null | {factor, low_freq_factor,
                 high_freq_factor, original_max_position_embeddings}}, ...]
               -> [inv_freq (head_dim/2), ...] from ROPE_INIT_FUNCTIONS["default" | "llama3"]
  "cos_sin":   {"head_dim", "theta", "rope_scaling", "max_position"}
               -> {"cos", "sin"}: LlamaRotaryEmbedding.forward at positions 0..max_position-1,
                  each (max_position, head_dim)
  "rmsnorm":   {"N", "C", "eps", "x" (N,C), "weight" (C)} -> LlamaRMSNorm(x) (N,C)
  "mlp":       {"N", "hidden", "intermediate", "x" (N,hidden), "gate" (I,hidden), "up" (I,hidden),
                "down" (hidden,I)} -> LlamaMLP(x) (N,hidden): down(silu(gate x) * up x)
  "attention": {"B", "T", "NH", "NKV", "HS", "theta", "rope_scaling", "pos0", "x" (B,T,NH*HS),
                "q" (NH*HS,NH*HS), "k" (NKV*HS,NH*HS), "v" (NKV*HS,NH*HS), "o" (NH*HS,NH*HS)}
               -> LlamaAttention (eager: RoPE at positions pos0.., repeat_kv, causal mask) (B,T,NH*HS)

Runs offline with the repo's .venv python (transformers pinned in
scripts/install-deps.sh, Debian's torch 1.13 through --system-site-packages).
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)


def config(head_dim, theta, rope_scaling, nh=1, nkv=1, hidden=None, intermediate=1):
    scaling, max_pos = None, 8192
    if rope_scaling is not None:
        scaling = dict(rope_scaling, rope_type="llama3")
        # Llama 3.1 extends 8192 to 131072; transformers warns unless the extended length is longer.
        max_pos = 16 * rope_scaling["original_max_position_embeddings"]
    return LlamaConfig(
        hidden_size=hidden if hidden is not None else head_dim * nh,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        intermediate_size=intermediate,
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
    )


def tensor(values, *shape):
    return torch.tensor(values, dtype=torch.float32).reshape(*shape)


def flat(t):
    return t.detach().reshape(-1).tolist()


def main(inp_path, out_path):
    with open(inp_path) as f:
        req = json.load(f)
    out = {}
    torch.set_grad_enabled(False)

    if "inv_freq" in req:
        out["inv_freq"] = []
        for r in req["inv_freq"]:
            cfg = config(r["head_dim"], r["theta"], r["rope_scaling"])
            kind = "default" if r["rope_scaling"] is None else "llama3"
            inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
            assert attention_factor == 1.0, attention_factor
            out["inv_freq"].append(flat(inv_freq))

    if "cos_sin" in req:
        r = req["cos_sin"]
        emb = LlamaRotaryEmbedding(config=config(r["head_dim"], r["theta"], r["rope_scaling"]))
        T = r["max_position"]
        x = torch.zeros(1, T, r["head_dim"])
        cos, sin = emb(x, torch.arange(T)[None, :])
        out["cos_sin"] = {"cos": flat(cos[0]), "sin": flat(sin[0])}

    if "rmsnorm" in req:
        r = req["rmsnorm"]
        norm = LlamaRMSNorm(r["C"], eps=r["eps"])
        norm.weight.copy_(tensor(r["weight"], r["C"]))
        out["rmsnorm"] = flat(norm(tensor(r["x"], r["N"], r["C"])))

    if "mlp" in req:
        r = req["mlp"]
        H, I = r["hidden"], r["intermediate"]
        mlp = LlamaMLP(config(H, 10000.0, None, hidden=H, intermediate=I))
        mlp.gate_proj.weight.copy_(tensor(r["gate"], I, H))
        mlp.up_proj.weight.copy_(tensor(r["up"], I, H))
        mlp.down_proj.weight.copy_(tensor(r["down"], H, I))
        out["mlp"] = flat(mlp(tensor(r["x"], r["N"], H)))

    if "attention" in req:
        r = req["attention"]
        B, T, NH, NKV, HS, pos0 = r["B"], r["T"], r["NH"], r["NKV"], r["HS"], r["pos0"]
        C = NH * HS
        cfg = config(HS, r["theta"], r["rope_scaling"], nh=NH, nkv=NKV)
        cfg._attn_implementation = "eager"
        attn = LlamaAttention(cfg, layer_idx=0).eval()
        attn.q_proj.weight.copy_(tensor(r["q"], C, C))
        attn.k_proj.weight.copy_(tensor(r["k"], NKV * HS, C))
        attn.v_proj.weight.copy_(tensor(r["v"], NKV * HS, C))
        attn.o_proj.weight.copy_(tensor(r["o"], C, C))
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
        pos = torch.arange(pos0, pos0 + T)[None, :].expand(B, T)
        emb = LlamaRotaryEmbedding(config=cfg)
        y, _, _ = attn(tensor(r["x"], B, T, C), attention_mask=mask, position_ids=pos,
                       position_embeddings=emb(torch.zeros(B, T, C), pos))
        out["attention"] = flat(y)

    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: hf_llama_ops.py IN.json OUT.json")
    main(sys.argv[1], sys.argv[2])
