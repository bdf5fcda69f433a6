#!/usr/bin/env bash
# How much of a quickstart model's samples are words: over 8 seeds, the share
# of the sampled words (letters and apostrophes, lower-cased, the prompt left
# out) that are dictionary words: /usr/share/dict/words when installed, else
# the words of the fortunes corpus itself (the script says which). The
# README's quickstart table comes from it.
#   bash scripts/sample_word_share.sh RUN_DIR [max_tokens] [top_k] [temperature]
set -euo pipefail
run=$1; n=${2:-60}; k=${3:-10}; t=${4:-0.8}
prompt="The meaning of life is"
words=$(mktemp); trap 'rm -f "$words"' EXIT
if [ -r /usr/share/dict/words ]; then
  src=/usr/share/dict/words; tr 'A-Z' 'a-z' < "$src" | sort -u > "$words"
else
  src="the fortunes corpus"
  find /usr/share/games/fortunes -type f ! -name '*.dat' ! -name '*.u8' -exec cat {} + |
    tr 'A-Z' 'a-z' | grep -oE "[a-z']+" | sort -u > "$words"
fi
total=0; hits=0
for seed in 1 2 3 4 5 6 7 8; do
  text=$(./build/trainrun generate --checkpoint "$run" --prompt "$prompt" --max-tokens "$n" --top-k "$k" \
           --temperature "$t" --seed "$seed" 2>/dev/null)
  text=${text#"$prompt"}; text=${text//"<|endoftext|>"/ }  # a document boundary, no word
  read -r a b < <(printf '%s' "$text" | tr 'A-Z' 'a-z' | grep -oE "[a-z']+" | sed "s/^'*//; s/'*$//" | grep . |
                  awk -v dict="$words" 'BEGIN { while ((getline w < dict) > 0) d[w] = 1 }
                                        { n++; if ($0 in d) h++ } END { print n + 0, h + 0 }')
  total=$((total + a)); hits=$((hits + b))
done
echo "word share: $hits / $total = $(awk -v h=$hits -v t=$total 'BEGIN { printf "%.1f%%", 100 * h / t }') (dictionary: $src; 8 seeds, $n tokens, top-k $k, temperature $t)"
