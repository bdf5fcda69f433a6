#!/usr/bin/env bash
# The GPU check of the CUDA backend. A GPU is lent for ~15 minutes of device
# time in calls of at most 600 s, so one call of `run` is planned to learn
# the most per second and to lose nothing when it is cut short:
#
#   scripts/gpu-check.sh bundle
#       On a build machine with the CUDA toolkit (no GPU needed): builds
#       build-cuda (trainrun, libtrainrun_cuda.so, test_cuda_ops) and packs
#       them, with the non-system shared libraries they need, into
#       build-gpu-bundle/bundle.tar.xz (git-ignored). cuBLASLt, NCCL and cuDNN
#       are NOT packed: the GPU machine has them in its nvidia-* wheels.
#
#   scripts/gpu-check.sh run          (the default; the first call)
#       The steps of RUN_STEPS below, in order of what we learn per second:
#       every CUDA op against the CPU at small odd shapes; the same at wide
#       shapes (C 4096/8192, T > 1030, HS 128, one KV head per rank); 20
#       GPT-2 steps against the CPU's losses; the adapters' ops and LoRA/DoRA
#       training against the CPU; GPT-2 124M and
#       Llama-1B tokens/s and MFU; the kernel benches.
#
#   scripts/gpu-check.sh run2 [STEP...]   (a later call)
#       RUN2_STEPS: offload, `generate` on CUDA, document-masked attention,
#       the wide kernel benches and torch's SDPA reference; or the named
#       steps (of either list: what a first call did not finish, as its
#       summary.txt says).
#
#   scripts/gpu-check.sh --dry-run [run|run2]
#       Prints the steps, their caps and the total; exits 0 only when the
#       total fits one call (<= GPU_CHECK_BUDGET_S, 540 s by default).
#
# Time: one global deadline, GPU_CHECK_BUDGET_S (540 s: 60 s under the
# device call's 600 s for the transfers) from the start. Every step runs
# under `timeout -k KILL_S CAP` with CAP = min(its cap, the time left before
# the deadline less KILL_S), and a step with under GPU_CHECK_MIN_STEP_S left
# is skipped, so the call ends by the deadline whatever hangs. Training runs
# get SIGKILL at their cap (timeout -s KILL), never SIGTERM: trainrun takes
# a TERM as a preemption and writes a checkpoint (15 GB for Llama-1B); its
# worker dies with it (PR_SET_PDEATHSIG). After each step one line goes to
# $OUT/summary.txt (step, PASS/FAIL/TIMEOUT/SKIPPED, rc, seconds, the
# result), so a call that is cut short still says what it found.
#
# Environment (tests/test_gpu_check.cpp runs the script in seconds with these):
#   GPU_CHECK_BUDGET_S  the deadline (default 540)
#   GPU_CHECK_KILL_S    timeout -k grace (default 10)
#   GPU_CHECK_CAP_S     every step's cap (default: each its own, below)
#   GPU_CHECK_MIN_STEP_S  the least time worth starting a step (default 5)
#   GPU_CHECK_BIN       a directory with trainrun and test_cuda_ops to use
#                       instead of unpacking the bundle (tests: stubs)
#
# With the device tool: carry ["build-gpu-bundle"], timeout_s 580, command
#   bash scripts/gpu-check.sh run
# Record what summary.txt says in docs/gpu-results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUNDLE_DIR="$ROOT/build-gpu-bundle"

# The checked-out commit, read from .git without running git ("unknown" if
# this is not a plain checkout). Uncommitted changes are not reflected.
commit_id() {
  local head ref
  git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null && return
  head=$(cat "$ROOT/.git/HEAD" 2>/dev/null) || { echo unknown; return; }
  if [[ $head == ref:* ]]; then
    ref=${head#ref: }
    cat "$ROOT/.git/$ref" 2>/dev/null | cut -c1-12 ||
      grep " $ref\$" "$ROOT/.git/packed-refs" 2>/dev/null | cut -c1-12 || echo unknown
  else
    echo "${head:0:12}"
  fi
}

# ---- the steps: name|cap in seconds|what it tells us ---------------------------------
# The sum of a list's caps plus one KILL_S must stay <= 540 (--dry-run checks;
# so does tests/test_gpu_check.cpp).
RUN_STEPS=(
  "setup|15|unpack the bundle; GPU, driver, libraries, version"
  "ops_small|95|every CUDA op vs the CPU backend at small odd shapes (test_cuda_ops, not [wide]/[train]/[docmask]/[adapter])"
  "ops_wide|80|the ops at C=4096/8192, T>1030, HS=128, one KV head per rank, checked against the CPU (test_cuda_ops [wide])"
  "train_vs_cpu|80|20 GPT-2 steps on CUDA vs the CPU's losses, no_shard and full_shard (test_cuda_ops [train] but not [adapter]; its 2-GPU NCCL cases skip on one GPU)"
  "adapters|35|the adapters' ops (gemm, dropout mask bit for bit, row_norms, dora) vs the CPU, and LoRA/DoRA training on CUDA vs the CPU's losses (test_cuda_ops [adapter])"
  "gpt2_124m|75|GPT-2 124M training on one GPU: tokens/s and MFU (configs/gpt2_124m_h200.yaml)"
  "llama_1b|100|Llama-3.2-1B-shaped training on one GPU: tokens/s and MFU (configs/llama3_1b_h200.yaml)"
  "bench_kernels|50|trainrun bench kernels at GPT-2 124M's shapes (and the Llama ops at 1B's)"
)
RUN2_STEPS=(
  "setup|15|unpack the bundle; GPU, driver, libraries, version"
  "offload|90|GPT-2 124M with parallel.offload=cpu (full_shard): tokens/s, pinned chunked gradient copies"
  "generate|60|a tiny run on CUDA, then trainrun generate from its weights"
  "docmask|60|document-masked attention, RoPE and encoder vs the CPU (test_cuda_ops [docmask])"
  "bench_wide|130|trainrun bench kernels at C=4096 and 8192"
  "torch_ref|60|torch SDPA (flash, cuDNN) and bf16 matmul: the references for the kernel targets"
)

BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
KILL_S="${GPU_CHECK_KILL_S:-10}"
MIN_STEP_S="${GPU_CHECK_MIN_STEP_S:-5}"
OUTDIR="${OUT:-$BUNDLE_DIR/out}"  # git-ignored (/build*/)
WORK="${TMPDIR:-/tmp}/trainrun-gpu-check"
B="$WORK/b"  # the unpacked bundle (bin/, lib/), or GPU_CHECK_BIN's stand-ins

step_field() { local IFS='|'; read -r -a f <<< "$1"; echo "${f[$2]}"; }
find_step() {
  local s
  for s in "${RUN_STEPS[@]}" "${RUN2_STEPS[@]}"; do
    [[ "$(step_field "$s" 0)" == "$1" ]] && { echo "$s"; return 0; }
  done
  return 1
}
cap_of() { if [[ -n "${GPU_CHECK_CAP_S:-}" ]]; then echo "$GPU_CHECK_CAP_S"; else step_field "$1" 1; fi; }

dry_run() {
  local -a list=("$@") ; local total=0 s
  printf '%-14s %6s  %s\n' step cap_s what
  for s in "${list[@]}"; do
    printf '%-14s %6s  %s\n' "$(step_field "$s" 0)" "$(cap_of "$s")" "$(step_field "$s" 2)"
    total=$((total + $(cap_of "$s")))
  done
  total=$((total + KILL_S))
  local limit=$((BUDGET_S < 540 ? BUDGET_S : 540))
  printf 'total %d s (the caps + one timeout -k grace of %d s); one call allows %d s\n' "$total" "$KILL_S" "$limit"
  ((total <= limit))
}

# ---------------------------------------------------------------------------------
bundle() {
  set -e
  local build="$ROOT/build-cuda" stage="$BUNDLE_DIR/stage"
  echo "gpu-check bundle: building $build (CUDA on)"
  cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINRUN_CUDA=ON >/dev/null
  ninja -C "$build" -j "${JOBS:-2}" trainrun trainrun_cuda test_cuda_ops
  rm -rf "$stage" "$BUNDLE_DIR/bundle.tar.xz"
  mkdir -p "$stage/bin" "$stage/lib" "$stage/lib/fallback"
  cp "$build/trainrun" "$build/test_cuda_ops" "$build/libtrainrun_cuda.so" "$stage/bin/"
  strip --strip-debug "$stage/bin/"* 2>/dev/null || true
  # Shared libraries of the two executables, except glibc's (the GPU
  # machine's own are newer) and the CUDA ones (taken from its wheels).
  # libstdc++/libgcc_s go to lib/fallback, used only if the machine's are older.
  ldd "$build/trainrun" "$build/test_cuda_ops" | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libresolv.so*) ;;
      libcuda*|libcublas*|libnccl*|libcudnn*|libcudart*) ;;
      libstdc++.so*|libgcc_s.so*) cp -L "$lib" "$stage/lib/fallback/" ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
  commit_id > "$stage/COMMIT"
  date -u +%Y-%m-%dT%H:%MZ > "$stage/BUILT"
  tar -C "$stage" -cJf "$BUNDLE_DIR/bundle.tar.xz" .
  rm -rf "$stage"
  du -h "$BUNDLE_DIR/bundle.tar.xz"
  echo "gpu-check bundle: done; carry build-gpu-bundle and run: bash scripts/gpu-check.sh run"
}

# Directories of the CUDA libraries in python3's nvidia-* wheels.
nvidia_wheel_libdirs() {
  python3 - <<'PY' 2>/dev/null
import os, sys
try:
    import nvidia
except Exception:
    sys.exit(0)
want = ("libcublasLt.so", "libcublas.so", "libnccl.so", "libcudnn.so", "libcudart.so", "libnvJitLink.so")
dirs = []
for root in list(getattr(nvidia, "__path__", [])):
    for d, _, files in os.walk(root):
        if any(f.startswith(w) for f in files for w in want) and d not in dirs:
            dirs.append(d)
print(":".join(dirs))
PY
}

# Unpacks the bundle into $WORK/b and points LD_LIBRARY_PATH at its
# libraries and the machine's nvidia-* wheels.
unpack() {
  if [[ ! -f "$BUNDLE_DIR/bundle.tar.xz" ]]; then
    echo "gpu-check: no build-gpu-bundle/bundle.tar.xz; run 'scripts/gpu-check.sh bundle' on the build machine and carry build-gpu-bundle" >&2
    return 2
  fi
  rm -rf "$WORK/b" && mkdir -p "$WORK/b"
  timeout -k "$KILL_S" "$STEP_CAP" tar -C "$WORK/b" -xJf "$BUNDLE_DIR/bundle.tar.xz" 2>/dev/null ||
    timeout -k "$KILL_S" "$STEP_CAP" python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BUNDLE_DIR/bundle.tar.xz" "$WORK/b" ||
    { echo "gpu-check: cannot unpack the bundle" >&2; return 2; }
  local NV
  NV=$(timeout -k "$KILL_S" 20 bash -c "$(declare -f nvidia_wheel_libdirs); nvidia_wheel_libdirs")
  export LD_LIBRARY_PATH="$WORK/b/lib${NV:+:$NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The build machine's libstdc++ only if the GPU machine's is too old for the binaries.
  if ! timeout -k "$KILL_S" 20 "$WORK/b/bin/trainrun" --help >/dev/null 2>&1; then export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$WORK/b/lib/fallback"; fi
}


# ---- running steps under the deadline ------------------------------------------------
T0=$SECONDS
summary() { printf '%s\n' "$*" >> "$OUTDIR/summary.txt"; printf '%s\n' "$*"; }
left() { echo $((BUDGET_S - (SECONDS - T0))); }
# The cap a step may have now: its own, or what is left before the deadline
# less the kill grace. 0: not worth starting.
cap_now() {
  local cap=$1 room
  room=$(( $(left) - KILL_S ))
  ((room < cap)) && cap=$room
  ((room < MIN_STEP_S)) && cap=0
  echo "$cap"
}
# Runs `cmd...` under the step's cap: TERM at the cap, KILL KILL_S later.
# `kill_at_cap`: SIGKILL at the cap (training runs: no preemption checkpoint).
STEP_CAP=0
t_run() { timeout -k "$KILL_S" "$STEP_CAP" "$@"; }
t_train() { timeout -s KILL -k "$KILL_S" "$STEP_CAP" "$@"; }

# rc 124 (TERM at the cap) and 137 (KILL) are TIMEOUT.
verdict() { case "$1" in 0) echo PASS ;; 124|137) echo TIMEOUT ;; *) echo FAIL ;; esac; }

run_step() {
  local spec=$1 name cap t rc note
  name=$(step_field "$spec" 0)
  cap=$(cap_now "$(cap_of "$spec")")
  if ((cap <= 0)); then
    summary "$(printf '%-14s SKIPPED  the deadline (%s s) leaves %s s' "$name" "$BUDGET_S" "$(left)")"
    return 0
  fi
  STEP_CAP=$cap
  t=$SECONDS
  NOTE=""
  "step_$name" > "$OUTDIR/$name.log" 2>&1
  rc=$?
  summary "$(printf '%-14s %-8s rc=%-3s %4d s (cap %d)  %s' "$name" "$(verdict $rc)" "$rc" $((SECONDS - t)) "$cap" "$NOTE")"
  return 0
}

run_list() {
  mkdir -p "$OUTDIR" "$WORK"
  : > "$OUTDIR/summary.txt"
  summary "== gpu-check $MODE $(date -u +%Y-%m-%dT%H:%MZ), checkout $(commit_id), budget ${BUDGET_S} s"
  local s
  for s in "$@"; do run_step "$s"; done
  summary "== gpu-check $MODE done in $((SECONDS - T0)) s (logs: $OUTDIR)"
  ! grep -qE " (FAIL|TIMEOUT) " "$OUTDIR/summary.txt"
}

# ---- the steps -----------------------------------------------------------------------
# Each writes its log to stdout (run_step sends it to $OUTDIR/<step>.log)
# and may set NOTE, the rest of its summary line.

step_setup() {
  if [[ -n "${GPU_CHECK_BIN:-}" ]]; then
    mkdir -p "$B/bin" && cp "$GPU_CHECK_BIN"/* "$B/bin/"
    echo "gpu-check: GPU_CHECK_BIN=$GPU_CHECK_BIN (stand-ins, no bundle)"
    NOTE="binaries from GPU_CHECK_BIN"
    return 0
  fi
  unpack || return $?
  echo "bundle commit $(cat "$B/COMMIT"), built $(cat "$B/BUILT")"
  [[ "$(cat "$B/COMMIT")" != "$(commit_id)" ]] &&
    echo "WARNING: the bundle was built from $(cat "$B/COMMIT") but this checkout is $(commit_id); rebuild it"
  t_run nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -2
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ldd "$B/bin/trainrun" "$B/bin/libtrainrun_cuda.so" "$B/bin/test_cuda_ops" 2>&1 | grep "not found" | sort -u
  t_run "$B/bin/trainrun" --version
  local rc=$?
  NOTE="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), bundle $(cat "$B/COMMIT")"
  return $rc
}

# test_cuda_ops with a Catch2 filter; NOTE: its totals line.
cuda_tests() {
  (cd "$WORK" && t_run "$B/bin/test_cuda_ops" -d yes "$@" 2>&1)
  local rc=${PIPESTATUS[0]}
  return "$rc"
}
tests_note() {
  local log="$OUTDIR/$1.log"
  if grep -q "SKIPPED: no usable GPU" "$log"; then echo "SKIPPED: no usable GPU"; return; fi
  grep -E "test cases|All tests passed" "$log" | tail -1
  grep -E "FAILED|rel err .*e\+|inf \(tol" "$log" | head -3 | tr -s ' \n' ' '
}
step_ops_small() { cuda_tests "~[wide]~[train]~[docmask]~[adapter]"; local rc=$?; NOTE=$(tests_note ops_small); return $rc; }
step_ops_wide() { cuda_tests "[wide]"; local rc=$?; NOTE=$(tests_note ops_wide); return $rc; }
step_train_vs_cpu() { cuda_tests "[train]~[adapter]"; local rc=$?; NOTE=$(tests_note train_vs_cpu); return $rc; }
step_adapters() { cuda_tests "[adapter]"; local rc=$?; NOTE=$(tests_note adapters); return $rc; }
step_docmask() { cuda_tests "[docmask]"; local rc=$?; NOTE=$(tests_note docmask); return $rc; }

# A training run: SIGKILL at the cap (no preemption checkpoint), no
# checkpoint at all, its output dir under $WORK.
train() {
  local dir=$1; shift
  rm -rf "$dir"
  t_train "$B/bin/trainrun" "$@" --set output.dir="$dir" --set checkpoint.interval=0 --set checkpoint.final=false 2>&1
}
PEAK_TFLOPS=989.4  # H100/H200 SXM dense bf16
tps_of() { grep -E "^(\[rank 0\] )?step" "$1" | grep -o "[0-9.]* tok/s" | tail -1 | awk '{print $1}'; }
mfu_note() {  # log, fallback FLOPs per token
  local tps fpt
  tps=$(tps_of "$1")
  fpt=$(grep -o "mfu: [0-9.]* MFLOP per token" "$1" | head -1 | awk '{printf "%.0f", $2 * 1e6}')
  [[ -z "$fpt" ]] && fpt=$2
  if [[ -n "$tps" ]]; then
    awk -v t="$tps" -v f="$fpt" -v p="$PEAK_TFLOPS" \
      'BEGIN{printf "%s tok/s, MFU %.1f%% (%.0f FLOP/token, peak %s TFLOP/s)", t, 100*t*f/(p*1e12), f, p}'
  else
    echo "no throughput line; see the log"
  fi
}
step_gpt2_124m() {
  train "$WORK/run124m" --config "$ROOT/configs/gpt2_124m_h200.yaml"
  local rc=$?
  NOTE=$(mfu_note "$OUTDIR/gpt2_124m.log" $((6 * 124439808 + 12 * 12 * 768 * 1024)))
  return $rc
}
step_llama_1b() {
  train "$WORK/runllama1b" --config "$ROOT/configs/llama3_1b_h200.yaml"
  local rc=$?
  NOTE="$(mfu_note "$OUTDIR/llama_1b.log" $((6 * 1235746816 + 12 * 16 * 2048 * 2048))); target 50%"
  return $rc
}
step_offload() {
  train "$WORK/runoffload" --config "$ROOT/configs/gpt2_124m_h200.yaml" --set parallel.sharding=full_shard \
    --set parallel.offload=cpu --set train.max_steps=20
  local rc=$?
  NOTE="offload cpu: $(mfu_note "$OUTDIR/offload.log" $((6 * 124439808 + 12 * 12 * 768 * 1024)))"
  return $rc
}
step_generate() {
  local dir="$WORK/rungen"
  rm -rf "$dir"
  # A tiny GPT-2 on CUDA with its final weights (small: kilobytes), then sampling from them on CUDA.
  t_train "$B/bin/trainrun" --config "$ROOT/configs/gpt2_124m_h200.yaml" --set output.dir="$dir" \
    --set model.n_layer=2 --set model.n_embd=128 --set model.n_head=4 --set model.vocab_size=256 \
    --set model.seq_len=64 --set data.synthetic.vocab=256 --set train.global_batch_size=8 \
    --set train.micro_batch_size=8 --set train.max_steps=20 --set checkpoint.final=true 2>&1 || return $?
  t_run "$B/bin/trainrun" generate --checkpoint "$dir" --prompt "1 2 3" --max-tokens 32 2>&1
  local rc=$?
  NOTE="generate rc=$rc; the sample is in generate.log"
  return $rc
}
step_bench_kernels() {
  t_run "$B/bin/trainrun" bench kernels --repeats 20 2>&1
  local rc=$?
  NOTE=$(grep -E '^(ceiling|attention)' "$OUTDIR/bench_kernels.log" | sed 's/  */ /g' | head -3 | tr '\n' ';')
  return $rc
}
step_bench_wide() {
  local c rc=0 half=$((STEP_CAP / 2))
  for c in 4096 8192; do
    echo "== bench kernels at C=$c (TRAINRUN_BENCH_C=$c)"
    TRAINRUN_BENCH_C=$c timeout -k "$KILL_S" "$half" "$B/bin/trainrun" bench kernels --repeats 10 2>&1 || rc=$?
  done
  NOTE=$(grep -E '^(layernorm bwd|encoder bwd|attention kv|gemm fwd fc )' "$OUTDIR/bench_wide.log" | sed 's/  */ /g' | head -4 | tr '\n' ';')
  return $rc
}
step_torch_ref() {
  t_run python3 - <<'PY' 2>&1
import contextlib, torch, torch.nn.functional as F
B, T, NH, HS = 16, 1024, 12, 64
dev = "cuda"
def med(f, n=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3): f()
    t = []
    for _ in range(n):
        s.record(); f(); e.record(); torch.cuda.synchronize(); t.append(s.elapsed_time(e))
    return sorted(t)[len(t) // 2]
fwd_flops = 4 * B * NH * T * T * HS / 2
q, k, v = (torch.randn(B, NH, T, HS, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(B, NH, T, HS, device=dev, dtype=torch.bfloat16)
try:
    from torch.nn.attention import sdpa_kernel, SDPBackend
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
except Exception:
    sdpa_kernel, backends = None, [("default", None)]
for name, be in backends:
    try:
        ctx = sdpa_kernel(be) if sdpa_kernel else contextlib.nullcontext()
        with ctx:
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            tf = med(f)
            o = f()
            tb = med(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
        print(f"torch SDPA {name:6s}: fwd {tf*1e3:8.1f} us {fwd_flops/tf/1e9:7.1f} TFLOP/s | "
              f"bwd {tb*1e3:8.1f} us {2.5*fwd_flops/tb/1e9:7.1f} TFLOP/s")
    except Exception as ex:
        print(f"torch SDPA {name}: unavailable ({type(ex).__name__}: {ex})")
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
t = med(lambda: a @ b, 10)
print(f"torch bf16 matmul 8192^3: {2*8192**3/t/1e9:.1f} TFLOP/s")
PY
  local rc=${PIPESTATUS[0]}
  NOTE=$(grep -E '^torch' "$OUTDIR/torch_ref.log" | tr '\n' ';')
  return "$rc"
}

# ---------------------------------------------------------------------------------
MODE="${1:-run}"
case "$MODE" in
  bundle) bundle ;;
  --dry-run)
    case "${2:-run}" in
      run) dry_run "${RUN_STEPS[@]}" ;;
      run2) dry_run "${RUN2_STEPS[@]}" ;;
      *) echo "usage: scripts/gpu-check.sh --dry-run [run|run2]" >&2; exit 2 ;;
    esac ;;
  run) run_list "${RUN_STEPS[@]}" ;;
  run2)
    shift
    if (($# == 0)); then
      run_list "${RUN2_STEPS[@]}"
    else
      # The named steps, after setup (unless named).
      list=()
      [[ " $* " == *" setup "* ]] || list+=("$(find_step setup)")
      for n in "$@"; do
        spec=$(find_step "$n") || { echo "gpu-check: no step '$n' (steps: run's and run2's, see --dry-run)" >&2; exit 2; }
        list+=("$spec")
      done
      run_list "${list[@]}"
    fi ;;
  *) echo "usage: scripts/gpu-check.sh [bundle|run|run2 [STEP...]|--dry-run [run|run2]]" >&2; exit 2 ;;
esac
