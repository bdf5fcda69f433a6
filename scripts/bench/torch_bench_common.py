"""What the PyTorch sides of the CPU training benchmarks share
(pytorch_gpt2_bench.py, pytorch_llama_bench.py): the thread setup, the AdamW
choice and the timed step loop, so both models are measured the same way.
"""
import os
import re
import statistics
import time


def import_torch(threads, seed):
    """Imports torch with PyTorch's best CPU settings for an N-thread
    comparison and returns the module.

    Debian's torch does its GEMMs through libblas.so.3, which is OpenBLAS
    (pthread build by default) with its own thread pool that
    torch.set_num_threads does not control (torch was built with
    BLAS_INFO=generic). Left alone it starts one thread per core on top of
    torch's N OpenMP threads, so it is pinned to N before torch loads it.
    - set_num_interop_threads(1): eager training has no inter-op parallelism
      to exploit; extra pools only compete for the N cores. It must be called
      before any parallel work starts, hence first.
    - set_num_threads(N): intra-op (OpenMP) threads, the same N trainrun gets.
    - autograd anomaly detection off (the default; stated, it is very slow).
    """
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    import torch
    torch.set_num_interop_threads(1)
    torch.set_num_threads(threads)
    torch.autograd.set_detect_anomaly(False)
    torch.manual_seed(seed)
    return torch


def has_fused_cpu_adamw(torch):
    """The fused CPU AdamW came in 2.4 (1.13 has no `fused`; 2.0-2.3 accept it
    for CUDA only)."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    return (major, minor) >= (2, 4)


def time_steps(torch, args, model, opt, loss_of):
    """Runs args.warmup + args.steps training steps on random batches made
    before timing, and returns (times of the timed steps, every loss, the
    first step's time). One step is what trainrun's step does: zero grads
    (set_to_none: no memset), forward, backward, global grad-norm clip
    (args.grad_clip; 0 = off), AdamW update. loss_of(x, y) returns the scalar
    loss of one batch."""
    n = args.warmup + args.steps
    g = torch.Generator().manual_seed(args.seed + 1)
    xs = torch.randint(0, args.vocab, (n, args.batch, args.seq), generator=g)
    ys = torch.randint(0, args.vocab, (n, args.batch, args.seq), generator=g)
    model.train()  # the mode a training step runs in (no dropout: costs nothing)
    times, losses, t_first = [], [], None
    for i in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(xs[i], ys[i])
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        losses.append(loss.item())  # .item() also makes sure the step is finished
        dt = time.perf_counter() - t0
        if i == 0:
            t_first = dt
        if i >= args.warmup:
            times.append(dt)
    return times, losses, t_first


def step_summary(times, losses):
    """The stderr detail both benchmarks print: min/median/max and the loss."""
    med = statistics.median(times)
    return (f"step ms min/median/max {1e3 * min(times):.1f}/{1e3 * med:.1f}/{1e3 * max(times):.1f}; "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


def result_line(torch, args, times):
    """The one stdout line cpu_vs_pytorch.sh parses (median over the timed steps)."""
    med = statistics.median(times)
    return (f"pytorch tokens_per_sec={args.batch * args.seq / med:.1f} threads={args.threads} "
            f"ms_per_step={1e3 * med:.3f} mode={args.mode} torch={torch.__version__}")
