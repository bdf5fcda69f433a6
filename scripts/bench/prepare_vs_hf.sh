#!/usr/bin/env bash
# Tokenizer throughput, `trainrun prepare --tokenizer` vs HF tokenizers'
# encode_batch, on the same text, tokenizer and thread count, in one run.
# The text is the fortunes corpus repeated to MB megabytes; the tokenizers
# (GPT-2 and Llama-3 style byte-level BPE, vocab 16000, by
# scripts/reference/hf_tokenizer.py; Llama 2, Mistral, Gemma and T5 style
# SentencePiece conversions, vocab 8000, by hf_tokenizer_zoo.py) are
# trained on it offline. trainrun's MB/s is prepare's whole run
# (read, encode, write shards); HF's is encode_batch over the file cut into
# ~64 KB line-aligned documents (no reading, no writing), special tokens as text on both sides.
#   usage: scripts/bench/prepare_vs_hf.sh [MB] [threads...]   (default: 20 1 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
MB=${1:-20}
shift || true
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(1 2)
BIN=${TRAINRUN_BIN:-./build/trainrun}  # TRAINRUN_BIN: another build, for before/after
[ -x "$BIN" ] || bash scripts/build.sh trainrun >/dev/null
PY=.venv/bin/python
REF=scripts/reference/hf_tokenizer.py
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

FORT=/usr/share/games/fortunes
ls "$FORT"/* | grep -v -e '\.dat$' -e '\.u8$' | xargs cat > "$W/fortunes.txt"
$PY - "$W/fortunes.txt" "$W/corpus.txt" "$MB" <<'PY'
import sys
src, dst, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(src, encoding="utf-8", errors="replace").read()
with open(dst, "w", encoding="utf-8") as f:
    n = 0
    while n < mb * 1000000:
        f.write(text)
        n += len(text.encode("utf-8"))
PY
$PY "$REF" make --dir "$W" --corpus "$W/fortunes.txt" --vocab 16000 >/dev/null
# SentencePiece families (Llama 2 BPE with byte fallback, Mistral's
# Metaspace, Gemma's Replace + Split, T5's Unigram + Precompiled) through
# transformers' converters.
$PY scripts/reference/hf_tokenizer_zoo.py make --only spm --dir "$W" --corpus "$W/fortunes.txt" --vocab 8000 >/dev/null 2>&1
SIZE=$(stat -c %s "$W/corpus.txt")
echo "text: $((SIZE / 1000000)) MB (fortunes repeated); $(nproc) cores"
printf "%-8s %-8s %-16s %-16s %-8s\n" tokenizer threads "trainrun MB/s" "HF MB/s" ratio
for style in gpt2 llama3 llama2 mistral gemma t5; do
  for t in "${THREADS[@]}"; do
    out=$("$BIN" prepare --tokenizer "$W/$style.json" --input "$W/corpus.txt" --output "$W/out" \
      --val-fraction 0 --threads "$t" 2>/dev/null)
    tr=$(echo "$out" | sed -n 's/.*(\([0-9.]*\) MB\/s.*/\1/p')
    hf=$($PY "$REF" bench --tokenizer "$W/$style.json" --input "$W/corpus.txt" --threads "$t" |
      sed -n 's/.*MB\/s \([0-9.]*\).*/\1/p')
    ratio=$($PY -c "print('%.2f' % ($tr / $hf))")
    printf "%-8s %-8s %-16s %-16s %-8s\n" "$style" "$t" "$tr" "$hf" "${ratio}x"
  done
done
