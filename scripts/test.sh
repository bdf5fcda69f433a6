#!/usr/bin/env bash
# The whole test suite: install dependencies (and the test peers: PyTorch,
# safetensors), build everything, run every CTest test. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --test
bash scripts/build.sh
cd build
# Tests are run one at a time: several spawn multi-process jobs and all of
# them use OpenMP; on a 2-core machine parallel tests only fight each other.
ctest --output-on-failure --timeout 900 "$@"
