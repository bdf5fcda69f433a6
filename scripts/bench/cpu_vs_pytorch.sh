#!/usr/bin/env bash
# CPU training throughput, trainrun vs PyTorch, same model and machine, in one
# run, at 1 and 2 threads, fp32, AdamW, B=8, T=256, V=4096:
#   gpt2   L=4 NH=4 C=256                       (configs/bench_cpu.yaml)
#   llama  L=4 NH=8 NKV=2 C=256 F=704, untied   (configs/bench_cpu_llama.yaml)
# PyTorch columns: Debian's torch 1.13 (/usr/bin/python3; eager, the only
# setting it has), and a PyTorch 2.x from PyPI in its own venv at its best
# settings: eager + F.scaled_dot_product_attention (GQA by enable_gqa where
# it exists) and that model under torch.compile. The ratio is trainrun over
# the best PyTorch figure of the row.
#
# Steady state, the same rule on both sides: the median step time over 20
# timed steps after 3 warmup steps (the compile mode compiles in the first
# of them). trainrun runs the config's 23 steps with train.log_interval=1,
# so its metrics hold every step's time; steps 4-23 are the timed ones. Each (model, threads) row runs its
# programs back to back, trainrun first, so load from other processes hits
# them alike; BENCH_ROUNDS=N repeats each row's sequence N times and keeps
# each program's best figure. The machine's load average is printed before
# and after: figures taken under load are not comparable with quiet ones.
#
#   usage: scripts/bench/cpu_vs_pytorch.sh [threads...]   (default: 1 2)
#   environment:
#     BENCH_MODELS="gpt2 llama"   which rows
#     BENCH_ROUNDS=1              repetitions of each row (best kept)
#     BENCH_TORCH2=1              0: only Debian's torch 1.13 (no venv, no download)
#     TRAINRUN_BENCH_VENV=~/.cache/trainrun/bench-venv
#                                 the PyTorch 2.x venv; created on first use with
#                                 `python3 -m venv` + `pip install torch` (PyPI's
#                                 wheel is large, several GB with its CUDA
#                                 libraries; not part of CI)
set -euo pipefail
cd "$(dirname "$0")/../.."
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(1 2)
read -r -a MODELS <<<"${BENCH_MODELS:-gpt2 llama}"
ROUNDS=${BENCH_ROUNDS:-1}
BIN=./build/trainrun
[ -x "$BIN" ] || bash scripts/build.sh trainrun >/dev/null
PY=/usr/bin/python3
VENV=${TRAINRUN_BENCH_VENV:-$HOME/.cache/trainrun/bench-venv}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

for m in "${MODELS[@]}"; do
  case $m in gpt2|llama) ;; *) echo "cpu_vs_pytorch: BENCH_MODELS: unknown model '$m' (gpt2, llama)" >&2; exit 2 ;; esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "cpu_vs_pytorch: BENCH_ROUNDS must be a positive integer, not '$ROUNDS'" >&2; exit 2; }

# The PyTorch 2.x venv: made once, reused after. Debian's python3 (it has
# the headers torch.compile's C++ code generation needs).
VPY=""
if [[ "${BENCH_TORCH2:-1}" != 0 ]]; then
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "cpu_vs_pytorch: installing PyTorch 2.x from PyPI into $VENV (first use; a large download)" >&2
    { $PY -m venv "$VENV" && "$VENV/bin/pip" install --quiet torch numpy; } >&2 ||
      echo "cpu_vs_pytorch: could not install torch into $VENV; the PyTorch 2.x columns are left out (BENCH_TORCH2=0 skips this)" >&2
  fi
  "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 && VPY="$VENV/bin/python"
fi
T2=""
[[ -n $VPY ]] && T2=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])")
T1=$($PY -c "import torch; print(torch.__version__.split('a')[0])")

# One PyTorch figure: tokens/s, or "-" if that setting failed (its stderr is kept in $OUT).
torch_tps() {  # python model threads mode tag
  local py=$1 model=$2 t=$3 mode=$4 tag=$5 line args
  if [[ $model == gpt2 ]]; then
    args=(scripts/bench/pytorch_gpt2_bench.py --layers 4 --heads 4 --embd 256)
  else
    args=(scripts/bench/pytorch_llama_bench.py --layers 4 --heads 8 --kv-heads 2 --embd 256 --ffn 704)
  fi
  if line=$(OMP_NUM_THREADS=$t OMP_WAIT_POLICY=PASSIVE "$py" "${args[@]}" --threads "$t" --mode "$mode" \
      --vocab 4096 --seq 256 --batch 8 --steps 20 --warmup 3 2>"$OUT/$tag.err"); then
    echo "$line" | sed -n 's/.*tokens_per_sec=\([0-9.]*\).*/\1/p'
  else
    echo "cpu_vs_pytorch: $tag failed: $(tail -1 "$OUT/$tag.err")" >&2
    echo "-"
  fi
}

best_of() { $PY -c "import sys; v=[float(x) for x in sys.argv[1:] if x != '-']; print('%.0f' % max(v) if v else '-')" "$@"; }

echo "cpu_vs_pytorch: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
  "$(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), rounds $ROUNDS"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
H_T2=${T2:+torch $T2}
printf "%-6s %-7s %-10s %-13s %-18s %-21s %-7s\n" model threads trainrun "torch ${T1}" "${H_T2:-torch 2.x} sdpa" \
  "${H_T2:-torch 2.x} compile" "vs best"
for model in "${MODELS[@]}"; do
  cfg=configs/bench_cpu.yaml
  [[ $model == llama ]] && cfg=configs/bench_cpu_llama.yaml
  for t in "${THREADS[@]}"; do
    tr=() p1=() ps=() pc=()
    for ((r = 1; r <= ROUNDS; ++r)); do
      rm -rf "$OUT/tr"
      OMP_NUM_THREADS=$t OMP_WAIT_POLICY=PASSIVE "$BIN" --config "$cfg" --set output.dir="$OUT/tr" \
        --set train.log_interval=1 >"$OUT/tr.log" 2>&1 || { cat "$OUT/tr.log"; exit 1; }
      tr+=("$($PY - "$OUT/tr/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
timed = [r["tokens_per_sec"] for r in rows if r["step"] >= 4]  # after 3 warmup steps
assert len(timed) == 20, f"expected steps 4-23 in {sys.argv[1]}, got {len(timed)}"
print("%.0f" % statistics.median(timed))
PY
)")
      p1+=("$(torch_tps "$PY" "$model" "$t" eager "$model-t$t-1.13")")
      if [[ -n $VPY ]]; then
        ps+=("$(torch_tps "$VPY" "$model" "$t" sdpa "$model-t$t-sdpa")")
        pc+=("$(torch_tps "$VPY" "$model" "$t" compile "$model-t$t-compile")")
      else
        ps+=("-") pc+=("-")
      fi
    done
    b_tr=$(best_of "${tr[@]}") b1=$(best_of "${p1[@]}") bs=$(best_of "${ps[@]}") bc=$(best_of "${pc[@]}")
    best=$(best_of "$b1" "$bs" "$bc")
    ratio=$($PY -c "import sys; b=sys.argv[2]; print('-' if b == '-' else '%.2fx' % (float(sys.argv[1]) / float(b)))" "$b_tr" "$best")
    printf "%-6s %-7s %-10s %-13s %-18s %-21s %-7s\n" "$model" "$t" "$b_tr" "$b1" "$bs" "$bc" "$ratio"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)   (tokens/s; 'vs best' = trainrun / the best PyTorch figure of the row)"
