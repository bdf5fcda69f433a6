#!/usr/bin/env bash
# The one GPU check of the CUDA backend, in two halves:
#
#   scripts/gpu-check.sh bundle
#       On a build machine with the CUDA toolkit (no GPU needed): builds
#       build-cuda (trainrun, libtrainrun_cuda.so, test_cuda_ops) and packs
#       them, with the non-system shared libraries they need (OpenBLAS,
#       yaml-cpp, Gloo, ...), into build-gpu-bundle/bundle.tar.xz
#       (git-ignored: /build*/). cuBLASLt, NCCL and cuDNN are NOT packed: the
#       GPU machine has them in its Python nvidia-* wheels.
#
#   scripts/gpu-check.sh run          (the default)
#       On the GPU machine, using only the carried bundle (no network, no
#       installs, no build), within ~8 minutes on an H100/H200:
#         1. the CUDA tests (tests/test_cuda_ops.cpp: every kernel against the
#            CPU backend, the GEMM epilogues, NCCL, 20 training steps vs CPU);
#         2. `trainrun bench kernels`: each kernel's GB/s or TFLOP/s next to
#            the card's measured copy bandwidth and cuBLASLt GEMM rate, at
#            GPT-2 124M's shapes, then again at C = 4096 and 8192 (wide
#            models: TRAINRUN_BENCH_C, HS 128, B=4; GPU_CHECK_WIDE=0 skips
#            these two);
#         3. torch's SDPA (flash / cuDNN) at the same attention shape, the
#            reference for the attention target;
#         4. GPT-2 124M training on one GPU (configs/gpt2_124m_h200.yaml):
#            tokens/s and MFU = tokens/s x (6N + 12 L C T) / peak;
#         5. Llama-3.2-1B-shaped training on one GPU
#            (configs/llama3_1b_h200.yaml: L16 C2048 NH32 NKV8 F8192 V128256,
#            tied, rope llama3, bf16, B=16 x T=2048): tokens/s and MFU with
#            the FLOPs per token the run itself prints (the model's
#            6N + 12 L C T); GPU_CHECK_LLAMA=0 skips it;
#       then prints a short table. Logs go to $OUT (device tool) or
#       build-gpu-bundle/out.
#
#   scripts/gpu-check.sh wide
#       Only the two wide `bench kernels` runs of step 2 (a short device call).
#
#   scripts/gpu-check.sh llama
#       Only step 5, the Llama-3.2-1B-shaped training run (its log; the MFU
#       line is in `run`'s summary).
#
# With the device tool: carry ["build-gpu-bundle"], timeout_s 580, command
#   bash scripts/gpu-check.sh run
# Record what it prints in docs/gpu-results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE="${1:-run}"
BUNDLE_DIR="$ROOT/build-gpu-bundle"

# The checked-out commit, read from .git without running git ("unknown" if
# this is not a plain checkout). Uncommitted changes are not reflected.
commit_id() {
  local head ref
  head=$(cat "$ROOT/.git/HEAD" 2>/dev/null) || { echo unknown; return; }
  if [[ $head == ref:* ]]; then
    ref=${head#ref: }
    cat "$ROOT/.git/$ref" 2>/dev/null | cut -c1-12 ||
      grep " $ref\$" "$ROOT/.git/packed-refs" 2>/dev/null | cut -c1-12 || echo unknown
  else
    echo "${head:0:12}"
  fi
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

# ---------------------------------------------------------------------------------
OUTDIR="${OUT:-$BUNDLE_DIR/out}"  # git-ignored (/build*/)
WORK="${TMPDIR:-/tmp}/trainrun-gpu-check"

say() { printf '%s\n' "$*" | tee -a "$OUTDIR/summary.txt"; }

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
  tar -C "$WORK/b" -xJf "$BUNDLE_DIR/bundle.tar.xz" 2>/dev/null ||
    python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BUNDLE_DIR/bundle.tar.xz" "$WORK/b" ||
    { echo "gpu-check: cannot unpack the bundle" >&2; return 2; }
  local NV
  NV=$(nvidia_wheel_libdirs)
  export LD_LIBRARY_PATH="$WORK/b/lib${NV:+:$NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The build machine's libstdc++ only if the GPU machine's is too old for the binaries.
  if ! "$WORK/b/bin/trainrun" --help >/dev/null 2>&1; then export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$WORK/b/lib/fallback"; fi
}

# `bench kernels` at the wide-model widths (kernels/cuda/cuda_bench.cu:
# TRAINRUN_BENCH_C): LayerNorm's shared-memory plans, the embedding backward
# and the GEMMs where C = 4096 / 8192 take them. Fewer repeats than the
# 124M table, to stay inside the device call's time.
bench_wide() {
  local c
  for c in 4096 8192; do
    echo; echo "== bench kernels at C=$c (TRAINRUN_BENCH_C=$c)"
    TRAINRUN_BENCH_C=$c timeout 60 "$WORK/b/bin/trainrun" bench kernels --repeats 10 2>&1 | tee "$OUTDIR/bench_kernels_c$c.txt"
  done
}

wide() {
  mkdir -p "$OUTDIR" "$WORK"
  unpack || return $?
  bench_wide
}

run() {
  mkdir -p "$OUTDIR" "$WORK"
  : > "$OUTDIR/summary.txt"
  local t_start=$SECONDS
  unpack || return $?
  local B="$WORK/b"
  local missing
  missing=$(ldd "$B/bin/trainrun" "$B/bin/libtrainrun_cuda.so" "$B/bin/test_cuda_ops" 2>&1 | grep "not found" | sort -u)
  {
    echo "== gpu-check $(date -u +%Y-%m-%dT%H:%MZ), bundle commit $(cat "$B/COMMIT"), built $(cat "$B/BUILT")"
    # The bundle carries binaries; the checkout carries configs and the
    # commit to record. Say so when they differ (a stale bundle).
    [[ "$(cat "$B/COMMIT")" != "$(commit_id)" ]] &&
      echo "WARNING: the bundle was built from $(cat "$B/COMMIT") but this checkout is $(commit_id); rebuild it (scripts/gpu-check.sh bundle) before recording results"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -2
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    [[ -n "$missing" ]] && echo "MISSING LIBRARIES:" && echo "$missing"
    "$B/bin/trainrun" --version
  } 2>&1 | tee "$OUTDIR/env.txt"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

  # 1. CUDA tests -------------------------------------------------------------------
  echo; echo "== 1/5 CUDA tests"
  (cd "$WORK" && timeout 150 "$B/bin/test_cuda_ops" -d yes 2>&1) | tee "$OUTDIR/cuda_tests.log" | grep -iE "rel err|rel diff|FAILED|skipped|passed|error" | tail -120
  local test_rc=${PIPESTATUS[0]}

  # 2. kernels and GEMMs ------------------------------------------------------------------
  echo; echo "== 2/5 trainrun bench kernels (GPT-2 124M shapes, then the Llama ops at Llama-3.2-1B's)"
  timeout 120 "$B/bin/trainrun" bench kernels --repeats 20 2>&1 | tee "$OUTDIR/bench_kernels.txt"
  [[ "${GPU_CHECK_WIDE:-1}" != 0 ]] && bench_wide

  # 3. the attention reference -----------------------------------------------------------
  echo; echo "== 3/5 torch SDPA reference (B=16 T=1024 NH=12 HS=64, causal, bf16)"
  timeout 60 python3 - <<'PY' 2>&1 | tee "$OUTDIR/torch_ref.txt"
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

  # 4. GPT-2 124M training ------------------------------------------------------------------
  echo; echo "== 4/5 GPT-2 124M training, one GPU (configs/gpt2_124m_h200.yaml)"
  rm -rf "$WORK/run124m"
  timeout 180 "$B/bin/trainrun" --config "$ROOT/configs/gpt2_124m_h200.yaml" --set output.dir="$WORK/run124m" 2>&1 |
    tee "$OUTDIR/train_124m.log" | grep -E "step|error|memory|backend" | tail -12
  local train_rc=${PIPESTATUS[0]}

  # 5. Llama-3.2-1B-shaped training ----------------------------------------------------------
  local llama_rc=skipped
  if [[ "${GPU_CHECK_LLAMA:-1}" != 0 ]]; then
    echo; echo "== 5/5 Llama-3.2-1B-shaped training, one GPU (configs/llama3_1b_h200.yaml)"
    rm -rf "$WORK/runllama1b"
    timeout 240 "$B/bin/trainrun" --config "$ROOT/configs/llama3_1b_h200.yaml" --set output.dir="$WORK/runllama1b" 2>&1 |
      tee "$OUTDIR/train_llama1b.log" | grep -E "step|error|memory|backend|mfu:" | tail -12
    llama_rc=${PIPESTATUS[0]}
  fi

  # NCCL bandwidth, when the machine has 2+ GPUs (one rank per GPU) ------------------------
  local ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [[ ${ngpu:-0} -ge 2 ]]; then
    echo; echo "== extra: trainrun bench comm --backend cuda --nproc $ngpu"
    timeout 120 "$B/bin/trainrun" bench comm --backend cuda --nproc "$ngpu" 2>&1 | tee "$OUTDIR/bench_comm_nccl.txt"
  fi

  # summary ---------------------------------------------------------------------------------
  local card tps mfu peak=989.4
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  tps=$(grep -E "^(\[rank 0\] )?step" "$OUTDIR/train_124m.log" | grep -o "[0-9.]* tok/s" | tail -1 | awk '{print $1}')
  # 6N + 12 L C T with N = 124,439,808 (V=50257, T=1024)
  local fpt=$((6 * 124439808 + 12 * 12 * 768 * 1024))
  if [[ -n "$tps" ]]; then mfu=$(awk -v t="$tps" -v f="$fpt" -v p="$peak" 'BEGIN{printf "%.1f", 100*t*f/(p*1e12)}'); fi
  # Llama: the last logged step's tokens/s (steady state: the first logs
  # hold the warm-up steps), and the FLOPs per token from the run's own
  # "mfu: X MFLOP per token" line (6N + 12 L C T of the model); the
  # fallback is that formula for this config: N = 1,235,746,816, T = 2048.
  local ltps="" lmfu="" lfpt=""
  if [[ -f "$OUTDIR/train_llama1b.log" ]]; then
    ltps=$(grep -E "^(\[rank 0\] )?step" "$OUTDIR/train_llama1b.log" | grep -o "[0-9.]* tok/s" | tail -1 | awk '{print $1}')
    lfpt=$(grep -o "mfu: [0-9.]* MFLOP per token" "$OUTDIR/train_llama1b.log" | head -1 | awk '{printf "%.0f", $2 * 1e6}')
    [[ -z "$lfpt" ]] && lfpt=$((6 * 1235746816 + 12 * 16 * 2048 * 2048))
    if [[ -n "$ltps" ]]; then lmfu=$(awk -v t="$ltps" -v f="$lfpt" -v p="$peak" 'BEGIN{printf "%.1f", 100*t*f/(p*1e12)}'); fi
  fi
  echo
  say "== gpu-check summary: ${card:-unknown GPU}, $(date -u +%Y-%m-%d), bundle commit $(cat "$B/COMMIT"), $((SECONDS - t_start)) s"
  if grep -q "SKIPPED: no usable GPU" "$OUTDIR/cuda_tests.log"; then
    say "cuda tests            SKIPPED: $(grep -m1 -A1 'SKIPPED: no usable GPU' "$OUTDIR/cuda_tests.log" | tr -s ' \n' ' ')"
    test_rc=3
  elif [[ $test_rc -eq 0 ]]; then say "cuda tests            PASS ($(grep -E 'test cases|All tests' "$OUTDIR/cuda_tests.log" | tail -1))"
  else say "cuda tests            FAIL rc=$test_rc ($(grep -E 'test cases' "$OUTDIR/cuda_tests.log" | tail -1)); see cuda_tests.log"; fi
  say "$(grep -E '^(ceiling|attention)' "$OUTDIR/bench_kernels.txt" | sed 's/  */ /g' || echo 'bench kernels: no results; see bench_kernels.txt')"
  local c
  for c in 4096 8192; do
    [[ -f "$OUTDIR/bench_kernels_c$c.txt" ]] || continue
    say "$(grep -E '^(layernorm bwd|encoder bwd|attention kv|gemm fwd fc )' "$OUTDIR/bench_kernels_c$c.txt" | sed "s/  */ /g; s/^/C=$c: /" ||
      echo "bench kernels C=$c: no results; see bench_kernels_c$c.txt")"
  done
  say "$(grep -E '^torch' "$OUTDIR/torch_ref.txt" || echo 'torch reference: no results; see torch_ref.txt')"
  if [[ -n "$tps" ]]; then say "GPT-2 124M train      $tps tok/s, MFU $mfu% (6N+12LCT = $fpt FLOP/token, peak $peak TFLOP/s bf16 dense)"
  else say "GPT-2 124M train      no throughput (rc=$train_rc); see train_124m.log"; fi
  if [[ $llama_rc == skipped ]]; then say "Llama 1B train        skipped (GPU_CHECK_LLAMA=0)"
  elif [[ -n "$ltps" ]]; then say "Llama 1B train        $ltps tok/s, MFU $lmfu% (6N+12LCT = $lfpt FLOP/token, peak $peak TFLOP/s bf16 dense; target 50%)"
  else say "Llama 1B train        no throughput (rc=$llama_rc); see train_llama1b.log"; fi
  say "$(grep -E '^llama' "$OUTDIR/bench_kernels.txt" | sed 's/  */ /g' || echo 'bench kernels: no Llama rows; see bench_kernels.txt')"
  say "(full kernel table: bench_kernels.txt; logs in $OUTDIR)"
  [[ $test_rc -eq 0 && -n "$tps" && ( $llama_rc == skipped || -n "$ltps" ) ]]
}

# Step 5 alone (a short device call): the Llama-3.2-1B-shaped training run.
llama() {
  mkdir -p "$OUTDIR" "$WORK"
  unpack || return $?
  rm -rf "$WORK/runllama1b"
  timeout 240 "$WORK/b/bin/trainrun" --config "$ROOT/configs/llama3_1b_h200.yaml" --set output.dir="$WORK/runllama1b" 2>&1 |
    tee "$OUTDIR/train_llama1b.log" | grep -E "step|error|memory|backend|mfu:" | tail -12
  return "${PIPESTATUS[0]}"
}

case "$MODE" in
  bundle) bundle ;;
  run) run ;;
  wide) wide ;;
  llama) llama ;;
  *) echo "usage: scripts/gpu-check.sh [bundle|run|wide|llama]" >&2; exit 2 ;;
esac
