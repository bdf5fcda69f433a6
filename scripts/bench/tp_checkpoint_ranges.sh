#!/usr/bin/env bash
# Issue #14: what a tensor-parallel checkpoint costs in ranges, manifest
# segments, pwrite/pread calls and time, for a model whose row-parallel
# weights have many rows (a llama with n_embd 1024: each TP rank holds one
# run per row of o_proj and down_proj). Saves at tp2, then loads at tp2.
#
#   scripts/bench/tp_checkpoint_ranges.sh [TRAINRUN ...]
#
# Give several binaries (e.g. main's build and this branch's) to compare
# them on the same job. Needs strace. CPU backend, 2 ranks.
set -uo pipefail
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=("$(dirname "$0")/../../build/trainrun")
work=$(mktemp -d /tmp/tp_ckpt_bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat > "$work/job.yaml" <<YAML
model: {arch: llama, n_layer: 4, n_head: 16, n_kv_head: 8, n_embd: 1024, ffn_dim: 512, vocab_size: 256, seq_len: 16}
data: {format: synthetic, synthetic: {vocab: 256, branching: 3}}
train: {global_batch_size: 2, micro_batch_size: 1, max_steps: 1, lr: 1.0e-3, warmup_steps: 0, log_interval: 1, eval_interval: 0}
output: {dir: $work/run, sample_tokens: 0}
parallel: {sharding: full_shard, tensor_parallel: 2, nproc_per_node: 2, timeout_s: 300}
YAML
# segments: manifest entries (both files); pwrites/preads: calls by all ranks
# (save run / resume run, strace -f); save_s: training blocked by the save;
# load_s: Checkpointer::load on rank 0 (this branch logs it); resume_run_s:
# the whole resume run (setup, load, one step) under strace.
printf '%-40s %9s %9s %9s %9s %9s %12s %9s\n' binary segments pwrites save_s preads load_s resume_run_s ranges
for bin in "${bins[@]}"; do
  rm -rf "$work/run"
  TRAINRUN_PROGRESS=plain strace -f -qq -c -o "$work/save.strace" -e trace=pwrite64 \
    "$bin" --config "$work/job.yaml" > "$work/save.log" 2>&1
  pw=$(awk '$NF=="pwrite64"{print $4}' "$work/save.strace")
  save_s=$(grep -o 'training blocked [0-9.]* s' "$work/save.log" | tail -1 | awk '{print $3}')
  segs=$(python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(sum(len(f['segments']) for f in m['files'].values()))" \
    "$work/run/checkpoints/step_00000001/manifest.json")
  t0=$(date +%s.%N)
  TRAINRUN_PROGRESS=plain strace -f -qq -c -o "$work/load.strace" -e trace=pread64 \
    "$bin" --config "$work/job.yaml" --set train.max_steps=2 > "$work/load.log" 2>&1
  run_s=$(echo "$(date +%s.%N) - $t0" | bc)
  pr=$(awk '$NF=="pread64"{print $4}' "$work/load.strace")
  load_s=$(grep -o 'ranges on rank 0, [0-9.]* s)' "$work/load.log" | awk '{print $5}' || true)
  ranges=$(grep -o "; [0-9]* ranges on rank 0" "$work/load.log" | awk "{print \$2}" || true)
  printf '%-40s %9s %9s %9s %9s %9s %12s %9s\n' "$bin" "$segs" "$pw" "${save_s:--}" "$pr" "${load_s:--}" "$run_s" "${ranges:--}"
done
