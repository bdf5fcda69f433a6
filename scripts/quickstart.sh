#!/usr/bin/env bash
# The quickstart: install dependencies, build, prepare the fortunes corpus as
# byte-level shards, train configs/quickstart.yaml on the CPU and sample text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh trainrun
if [ ! -e data/fortunes/train_000000.bin ]; then
  ./build/trainrun prepare --input /usr/share/games/fortunes --output data/fortunes --val-fraction 0.02
fi
./build/trainrun --config configs/quickstart.yaml "$@"
echo "--- a sample from the trained model (top-k 10, temperature 0.8):"
./build/trainrun generate --checkpoint runs/quickstart --prompt "The meaning of life is " \
  --max-tokens 200 --top-k 10 --temperature 0.8 --seed 7
echo
