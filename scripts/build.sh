#!/usr/bin/env bash
# Configure and build trainrun (Release, Ninja, ccache when present) into
# ./build. CUDA is compiled when nvcc is found (TRAINRUN_CUDA=AUTO); pass
# TRAINRUN_CUDA=OFF in the environment to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${JOBS:-$(nproc)}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINRUN_CUDA="${TRAINRUN_CUDA:-AUTO}" >/dev/null
ninja -C build -j "$JOBS" "$@"
