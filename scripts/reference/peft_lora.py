#!/usr/bin/env python3
"""Hugging Face peft as the peer of trainrun's LoRA adapters (core/model/adapter).

  peft_lora.py make --arch llama|gpt2|qwen2 --out DIR --r R --alpha A --targets q_proj,v_proj [--seed S] [--dora]
                    [--kv-heads K] [--layers L] [--width C --ffn F]
                    [--base-dtype nf4|bf16]
      DIR/base: a small random model (every parameter perturbed, norm gains
      around 1) saved with save_pretrained; DIR/adapter: a peft LoRA adapter
      on it (get_peft_model + LoraConfig), its A and B both set to visible
      random values (peft starts B at zero, which would leave every A
      gradient zero and hide mistakes), saved with PeftModel.save_pretrained.
      --dora: LoraConfig(use_dora=True); DIR/dora_init.safetensors holds the
      magnitudes peft initialised ('<file name>': ||W|| per output row, B
      still zero), then each magnitude is moved off ||W + s B A|| (scaled by
      1 + 0.2 N(0,1)), so g = m / ||.|| is not 1 and the (g - 1) term counts.
      --kv-heads: the Llama's key/value heads (default 2 of its 4 query heads;
      1 makes tensor parallelism at 2 ranks replicate the KV head).
      --width / --ffn: n_embd (default 32) and the Llama's MLP width (default
      48; GPT-2's is 4 x n_embd): NF4 under tensor parallelism needs each
      rank's slice to be whole 64-blocks (e.g. --width 128 --ffn 256 at tp2).
      --base-dtype nf4: also DIR/base_nf4, the base with every block linear's
      weight replaced by its NF4 round trip (nf4_reference.py's quantize and
      dequantize, bitsandbytes' quantize_4bit(blocksize=64,
      compress_statistics=True, nf4) on the nn.Linear-shaped (out, in)
      weight: GPT-2's Conv1D weights, (in, out) in the file, are transposed
      before and after), the rest untouched: what QLoRA's Linear4bit
      computes with. --base-dtype bf16: DIR/base_bf16, every parameter
      rounded to bf16 (torch's round to nearest even) and back to fp32.

  peft_lora.py grads --base DIR --adapter DIR --batch BATCH.safetensors --out OUT.safetensors
      PeftModel.from_pretrained(base, adapter, is_trainable=True) in fp32;
      one forward on BATCH's int32 'inputs' (B,T), the mean cross-entropy
      against its 'targets' (no shift) and a backward. OUT: 'logits'
      (B,T,V), 'loss' (1) and 'grad.<name>' for every adapter tensor, named
      as in adapter_model.safetensors.

  peft_lora.py logits --base DIR --adapter DIR --batch BATCH --out OUT
      The adapted model's logits (PeftModel.from_pretrained, unmerged).

  peft_lora.py merge --base DIR --adapter DIR --out DIR
      merge_and_unload() saved with save_pretrained (safetensors).

Offline, with the repo's .venv python (transformers 4.44.2, peft 0.12.0, torch 1.13).
"""
import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# nf4_reference's dynamic map is torch.linspace's on AVX2 (its docstring); set before torch loads.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402


def random_base(arch, seed, layers=2, kv_heads=2, width=32, ffn=48):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=61, hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=16,
                          rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                          mlp_bias=False, hidden_act="silu", torch_dtype="float32")
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":  # Llama's shape with q/k/v biases (perturbed below with the rest)
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=61, hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=16,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                          use_sliding_window=False, hidden_act="silu", torch_dtype="float32")
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = GPT2Config(n_layer=layers, n_head=4, n_embd=width, vocab_size=61, n_positions=16,
                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         layer_norm_epsilon=1e-5)
        model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if ("norm" in name or ".ln_" in name) and name.endswith("weight") else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return model


def round_trip_base(model, dtype):
    """The base as trainrun holds it under model.base_dtype `dtype` (see make --base-dtype)."""
    from transformers.pytorch_utils import Conv1D
    with torch.no_grad():
        if dtype == "bf16":
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
            return
        import nf4_reference
        quantized = 0
        for name, mod in model.named_modules():
            # Linear4bit replaces the linears inside the blocks; lm_head stays (transformers skips it).
            if not (isinstance(mod, (torch.nn.Linear, Conv1D)) and (".layers." in name or ".h." in name)):
                continue
            w = mod.weight.t() if isinstance(mod, Conv1D) else mod.weight  # (out, in)
            deq = nf4_reference.quantize(w.contiguous().numpy().reshape(-1))[4]
            new = torch.from_numpy(deq.copy()).reshape(w.shape)
            mod.weight.copy_(new.t() if isinstance(mod, Conv1D) else new)
            quantized += 1
        assert quantized > 0, "no block linear found to quantize"


def load_adapted(base, adapter, trainable):
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable)
    model.eval()  # no dropout anywhere (lora_dropout is 0 in these tests)
    return model


def file_name(param_name):
    # named_parameters: ...q_proj.lora_A.default.weight; the file drops the adapter name,
    # and DoRA's ...lora_magnitude_vector.default.weight is saved as ...lora_magnitude_vector.
    return param_name.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector").replace(".default", "")


def cmd_make(a):
    model = random_base(a.arch, a.seed, a.layers, a.kv_heads, a.width, a.ffn)
    model.save_pretrained(os.path.join(a.out, "base"), safe_serialization=True)
    if a.base_dtype:
        rounded = random_base(a.arch, a.seed, a.layers, a.kv_heads, a.width, a.ffn)
        round_trip_base(rounded, a.base_dtype)
        rounded.save_pretrained(os.path.join(a.out, "base_" + a.base_dtype), safe_serialization=True)
    cfg = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=a.targets.split(","),
                     bias="none", task_type="CAUSAL_LM", fan_in_fan_out=(a.arch == "gpt2"), use_dora=a.dora)
    peft_model = get_peft_model(model, cfg)
    if a.dora:
        save_file({file_name(n): p.detach().clone().contiguous() for n, p in peft_model.named_parameters()
                   if "lora_magnitude_vector" in n}, os.path.join(a.out, "dora_init.safetensors"))
    torch.manual_seed(a.seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
            elif "lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
    peft_model.save_pretrained(os.path.join(a.out, "adapter"), safe_serialization=True)
    return 0


def cmd_grads(a):
    model = load_adapted(a.base, a.adapter, True)
    batch = load_file(a.batch)
    inputs, targets = batch["inputs"].to(torch.long), batch["targets"].to(torch.long)
    logits = model(input_ids=inputs).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    ref = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        if p.requires_grad:
            ref["grad." + file_name(name)] = p.grad.detach().float().contiguous()
    save_file(ref, a.out)
    return 0


def cmd_logits(a):
    model = load_adapted(a.base, a.adapter, False)
    with torch.no_grad():
        logits = model(input_ids=load_file(a.batch)["inputs"].to(torch.long)).logits
    save_file({"logits": logits.float().contiguous()}, a.out)
    return 0


def cmd_merge(a):
    model = load_adapted(a.base, a.adapter, False).merge_and_unload()
    model.save_pretrained(a.out, safe_serialization=True)
    if a.generate is not None:
        # Greedy generate from the saved merged model, as hf_llama.py /
        # hf_gpt2.py 'generate' does, in this process (one Python start less).
        hf_logging.set_verbosity_error()
        merged, info = AutoModelForCausalLM.from_pretrained(a.out, local_files_only=True, output_loading_info=True,
                                                            torch_dtype=torch.float32)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            print(f"from_pretrained({a.out}) did not load cleanly: {problems}", file=sys.stderr)
            return 1
        merged.eval()
        ids = torch.tensor([[int(t) for t in a.generate.split()]], dtype=torch.long)
        with torch.no_grad():
            out = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens,
                                  min_new_tokens=a.max_new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        print(" ".join(str(int(t)) for t in out[0].tolist()))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--arch", choices=["llama", "gpt2", "qwen2"], required=True)
    mk.add_argument("--out", required=True)
    mk.add_argument("--r", type=int, required=True)
    mk.add_argument("--alpha", type=float, required=True)
    mk.add_argument("--targets", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dora", action="store_true")
    mk.add_argument("--kv-heads", type=int, default=2)
    mk.add_argument("--base-dtype", choices=["nf4", "bf16"], default=None)
    mk.add_argument("--layers", type=int, default=2)  # the interleaved pipeline tests need 4
    mk.add_argument("--width", type=int, default=32)
    mk.add_argument("--ffn", type=int, default=48)
    for name in ("grads", "logits"):
        s = sub.add_parser(name)
        s.add_argument("--base", required=True)
        s.add_argument("--adapter", required=True)
        s.add_argument("--batch", required=True)
        s.add_argument("--out", required=True)
    mg = sub.add_parser("merge")
    mg.add_argument("--base", required=True)
    mg.add_argument("--adapter", required=True)
    mg.add_argument("--out", required=True)
    mg.add_argument("--generate", default=None, help="a prompt (token ids): print the merged model's greedy continuation")
    mg.add_argument("--max-new-tokens", type=int, default=8)
    a = p.parse_args(argv)
    return {"make": cmd_make, "grads": cmd_grads, "logits": cmd_logits, "merge": cmd_merge}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
