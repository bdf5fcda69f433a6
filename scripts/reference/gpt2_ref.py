#!/usr/bin/env python3
"""PyTorch reference of trainrun's GPT-2, used to check the C++ model.

The model is exactly core/model/gpt2/gpt2.h: token + learned position embeddings,
L pre-LayerNorm blocks (causal multi-head attention, GELU(tanh) MLP of width
4C), a final LayerNorm, an LM head tied to wte; LayerNorm eps 1e-5; loss =
mean cross-entropy over all B*T positions (over those whose target is not
-100, PyTorch's ignore_index, when some are masked). Parameter names and layouts are
HF GPT-2's with nn.Linear (out, in) weights, so named_parameters() of GPT2
below are exactly the safetensors names.

  gpt2_ref.py --weights W.safetensors --batch BATCH.safetensors --out OUT.safetensors
              [--adamw-steps K --lr LR --beta1 B1 --beta2 B2 --eps EPS
               --weight-decay WD --grad-clip CLIP] [--double]
  gpt2_ref.py --selftest [--double]

OUT holds: loss (1,), logits (B,T,V), grad.<name> for every parameter (at
the initial weights), adamw_losses (K,) (loss before each of K AdamW steps on
the same batch, so adamw_losses[0] == loss) and final.<name> (the weights
after the K steps, for pinpointing optimizer differences). All F32, computed
in fp32 or, with --double, in float64. __metadata__ records the config and the
optimizer settings used.

Runs with /usr/bin/python3 (Debian's torch 1.13) or the repo's .venv python.
It uses the `safetensors` package when importable and otherwise a small
built-in reader/writer (the format is simple), so the venv is not required.
"""
import argparse
import json
import math
import os
import struct
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-5

# ---- safetensors I/O ---------------------------------------------------------
# Prefer the real package; the fallback exists so the reference runs under
# plain /usr/bin/python3, where Debian ships torch but not safetensors.

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

try:
    from safetensors import safe_open as _safe_open
    from safetensors.torch import save_file as _st_save_file
    HAVE_SAFETENSORS = True
except ImportError:
    HAVE_SAFETENSORS = False


def _builtin_load(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: file too short")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError(f"{path}: header length {n} larger than the file")
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if e["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {e['dtype']}")
        b, end = e["data_offsets"]
        dt = _ST_DTYPES[e["dtype"]]
        buf = bytearray(data[b:end])
        t = torch.frombuffer(buf, dtype=dt) if len(buf) else torch.empty(0, dtype=dt)
        out[name] = t.reshape(e["shape"]).clone()
    return out, meta


def _builtin_save(tensors, path, metadata):
    header = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, off = [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))


def load_safetensors(path):
    """Returns ({name: tensor}, metadata dict)."""
    if not HAVE_SAFETENSORS:
        return _builtin_load(path)
    out = {}
    with _safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out, meta


def save_safetensors(tensors, path, metadata=None):
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    metadata = {k: str(v) for k, v in (metadata or {}).items()}
    if HAVE_SAFETENSORS:
        _st_save_file(tensors, path, metadata=metadata)
    else:
        _builtin_save(tensors, path, metadata)


# ---- the model -----------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, C, NH, max_T):
        super().__init__()
        assert C % NH == 0, f"n_embd {C} is not divisible by n_head {NH}"
        self.NH = NH
        self.c_attn = nn.Linear(C, 3 * C)  # q | k | v, in that column order
        self.c_proj = nn.Linear(C, C)
        # Precomputed so the mask is not rebuilt every forward (benchmark speed).
        self.register_buffer("mask", torch.ones(max_T, max_T, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        HS = C // self.NH
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.NH, HS).transpose(1, 2)  # (B, NH, T, HS)
        k = k.view(B, T, self.NH, HS).transpose(1, 2)
        v = v.view(B, T, self.NH, HS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        # GELU with the tanh approximation, as in GPT-2 (and llm.c).
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, NH, max_T):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=LN_EPS)
        self.attn = CausalSelfAttention(C, NH, max_T)
        self.ln_2 = nn.LayerNorm(C, eps=LN_EPS)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """named_parameters() gives the external names: transformer.wte.weight, ...
    The LM head has no parameter of its own: logits = ln_f(x) @ wte^T."""

    def __init__(self, n_layer, n_head, n_embd, vocab_size, seq_len):
        super().__init__()
        self.config = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, seq_len=seq_len)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(seq_len, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, seq_len) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, eps=LN_EPS),
        ))

    def forward(self, idx, targets=None):
        B, T = idx.shape
        maxT = self.config["seq_len"]
        assert T <= maxT, f"sequence length {T} exceeds the position table ({maxT})"
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = F.linear(x, self.transformer.wte.weight)  # tied head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def init_random(self, std=0.02, seed=0):
        """GPT-2-like init, for self-tests and benchmarks. LayerNorm weights
        and biases are perturbed too, so tests exercise them (all-ones/zeros
        would hide transposition bugs)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
                else:
                    p.copy_(std * torch.randn(p.shape, generator=g, dtype=torch.float64))
        return self


def decay_groups(model):
    """AdamW groups: decay every 2-D weight (wte, wpe, Linear weights), not the
    biases or LayerNorm parameters. named_parameters() yields the tied wte once."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    return decay, no_decay


def make_adamw(model, lr, beta1, beta2, eps, weight_decay, foreach=None):
    decay, no_decay = decay_groups(model)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(beta1, beta2), eps=eps, foreach=foreach)


# ---- loading ------------------------------------------------------------------

def model_from_safetensors(path, dtype):
    tensors, meta = load_safetensors(path)
    try:
        cfg = {k: int(meta[k]) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "seq_len")}
    except KeyError as e:
        sys.exit(f"gpt2_ref: {path}: __metadata__ lacks {e} (need n_layer, n_head, n_embd, vocab_size, seq_len)")
    model = GPT2(**cfg).to(dtype)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        sys.exit(f"gpt2_ref: {path}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                 f"unexpected tensors {extra[:5]}{'...' if len(extra) > 5 else ''}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                sys.exit(f"gpt2_ref: {path}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)} "
                         f"for config {cfg}")
            p.copy_(t.to(dtype))
    return model


def load_batch(path, vocab_size, seq_len):
    tensors, _ = load_safetensors(path)
    for k in ("inputs", "targets"):
        if k not in tensors:
            sys.exit(f"gpt2_ref: {path}: missing int32 tensor '{k}' (B,T)")
    x, y = tensors["inputs"].long(), tensors["targets"].long()
    if x.dim() != 2 or x.shape != y.shape:
        sys.exit(f"gpt2_ref: {path}: inputs {tuple(x.shape)} and targets {tuple(y.shape)} must both be (B,T)")
    if x.shape[1] > seq_len:
        sys.exit(f"gpt2_ref: {path}: T={x.shape[1]} exceeds the model's seq_len {seq_len}")
    for k, t in (("inputs", x), ("targets", y)):
        # A target of -100 is a masked label (F.cross_entropy's ignore_index):
        # the loss is the mean over the others, as SFT with loss masks.
        valid = t[t != -100] if k == "targets" else t
        if valid.numel() and (valid.min() < 0 or valid.max() >= vocab_size):
            sys.exit(f"gpt2_ref: {path}: {k} has token ids outside [0, {vocab_size})"
                     + (" (or -100, a masked target)" if k == "targets" else ""))
    return x, y


# ---- the reference run ------------------------------------------------------------

def reference(model, x, y, steps, lr, beta1, beta2, eps, weight_decay, grad_clip):
    """Returns dict of output tensors (in the model's dtype)."""
    model.train()  # no dropout anywhere, so train/eval give the same math
    out = {}
    logits, loss = model(x, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    out["loss"] = loss.detach().reshape(1)
    out["logits"] = logits.detach()
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().clone()

    # K AdamW steps on the same batch; loss recorded before each update.
    # clip_grad_norm_ scales by max_norm / (total_norm + 1e-6) when that is < 1.
    opt = make_adamw(model, lr, beta1, beta2, eps, weight_decay)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
    out["adamw_losses"] = torch.stack(losses) if losses else torch.zeros(0, dtype=out["loss"].dtype)
    if steps > 0:
        for name, p in model.named_parameters():
            out["final." + name] = p.detach().clone()
    return out


def run(args):
    dtype = torch.float64 if args.double else torch.float32
    model = model_from_safetensors(args.weights, dtype)
    x, y = load_batch(args.batch, model.config["vocab_size"], model.config["seq_len"])
    out = reference(model, x, y, args.adamw_steps, args.lr, args.beta1, args.beta2, args.eps,
                    args.weight_decay, args.grad_clip)
    meta = dict(model.config)
    meta.update(compute_dtype="float64" if args.double else "float32", adamw_steps=args.adamw_steps, lr=repr(args.lr),
                beta1=repr(args.beta1), beta2=repr(args.beta2), eps=repr(args.eps),
                weight_decay=repr(args.weight_decay), grad_clip=repr(args.grad_clip), torch=torch.__version__)
    save_safetensors({k: v.float() for k, v in out.items()}, args.out, meta)
    print(f"gpt2_ref: loss={out['loss'].item():.6f} B={x.shape[0]} T={x.shape[1]} "
          f"adamw_steps={args.adamw_steps} -> {args.out}")


# ---- self-test ------------------------------------------------------------------------

def naive_forward(W, cfg, idx, targets):
    """The spec written out with explicit loops over positions and heads, no
    nn modules: an independent check of the module-based forward (q|k|v
    column split, head split, causal mask, LN, GELU-tanh, tied head)."""
    C, NH, L = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
    HS = C // NH

    def ln(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)  # biased variance
        return (x - mu) / torch.sqrt(var + LN_EPS) * w + b

    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    B, T = idx.shape
    logits = torch.zeros(B, T, cfg["vocab_size"], dtype=torch.float64)
    for b in range(B):
        x = torch.stack([W["transformer.wte.weight"][idx[b, t]] + W["transformer.wpe.weight"][t] for t in range(T)])
        for l in range(L):
            P = lambda n: W[f"transformer.h.{l}.{n}"]  # noqa: E731
            h = ln(x, P("ln_1.weight"), P("ln_1.bias"))
            qkv = h @ P("attn.c_attn.weight").T + P("attn.c_attn.bias")
            y = torch.zeros(T, C, dtype=torch.float64)
            for hd in range(NH):
                cols = slice(hd * HS, (hd + 1) * HS)
                q, k, v = qkv[:, 0:C][:, cols], qkv[:, C:2 * C][:, cols], qkv[:, 2 * C:3 * C][:, cols]
                for t in range(T):
                    s = torch.stack([q[t] @ k[u] / math.sqrt(HS) for u in range(t + 1)])
                    a = torch.exp(s - s.max())
                    a = a / a.sum()
                    y[t, cols] = sum(a[u] * v[u] for u in range(t + 1))
            x = x + y @ P("attn.c_proj.weight").T + P("attn.c_proj.bias")
            h = ln(x, P("ln_2.weight"), P("ln_2.bias"))
            x = x + gelu(h @ P("mlp.c_fc.weight").T + P("mlp.c_fc.bias")) @ P("mlp.c_proj.weight").T + P("mlp.c_proj.bias")
        x = ln(x, W["transformer.ln_f.weight"], W["transformer.ln_f.bias"])
        logits[b] = x @ W["transformer.wte.weight"].T
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logits, nll.mean()


def selftest(args):
    """Builds a small random model, round-trips it through safetensors and the
    CLI path, and checks: (1) autograd gradients against central finite
    differences in float64 (wte covers the tied head), (2) the optimizer loop
    against a hand-written AdamW (decay on 2-D weights incl. wpe, not on
    biases/LN; bias correction; clipping with torch's 1e-6), (3) the built-in
    safetensors fallback against the package when both exist."""
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=37, seq_len=12)
    B, T = 3, 10  # T < seq_len: the unused wpe rows must get zero gradient
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as d:
        model = GPT2(**cfg).init_random(std=0.1, seed=1)
        wpath, bpath, opath = (os.path.join(d, n) for n in ("w.safetensors", "b.safetensors", "o.safetensors"))
        save_safetensors({k: v for k, v in model.state_dict().items()}, wpath, cfg)
        g = torch.Generator().manual_seed(2)
        x = torch.randint(0, cfg["vocab_size"], (B, T), generator=g, dtype=torch.int32)
        y = torch.randint(0, cfg["vocab_size"], (B, T), generator=g, dtype=torch.int32)
        save_safetensors({"inputs": x, "targets": y}, bpath)

        if HAVE_SAFETENSORS:
            t1, m1 = load_safetensors(wpath)
            t2, m2 = _builtin_load(wpath)
            check(m1 == m2 and all(torch.equal(t1[k], t2[k]) for k in t1) and t1.keys() == t2.keys(),
                  "built-in safetensors reader matches the package")
            _builtin_save(t1, os.path.join(d, "b2.safetensors"), m1)
            t3, m3 = load_safetensors(os.path.join(d, "b2.safetensors"))
            check(m3 == m1 and all(torch.equal(t1[k], t3[k]) for k in t1), "package reads the built-in writer's file")

        # (0) the forward against the spec written out naively, in float64.
        m64 = model_from_safetensors(wpath, torch.float64)
        xl, yl = load_batch(bpath, cfg["vocab_size"], cfg["seq_len"])
        W = {n: p.detach() for n, p in m64.named_parameters()}
        nlogits, nloss = naive_forward(W, cfg, xl, yl)
        logits, loss = m64(xl, yl)
        diff = float((logits.detach() - nlogits).abs().max())
        check(diff < 1e-12 and abs(loss.item() - nloss.item()) < 1e-12,
              f"forward matches the naive loop implementation (max logit diff {diff:.1e})")

        # (1) gradients vs finite differences, in float64.
        m64.zero_grad(set_to_none=True)
        loss.backward()
        params = dict(m64.named_parameters())
        h = 1e-6
        probes = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                  "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias",
                  "transformer.h.1.attn.c_proj.weight", "transformer.h.1.mlp.c_fc.weight",
                  "transformer.h.1.mlp.c_proj.bias", "transformer.ln_f.weight", "transformer.ln_f.bias"]
        worst = biggest = 0.0
        for pi, name in enumerate(probes):
            p = params[name]
            flat = p.data.view(-1)
            gi = torch.Generator().manual_seed(100 + pi)  # fixed probes (hash() is salted per process)
            for i in torch.randint(0, flat.numel(), (4,), generator=gi).tolist():
                old = flat[i].item()
                with torch.no_grad():
                    flat[i] = old + h
                    lp = m64(xl, yl)[1].item()
                    flat[i] = old - h
                    lm = m64(xl, yl)[1].item()
                    flat[i] = old
                fd = (lp - lm) / (2 * h)
                ag = p.grad.view(-1)[i].item()
                # Central differences in float64 are good to ~1e-9 absolute;
                # the 1e-4 floor keeps near-zero gradients from dominating.
                worst = max(worst, abs(fd - ag) / max(1e-4, abs(ag)))
                biggest = max(biggest, abs(ag))
        check(worst < 1e-5 and biggest > 1e-3,
              f"autograd vs finite differences, 4 entries of each of {len(probes)} params "
              f"(worst rel err {worst:.1e}, largest |grad| {biggest:.1e})")
        check(torch.all(params["transformer.wpe.weight"].grad[T:] == 0).item(), "unused wpe rows get zero gradient")

        # (2) the CLI path and the optimizer against a hand-written AdamW.
        hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=0.05)
        steps = 4
        ns = argparse.Namespace(weights=wpath, batch=bpath, out=opath, adamw_steps=steps, double=True, **hp)
        run(ns)
        out, meta = load_safetensors(opath)
        check(out["logits"].shape == (B, T, cfg["vocab_size"]), "logits shape (B,T,V)")
        check(out["adamw_losses"].shape == (steps,) and out["adamw_losses"][0].item() == out["loss"][0].item(),
              "adamw_losses[0] == loss")
        check(abs(out["loss"][0].item() - loss.item()) < 1e-6, "CLI loss matches the in-process loss")
        check(all(torch.allclose(out["grad." + n].double(), p.grad, rtol=1e-5, atol=1e-9) for n, p in params.items()),
              "CLI gradients match the in-process gradients")
        check(out["adamw_losses"][-1] < out["adamw_losses"][0], "AdamW steps reduce the loss")

        manual = model_from_safetensors(wpath, torch.float64)
        state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in manual.named_parameters()}
        clipped = False
        for t in range(1, steps + 1):
            manual.zero_grad(set_to_none=True)
            manual(xl, yl)[1].backward()
            with torch.no_grad():
                norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in manual.parameters()))
                scale = min(1.0, hp["grad_clip"] / (norm + 1e-6))
                clipped |= scale < 1.0
                for n, p in manual.named_parameters():
                    gr = p.grad * scale
                    m, v = state[n]
                    wd = hp["weight_decay"] if p.dim() >= 2 else 0.0
                    p.mul_(1 - hp["lr"] * wd)  # decoupled decay, before the Adam update
                    m.mul_(hp["beta1"]).add_((1 - hp["beta1"]) * gr)
                    v.mul_(hp["beta2"]).add_((1 - hp["beta2"]) * gr * gr)
                    mhat = m / (1 - hp["beta1"] ** t)
                    vhat = v / (1 - hp["beta2"] ** t)
                    p.sub_(hp["lr"] * mhat / (vhat.sqrt() + hp["eps"]))
        check(clipped, "the self-test exercised gradient clipping")
        # In float64 in-process (the file holds F32, which would hide ~1e-8).
        ref64 = reference(model_from_safetensors(wpath, torch.float64), xl, yl, steps, **hp)
        worst = max(float((ref64["final." + n] - p).abs().max()) for n, p in manual.named_parameters())
        moved = max(float((ref64["final." + n] - params[n]).abs().max()) for n, _ in manual.named_parameters())
        check(worst < 1e-12 and moved > 1e-3,
              f"torch AdamW + clipping matches the hand-written update (max abs diff {worst:.1e}, "
              f"weights moved up to {moved:.1e})")
        worst = max(float((out["final." + n].double() - p).abs().max()) for n, p in manual.named_parameters())
        check(worst < 1e-6, f"the CLI's final.* weights match too (max abs diff {worst:.1e}, F32 rounding)")

        # fp32 vs float64 agree to float tolerance (the C++ CPU backend is fp32).
        m32 = model_from_safetensors(wpath, torch.float32)
        l32 = m32(xl, yl)[1].item()
        check(abs(l32 - loss.item()) < 1e-5, f"fp32 loss {l32:.7f} matches float64 {loss.item():.7f}")

    print("selftest:", "FAILED" if failures else "all checks passed",
          "" if HAVE_SAFETENSORS else "(safetensors package not found; used the built-in reader/writer)")
    return 1 if failures else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", help="safetensors with the model weights and __metadata__ config")
    ap.add_argument("--batch", help="safetensors with int32 'inputs' and 'targets' (B,T)")
    ap.add_argument("--out", help="safetensors to write (loss, logits, grad.*, adamw_losses, final.*)")
    ap.add_argument("--adamw-steps", type=int, default=0, help="AdamW steps on the batch (default 0)")
    # Defaults follow trainrun's TrainSpec (core/config/job_spec.h).
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global L2 norm clip; 0 = off")
    ap.add_argument("--double", action="store_true", help="compute in float64 (outputs are still F32)")
    ap.add_argument("--selftest", action="store_true", help="check this script on a random model and exit")
    args = ap.parse_args(argv)
    if args.selftest:
        return selftest(args)
    if not (args.weights and args.batch and args.out):
        ap.error("--weights, --batch and --out are required (or --selftest)")
    if args.adamw_steps < 0:
        ap.error("--adamw-steps must be >= 0")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
