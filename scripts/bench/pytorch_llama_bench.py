#!/usr/bin/env python3
"""PyTorch side of the CPU Llama training benchmark (trainrun vs PyTorch, same
model, same threads, same machine; scripts/bench/cpu_vs_pytorch.sh).

  pytorch_llama_bench.py --threads N [--mode eager|sdpa|compile]
                         [--layers 4 --heads 8 --kv-heads 2 --embd 256 --ffn 704
                          --vocab 4096 --seq 256 --batch 8 --steps 20 --warmup 3]
                         [--grad-clip 1.0] [--seed 0]

Prints exactly one line on stdout:
  pytorch tokens_per_sec=<float> threads=<N> ms_per_step=<float> mode=<mode> torch=<version>
(median over the timed steps; details go to stderr).

The model is trainrun's Llama (core/model/llama/): token embedding, L
pre-RMSNorm blocks (fused q|k|v projection, RoPE in HF's rotate_half form,
theta 5e5, causal grouped-query attention, output projection; RMSNorm, fused
gate|up projection, SwiGLU, down projection), final RMSNorm, untied LM head,
no biases, mean cross-entropy. One step is what trainrun's step does: zero
grads, forward, backward, global grad-norm clip (1.0), AdamW with decay on
2-D weights only.

Modes (each the best PyTorch offers for it):
  eager    attention written out (q k^T, mask, softmax, P v) with the KV heads
           repeated (HF's repeat_kv); the only choice on torch 1.13.
  sdpa     F.scaled_dot_product_attention(is_causal=True), GQA through
           enable_gqa=True where the version has it (2.5+), else repeat_kv;
           F.rms_norm where it exists (2.4+).
  compile  sdpa's model under torch.compile (inductor; the first warmup step
           compiles, which is why --warmup must be >= 2 for it).
AdamW: fused=True where the CPU supports it (torch 2.4+), else the per-tensor
loop (foreach=False, measured faster than foreach on 1.13 here; see
pytorch_gpt2_bench.py).
"""
import argparse
import math
import os
import sys

# torch is imported in main(), after OPENBLAS_NUM_THREADS is set (see there).


def build_model(torch, args, mode):
    nn, F = torch.nn, torch.nn.functional
    C, NH, NKV, HS, FF = args.embd, args.heads, args.kv_heads, args.embd // args.heads, args.ffn
    R = NH // NKV
    use_sdpa = mode in ("sdpa", "compile") and hasattr(F, "scaled_dot_product_attention")
    gqa_kw = False
    if use_sdpa:  # a builtin: no signature to inspect, so try it on a tiny input
        try:
            F.scaled_dot_product_attention(torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2),
                                           enable_gqa=True)
            gqa_kw = True
        except (TypeError, RuntimeError):
            pass
    has_rms_norm = mode != "eager" and hasattr(F, "rms_norm")
    eps = 1e-5

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):
            if has_rms_norm:
                return F.rms_norm(x, (C,), self.weight, eps)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    # RoPE tables (T, HS): HF's cos/sin with each frequency over both halves.
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HS, 2, dtype=torch.float32) / HS))
    ang = torch.outer(torch.arange(args.seq, dtype=torch.float32), inv_freq)
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos(), ang.sin()

    def rotate_half(x):
        x1, x2 = x[..., : HS // 2], x[..., HS // 2:]
        return torch.cat([-x2, x1], dim=-1)

    def repeat_kv(x):  # (B, NKV, T, HS) -> (B, NH, T, HS)
        B, _, T, _ = x.shape
        return x[:, :, None].expand(B, NKV, R, T, HS).reshape(B, NH, T, HS)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(C, (NH + 2 * NKV) * HS, bias=False)
            self.o = nn.Linear(C, C, bias=False)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            self.register_buffer("mask", torch.ones(args.seq, args.seq, dtype=torch.bool).tril(), persistent=False)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).split([NH * HS, NKV * HS, NKV * HS], dim=2)
            q = q.view(B, T, NH, HS).transpose(1, 2)
            k = k.view(B, T, NKV, HS).transpose(1, 2)
            v = v.view(B, T, NKV, HS).transpose(1, 2)
            c, s = self.cos[:T], self.sin[:T]
            q = q * c + rotate_half(q) * s
            k = k * c + rotate_half(k) * s
            if use_sdpa:
                if gqa_kw:
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    y = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), is_causal=True)
            else:
                k, v = repeat_kv(k), repeat_kv(v)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
                att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
                y = F.softmax(att, dim=-1) @ v
            return self.o(y.transpose(1, 2).reshape(B, T, C))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Linear(C, 2 * FF, bias=False)
            self.down = nn.Linear(FF, C, bias=False)

        def forward(self, x):
            g, u = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(g) * u)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn, self.ln2, self.mlp = RMSNorm(), Attention(), RMSNorm(), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, C)
            self.blocks = nn.ModuleList([Block() for _ in range(args.layers)])
            self.norm = RMSNorm()
            self.lm_head = nn.Linear(C, args.vocab, bias=False)

        def forward(self, idx, targets):
            x = self.embed(idx)
            for b in self.blocks:
                x = b(x)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    model = Llama()
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * args.layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model, dict(sdpa=use_sdpa, enable_gqa=gqa_kw, rms_norm=has_rms_norm)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--mode", choices=("eager", "sdpa", "compile"), default="sdpa")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, allocator, thread pool)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global L2 norm clip; 0 = off")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--threads and --steps must be >= 1, --warmup >= 0")
    if args.embd % args.heads or args.heads % args.kv_heads or (args.embd // args.heads) % 2:
        ap.error("--heads must divide --embd, --kv-heads must divide --heads, and the head size must be even")
    if args.mode == "compile" and args.warmup < 2:
        ap.error("--mode compile needs --warmup >= 2 (the first steps compile)")

    # Thread and seed setup: torch_bench_common (shared with the GPT-2 side).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_bench_common as common
    torch = common.import_torch(args.threads, args.seed)
    if args.mode != "eager" and not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        print(f"pytorch: torch {torch.__version__} has no scaled_dot_product_attention; --mode {args.mode} "
              "needs torch 2.x (use --mode eager)", file=sys.stderr)
        return 2
    if args.mode == "compile" and not hasattr(torch, "compile"):
        print(f"pytorch: torch {torch.__version__} has no torch.compile (needs 2.x)", file=sys.stderr)
        return 2

    model, how = build_model(torch, args, args.mode)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    fused = common.has_fused_cpu_adamw(torch)
    opt = torch.optim.AdamW(groups, fused=True, **kw) if fused else torch.optim.AdamW(groups, foreach=False, **kw)
    step_model = torch.compile(model) if args.mode == "compile" else model

    times, losses, t_first = common.time_steps(torch, args, model, opt, step_model)

    nparams = sum(p.numel() for p in model.parameters())
    print(f"pytorch llama: torch {torch.__version__}, mode {args.mode} ({how}), {nparams} params, "
          f"B={args.batch} T={args.seq}, threads={torch.get_num_threads()}, adamw fused={fused}; first step "
          f"{1e3 * t_first:.0f} ms; {common.step_summary(times, losses)}", file=sys.stderr)
    print(common.result_line(torch, args, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
