#!/usr/bin/env bash
# CPU training throughput, trainrun vs PyTorch, same model and machine, in one
# run: GPT-2 L=4 NH=4 C=256 V=4096 T=256 B=8, fp32, AdamW, at 1 and 2 threads.
# Prints a table of tokens/s and the ratio. Steady state: both sides skip
# their first steps (trainrun reports the mean over steps 4-23 from its
# metrics; PyTorch the median over its timed steps after warmup).
#   usage: scripts/bench/cpu_vs_pytorch.sh [threads...]   (default: 1 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(1 2)
BIN=./build/trainrun
[ -x "$BIN" ] || bash scripts/build.sh trainrun >/dev/null
PY=/usr/bin/python3
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

printf "%-8s %-18s %-18s %-8s\n" threads "trainrun tok/s" "pytorch tok/s" ratio
for t in "${THREADS[@]}"; do
  # log_interval 20 with 23 steps: the record at step 20 covers steps 2-20 (the
  # first log at step 1 takes the cold first step out of the window).
  OMP_NUM_THREADS=$t OMP_WAIT_POLICY=PASSIVE "$BIN" --config configs/bench_cpu.yaml \
    --set output.dir="$OUT/tr$t" >"$OUT/tr$t.log" 2>&1 || { cat "$OUT/tr$t.log"; exit 1; }
  tr_tps=$($PY -c "import json,sys; r=[json.loads(l) for l in open('$OUT/tr$t/metrics.jsonl')]; print('%.0f' % r[1]['tokens_per_sec'])")
  pt_line=$(OMP_NUM_THREADS=$t OMP_WAIT_POLICY=PASSIVE $PY scripts/bench/pytorch_gpt2_bench.py --threads "$t" \
    --layers 4 --heads 4 --embd 256 --vocab 4096 --seq 256 --batch 8 --steps 20 --warmup 3)
  pt_tps=$(echo "$pt_line" | sed -n 's/.*tokens_per_sec=\([0-9.]*\).*/\1/p')
  ratio=$($PY -c "print('%.2f' % ($tr_tps / $pt_tps))")
  printf "%-8s %-18s %-18.0f %-8s\n" "$t" "$tr_tps" "$pt_tps" "${ratio}x"
done
