#!/usr/bin/env bash
# Sampling speed with a KV cache on the CPU, trainrun vs transformers, same
# weights, threads and machine, in one run: `trainrun generate --top-k 1`
# against GPT2LMHeadModel.generate(use_cache=True, greedy), for the
# quickstart model (L=4 C=128 V=256) and a GPT-2 124M (L=12 C=768
# V=50257), random weights (speed does not depend on their values).
# trainrun's figure is from its own "N tokens in X s" line (the best of
# REPEAT runs); transformers' the best of REPEAT timed generate calls after
# loading. Both include the 1-token prompt's prefill. Needs the test venv
# (scripts/install-deps.sh --test: transformers 4.44.2 on Debian's torch).
#   usage: scripts/bench/generate_vs_hf.sh [threads...]   (default: 1 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(1 2)
BIN=./build/trainrun
[ -x "$BIN" ] || bash scripts/build.sh trainrun >/dev/null
PY=.venv/bin/python
[ -x "$PY" ] || { echo "generate_vs_hf: run scripts/install-deps.sh --test first (needs $PY)" >&2; exit 1; }
REPEAT=${REPEAT:-3}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# A trainrun model file of the shape with random weights (the layout of
# core/model/model_io.cpp: HF names, nn.Linear layout, our metadata), then the
# same weights as a Hugging Face directory via `trainrun export`.
make_model() {  # name L NH C V T
  "$PY" - "$OUT/$1.safetensors" "$2" "$3" "$4" "$5" "$6" <<'PY'
import sys, numpy as np
from safetensors.numpy import save_file
path, L, NH, C, V, T = sys.argv[1], *map(int, sys.argv[2:])
rng = np.random.default_rng(0)
t = {}
def add(name, *shape, gain=False):
    t[name] = (float(gain) + 0.02 * rng.standard_normal(shape)).astype(np.float32)
add("transformer.wte.weight", V, C); add("transformer.wpe.weight", T, C)
for l in range(L):
    p = f"transformer.h.{l}."
    add(p + "ln_1.weight", C, gain=True); add(p + "ln_1.bias", C)
    add(p + "attn.c_attn.weight", 3 * C, C); add(p + "attn.c_attn.bias", 3 * C)
    add(p + "attn.c_proj.weight", C, C); add(p + "attn.c_proj.bias", C)
    add(p + "ln_2.weight", C, gain=True); add(p + "ln_2.bias", C)
    add(p + "mlp.c_fc.weight", 4 * C, C); add(p + "mlp.c_fc.bias", 4 * C)
    add(p + "mlp.c_proj.weight", C, 4 * C); add(p + "mlp.c_proj.bias", C)
add("transformer.ln_f.weight", C, gain=True); add("transformer.ln_f.bias", C)
meta = {"format": "pt", "arch": "gpt2", "n_layer": str(L), "n_head": str(NH), "n_embd": str(C),
        "vocab_size": str(V), "seq_len": str(T), "init_std": "0.02"}
save_file(t, path, metadata=meta)
PY
  "$BIN" export --checkpoint "$OUT/$1.safetensors" --out "$OUT/$1.hf" >/dev/null 2>&1
}

bench() {  # name tokens threads
  local name=$1 n=$2 t=$3 best=0
  for _ in $(seq "$REPEAT"); do
    local tps
    tps=$(OMP_NUM_THREADS=$t "$BIN" generate --checkpoint "$OUT/$name.safetensors" \
      --prompt "$( [ "$name" = quickstart ] && echo a || echo 50 )" --max-tokens "$n" --top-k 1 2>&1 >/dev/null |
      sed -n 's/.* s (\([0-9.]*\) tokens\/s.*/\1/p')
    best=$("$PY" -c "print(max($best, $tps))")
  done
  local hf
  hf=$(OMP_NUM_THREADS=$t "$PY" scripts/reference/hf_gpt2.py generate --model "$OUT/$name.hf" \
    --prompt "$( [ "$name" = quickstart ] && echo 97 || echo 50 )" --max-new-tokens "$n" --threads "$t" \
    --repeat "$REPEAT" 2>&1 >/dev/null | sed -n 's/^tokens\/s \([0-9.]*\)$/\1/p')
  printf "%-12s %-8s %-8s %-16.1f %-16.1f %-8s\n" "$name" "$t" "$n" "$best" "$hf" \
    "$("$PY" -c "print('%.2fx' % ($best / $hf))")"
}

make_model quickstart 4 4 128 256 128
make_model gpt2-124M 12 12 768 50257 1024
printf "%-12s %-8s %-8s %-16s %-16s %-8s\n" model threads tokens "trainrun tok/s" "transformers tok/s" ratio
for t in "${THREADS[@]}"; do
  bench quickstart 127 "$t"
  bench gpt2-124M 100 "$t"
done
