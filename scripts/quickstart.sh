#!/usr/bin/env bash
# The quickstart: install dependencies, build trainrun (that target only),
# train a 4096-token BPE tokenizer on the fortunes corpus and prepare the
# corpus with it (each fortune a document), train configs/quickstart.yaml on the CPU and sample text.
# Under 5 minutes on 2 idle cores after the build (README.md has the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh trainrun
SECONDS=0
./build/trainrun tokenizer train --input /usr/share/games/fortunes --vocab-size 4096 \
  --special-tokens '<|endoftext|>' --output data/fortunes_tokenizer --quiet
./build/trainrun prepare --input /usr/share/games/fortunes --output data/fortunes_bpe \
  --tokenizer data/fortunes_tokenizer/tokenizer.json --val-fraction 0.02 --document-separator '%'
./build/trainrun --config configs/quickstart.yaml "$@"
echo "--- a sample from the trained model (top-k 10, temperature 0.8, one fortune: it stops at <|endoftext|>):"
./build/trainrun generate --checkpoint runs/quickstart --prompt "The meaning of life is" \
  --max-tokens 60 --top-k 10 --temperature 0.8 --seed 7 --stop '<|endoftext|>'
echo "--- tokenizer, data, training and samples: ${SECONDS} s after the build"
