#!/usr/bin/env python3
"""An independent NF4 reference for tests/test_nf4.cpp, written from bitsandbytes' published
algorithm (bitsandbytes cannot run here: its wheel needs torch >= 2, the venv has 1.13).

  nf4_reference.py DIR

For every DIR/NAME.x.f32 (raw little-endian float32, a whole tensor), writes what
bitsandbytes' quantize_4bit(A, blocksize=64, compress_statistics=True, quant_type="nf4")
holds, and what dequantize_4bit returns from it:
  NAME.packed (uint8)  NAME.qabsmax (uint8)  NAME.absmax2 (f32)  NAME.offset (one f32)
  NAME.deq.f32         NAME.deq.bf16 (uint16, torch's float32 -> bfloat16 conversion)
For every DIR/NAME.s4.f32 (values already scaled to [-1, 1]): NAME.codes4, the NF4 code of each.
For every DIR/NAME.s8.f32: NAME.codes8, the dynamic-map index of each.
Always: DIR/map.f32, the signed dynamic map (256 f32).

How each bitsandbytes fact is reproduced (vectorised numpy, float32 throughout):
  - NF4 values and the decision thresholds: the decimal literals of bitsandbytes' table and
    of its dQuantizeNF4 tree, rounded exactly (fractions) to the nearest float32, as nvcc
    does. A code is the number of thresholds strictly below the scaled value (the tree's
    result without walking it; NaN compares false: code 0).
  - blocks of 64: absmax = max |x|; scaled = x * (1 / absmax). bitsandbytes' CUDA build
    uses --use_fast_math, which flushes subnormal operands and results to zero (ftz below);
    its reciprocal is rcp.approx there, the correctly rounded 1/absmax here (see nf4.h).
    Elements past n are zeros, as its zero-filled block loads.
  - offset = mean(absmax): math.fsum / count, rounded once to float32 (torch's own float32
    mean reduction differs from it in the last bits, and between devices).
  - double quantization: absmax - offset in blocks of 256, quantized with the signed
    dynamic map by dQuantize's search (seven halving steps from index 127, then the nearer
    end by float32 midpoint); checked here to be a nearest map entry.
  - the dynamic map: create_dynamic_map(signed=True) with torch.linspace, pinned to the
    AVX2 CPU kernels (ATEN_CPU_CAPABILITY=avx2): torch's linspace rounds differently with
    other vector widths, so the map would depend on the machine.
  - dequantize: absmax' = ftz(map[q] * absmax2) + offset; x' = ftz(code * ftz(absmax')).

Runs with the repo's .venv python (numpy, torch 1.13).
"""
import math
import os
import sys
from fractions import Fraction

os.environ["ATEN_CPU_CAPABILITY"] = "avx2"  # before torch is imported: see the docstring

import numpy as np  # noqa: E402
import torch  # noqa: E402

F32 = np.float32
FLT_MIN = F32(1.1754943508222875e-38)

NF4_LITERALS = [
    "-1.0", "-0.6961928009986877", "-0.5250730514526367", "-0.39491748809814453",
    "-0.28444138169288635", "-0.18477343022823334", "-0.09105003625154495", "0.0",
    "0.07958029955625534", "0.16093020141124725", "0.24611230194568634", "0.33791524171829224",
    "0.44070982933044434", "0.5626170039176941", "0.7229568362236023", "1.0",
]
# dQuantizeNF4's comparisons (x > t goes to the upper half), in the tree's own order.
THRESHOLD_LITERALS = [
    "0.03979014977812767", "0.3893125355243683", "0.6427869200706482", "0.8614784181118011",
    "0.5016634166240692", "0.2035212516784668", "0.2920137718319893", "0.1202552504837513",
    "-0.33967943489551544", "-0.13791173323988914", "-0.045525018125772476", "-0.23460740596055984",
    "-0.6106329262256622", "-0.4599952697753906", "-0.8480964004993439",
]


def nearest_f32(literal):
    """The float32 nearest to a decimal literal (ties to even), without a double in between."""
    exact = Fraction(literal)
    c = F32(float(exact))
    cands = [np.nextafter(c, F32(-np.inf)), c, np.nextafter(c, F32(np.inf))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.uint32)) & 1))
    return F32(best)


NF4 = np.array([nearest_f32(s) for s in NF4_LITERALS], dtype=F32)
THRESHOLDS = np.sort(np.array([nearest_f32(s) for s in THRESHOLD_LITERALS], dtype=F32))


def ftz(a):
    a = np.asarray(a, dtype=F32)
    return np.where(np.abs(a) < FLT_MIN, np.copysign(F32(0), a), a).astype(F32)


def dynamic_map():
    data = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    assert len(data) == 256
    data.sort()
    return torch.tensor(data, dtype=torch.float32).numpy()


MAP = dynamic_map()


def nf4_codes(scaled):
    with np.errstate(invalid="ignore"):
        return (scaled[..., None] > THRESHOLDS).sum(axis=-1).astype(np.uint8)


def map_codes(x):
    x = np.asarray(x, dtype=F32)
    pivot = np.full(x.shape, 127, dtype=np.int64)
    lower_p = np.zeros(x.shape, dtype=np.int64)
    upper_p = np.full(x.shape, 255, dtype=np.int64)
    lower = np.full(x.shape, F32(-1.0), dtype=F32)
    upper = np.full(x.shape, F32(1.0), dtype=F32)
    val = MAP[pivot]
    with np.errstate(invalid="ignore"):
        for step in (64, 32, 16, 8, 4, 2, 1):
            up = x > val
            lower_p = np.where(up, pivot, lower_p)
            lower = np.where(up, val, lower)
            upper_p = np.where(up, upper_p, pivot)
            upper = np.where(up, upper, val)
            pivot = np.where(up, pivot + step, pivot - step)
            val = MAP[pivot]
        upper = np.where(upper_p == 255, MAP[255], upper).astype(F32)
        lower = np.where(lower_p == 0, MAP[0], lower).astype(F32)
        up = x > val
        mid_up = ((upper + val) * F32(0.5)).astype(F32)
        mid_lo = ((lower + val) * F32(0.5)).astype(F32)
        q = np.where(up, np.where(x > mid_up, upper_p, pivot), np.where(x < mid_lo, lower_p, pivot))
    # The search must land on a nearest entry (within the fp32 midpoint's rounding: 2 ulps).
    fin = np.isfinite(x)
    d = np.abs(x[fin].astype(np.float64) - MAP[q[fin]].astype(np.float64))
    for nb in (q[fin] - 1, q[fin] + 1):
        ok = (nb >= 0) & (nb <= 255)
        dn = np.abs(x[fin][ok].astype(np.float64) - MAP[nb[ok]].astype(np.float64))
        assert np.all(d[ok] <= dn + 2.4e-7 * np.abs(x[fin][ok]) + 1e-45), "dQuantize search is not nearest"
    return q.astype(np.uint8)


def quantize(x):
    n = x.size
    blocks = -(-n // 64)
    padded = np.zeros(blocks * 64, dtype=F32)
    padded[:n] = x
    xb = ftz(padded).reshape(blocks, 64)
    absmax = np.abs(xb).max(axis=1).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = ftz(F32(1.0) / absmax)
        scaled = ftz(xb * scale[:, None])
    codes = nf4_codes(scaled).reshape(-1)[: n + (n % 2)]
    packed = (codes[0::2] << 4) | codes[1::2]

    offset = F32(math.fsum(absmax.astype(np.float64).tolist()) / blocks)
    v = (absmax - offset).astype(F32)
    runs = -(-blocks // 256)
    vp = np.zeros(runs * 256, dtype=F32)
    vp[:blocks] = v
    vr = ftz(vp).reshape(runs, 256)
    absmax2 = np.abs(vr).max(axis=1).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale2 = ftz(F32(1.0) / absmax2)
        s2 = ftz(vr * scale2[:, None])
    qabsmax = map_codes(s2).reshape(-1)[:blocks]

    # dequantize_4bit: dequantize_blockwise(qabsmax) + offset, then code * absmax per block.
    a = ftz(MAP[qabsmax] * np.repeat(absmax2, 256)[:blocks])
    a = (a + offset).astype(F32)
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2] = packed >> 4
    nibbles[1::2] = packed & 15
    deq = ftz(NF4[nibbles[:n]] * np.repeat(ftz(a), 64)[:n])
    bf16 = torch.from_numpy(deq.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return packed.astype(np.uint8), qabsmax, absmax2, offset, deq, bf16


def main():
    d = sys.argv[1]
    MAP.astype(F32).tofile(os.path.join(d, "map.f32"))
    for f in sorted(os.listdir(d)):
        path = os.path.join(d, f)
        if f.endswith(".x.f32"):
            name = f[: -len(".x.f32")]
            x = np.fromfile(path, dtype=F32)
            packed, qabsmax, absmax2, offset, deq, bf16 = quantize(x)
            for ext, arr in (("packed", packed), ("qabsmax", qabsmax), ("absmax2", absmax2),
                             ("offset", np.array([offset], dtype=F32)), ("deq.f32", deq), ("deq.bf16", bf16)):
                arr.tofile(os.path.join(d, f"{name}.{ext}"))
        elif f.endswith(".s4.f32"):
            nf4_codes(np.fromfile(path, dtype=F32)).tofile(os.path.join(d, f[: -len(".s4.f32")] + ".codes4"))
        elif f.endswith(".s8.f32"):
            map_codes(np.fromfile(path, dtype=F32)).tofile(os.path.join(d, f[: -len(".s8.f32")] + ".codes8"))


if __name__ == "__main__":
    main()
