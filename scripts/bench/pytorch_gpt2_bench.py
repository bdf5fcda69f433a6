#!/usr/bin/env python3
"""PyTorch side of the CPU training benchmark (trainrun vs PyTorch, same
model, same threads, same machine).

  pytorch_gpt2_bench.py --threads N [--layers 4 --heads 4 --embd 256 --vocab 4096
                        --seq 256 --batch 8 --steps 20 --warmup 3]
                        [--grad-clip 1.0] [--foreach 1] [--seed 0] [--mode eager|sdpa|compile]

Prints exactly one line on stdout:
  pytorch tokens_per_sec=<float> threads=<N> ms_per_step=<float> mode=<mode> torch=<version>
(median over the timed steps; details go to stderr). One step is what
trainrun's training step does: zero grads, forward, backward, global grad-norm
clip (trainrun's default 1.0; --grad-clip 0 turns it off), AdamW update with
decay on 2-D weights only.

The model is gpt2_ref.GPT2 (scripts/reference/gpt2_ref.py), i.e. exactly the
model the C++ backend is checked against. Runs with /usr/bin/python3
(torch 1.13: --mode eager only) or a torch 2.x venv (cpu_vs_pytorch.sh makes
one), whose best settings are the other two modes:
  eager    gpt2_ref's attention as written (q k^T, mask, softmax, P v);
  sdpa     the same model with F.scaled_dot_product_attention(is_causal=True);
  compile  sdpa's model under torch.compile (the first warmup step compiles);
and, on 2.4+, AdamW(fused=True) (the CPU fused kernel) instead of --foreach.
"""
import argparse
import os
import sys

# torch is imported in main(), after OPENBLAS_NUM_THREADS is set (see there).


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, thread pool warm-up)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global L2 norm clip; 0 = off")
    # torch 1.13's AdamW has no `fused` argument (it is always the non-fused
    # path). foreach=False (per-tensor in-place ops) measured faster than the
    # multi-tensor foreach path on CPU here (optimizer step alone, 1 thread,
    # this model: ~15 ms vs ~20-60 ms), so it is the default; 1 selects foreach.
    ap.add_argument("--foreach", type=int, default=0, choices=(0, 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=("eager", "sdpa", "compile"), default="eager")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--threads and --steps must be >= 1, --warmup >= 0")

    # The thread and seed setup is torch_bench_common's (shared with the Llama side).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_bench_common as common
    torch = common.import_torch(args.threads, args.seed)
    import torch.nn.functional as F
    if args.mode != "eager" and not hasattr(F, "scaled_dot_product_attention"):
        print(f"pytorch: torch {torch.__version__} has no scaled_dot_product_attention; --mode {args.mode} "
              "needs torch 2.x (use --mode eager)", file=sys.stderr)
        return 2
    if args.mode == "compile" and args.warmup < 2:
        ap.error("--mode compile needs --warmup >= 2 (the first steps compile)")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import gpt2_ref

    if args.mode != "eager":
        # The same projections and head split as gpt2_ref.CausalSelfAttention,
        # with the fused attention kernel in place of the written-out one.
        def sdpa_forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        gpt2_ref.CausalSelfAttention.forward = sdpa_forward

    model = gpt2_ref.GPT2(n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
                          vocab_size=args.vocab, seq_len=args.seq).init_random(seed=args.seed)
    # trainrun's TrainSpec defaults (lr does not affect speed).
    fused = common.has_fused_cpu_adamw(torch)
    if fused:
        decay, no_decay = gpt2_ref.decay_groups(model)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    else:
        opt = gpt2_ref.make_adamw(model, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                  foreach=bool(args.foreach))
    step_model = torch.compile(model) if args.mode == "compile" else model

    times, losses, _ = common.time_steps(torch, args, model, opt, lambda x, y: step_model(x, y)[1])

    nparams = sum(p.numel() for p in model.parameters())
    print(f"pytorch gpt2: torch {torch.__version__}, mode {args.mode}, adamw fused={fused}, {nparams} params, B={args.batch} T={args.seq}, "
          f"threads={torch.get_num_threads()} interop={torch.get_num_interop_threads()}, foreach={bool(args.foreach)}, "
          f"grad_clip={args.grad_clip}; {common.step_summary(times, losses)}", file=sys.stderr)
    print(common.result_line(torch, args, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
