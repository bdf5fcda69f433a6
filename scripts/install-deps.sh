#!/usr/bin/env bash
# Idempotent install of everything trainrun needs on Debian 12 (bookworm).
#   scripts/install-deps.sh          build + runtime dependencies
#   scripts/install-deps.sh --test   also the test peers (PyTorch, fortunes; safetensors, tensorboard, transformers venv)
# Safe to run again: apt-get skips what is installed, the venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TEST=0
for a in "$@"; do
  case "$a" in
    --test) WITH_TEST=1 ;;
    *) echo "install-deps.sh: unknown option '$a' (use --test)" >&2; exit 2 ;;
  esac
done

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

PKGS=(build-essential cmake ninja-build ccache pkg-config git
      libcli11-dev libyaml-cpp-dev nlohmann-json3-dev catch2
      libopenblas-dev libopenblas-openmp-dev libgloo-dev libxxhash-dev
      libprotobuf-dev protobuf-compiler libpcre2-dev libicu-dev liburing-dev gnuplot-nox
      fortunes fortunes-min iproute2 procps)
# libprotobuf-dev + protobuf-compiler: TensorBoard event files (core/train/proto);
# libpcre2-dev: the tokenizer's Unicode regexes (core/data/tokenizer);
# libicu-dev: its normal forms, case mapping and grapheme clusters (NFC/NFKC, Lowercase, Precompiled);
# liburing-dev: io_uring for parallel.offload: nvme (optional at build time: without it, a pread/pwrite pool);
# gnuplot-nox: `trainrun plot` and the end-of-run plot (run as a program, not linked).
if [ "$WITH_TEST" = 1 ]; then
  PKGS+=(python3 python3-venv python3-numpy python3-torch)
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ "$WITH_TEST" = 1 ]; then
  # Test peers that Debian does not package: safetensors (reads what we write).
  # --system-site-packages so the venv sees Debian's torch and numpy.
  VENV=.venv
  if [ ! -x "$VENV/bin/python" ]; then
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import safetensors" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "safetensors==0.4.5"
  fi
  # tensorboard: its EventAccumulator reads our event files back in
  # tests/test_operator.cpp. 2.16.2 supports Python 3.11 and Debian 12's
  # numpy 1.24; protobuf pinned to the 4.25 line it was released against.
  if ! "$VENV/bin/python" -c "import tensorboard" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "tensorboard==2.16.2" "protobuf==4.25.3"
  fi
  # transformers: GPT2LMHeadModel.from_pretrained loads `trainrun export`
  # directories and save_pretrained writes what model.init_from reads
  # (tests/test_interop.cpp). 4.44.2 is a release that still runs on Debian
  # 12's torch 1.13 (later ones need torch 2), Python 3.11 and numpy 1.24;
  # its hub client pinned so a fresh venv gets what was tested.
  if ! "$VENV/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '4.44.2')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "transformers==4.44.2" "huggingface_hub==0.36.2" \
      "tokenizers==0.19.1"
  fi
  # sentencepiece: trains the SentencePiece BPE and Unigram models that
  # tests/test_tokenizer_hf.cpp converts with transformers' slow->fast
  # converters (which read the model proto with protobuf, pinned above).
  if ! "$VENV/bin/python" -c "import sentencepiece, sys; sys.exit(sentencepiece.__version__ != '0.2.0')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "sentencepiece==0.2.0"
  fi
  # jinja2: apply_chat_template renders with it; tests/test_chat_template.cpp
  # checks trainrun's own Jinja renderer against it (transformers needs >= 3.1).
  if ! "$VENV/bin/python" -c "import jinja2" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "jinja2==3.1.4" "markupsafe==3.0.4"
  fi
  # peft: the LoRA adapters' peer (tests/test_lora.cpp, scripts/reference/peft_lora.py).
  # 0.12.0 is the last line that runs on transformers 4.44 and torch 1.13;
  # it imports accelerate (0.33.0, which still accepts torch 1.13). --no-deps:
  # their other requirements are already in the venv, pinned above.
  if ! "$VENV/bin/python" -c "import peft, sys; sys.exit(peft.__version__ != '0.12.0')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "peft==0.12.0" "accelerate==0.33.0"
  fi
  # .venv-hf-next: transformers with Qwen3ForCausalLM (added in 4.51), the
  # peer of tests/test_qwen3.cpp only, so every other test keeps the pinned
  # peers above. transformers >= 4.51 imports torch.distributed.tensor, which
  # Debian's torch 1.13 lacks, so this venv has its own torch 2.5.1 from PyPI
  # (not --system-site-packages). PyPI's Linux x86_64 torch wheel depends on
  # the CUDA runtime wheels (nvidia-*, triton) and does not import without
  # them, even on a CPU: measured on Debian 12, 2 cores, 2026-12: 2.9 GB
  # downloaded, 5.3 GB on disk, 3.5 minutes. TRAINRUN_SKIP_HF_NEXT=1 skips
  # it (test_qwen3's transformers cases then skip, naming the venv).
  NEXT=.venv-hf-next
  if [ "${TRAINRUN_SKIP_HF_NEXT:-0}" != 1 ] &&
     ! "$NEXT/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '4.51.3')" 2>/dev/null; then
    [ -x "$NEXT/bin/python" ] || /usr/bin/python3 -m venv "$NEXT"
    "$NEXT/bin/python" -m pip install -q --disable-pip-version-check "torch==2.5.1" "numpy==1.26.4" \
      "transformers==4.51.3" "tokenizers==0.21.4" "huggingface_hub==0.36.2" "safetensors==0.4.5"
  fi
fi
