#!/usr/bin/env python3
"""PyTorch side of the CPU training benchmark (trainrun vs PyTorch, same
model, same threads, same machine).

  pytorch_gpt2_bench.py --threads N [--layers 4 --heads 4 --embd 256 --vocab 4096
                        --seq 256 --batch 8 --steps 20 --warmup 3]
                        [--grad-clip 1.0] [--foreach 1] [--seed 0]

Prints exactly one line on stdout:
  pytorch tokens_per_sec=<float> threads=<N> ms_per_step=<float>
(median over the timed steps; details go to stderr). One step is what
trainrun's training step does: zero grads, forward, backward, global grad-norm
clip (trainrun's default 1.0; --grad-clip 0 turns it off), AdamW update with
decay on 2-D weights only.

The model is gpt2_ref.GPT2 (scripts/reference/gpt2_ref.py), i.e. exactly the
model the C++ backend is checked against. Runs with /usr/bin/python3.
"""
import argparse
import os
import statistics
import sys
import time

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
    args = ap.parse_args(argv)
    if args.threads < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--threads and --steps must be >= 1, --warmup >= 0")

    # Debian's torch does its GEMMs through libblas.so.3, which is OpenBLAS
    # (pthread build by default) with its own thread pool that
    # torch.set_num_threads does not control (torch was built with
    # BLAS_INFO=generic). Left alone it starts one thread per core on top of
    # torch's N OpenMP threads; pin it to N before torch loads the library.
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import gpt2_ref

    # PyTorch's best CPU settings, so the comparison is fair:
    # - set_num_threads(N): intra-op (OpenMP) threads, the same N trainrun gets.
    # - set_num_interop_threads(1): eager training has no inter-op parallelism
    #   to exploit; extra pools only compete for the N cores. Must be called
    #   before any parallel work starts, hence first.
    # - autograd anomaly detection off (the default; stated explicitly, it is
    #   very slow when on).
    # - model.train(): the mode a training step runs in (there is no dropout,
    #   so it costs nothing).
    # - zero_grad(set_to_none=True): no memset of the grads every step.
    torch.set_num_interop_threads(1)
    torch.set_num_threads(args.threads)
    torch.autograd.set_detect_anomaly(False)
    torch.manual_seed(args.seed)

    model = gpt2_ref.GPT2(n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
                          vocab_size=args.vocab, seq_len=args.seq).init_random(seed=args.seed)
    model.train()
    # trainrun's TrainSpec defaults (lr does not affect speed).
    opt = gpt2_ref.make_adamw(model, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              foreach=bool(args.foreach))

    # Random batches, made before timing so only the training step is measured.
    n = args.warmup + args.steps
    g = torch.Generator().manual_seed(args.seed + 1)
    xs = torch.randint(0, args.vocab, (n, args.batch, args.seq), generator=g)
    ys = torch.randint(0, args.vocab, (n, args.batch, args.seq), generator=g)

    times, losses = [], []
    for i in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(xs[i], ys[i])
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        losses.append(loss.item())  # .item() also makes sure the step is finished
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)

    med = statistics.median(times)
    tokens = args.batch * args.seq
    nparams = sum(p.numel() for p in model.parameters())
    print(f"pytorch: torch {torch.__version__}, {nparams} params, B={args.batch} T={args.seq}, "
          f"threads={torch.get_num_threads()} interop={torch.get_num_interop_threads()}, foreach={bool(args.foreach)}, "
          f"grad_clip={args.grad_clip}; step ms min/median/max {1e3 * min(times):.1f}/{1e3 * med:.1f}/"
          f"{1e3 * max(times):.1f}; loss {losses[0]:.4f} -> {losses[-1]:.4f}", file=sys.stderr)
    print(f"pytorch tokens_per_sec={tokens / med:.1f} threads={args.threads} ms_per_step={1e3 * med:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
